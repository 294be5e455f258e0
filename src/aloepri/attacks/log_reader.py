"""The log reader at scale: id-stream decipherment with sparse, bounded scores (10^3 .. 10^6 observed tokens).

Same observer as ``stream_decipher`` (the id stream, the public tokenizer and chat template, public text; no key,
no obfuscated weights), same cipher (a fixed 1:1 substitution of token ids), a search built to reach further and to
fit the volume the logs hold:

1. **Template anchors** (known pairs) and **candidates**: the ``max_candidates`` most frequent reference types
   (at least a multiple of the observed ids), anchors always. Nothing is ever observed ids x full vocabulary.
2. **Bigram model of the reference over the candidates**, sparse: ``log P(b | a) = base[b] + lift[a, b]``.
3. **Mean-field annealing** on sparse beliefs (top-k candidates per observed id): each id's score for a candidate is
   the expected log-likelihood of its observed neighbours under the current beliefs (plus a Poisson count term),
   computed in row blocks (float32, bounded memory); a capped Sinkhorn step keeps the beliefs near one-to-one.
   **Restarts** (``restarts``): other schedules (per-id temperatures growing with the id's count, more iterations,
   damping), each matched and polished by block moves; the likeliest under the bigram model is the fresh start.
4. **Assignment**: a minimum-cost bipartite matching (sparse Hungarian) on the final scores.
5. **Block moves**: rounds of exact conditional scores given the current hard map, re-matched over a random half
   of the ids, kept only when the exact bigram likelihood of the whole stream rises (many ids move at once).
6. **Simulated annealing** over reassignments and swaps on the exact bigram likelihood (a dense working set of the
   candidates in use, bounded by ``anneal_candidates``).
7. **Warm start** (``init``): an earlier map (the same observer at a smaller volume) is refined too, and the map the
   observer's own likelihood prefers is kept. The key is never used; ``progress`` may score stages for the caller.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import min_weight_full_bipartite_matching

from .base import register
from .behavioural import template_anchors
from .stream_decipher import DecipherResult, ObservedStream, adjacency, anneal_mapping

BLOCK_ELEMENTS = 16_000_000  # float32 cells of one dense score block (64 MB)
# mean-field schedules for ``decipher_logs(restarts=...)``: per-id temperatures (``mf_count_exponent``), longer and
# damped runs: every schedule tried on another key's stream (seed 1) at 10^4 tokens
RESTARTS = ({"temperatures": (2.0, 1.0, 0.5, 0.25, 0.12), "mf_count_exponent": 0.5},
            {"temperatures": (4.0, 2.0, 1.0, 0.5, 0.25, 0.12), "mf_count_exponent": 0.5, "mf_iterations": 2},
            {"temperatures": (4.0, 2.0, 1.0, 0.5, 0.25, 0.12), "mf_count_exponent": 0.5, "mf_iterations": 3,
             "damping": 0.3},
            {"temperatures": (8.0, 4.0, 2.0, 1.0, 0.5, 0.25), "mf_count_exponent": 0.75, "mf_iterations": 2},
            {"temperatures": (16.0, 8.0, 4.0, 2.0, 1.0, 0.5), "mf_iterations": 2, "damping": 0.5})


class CandidateModel:
    """Bigram model of the reference restricted to candidate columns (``cols``: plaintext ids, most frequent first).
    ``lp(a, b)`` = base[b] + lift[a, b] over column indices; ``unk`` = index len(cols): a plaintext outside the
    candidates (log P of it = ``unk_logp``; from it, the unigram)."""

    def __init__(self, reference: Sequence[Sequence[int]], cols: np.ndarray, vocab_size: int, lam: float = 0.8,
                 add: float = 0.1, lm_next: sp.csr_matrix | None = None, lm_weight: float = 0.5):
        self.cols = cols
        c = len(cols)
        index = np.full(vocab_size, c, np.int64)
        index[cols] = np.arange(c)
        self.index = index
        seqs = [index[np.asarray(s, np.int64)] for s in reference if len(s)]
        flat = np.concatenate(seqs)
        uni = np.bincount(flat, minlength=c + 1).astype(np.float64)
        # the unigram over the full vocabulary (add-``add``); the unknown bucket holds the rest of its mass
        p = (uni[:c] + add) / (len(flat) + add * vocab_size)
        self.p = p
        self.unk_logp = float(np.log(max(1e-12, 1.0 - p.sum()) / max(1, vocab_size - c)))
        a = np.concatenate([s[:-1] for s in seqs])
        b = np.concatenate([s[1:] for s in seqs])
        ok = (a < c) & (b < c)
        ctx = np.bincount(a, minlength=c + 1)[:c].astype(np.float64)
        pairs = sp.coo_matrix((np.ones(int(ok.sum())), (a[ok], b[ok])), shape=(c, c)).tocsr()
        pairs.sum_duplicates()
        coo = pairs.tocoo()
        cond = sp.csr_matrix((coo.data / ctx[coo.row], (coo.row, coo.col)), shape=(c, c))
        if lm_next is not None:
            # the public model's next-token distribution after each candidate (its top successors), mixed in where
            # the model was read (rows with no successors keep the reference's alone)
            has = np.asarray(lm_next.getnnz(axis=1)) > 0
            cond = sp.diags(np.where(has, 1 - lm_weight, 1.0)) @ cond + lm_weight * lm_next
            cond = sp.csr_matrix(cond)
            cond.sum_duplicates()
        coo = cond.tocoo()
        lift = np.log1p(lam * coo.data / ((1 - lam) * p[coo.col]))
        self.base = np.log((1 - lam) * p).astype(np.float32)
        self.lift = sp.csr_matrix((lift.astype(np.float32), (coo.row, coo.col)), shape=(c, c))
        self.lift_t = self.lift.T.tocsr()

    def extended(self, vocab_size: int, add: float = 0.1, lam: float = 0.8) -> "CandidateModel":
        """The same model over every token of the vocabulary: the candidates keep their column indices, the rest
        follow (unigram only: the reference's add-``add`` smoothing, no lift); ``unk`` becomes the new last index.
        What the public model's reading may propose is then never out of reach."""
        c = len(self.cols)
        rest = np.setdiff1d(np.arange(vocab_size), self.cols)
        out = object.__new__(CandidateModel)
        out.cols = np.concatenate([self.cols, rest])
        c2 = len(out.cols)
        out.index = np.full(vocab_size, c2, np.int64)
        out.index[out.cols] = np.arange(c2)
        # the unknown bucket's mass per type is the smoothed mass of an unseen type
        out.p = np.concatenate([self.p, np.full(len(rest), np.exp(self.unk_logp))])
        out.unk_logp = float(np.log(1e-12))
        out.base = np.concatenate([self.base, np.log((1 - lam) * out.p[c:])]).astype(np.float32)
        lift = self.lift.tocoo()
        out.lift = sp.csr_matrix((lift.data, (lift.row, lift.col)), shape=(c2, c2))
        out.lift_t = out.lift.T.tocsr()
        return out

    def pair_logp(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """log P(b | a) for column-index arrays (``unk`` allowed on either side)."""
        c = len(self.cols)
        out = np.where(b < c, self.base[np.minimum(b, c - 1)], self.unk_logp).astype(np.float64)
        both = (a < c) & (b < c)
        if both.any():
            out[both] += np.asarray(self.lift[a[both], b[both]]).ravel()
        return out


_SUCCESSORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {token: (next ids, probs)}


def lm_successors(model, tokens: np.ndarray, top: int = 64, batch: int = 256, device=None,
                  cols: np.ndarray | None = None) -> sp.csr_matrix:
    """(len(tokens), C) sparse: for each token alone as context, the public model's probabilities of its ``top``
    likeliest next tokens (over the whole vocabulary), kept where they are among ``cols`` (default ``tokens``):
    the model's bigram view of the language, from far more text than the observer's reference. One forward pass
    per token, remembered per model (a later volume or reference reuses them). Rows sum to at most 1."""
    cols = tokens if cols is None else cols
    import torch

    if device is None:
        params = getattr(model, "parameters", None)
        first = next(params(), None) if callable(params) else None
        device = first.device if first is not None else torch.device("cpu")
    try:
        memo = _SUCCESSORS.setdefault(model, {})
    except TypeError:  # not weak-referenceable: no memory between calls
        memo = {}
    todo = [int(t) for t in tokens if int(t) not in memo]
    with torch.no_grad():
        for a in range(0, len(todo), batch):
            ids = torch.as_tensor(todo[a:a + batch], device=device)[:, None]
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
            v, j = torch.topk(torch.softmax(logits, dim=-1), top, dim=1)
            for t, jj, vv in zip(todo[a:a + batch], j.cpu().numpy(), v.cpu().numpy()):
                memo[t] = (jj.astype(np.int64), vv.astype(np.float32))
    c = len(cols)
    index = {int(t): i for i, t in enumerate(cols)}
    rows, idx, vals = [], [], []
    for i, t in enumerate(tokens):
        nxt, p = memo[int(t)]
        at = np.array([index.get(int(x), -1) for x in nxt])
        ok = at >= 0
        rows.append(np.full(int(ok.sum()), i))
        idx.append(at[ok])
        vals.append(p[ok])
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(idx))),
                         shape=(len(tokens), c))


def log_likelihood(model: CandidateModel, pairs: sp.coo_matrix, m: np.ndarray, total: int) -> float:
    """The observer's key-free yardstick: bigram log-likelihood of the observed stream under the map ``m`` (row ->
    column index, ``unk`` allowed; ``pairs[r, q]``: times q precedes r) plus the Poisson term ``- N p`` per id."""
    ll = float((pairs.data * model.pair_logp(m[pairs.col], m[pairs.row])).sum())
    c = len(model.cols)
    return ll - total * float(model.p[m[m < c]].sum())


def _scores_block(model: CandidateModel, left: sp.csr_matrix, right: sp.csr_matrix, belief: sp.csr_matrix,
                  counts: np.ndarray, total: int, rows: np.ndarray) -> np.ndarray:
    """(len(rows), C) float32: expected log-likelihood of each row's neighbours if the row were each candidate,
    neighbours read through ``belief`` (R x C, sparse), plus the count term ``n log p - N p``."""
    out = (counts[rows, None].astype(np.float32) * model.base[None, :]) - np.float32(total) * model.p[None, :].astype(
        np.float32)
    ctx_l = left[rows] @ belief  # expected plaintext (column) counts of the left neighbours
    ctx_r = right[rows] @ belief
    out += (ctx_l @ model.lift).toarray()
    out += (ctx_r @ model.lift_t).toarray()
    return out


def _blocks(n_rows: int, n_cols: int):
    step = max(1, BLOCK_ELEMENTS // max(1, n_cols))
    for a in range(0, n_rows, step):
        yield np.arange(a, min(n_rows, a + step))


def top_scores(model: CandidateModel, left, right, belief, counts, total, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, its ``k`` best columns and their scores (R, k), computed block by block (bounded memory)."""
    n, c = left.shape[0], len(model.cols)
    k = min(k, c)
    top = np.empty((n, k), np.int64)
    val = np.empty((n, k), np.float32)
    for rows in _blocks(n, c):
        s = _scores_block(model, left, right, belief, counts, total, rows)
        t = np.argpartition(-s, k - 1, axis=1)[:, :k]
        top[rows], val[rows] = t, np.take_along_axis(s, t, axis=1)
    return top, val


def _belief(top: np.ndarray, prob: np.ndarray, n_cols: int) -> sp.csr_matrix:
    rows = np.repeat(np.arange(len(top)), top.shape[1])
    keep = prob.ravel() > 0
    return sp.csr_matrix((prob.ravel()[keep].astype(np.float32), (rows[keep], top.ravel()[keep])),
                         shape=(len(top), n_cols))


def onehot(m: np.ndarray, n_cols: int) -> sp.csr_matrix:
    ok = m < n_cols
    return sp.csr_matrix((np.ones(int(ok.sum()), np.float32), (np.flatnonzero(ok), m[ok])), shape=(len(m), n_cols))


def sinkhorn_cap(top: np.ndarray, prob: np.ndarray, n_cols: int, fixed_rows: np.ndarray, rounds: int = 3
                 ) -> np.ndarray:
    """Capped Sinkhorn: columns holding more than one unit of belief are scaled down to one, rows renormalised
    (anchors stay one-hot). Keeps the soft map near one-to-one without forcing it."""
    prob = prob.astype(np.float64).copy()
    for _ in range(rounds):
        mass = np.bincount(top.ravel(), weights=prob.ravel(), minlength=n_cols)
        scale = np.minimum(1.0, 1.0 / np.maximum(mass, 1e-12))
        prob *= scale[top]
        prob /= np.maximum(prob.sum(axis=1, keepdims=True), 1e-30)
    prob[fixed_rows] = 0.0
    prob[fixed_rows, 0] = 1.0
    return prob


def match(top: np.ndarray, val: np.ndarray, n_cols: int, fixed: dict[int, int]) -> np.ndarray:
    """1:1 row -> column maximising the summed row-normalised log-posteriors over each row's candidates (a sparse
    minimum-cost full bipartite matching; every row may also fall on a private 'unknown' column at a high cost,
    returned as ``n_cols``). Anchors are fixed."""
    n, k = top.shape
    post = val - np.logaddexp.reduce(val.astype(np.float64), axis=1, keepdims=True)
    return _min_cost(np.repeat(np.arange(n), k), top.ravel().copy(), (-post + 1.0).astype(np.float64).ravel(), n,
                     n_cols, fixed)


def _min_cost(rows: np.ndarray, cols: np.ndarray, w: np.ndarray, n: int, n_cols: int, fixed: dict[int, int]
              ) -> np.ndarray:
    """The sparse minimum-cost full matching behind ``match``: (row, column, cost) entries, one per pair; each row
    may also fall on its own 'unknown' column at a cost above every other (returned as ``n_cols``)."""
    taken = np.zeros(n_cols + 1, bool)
    for r, c in fixed.items():
        taken[c] = True
    free = ~np.isin(rows, list(fixed)) & ~taken[cols]
    rows, cols, w = rows[free], cols[free], w[free]
    fr = np.array(sorted(fixed), np.int64)
    fc = np.array([fixed[r] for r in fr], np.int64)
    fc = np.where(fc >= n_cols, n_cols + fr, fc)  # held on 'unknown': the row's own dummy column
    dummy_cost = float(w.max() + 50.0) if len(w) else 1.0
    rows = np.concatenate([rows, fr, np.arange(n)])
    cols = np.concatenate([cols, fc, n_cols + np.arange(n)])
    w = np.concatenate([w, np.full(len(fr), 1.0), np.full(n, dummy_cost)])
    g = sp.csr_matrix((w, (rows, cols)), shape=(n, n_cols + n))
    g.sum_duplicates()
    r_idx, c_idx = min_weight_full_bipartite_matching(g)
    assigned = np.full(n, n_cols, np.int64)
    assigned[r_idx] = c_idx
    return np.where(assigned >= n_cols, n_cols, assigned).astype(np.int64)


def decipher_logs(requests: Sequence[Sequence[int]], vocab_size: int, reference: Sequence[Sequence[int]],
                  prefix: Sequence[int] = (), suffix: Sequence[int] = (), *, init: dict[int, int] | None = None,
                  max_candidates: int = 12_000, candidates_per_id: float = 2.5, top_k: int = 12,
                  temperatures: Sequence[float] = (8.0, 4.0, 2.0, 1.0, 0.5), mf_iterations: int = 1,
                  damping: float = 0.0, mf_count_exponent: float = 0.0, restarts: Sequence[dict] = (),
                  sinkhorn_rounds: int = 3, block_rounds: int = 20,
                  anneal_steps: int = 400, anneal_candidates: int = 8_000, anneal_t_start: float = 4.0, seed: int = 0,
                  lm=None, lm_weight: float = 0.15, lm_candidates: int | None = None, lm_bigram: bool = True,
                  lm_rounds: int | None = None, lm_options: dict | None = None, fresh: bool = True,
                  extra_starts: Sequence[tuple[str, dict[int, int]]] = (), digits: Sequence[int] | None = None,
                  progress: Callable[[dict, np.ndarray], dict] | None = None) -> DecipherResult:
    """Decipher the observed ``requests`` (cipher ids) into plaintext ids with public ``reference`` text.

    ``init``: cipher id -> plaintext guess from earlier (a warm start; refined alongside the fresh run, the likelier
    kept; ``fresh=False``: the warm start alone, half the time). ``max_candidates`` / ``candidates_per_id``:
    plaintext types considered (the reference's most frequent, at most ``max_candidates``, at least
    ``candidates_per_id`` per observed id where the reference has them).
    ``temperatures`` / ``mf_iterations`` / ``damping`` / ``mf_count_exponent``: the mean-field schedule (an id's
    temperature is ``T x count^mf_count_exponent``). ``restarts``: more schedules (dicts of those four keywords),
    each run from scratch and polished by ``block_rounds`` of block moves; the map the bigram likelihood prefers
    among them is the fresh start (``RESTARTS``: the schedules the benchmarks use).
    ``digits``: the plaintext ids of the ten digits (public: the tokenizer's); the ids the kept map holds on
    digits are then re-assigned among them by their place in numbers (``digits_unit``, from the reference alone).
    ``lm`` (the public model): with ``lm_bigram`` its next-token distribution after each candidate joins the
    bigram model (``lm_successors``); with ``lm_rounds`` set (0 or more) the maps the search ends on (and the
    warm start as given) are read by the model, the one it rates likeliest is kept and refined by ``lm_refine``
    (``lm_rounds`` rounds of EM with the model's full-context predictions, then the digits as a unit;
    ``lm_options``: its keywords, e.g. ``sample_tokens``, ``digits``, ``device``). ``extra_starts``: (name,
    cipher id -> plaintext) maps from other searches (another decipherer) the model also reads and may choose.
    Memory: O(nnz of the bigram model + ids x top_k + anneal_candidates^2), never ids x candidates; the model's
    reading: O(tokens read x its ``top``)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    stream = ObservedStream.of(requests)
    n = len(stream.cipher_ids)
    row_of = {int(c): r for r, c in enumerate(stream.cipher_ids)}
    anchors = {row_of[c]: p for c, p in template_anchors(prefix, suffix, requests) if c in row_of} \
        if (prefix or suffix) else {}
    ref_counts = np.bincount(np.concatenate([np.asarray(s, np.int64) for s in reference]), minlength=vocab_size)
    seen = np.flatnonzero(ref_counts)
    n_cand = int(min(len(seen), max(max_candidates, candidates_per_id * n)))
    cols = seen[np.argsort(-ref_counts[seen], kind="stable")][:n_cand]
    cols = np.concatenate([cols, np.setdiff1d(np.fromiter(anchors.values(), np.int64, len(anchors)), cols)])
    lm_next = None
    if lm is not None and lm_bigram:  # the model reads the ``lm_candidates`` most frequent candidates (all: None)
        read = cols[:lm_candidates] if lm_candidates else cols
        lm_next = sp.vstack([lm_successors(lm, read, cols=cols),
                             sp.csr_matrix((len(cols) - len(read), len(cols)), dtype=np.float32)]).tocsr()
    model = CandidateModel(reference, cols, vocab_size, lm_next=lm_next, lm_weight=lm_weight)
    c = len(cols)
    fixed = {r: int(model.index[p]) for r, p in anchors.items()}
    fixed_rows = np.array(sorted(fixed), np.int64)
    left, right = adjacency(stream)
    left, right = left.astype(np.float32), right.astype(np.float32)
    pairs = left.tocoo()
    counts = stream.counts.astype(np.float64)
    free = np.ones(n, bool)
    free[fixed_rows] = False
    total = int(counts[free].sum())
    trace: list[dict] = []

    def to_full(m: np.ndarray) -> np.ndarray:
        full = np.full(vocab_size, -1, np.int64)
        full[stream.cipher_ids] = np.where(m < c, cols[np.minimum(m, c - 1)], -1)
        return full

    def record(entry: dict, m: np.ndarray) -> None:
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        entry["log_likelihood"] = round(log_likelihood(model, pairs, m, total), 1)
        if progress is not None:
            entry.update(progress(entry, to_full(m)))
        trace.append(entry)

    def fix(m: np.ndarray) -> np.ndarray:
        m[fixed_rows] = [fixed[r] for r in fixed_rows]
        return m

    # 3. mean-field annealing from the counts alone (uniform beliefs: no context yet)
    fresh = fresh or not init

    def mean_field(temps: Sequence[float], iterations: int, damp: float, exponent: float, tag: str) -> np.ndarray:
        # per-row temperature ``temp x count^exponent``: an id seen often is not frozen at the first step
        row_scale = np.maximum(counts, 1.0)[:, None] ** exponent
        belief = onehot(fix(np.full(n, c, np.int64)), c)
        top, val = top_scores(model, left, right, belief, counts, total, top_k)
        for temp in temps:
            for _ in range(iterations):
                z = val.astype(np.float64) / (temp * row_scale)
                prob = np.exp(z - z.max(axis=1, keepdims=True))
                prob /= prob.sum(axis=1, keepdims=True)
                for r in fixed_rows:
                    top[r, 0] = fixed[r]
                prob = sinkhorn_cap(top, prob, c, fixed_rows, sinkhorn_rounds)
                # damped: synchronous mean-field updates otherwise oscillate between two maps
                belief = (1 - damp) * _belief(top, prob, c) + damp * belief if damp else _belief(top, prob, c)
                top, val = top_scores(model, left, right, belief, counts, total, top_k)
            record({"stage": f"{tag}mean-field T={temp:g}"}, fix(top[np.arange(n), np.argmax(val, axis=1)]))
        m = fix(match(top, val, c, fixed))
        record({"stage": f"{tag}matching"}, m)
        return m

    starts = []
    if fresh:
        m = mean_field(temperatures, mf_iterations, damping, mf_count_exponent, "")
        if restarts:
            # restarts: other mean-field schedules, each polished by block moves; the likeliest is the fresh start
            # (the observer's own bigram likelihood chooses; the key never does)
            m = block_moves(model, left, right, pairs, counts, total, m, fixed, block_rounds, top_k, rng)
            best_ll = log_likelihood(model, pairs, m, total)
            record({"stage": "restart 0: block moves"}, m)
            for i, sched in enumerate(restarts):
                sched = dict(sched)
                mi = mean_field(sched.get("temperatures", temperatures), sched.get("mf_iterations", mf_iterations),
                                sched.get("damping", damping), sched.get("mf_count_exponent", mf_count_exponent),
                                f"restart {i + 1}: ")
                mi = block_moves(model, left, right, pairs, counts, total, mi, fixed, block_rounds, top_k, rng)
                ll_i = log_likelihood(model, pairs, mi, total)
                record({"stage": f"restart {i + 1}: block moves"}, mi)
                if ll_i > best_ll:
                    m, best_ll = mi, ll_i
        starts.append(("fresh", m))
    def as_rows(given: dict[int, int]) -> np.ndarray:
        warm = fix(np.array([model.index[given[int(i)]] if int(i) in given and given[int(i)] >= 0 else c
                             for i in stream.cipher_ids], np.int64))
        # a warm map may repeat columns where the earlier volume's ids were not all distinct here: keep the first
        _, first = np.unique(warm, return_index=True)
        dup = np.ones(n, bool)
        dup[first] = False
        warm[dup & (warm < c)] = c
        return fix(warm)

    if init:
        starts.append(("warm", as_rows(init)))
        record({"stage": "warm start"}, starts[-1][1])
    best, best_ll = None, -np.inf
    ends: list[tuple[str, np.ndarray]] = []
    for name, m in starts:
        if name == "warm":
            ends.append(("warm start", m.copy()))
        if block_rounds:
            m = block_moves(model, left, right, pairs, counts, total, m, fixed, block_rounds, top_k, rng)
            record({"stage": f"{name}: block moves"}, m)
        if anneal_steps:
            m = anneal(model, left, right, counts, total, m, fixed, anneal_steps * n, anneal_candidates, top_k,
                       int(rng.integers(1 << 30)), anneal_t_start)
            record({"stage": f"{name}: annealing", "steps": anneal_steps * n}, m)
        ends.append((f"{name}: searched", m))
        ll = log_likelihood(model, pairs, m, total)
        if ll > best_ll:
            best, best_ll = m, ll
    trace.append({"stage": "kept", "log_likelihood": round(best_ll, 1)})
    if digits is not None and len(digits):
        best, before, after = digits_unit(DigitContexts(reference, digits), stream.rows, best, model, fixed,
                                          seed=int(rng.integers(1 << 30)))
        record({"stage": "digits as a unit (reference)", "digit_score_before": round(float(before), 1),
                "digit_score": round(float(after), 1)}, best)
    if lm is not None and lm_rounds is not None:
        # the model, not the bigram likelihood, chooses between the maps (the warm start as given among them:
        # a larger volume never returns a map the model rates below the one it started from)
        # every token of the vocabulary becomes a candidate (the model may propose what the reference lacks)
        model = model.extended(vocab_size)
        c2 = len(model.cols)
        ends = [(name, np.where(m < c, m, c2)) for name, m in ends]
        best = np.where(best < c, best, c2)
        fixed = {r: (v if v < c else c2) for r, v in fixed.items()}
        cols, c = model.cols, c2
        fixed_rows = np.array(sorted(fixed), np.int64)
        # the maps given from outside, read again over every token (nothing they hold is out of reach now)
        ends = [(name, as_rows(init)) if name == "warm start" else (name, m) for name, m in ends]
        ends += [(name, as_rows(given)) for name, given in extra_starts]
        best, reading = lm_refine(lm, model, stream, left, right, counts, total, ends, fixed, rounds=lm_rounds,
                                  seed=seed, record=record, **(lm_options or {}))
        trace.append({"stage": "kept (model)", "model_ll": round(reading.mean_ll, 4),
                      "log_likelihood": round(log_likelihood(model, pairs, best, total), 1)})
    return DecipherResult(to_full(best), len(anchors), trace, round(time.perf_counter() - t0, 1))


def block_moves(model: CandidateModel, left, right, pairs, counts, total, m: np.ndarray, fixed: dict[int, int],
                rounds: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Rounds of many simultaneous moves: each id's exact conditional score given its neighbours' current columns,
    a matching over a random subset of the ids (the others keep their columns), kept when the exact likelihood of
    the whole stream rises. The subset halves after a rejected round."""
    c = len(model.cols)
    n = len(m)
    ll = log_likelihood(model, pairs, m, total)
    share = 1.0
    for _ in range(rounds):
        top, val = top_scores(model, left, right, onehot(m, c), counts, total, top_k)
        moving = rng.random(n) < share
        keep = {r: int(m[r]) for r in np.flatnonzero(~moving)}
        keep.update(fixed)
        # columns held by ids that stay are not offered to the moving ones
        cand = match(top, val, c, keep)
        new_ll = log_likelihood(model, pairs, cand, total)
        if new_ll > ll:
            m, ll = cand, new_ll
        else:
            share /= 2
            if share < 0.02:
                break
    return m


class DigitContexts:
    """The reference's digits in context, the cheap structure of numbers (dates, phone, card and account layouts):
    how often each of the ten ``digits`` (plaintext ids) follows each plaintext context of two tokens, and of one
    (``-1``: a request's start), interpolated (``strength`` pseudo-counts) down to the digits' unigram; and the
    layout of numbers: how often each digit stands at position k of a run of L digits after a given token
    (``layout_logp``; L and k capped at ``MAX_RUN``), interpolated down to (L, k) alone."""

    MAX_RUN = 12

    def __init__(self, reference: Sequence[Sequence[int]], digits: Sequence[int], strength: float = 5.0):
        self.digits = np.asarray(digits, np.int64)
        self.strength = strength
        k = len(self.digits)
        pos = {int(x): i for i, x in enumerate(self.digits)}
        self.ctx2: dict[tuple[int, int], np.ndarray] = {}
        self.ctx1: dict[int, np.ndarray] = {}
        self.layout: dict[tuple[int, int, int], np.ndarray] = {}
        self.layout1: dict[tuple[int, int], np.ndarray] = {}
        uni = np.zeros(k)
        for seq in reference:
            seq = np.asarray(seq, np.int64)
            is_digit = np.isin(seq, self.digits)
            for t in np.flatnonzero(is_digit).tolist():
                p1 = int(seq[t - 1]) if t >= 1 else -1
                p2 = int(seq[t - 2]) if t >= 2 else -1
                d = pos[int(seq[t])]
                self.ctx2.setdefault((p2, p1), np.zeros(k))[d] += 1
                self.ctx1.setdefault(p1, np.zeros(k))[d] += 1
                uni[d] += 1
            for t, run, at, before in digit_runs(seq, is_digit):
                d = pos[int(seq[t])]
                self.layout.setdefault((run, at, before), np.zeros(k))[d] += 1
                self.layout1.setdefault((run, at), np.zeros(k))[d] += 1
        self.uni = (uni + 1) / (uni.sum() + k)
        self._memo: dict[tuple[int, int], np.ndarray] = {}
        self._memo_layout: dict[tuple[int, int, int], np.ndarray] = {}

    def layout_logp(self, run: int, at: int, before: int) -> np.ndarray:
        """log P(digit | position ``at`` of a run of ``run`` digits after the token ``before``)."""
        key = (run, at, before)
        if key not in self._memo_layout:
            a = self.layout1.get((run, at))
            b = self.uni if a is None else (a + self.strength * self.uni) / (a.sum() + self.strength)
            c = self.layout.get(key)
            self._memo_layout[key] = np.log(b if c is None else (c + self.strength * b) / (c.sum() + self.strength))
        return self._memo_layout[key]

    def logp(self, p2: int, p1: int) -> np.ndarray:
        """log P(digit | p2, p1) over the ten digits."""
        key = (p2, p1)
        if key not in self._memo:
            a = self.ctx1.get(p1)
            b = self.uni if a is None else (a + self.strength * self.uni) / (a.sum() + self.strength)
            c = self.ctx2.get(key)
            self._memo[key] = np.log(b if c is None else (c + self.strength * b) / (c.sum() + self.strength))
        return self._memo[key]


def digit_runs(seq: np.ndarray, is_digit: np.ndarray, before_of: np.ndarray | None = None):
    """Each digit position of ``seq`` with its run: (position, run length, position in the run, the token before
    the run or -1), lengths and positions capped at ``DigitContexts.MAX_RUN``; ``before_of`` maps the token
    before (default: itself)."""
    cap = DigitContexts.MAX_RUN
    n = len(seq)
    if not is_digit.any():
        return
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_digit.astype(np.int8), [0]])))
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
        prev = -1 if a == 0 else int(seq[a - 1] if before_of is None else before_of[seq[a - 1]])
        for t in range(a, min(b, n)):
            yield t, min(b - a, cap), min(t - a, cap - 1), prev


def digits_unit(contexts: DigitContexts, rows: Sequence[np.ndarray], m: np.ndarray, model: CandidateModel,
                fixed: dict[int, int] | None = None, restarts: int = 20, seed: int = 0
                ) -> tuple[np.ndarray, float, float]:
    """The digits read as a unit, without a model: the ids the map holds on digits are re-assigned among the digits
    (swaps, and moves onto a digit no id holds) to maximise the likelihood of every digit occurrence given its two
    preceding tokens and given its place in its number (position in the run of digits, the run's length, the token
    before it) (``contexts``, from the reference; preceding digits read through the same assignment), by hill
    climbing from the current assignment, from the best assignment under the layout alone, and from ``restarts``
    random ones, the likeliest kept. The bigram model
    cannot tell the digits apart (their neighbours are digits alike); their place in numbers can. Returns the map
    and the score before and after (log-likelihood of the digit occurrences)."""
    c = len(model.cols)
    dcols = model.index[contexts.digits]
    held = np.isin(dcols, [v for v in (fixed or {}).values()])
    avail = np.flatnonzero((dcols < c) & ~held)  # digits (positions in ``contexts.digits``): candidates, no anchor's
    slots = np.flatnonzero(np.isin(m, dcols[avail]))
    slots = slots[~np.isin(slots, list(fixed or {}))]
    if len(slots) < 2:
        return m, 0.0, 0.0
    slot_of = np.full(len(m), -1, np.int64)
    slot_of[slots] = np.arange(len(slots))
    digit_of_col = {int(dcols[i]): int(i) for i in avail}
    plain = np.where(m < c, model.cols[np.minimum(m, c - 1)], -2)  # -2: an id on no candidate
    # occurrences, grouped: (slot, context 1, context 2) with a context = plaintext (>= -2) or -(3 + slot)
    enc = np.where(slot_of >= 0, -(3 + slot_of), plain)
    patterns: dict[tuple[int, int, int], int] = {}
    for r in rows:
        r = np.asarray(r, np.int64)
        for t in np.flatnonzero(slot_of[r] >= 0).tolist():
            key = (int(slot_of[r[t]]), int(enc[r[t - 1]]) if t >= 1 else -1, int(enc[r[t - 2]]) if t >= 2 else -1)
            patterns[key] = patterns.get(key, 0) + 1
    pat = list(patterns.items())
    digits = contexts.digits
    # the layout of numbers: position in its run of digits after the token before the run (a non-digit: fixed)
    layout = np.zeros((len(slots), len(digits)))
    for r in rows:
        r = np.asarray(r, np.int64)
        for t, run, at, before in digit_runs(r, slot_of[r] >= 0, plain):
            layout[slot_of[r[t]]] += contexts.layout_logp(run, at, before)
    slot_idx = np.arange(len(slots))

    def score(assign: np.ndarray) -> float:  # assign: slot -> digit position
        total = float(layout[slot_idx, assign].sum())
        for (sl, e1, e2), n in pat:
            p1 = int(digits[assign[-(e1 + 3)]]) if e1 <= -3 else e1
            p2 = int(digits[assign[-(e2 + 3)]]) if e2 <= -3 else e2
            total += n * contexts.logp(p2, p1)[assign[sl]]
        return total

    def climb(assign: np.ndarray) -> tuple[np.ndarray, float]:
        cur = score(assign)
        improved = True
        while improved:
            improved = False
            for i in range(len(assign)):
                free = np.setdiff1d(avail, assign)
                for j in list(range(i + 1, len(assign))) + [-1 - int(f) for f in free]:
                    old = assign.copy()
                    if j >= 0:
                        assign[i], assign[j] = assign[j], assign[i]
                    else:
                        assign[i] = -1 - j
                    v = score(assign)
                    if v > cur + 1e-9:
                        cur, improved = v, True
                        if j < 0:
                            break  # the free digits changed
                    else:
                        assign[:] = old
        return assign, cur

    start = np.array([digit_of_col[int(m[r])] for r in slots], np.int64)
    before = score(start)
    best, best_score = climb(start.copy())
    # and from the best assignment under the layout alone (a linear assignment: exact)
    from scipy.optimize import linear_sum_assignment

    ri, ci = linear_sum_assignment(-layout[:, avail])
    by_layout = start.copy()
    by_layout[ri] = avail[ci]
    a, v = climb(by_layout)
    if v > best_score:
        best, best_score = a, v
    rng = np.random.default_rng(seed)
    for _ in range(restarts):
        a, v = climb(rng.choice(avail, len(slots), replace=False))
        if v > best_score:
            best, best_score = a, v
    out = m.copy()
    out[slots] = dcols[best]
    return out, before, best_score


def anneal(model: CandidateModel, left, right, counts, total, m: np.ndarray, fixed: dict[int, int], steps: int,
           n_work: int, top_k: int, seed: int, t_start: float = 2.0) -> np.ndarray:
    """Simulated annealing (``stream_decipher.anneal_mapping``: reassignments and swaps on the exact bigram
    likelihood) over a dense working set: the columns in use, each id's best columns, and the most frequent
    candidates up to ``n_work``. Ids on no candidate keep it."""
    c = len(model.cols)
    top, _ = top_scores(model, left, right, onehot(m, c), counts, total, top_k)
    used = m[m < c]
    work = np.unique(np.concatenate([used, top.ravel(), np.arange(min(c, n_work))]))
    if len(work) > max(n_work, len(used)):  # bounded: used columns first, then the most frequent
        work = np.unique(np.concatenate([used, np.setdiff1d(work, used)[:max(0, n_work - len(used))]]))
    k = len(work)
    widx = np.full(c + 1, -1, np.int64)
    widx[work] = np.arange(k)
    # dense over the working set only (float32), filled in place: no second dense copy
    log_bigram = np.empty((k + 1, k + 1), np.float32)
    log_bigram[:k, :k] = model.base[work][None, :]
    sub = model.lift[work][:, work].tocoo()
    log_bigram[sub.row, sub.col] += sub.data
    del sub
    # one extra working column for 'unknown': log P(unk | a) = unk_logp; log P(b | unk) = base[b]
    log_bigram[k, :k] = model.base[work]
    log_bigram[:, k] = model.unk_logp
    start = np.where(m < c, widx[np.minimum(m, c)], k)
    start[(m < c) & (start < 0)] = k
    frozen = dict(fixed)
    frozen.update({int(r): k for r in np.flatnonzero(start == k)})
    prior = np.concatenate([-total * model.p[work], [0.0]]).astype(np.float64)
    rng = np.random.default_rng(seed)
    prop = widx[top]
    prop = np.where(prop < 0, start[:, None], prop)
    # plus random columns of similar reference frequency
    rank = np.clip(start[:, None] + rng.integers(-40, 41, (len(m), 4)) * np.maximum(1, start[:, None] // 25), 0, k - 1)
    proposals = np.concatenate([prop, rank], axis=1)
    fixed_w = {r: int(start[r]) for r in frozen}
    out = anneal_mapping(left.astype(np.float64), right.astype(np.float64), prior, log_bigram, start, fixed_w,
                         proposals, np.sqrt(counts), steps, t_start=t_start, seed=seed)
    res = np.where(out < k, work[np.minimum(out, k - 1)], c)
    res[list(fixed)] = [fixed[r] for r in fixed]
    return res


# --- the public model's full-context predictions: EM over the whole map, kept by the model's own likelihood ------

def _model_device(lm, device=None):
    import torch

    if device is not None:
        return torch.device(device)
    params = getattr(lm, "parameters", None)
    first = next(params(), None) if callable(params) else None
    return first.device if first is not None else torch.device("cpu")


def lm_read(lm, seqs: Sequence[np.ndarray], top: int = 48, batch_tokens: int = 2048, max_len: int = 1024,
            device=None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The public model over each plaintext sequence (full left context, windows of ``max_len``): per sequence,
    for its positions 1..L-1, log p(actual token | prefix) (L-1,), the ``top`` likeliest next tokens (L-1, top)
    and their log-probabilities (L-1, top), best first. Batched by length, right-padded; memory O(batch_tokens x
    vocabulary) for one batch's logits."""
    import torch

    device = _model_device(lm, device)
    windows = []  # (sequence, start, ids)
    for i, s in enumerate(seqs):
        s = np.asarray(s, np.int64)
        for a in range(0, max(1, len(s) - 1), max_len):
            w = s[a:a + max_len + 1]  # predicts positions a+1 .. a+max_len
            if len(w) > 1:
                windows.append((i, a, w))
    order = sorted(range(len(windows)), key=lambda j: -len(windows[j][2]))
    parts: list[list] = [[] for _ in seqs]
    with torch.no_grad():
        at = 0
        while at < len(order):
            width = len(windows[order[at]][2])
            batch = order[at:at + max(1, batch_tokens // width)]
            at += len(batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, w in enumerate(batch):
                seq = torch.as_tensor(windows[w][2])
                ids[j, :len(seq)] = seq
                mask[j, :len(seq)] = 1
            logits = lm(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            v, t = torch.topk(logp, top, dim=-1)
            actual = torch.gather(logp, 2, ids[:, 1:].to(device)[..., None])[..., 0]
            del logp
            v, t, actual = v.cpu().numpy(), t.cpu().numpy(), actual.cpu().numpy()
            for j, w in enumerate(batch):
                i, a, seq = windows[w]
                k = len(seq) - 1
                parts[i].append((a, actual[j, :k], t[j, :k], v[j, :k]))
    out = []
    for p in parts:
        p.sort(key=lambda x: x[0])
        if not p:
            out.append((np.zeros(0, np.float32), np.zeros((0, top), np.int64), np.zeros((0, top), np.float32)))
            continue
        out.append((np.concatenate([x[1] for x in p]), np.concatenate([x[2] for x in p]).astype(np.int64),
                    np.concatenate([x[3] for x in p])))
    return out


def cover_sample(rows: Sequence[np.ndarray], n_rows: int, max_tokens: int | None, cover: int = 3, seed: int = 0
                 ) -> list[int]:
    """Requests for the model to read: all of them when they fit ``max_tokens``; otherwise, in a seeded order,
    first those holding an id seen fewer than ``cover`` times so far, then the others, up to ``max_tokens``
    (every id read several times where the volume allows)."""
    total = sum(len(r) for r in rows)
    if max_tokens is None or total <= max_tokens:
        return list(range(len(rows)))
    order = np.random.default_rng(seed).permutation(len(rows))
    seen = np.zeros(n_rows, np.int64)
    chosen, used, rest = [], 0, []
    for i in order:
        r = rows[i]
        if used + len(r) > max_tokens:
            continue
        if (seen[r] < cover).any():
            chosen.append(int(i))
            used += len(r)
            np.add.at(seen, r, 1)
        else:
            rest.append(int(i))
    for i in rest:
        if used + len(rows[i]) <= max_tokens:
            chosen.append(i)
            used += len(rows[i])
    return sorted(chosen)


class ModelReading:
    """The public model's reading of the deciphered sample under one map: its mean log-likelihood per token (the
    observer's key-free yardstick) and, per observed row, the summed log-probabilities of candidate plaintexts at
    its occurrences (sparse: the model's ``top`` next tokens at each occurrence above a per-occurrence floor,
    the ``top``-th log-probability; every other candidate scores the floor)."""

    def __init__(self, lm, rows: Sequence[np.ndarray], plain_of_row: np.ndarray, index: np.ndarray, n_cols: int,
                 top: int, batch_tokens: int, device=None):
        n = len(plain_of_row)
        read = lm_read(lm, [plain_of_row[r] for r in rows], top=top, batch_tokens=batch_tokens, device=device)
        pos_rows = np.concatenate([r[1:] for r in rows if len(r) > 1])
        actual = np.concatenate([x[0] for x in read])
        tops = np.concatenate([x[1] for x in read])
        vals = np.concatenate([x[2] for x in read])
        self.mean_ll = float(actual.mean()) if len(actual) else 0.0
        self.positions = len(actual)
        floor = vals[:, -1].astype(np.float64)
        self.occurrences = np.bincount(pos_rows, minlength=n).astype(np.float64)
        self.floor = np.bincount(pos_rows, weights=floor, minlength=n)
        col = index[tops]
        ok = col < n_cols
        r = np.broadcast_to(pos_rows[:, None], col.shape)[ok]
        bonus = (vals - floor[:, None].astype(np.float32))[ok]
        self.bonus = sp.csr_matrix((bonus.astype(np.float64), (r, col[ok])), shape=(n, n_cols))
        self.bonus.sum_duplicates()
        # the model's belief that each occurrence is a digit (for the digits' step)
        self.tops, self.vals, self.pos_rows = tops, vals, pos_rows


def match_sparse(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, n_cols: int,
                 fixed: dict[int, int]) -> np.ndarray:
    """``match`` over an arbitrary sparse candidate list (row, column, score; one entry per pair), maximising the
    summed scores themselves (each a row's share of one log-likelihood; shifted per row to its best, which leaves
    the optimum unchanged)."""
    order = np.lexsort((cols, rows))
    rows, cols, vals = rows[order], cols[order], vals[order].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    mx = np.maximum.reduceat(vals, starts)
    grp = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(rows)]))
    return _min_cost(rows, cols, mx[grp] - vals + 1.0, n, n_cols, fixed)


def _lm_candidates(reading: ModelReading, model: CandidateModel, left, right, counts, total, m: np.ndarray,
                   movable: np.ndarray, per_row: int, top_k: int, w_left: float, w_right: float
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, score) for the movable rows: the model's ``per_row`` best columns at the row's occurrences
    (left context: its full-context predictions, scaled from the occurrences read to all of them), the bigram
    model's ``top_k`` and the row's current column; score = the model's left term + ``w_right`` x the bigram's
    right-context term + ``w_left`` x the bigram's own left term (its count and Poisson terms included)."""
    c = len(model.cols)
    belief = onehot(m, c)
    scale = counts / np.maximum(reading.occurrences, 1.0)
    bonus = reading.bonus
    out_r, out_c, out_v = [], [], []
    rows_all = np.flatnonzero(movable)
    for rows in _blocks(len(rows_all), c):
        rows = rows_all[rows]
        full = _scores_block(model, left, right, belief, counts, total, rows)
        rgt = ((right[rows] @ belief) @ model.lift_t).toarray()
        lft = full - rgt
        bt = np.argpartition(-full, min(top_k, c) - 1, axis=1)[:, :top_k]
        sub = bonus[rows]
        for j, r in enumerate(rows):
            lo, hi = sub.indptr[j], sub.indptr[j + 1]
            ci, bv = sub.indices[lo:hi], sub.data[lo:hi]
            if len(ci) > per_row:
                keep = np.argpartition(-bv, per_row - 1)[:per_row]
                ci = ci[keep]
            cand = np.unique(np.concatenate([ci, bt[j], [m[r]] if m[r] < c else []]).astype(np.int64))
            lmv = scale[r] * (reading.floor[r] + np.asarray(bonus[r, cand].todense()).ravel())
            out_r.append(np.full(len(cand), r))
            out_c.append(cand)
            out_v.append(lmv + w_right * rgt[j, cand] + w_left * lft[j, cand])
    if not out_r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate(out_r), np.concatenate(out_c), np.concatenate(out_v)


def lm_refine(lm, model: CandidateModel, stream: ObservedStream, left, right, counts, total,
              starts: Sequence[tuple[str, np.ndarray]], fixed: dict[int, int], *, rounds: int = 4, top: int = 48,
              per_row: int = 24, top_k: int = 12, w_left: float = 0.0, w_right: float = 1.0,
              min_occurrences: int = 1, sample_tokens: int | None = None, cover: int = 3, batch_tokens: int = 2048,
              device=None, digits: Sequence[int] | None = None, digit_rounds: int = 4, digit_occurrences: int = 4,
              digit_check_each: bool = False, context: int = 24, ahead: int = 6, seed: int = 0,
              move_evals: int = 0, move_rounds: int = 3, move_top: int = 16, move_min_occurrences: int = 2,
              move_occurrences: int = 8, move_cycle_width: int = 2, move_keep_digits: bool = False,
              move_rank: str = "total",
              record: Callable[[dict, np.ndarray], None] | None = None) -> tuple[np.ndarray, ModelReading]:
    """The public model reading whole requests. ``starts``: (name, map) pairs; the model reads a sample of the
    requests deciphered by each (``cover_sample``: all of them when they fit ``sample_tokens``; ``ModelReading``)
    and the map it rates likeliest is kept (how the fresh and the warm-started maps are chosen between: the
    model's mean log-likelihood per token, the observer's key-free yardstick).

    Then ``rounds`` of EM with its full-context predictions: every id read at least ``min_occurrences`` times is
    re-assigned by a 1:1 matching on the model's scores plus the bigram's right context (``_lm_candidates``), the
    new map kept only when the model's likelihood of the sample rises; after a rejected round, half as many ids
    move. Then the digits as a unit (``digits``: their plaintext ids; ``_digits_unit``). Then, with
    ``move_evals``, moves of one or two ids at once judged by the model (``model_moves``: ``move_*`` its
    keywords; ``move_keep_digits``: the ``digits`` neither move nor are displaced). Returns the map and the model's
    reading of it."""
    c = len(model.cols)
    n = len(starts[0][1])
    rng = np.random.default_rng(seed)
    chosen = cover_sample(stream.rows, n, sample_tokens, cover, seed)
    rows = [stream.rows[i] for i in chosen]
    holder = int(model.cols[0])  # what an id on 'unknown' reads as

    def read(mm: np.ndarray) -> ModelReading:
        plain = np.where(mm < c, model.cols[np.minimum(mm, c - 1)], holder)
        return ModelReading(lm, rows, plain, model.index, c, top, batch_tokens, device)

    m, reading = None, None
    for j, (name, start) in enumerate(starts):
        if any(np.array_equal(start, s) for _, s in starts[:j]):
            continue  # read once
        r0 = read(start)
        if record:
            record({"stage": f"model reads: {name}", "model_ll": round(r0.mean_ll, 4), "positions": r0.positions,
                    "requests_read": len(rows)}, start)
        if reading is None or r0.mean_ll > reading.mean_ll:
            m, reading = start, r0
    fixed_rows = np.array(sorted(fixed), np.int64)
    share = 1.0
    for i in range(rounds):
        # ids read fewer than ``min_occurrences`` times stay: where nothing binds them, the model's likeliest
        # reading is fluent text, not the traffic
        movable = (reading.occurrences >= max(1, min_occurrences)) & (rng.random(n) < share)
        movable[fixed_rows] = False
        keep = {int(r): int(m[r]) for r in np.flatnonzero(~movable)}
        keep.update(fixed)
        r_, c_, v_ = _lm_candidates(reading, model, left, right, counts, total, m, movable, per_row, top_k,
                                    w_left, w_right)
        cand = match_sparse(r_, c_, v_, n, c, keep)
        moved = int((cand != m).sum())
        new = read(cand)
        ok = new.mean_ll > reading.mean_ll
        if ok:
            m, reading = cand, new
        else:
            share /= 2
        if record:
            record({"stage": f"model EM round {i + 1}", "model_ll": round(new.mean_ll, 4), "moved": moved,
                    "kept": bool(ok)}, m)
        if moved == 0 or share < 0.05:
            break
    if digits is not None and len(digits) and digit_rounds > 0:
        m, reading = _digits_unit(lm, reading, read, model, rows, m, np.asarray(digits, np.int64), holder,
                                  rounds=digit_rounds, occurrences=digit_occurrences, context=context,
                                  ahead=ahead, batch_tokens=batch_tokens, device=device, rng=rng, record=record,
                                  check_each=digit_check_each)
    if move_evals > 0:
        m, mean_ll = model_moves(lm, model, rows, m, fixed, holder, evals=move_evals, rounds=move_rounds,
                                 top=move_top, min_occurrences=move_min_occurrences,
                                 occurrences=move_occurrences, cycle_width=move_cycle_width, context=context,
                                 ahead=ahead, keep=digits if move_keep_digits else None, rank=move_rank,
                                 batch_tokens=batch_tokens, device=device, seed=seed, record=record)
        # only the likelihood is read on from here (the kept map's yardstick); the sparse scores are the EM's
        reading.mean_ll = mean_ll
    return m, reading


def model_moves(lm, model: CandidateModel, rows: Sequence[np.ndarray], m: np.ndarray, fixed: dict[int, int],
                holder: int, *, evals: int, rounds: int = 3, top: int = 16, min_occurrences: int = 2,
                per_id: int = 3, cycle_width: int = 2, occurrences: int = 8, keep: Sequence[int] | None = None,
                rank: str = "total", context: int = 24, ahead: int = 6, batch_tokens: int = 2048,
                device=None, seed: int = 0, record: Callable[[dict, np.ndarray], None] | None = None
                ) -> tuple[np.ndarray, float]:
    """Moves of one or two ids at once, proposed and judged by the public model (where the bigram search and
    single-id hill climbing stall: a swap moves two ids jointly). The model reads the sample ``rows`` under the
    map ``m``. For every free id read at least ``min_occurrences`` times, the ``per_id`` plaintexts its
    predictions favour most over the id's occurrences (summed log-probability above each occurrence's floor, its
    ``top`` next tokens) are proposed: the id moves there and the id holding that plaintext, if any, takes the
    id's old one (a swap) or one of its own ``cycle_width`` best, whose holder takes the id's old one (a cycle of
    three ids: chains of misreadings such as ':' read as 'of' read as 'in' need it); anchors never move. Each is
    estimated by the same sums for every id it moves (``rank`` "mean": per occurrence of the ids moved, so that
    a rare id the model reads with confidence comes before a frequent one it merely finds more fluent). Proposals
    go in
    decreasing order of that estimate, at most ``evals`` per round, each judged by the model on windows
    (``context`` tokens before and ``ahead`` after up to ``occurrences`` sampled occurrences of each id moved,
    read with and without the move) and applied when the windows' likelihood rises. After each round the whole
    sample is read again, and the round is kept only if the model's mean log-likelihood per token rose (the
    observer's yardstick; the key is never used); the next round's proposals come from that reading. ``keep``:
    plaintexts whose ids neither move nor are displaced (the digits, read as a unit from the reference: in random
    numbers the model's preferences among digits are its prior, not the traffic). Returns the map and its mean
    log-likelihood."""
    c = len(model.cols)
    n = len(m)
    vocab = len(model.index)
    rng = np.random.default_rng(seed)
    fixed_cols = set(int(v) for v in fixed.values())
    kept_cols = set(int(x) for x in model.index[np.asarray(keep, np.int64)] if x < c) if keep is not None else set()
    fixed_cols |= kept_cols
    where: dict[int, list[tuple[int, int]]] = {}
    for i, rr in enumerate(rows):
        for t, q in enumerate(np.asarray(rr).tolist()):
            where.setdefault(q, []).append((i, t))
    pos_rows = np.concatenate([np.asarray(r[1:], np.int64) for r in rows if len(r) > 1])

    def plain_of(mm: np.ndarray) -> np.ndarray:
        return np.where(mm < c, model.cols[np.minimum(mm, c - 1)], holder)

    def read_all(mm: np.ndarray):
        p = plain_of(mm)
        out = lm_read(lm, [p[r] for r in rows], top=top, batch_tokens=batch_tokens, device=device)
        actual = np.concatenate([x[0] for x in out])
        return float(actual.mean()) if len(actual) else 0.0, out

    mean_ll, reading = read_all(m)
    if record:
        record({"stage": "model moves: start", "model_ll": round(mean_ll, 4)}, m)
    for rnd in range(rounds):
        tried: set = set()  # within a round (the next round reads another map)
        tops = np.concatenate([x[1] for x in reading])
        vals = np.concatenate([x[2] for x in reading]).astype(np.float64)
        above = vals - vals[:, -1:]
        movable = np.ones(n, bool)
        movable[list(fixed)] = False
        movable[np.isin(m, list(kept_cols))] = False
        occ = np.bincount(pos_rows, minlength=n)
        movable &= occ >= max(1, min_occurrences)
        ok = movable[pos_rows][:, None] & (tops < vocab)  # a model vocabulary past the tokenizer's: not a plaintext
        at_row = np.broadcast_to(pos_rows[:, None], tops.shape)
        agg = sp.csr_matrix((above[ok], (at_row[ok], tops[ok])), shape=(n, vocab))
        agg.sum_duplicates()
        cur_plain = plain_of(m)
        holder_of = {int(v): int(r) for r, v in enumerate(m) if v < c}
        best_of: dict[int, list[int]] = {}

        def gain(r: int, col: int) -> float:  # the model's sums for row r on column col, above its current one
            to = float(agg[r, model.cols[col]]) if col < c else 0.0
            return to - (float(agg[r, cur_plain[r]]) if m[r] < c else 0.0)

        for q in np.flatnonzero(movable):
            lo, hi = agg.indptr[q], agg.indptr[q + 1]
            cols_q = [int(model.index[agg.indices[j]]) for j in lo + np.argsort(-agg.data[lo:hi])[:per_id]]
            best_of[int(q)] = [x for x in cols_q if x < c and x != m[q] and x not in fixed_cols]
        proposals = []  # (estimate, [(row, new column), ...]): a move, a swap, or a cycle of three ids
        for q, tops_q in best_of.items():
            for col in tops_q:
                h = holder_of.get(col)
                if h is None:
                    proposals.append((gain(q, col), [(q, col)]))
                    continue
                if h in fixed or not movable[h]:
                    continue
                g1 = gain(q, col)
                proposals.append((g1 + gain(h, int(m[q])), [(q, col), (h, int(m[q]))]))
                for col2 in best_of.get(h, [])[:cycle_width]:
                    h2 = holder_of.get(col2)
                    if col2 == m[q] or h2 == q:
                        continue
                    if h2 is None:
                        proposals.append((g1 + gain(h, col2), [(q, col), (h, col2)]))
                    elif h2 not in fixed and movable[h2]:
                        proposals.append((g1 + gain(h, col2) + gain(h2, int(m[q])),
                                          [(q, col), (h, col2), (h2, int(m[q]))]))
        proposals = [x for x in proposals if x[0] > 0]
        if rank == "mean":  # the gain per occurrence of the ids moved: confident moves of rare ids first
            proposals = [(est / max(1, sum(int(occ[r]) for r, _ in mv)), mv) for est, mv in proposals]
        proposals.sort(key=lambda x: -x[0])
        start_m, start_ll = m.copy(), mean_ll
        done = applied = 0
        for est, moves in proposals:
            if done >= evals:
                break
            key = tuple(moves)
            if key in tried:
                continue
            new = m.copy()
            for r, col in moves:
                new[r] = col
            # still a 1:1 map from the current one (earlier moves of this round may have changed the holders)
            taken = new[new < c]
            if len(np.unique(taken)) != len(taken) or np.array_equal(new, m):
                continue
            tried.add(key)
            moved = [r for r, _ in moves]
            old_p, new_p = plain_of(m), plain_of(new)
            occs = []
            for r in moved:
                o = where.get(r, [])
                occs += o if len(o) <= occurrences else [o[k] for k in rng.choice(len(o), occurrences, False)]
            segs = [np.asarray(rows[i])[max(0, t - context):t + ahead + 1] for i, t in occs]
            scored = lm_read(lm, [old_p[s] for s in segs] + [new_p[s] for s in segs], top=1,
                             batch_tokens=batch_tokens, device=device)
            k = len(segs)
            delta = sum(float(x[0].sum()) for x in scored[k:]) - sum(float(x[0].sum()) for x in scored[:k])
            done += 1
            if delta > 0:
                m = new
                applied += 1
        if not applied:
            break
        new_ll, new_reading = read_all(m)
        kept = new_ll > start_ll
        if kept:
            mean_ll, reading = new_ll, new_reading
        else:
            m = start_m
        if record:
            record({"stage": f"model moves: round {rnd + 1}", "model_ll": round(new_ll, 4), "evals": done,
                    "applied": applied, "kept": bool(kept)}, m)
        if not kept:
            break
    return m, mean_ll


def _digits_unit(lm, reading: ModelReading, read: Callable[[np.ndarray], ModelReading], model: CandidateModel,
                 rows: Sequence[np.ndarray], m: np.ndarray, digits: np.ndarray, holder: int, *, rounds: int,
                 occurrences: int, context: int, ahead: int, batch_tokens: int, device, rng: np.random.Generator,
                 record, check_each: bool = False) -> tuple[np.ndarray, ModelReading]:
    """The digits as a unit. The ids on digit plaintexts, with the ids the model reads as digits (over half its
    probability on the ten at their occurrences) on the digits no id holds, are re-assigned among the ten by
    swaps the model scores on windows (``context`` tokens before each sampled occurrence, ``ahead`` after; every
    token of the two ids in the window swapped: dates, phone, card and account numbers read as a whole). Each
    round applies the swaps that raise the windows' likelihood, the largest first, each id once; the result is
    kept only if the model's likelihood of the whole sample rises (``check_each``: read after every round, the
    likeliest round kept)."""
    c = len(model.cols)
    n = len(m)
    dcols = model.index[digits]
    dcols = dcols[dcols < c]
    start_ll, start = reading.mean_ll, m.copy()
    best = (start, reading)
    is_d = np.isin(reading.tops, model.cols[dcols])
    mass = (np.exp(reading.vals) * is_d).sum(axis=1)
    per = np.bincount(reading.pos_rows, weights=mass, minlength=n) / np.maximum(reading.occurrences, 1)
    held = np.isin(m, dcols)
    free_cols = [int(x) for x in dcols if not (m == x).any()]
    extra = [int(r) for r in np.argsort(-per) if per[r] > 0.5 and not held[r]][:len(free_cols)]
    m = m.copy()
    for r, col in zip(extra, free_cols):  # the free digits in turn: the swaps below sort them out
        m[r] = col
    unit = np.flatnonzero(np.isin(m, dcols))
    if len(unit) < 2:
        return best
    where: dict[int, list[tuple[int, int]]] = {}
    for i, rr in enumerate(rows):
        for t in np.flatnonzero(np.isin(rr, unit)):
            where.setdefault(int(rr[t]), []).append((i, int(t)))
    sampled = {r: (occ if len(occ) <= occurrences else
                   [occ[k] for k in rng.choice(len(occ), occurrences, replace=False)]) for r, occ in where.items()}
    for rnd in range(rounds):
        plain = [np.where(m < c, model.cols[np.minimum(m, c - 1)], holder)[rr] for rr in rows]
        pairs = [(int(a), int(b)) for j, a in enumerate(unit) for b in unit[j + 1:]]
        windows, owner, bases = [], [], {}
        for j, (a, b) in enumerate(pairs):
            for r in (a, b):
                for i, t in sampled.get(r, []):
                    lo = max(0, t - context)
                    seg = rows[i][lo:t + ahead + 1]
                    w = plain[i][lo:t + ahead + 1].copy()
                    va = model.cols[m[a]] if m[a] < c else holder
                    vb = model.cols[m[b]] if m[b] < c else holder
                    w[seg == a], w[seg == b] = vb, va
                    windows.append(w)
                    owner.append((j, (i, t)))
                    bases.setdefault((i, t), plain[i][lo:t + ahead + 1])
        keys = list(bases)
        scored = lm_read(lm, windows + [bases[k] for k in keys], top=1, batch_tokens=batch_tokens, device=device)
        base_ll = {k: float(scored[len(windows) + q][0].sum()) for q, k in enumerate(keys)}
        gain = np.zeros(len(pairs))
        for (j, k), (actual, _, _) in zip(owner, scored[:len(windows)]):
            gain[j] += float(actual.sum()) - base_ll[k]
        used: set[int] = set()
        applied = 0
        for j in np.argsort(-gain):
            if gain[j] <= 0:
                break
            a, b = pairs[j]
            if a in used or b in used:
                continue
            m[a], m[b] = m[b], m[a]
            used.update((a, b))
            applied += 1
        entry = {"stage": f"digits: swap round {rnd + 1}", "swaps": applied, "digit_ids": len(unit),
                 "window_tokens": int(sum(len(w) for w in windows))}
        if applied and check_each:  # the whole sample read after every round: the likeliest round is kept
            new = read(m)
            entry["model_ll"] = round(new.mean_ll, 4)
            if new.mean_ll > best[1].mean_ll:
                best = (m.copy(), new)
        if record:
            record(entry, m)
        if not applied:
            break
    if not check_each and not np.array_equal(m, start):
        new = read(m)
        if new.mean_ll > start_ll:
            best = (m, new)
    ok = best[0] is not start
    if record:
        record({"stage": "digits: kept" if ok else "digits: rejected", "model_ll": round(best[1].mean_ll, 4),
                "kept": bool(ok)}, best[0])
    return best


# --- the registered attacks' engine: the audit's observer of the logs, at a stated traffic volume ----------------

# about a day of one user's ordinary use: some 100 requests of 200 tokens, chat template included
DEFAULT_TRAFFIC_TOKENS = 20_000
CURVE_POINTS = (1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)


def curve_volumes(traffic_tokens: int) -> list[int]:
    """The volumes the curve is measured at: the fixed points below ``traffic_tokens``, then it."""
    return [v for v in CURVE_POINTS if v < traffic_tokens] + [traffic_tokens]


def audit_traffic(tokenizer, private_ids: Sequence[Sequence[int]], private_masks: Sequence[Sequence[bool]],
                  traffic_tokens: int, seed: int) -> tuple[list[list[int]], list[np.ndarray], list[np.ndarray]]:
    """The logs of ``traffic_tokens`` tokens: public PII-like prompts (``data.private_prompts`` under another Faker
    seed: the same ten templates) with the client's private prompts spread evenly among them, every request
    wrapped in the public chat template. Returns (plaintext requests, PII mask per request, user-text mask per
    request: the template's tokens are False). Requests only: the model's replies are not in these logs."""
    from .behavioural import chat_template_ids
    from .data import private_prompts

    pre, post = chat_template_ids(tokenizer)
    own = [list(p) for p in private_ids]
    own_masks = [list(m) for m in private_masks]
    wrap = len(pre) + len(post)
    need = traffic_tokens - sum(len(p) + wrap for p in own)
    fill_ids: list[list[int]] = []
    fill_masks: list[list[bool]] = []
    if need > 0:
        mean = max(1.0, float(np.mean([len(p) for p in own])) if own else 80.0) + wrap
        extra = private_prompts(tokenizer, int(np.ceil(need / mean * 1.2)) + 5, seed + 1_000)
        total = 0
        for ids, mask in zip(extra.plain_ids, extra.pii_mask):
            if total >= need:
                break
            fill_ids.append(list(ids))
            fill_masks.append(list(mask))
            total += len(ids) + wrap
    # the client's prompts evenly through the day
    order: list[tuple[list[int], list[bool]]] = list(zip(fill_ids, fill_masks))
    step = max(1, (len(order) + len(own)) // max(1, len(own)))
    for i, item in enumerate(zip(own, own_masks)):
        order.insert(min(len(order), i * step + step // 2), item)
    requests, pii, user = [], [], []
    for ids, mask in order:
        requests.append(list(pre) + ids + list(post))
        pii.append(np.asarray([False] * len(pre) + [bool(x) for x in mask] + [False] * len(post)))
        user.append(np.asarray([False] * len(pre) + [True] * len(ids) + [False] * len(post)))
    return requests, pii, user


# the digits read as a unit (``digits_unit``, from the reference alone) at every volume: off. Measured back to back
# at ci on one obfuscated SmolLM2 with the generic reference, it read more at the small volumes of the curve but
# less of the client's prompts at the full volume
READ_DIGITS = False


def tokenizer_digits(tokenizer) -> list[int] | None:
    """The plaintext ids of the ten digits where each is one token of the public tokenizer, else None."""
    ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    unk = getattr(tokenizer, "unk_token_id", None)
    ok = all(isinstance(i, int) and i >= 0 and i != unk for i in ids) and len(set(ids)) == 10
    return ids if ok else None


def run_log_reader(target, data, budget, seed: int = 0, with_lm: bool = False):
    """The client's private prompts inside a day's logs (``budget.traffic_tokens`` tokens, default
    ``DEFAULT_TRAFFIC_TOKENS``; see ``audit_traffic``) through the key, deciphered with public text (fortunes +
    debian-reference) by ``decipher_logs`` at increasing volumes, each warm-started from the last. The attack's
    figure is on the client's prompts at the full volume; ``metrics['curve']`` holds recovery of the prompt
    (user-text) and PII tokens of all the traffic at each volume. With ``READ_DIGITS`` (off) the digits are read
    as a unit at each volume (``digits_unit``, where the tokenizer has the ten as single tokens). ``with_lm``: the
    public model's successor distributions join the reference's bigram model (``lm_successors``)."""
    from .base import AttackResult, score_mapping
    from .stream_decipher import public_reference

    tok = target.tokenizer
    traffic_tokens = int(getattr(budget, "traffic_tokens", None) or DEFAULT_TRAFFIC_TOKENS)
    plain_reqs, pii, user = audit_traffic(tok, data.plain_ids, data.pii_mask, traffic_tokens, seed)
    from .behavioural import chat_template_ids

    pre, post = chat_template_ids(tok)
    observed = [np.asarray(target.obfuscate_ids(r), np.int64) for r in plain_reqs]
    vocab = max(len(tok), 1 + max(int(o.max()) for o in observed))
    reference = public_reference(tok, int(max(300_000, 1_000_000 * min(1.0, 4 * budget.scale))))
    steps = int(400 * min(1.0, max(0.25, 4 * budget.scale)))
    lm = target.public_lm() if with_lm else None
    # one forward pass per candidate the model reads: 2,400 at ci, 6,000 at small, 12,000 at full (at 1.5B on 2
    # cores 12,000 reads took 5 of the 6 minutes of this attack at small)
    lm_reads = int(12_000 * min(1.0, max(0.2, 2 * budget.scale)))
    ends = np.cumsum([len(r) for r in observed])
    curve, init, res = [], None, None
    # whole requests up to each volume; a volume that adds no request is not measured twice
    sizes = {int(min(len(observed), np.searchsorted(ends, vol) + 1)) for vol in curve_volumes(int(ends[-1]))}
    for k in sorted(sizes):
        # the model reading whole requests (lm_rounds: lm_refine) is not used here: measured side by side at ci
        # on SmolLM2, its choice among the maps read less of the prompts than the bigram's, in twice the time
        res = decipher_logs(observed[:k], vocab, reference, pre, post, init=init, anneal_steps=steps, seed=seed,
                            lm=lm, lm_candidates=lm_reads, digits=tokenizer_digits(tok) if READ_DIGITS else None)
        flat = np.concatenate(observed[:k])
        truth = np.concatenate(plain_reqs[:k])
        ok = res.obf_to_plain[flat] == truth
        u, p = np.concatenate(user[:k]), np.concatenate(pii[:k])
        curve.append({"tokens": int(len(flat)), "requests": k, "all_token_recovery": round(float(ok.mean()), 4),
                      "prompt_token_recovery": round(float(ok[u].mean()), 4) if u.any() else None,
                      "pii_token_recovery": round(float(ok[p].mean()), 4) if p.any() else None,
                      "seconds": res.seconds})
        seen = np.unique(flat)
        init = {int(c): int(res.obf_to_plain[c]) for c in seen}
    guess = np.full(len(target.true_permutation()), -1, np.int64)
    guess[:len(res.obf_to_plain)] = res.obf_to_plain[:len(guess)]
    metrics = score_mapping(target, data, guess, text_metrics=True)
    metrics.update({"tokens_observed": int(ends[-1]), "requests_observed": len(observed), "anchors": res.anchors,
                    "curve": curve, "traffic": "public PII-like prompts (Faker, the audit's ten templates, another "
                    "seed) with the client's prompts among them, in the chat template; requests only"})
    info = {"budget": budget.name, "reference": "fortunes + debian-reference", "traffic_tokens": int(ends[-1]),
            "anneal_steps_per_id": steps, "seed": seed, "warm_started": True}
    uses = (f"the logs: {int(ends[-1])} obfuscated ids in {len(observed)} requests; the public tokenizer and chat "
            "template; public text (fortunes, debian-reference)" + ("; the public model (no obfuscated weights)"
                                                                    if with_lm else "") + "; no key")
    name = "stream-decipher-lm" if with_lm else "stream-decipher"
    return AttackResult(name, metrics["ttrsr"], metrics["piirsr"], metrics, info, uses=uses)


@register("stream-decipher")
def stream_decipher(target, data, budget, seed: int = 0):
    """Id-stream decipherment of a day's logs (``run_log_reader``: template anchors, sparse mean-field, matching,
    block moves and annealing on a bigram model of public text, warm-started along the volume); no model."""
    return run_log_reader(target, data, budget, seed, with_lm=False)


@register("stream-decipher-lm", uses_engine=True)
def stream_decipher_lm(target, data, budget, seed: int = 0):
    """The same with the public model's next-token distributions joining the public text's bigram model."""
    return run_log_reader(target, data, budget, seed, with_lm=True)
