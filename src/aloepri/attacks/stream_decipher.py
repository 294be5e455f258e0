"""Id-stream decipherment: what an observer of the request logs reads, holding the public model but not the key.

The vocabulary permutation is a fixed 1:1 substitution cipher on token ids, so the classic decipherment methods
apply (Knight et al. 2006; Ravi & Knight 2011; Nuhn et al. 2013): they use *context*, not only counts. The observer
here holds what every observer of an open-weight deployment holds: the observed id stream (request by request),
the public tokenizer and its chat template, public text, and (optionally) the public language model itself. It does
not hold the obfuscated weights or the key.

Stages (each a pure function on numpy / torch arrays):

1. **Template anchors.** The public chat template's constant tokens sit at fixed offsets from both ends of every
   request: known (cipher, plain) pairs for free (``behavioural.template_anchors``).
2. **Frequency seed.** Every other observed id starts at the public reference token of the same frequency rank
   (TFMA), restricted to the candidate plaintext tokens.
3. **Context decipherment.** For every observed cipher id ``c`` and every candidate plaintext token ``v``, a score
   ``S[c, v]`` sums, over the occurrences of ``c``, the expected log-probability of ``v`` given its left neighbour
   and of the right neighbour given ``v`` under a smoothed bigram model of the public text, plus a Poisson term
   for the id's count. Mean-field iterations (neighbours as beliefs, temperature falling) sharpen the beliefs; a
   greedy 1:1 assignment (most confident first; anchors fixed) starts a simulated annealing over the 1:1 mapping
   on the exact bigram log-likelihood of the whole observed stream.
4. **Public-LM judge** (the observer with the model). The public LM reads the deciphered requests (batched, within
   a budget of tokens and seconds). Candidate mappings (another annealing run; a mapping re-annealed with the LM's
   next-token log-probabilities as extra evidence) replace the current one only if the LM finds the deciphered
   stream likelier: the traffic was written for this model (and its replies by it), so no key is needed to choose.

Scoring needs the key and nothing else does: ``decipher_stream`` returns a full ``cipher -> plain`` guess.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from .behavioural import template_anchors


@dataclass
class BigramModel:
    """Interpolated bigram model over plaintext ids, kept sparse:
    ``log P(v | u) = base[v] + lift[u, v]`` with ``base = log((1 - lam) p(v))`` and
    ``lift[u, v] = log(1 + lam c(u, v) / (c(u) (1 - lam) p(v)))``, non-zero only where the pair was seen."""

    base: np.ndarray  # (V,) float64
    lift: sp.csr_matrix  # (V, V)

    @property
    def unigram(self) -> np.ndarray:
        """(V,) the smoothed unigram p(v) the model was built with."""
        p = np.exp(self.base)
        return p / p.sum()


def bigram_model(reference: Sequence[Sequence[int]], vocab_size: int, lam: float = 0.8, add: float = 0.1
                 ) -> BigramModel:
    """A bigram model of public text (``reference``: token-id sequences; pairs never cross a sequence boundary).
    Unigram with add-``add`` smoothing so that tokens absent from the reference stay possible."""
    seqs = [np.asarray(s, np.int64) for s in reference if len(s)]
    flat = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    uni = np.bincount(flat, minlength=vocab_size).astype(np.float64) + add
    p = uni / uni.sum()
    left = np.concatenate([s[:-1] for s in seqs]) if seqs else flat
    right = np.concatenate([s[1:] for s in seqs]) if seqs else flat
    pairs = sp.coo_matrix((np.ones(len(left)), (left, right)), shape=(vocab_size, vocab_size)).tocsr()
    pairs.sum_duplicates()
    ctx = np.asarray(pairs.sum(axis=1)).ravel()
    coo = pairs.tocoo()
    lift = np.log1p(lam * coo.data / (ctx[coo.row] * (1 - lam) * p[coo.col]))
    return BigramModel(np.log((1 - lam) * p), sp.csr_matrix((lift, (coo.row, coo.col)), shape=pairs.shape))


@dataclass
class ObservedStream:
    """The observed requests as row indices: ``rows[i]`` is the row (distinct cipher id) of each token of request i."""

    cipher_ids: np.ndarray  # (R,) distinct observed cipher ids; row r is cipher_ids[r]
    rows: list[np.ndarray]
    counts: np.ndarray  # (R,) occurrences of each row

    @classmethod
    def of(cls, requests: Sequence[Sequence[int]]) -> "ObservedStream":
        flat = np.concatenate([np.asarray(r, np.int64) for r in requests])
        ids, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
        rows, at = [], 0
        for r in requests:
            rows.append(inverse[at:at + len(r)])
            at += len(r)
        return cls(ids, rows, counts)


def adjacency(stream: ObservedStream) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """(R, R) counts: ``left[r, q]`` = times row q immediately precedes row r; ``right[r, q]`` = times q follows r."""
    pairs = [np.stack([rows[:-1], rows[1:]]) for rows in stream.rows if len(rows) > 1]
    n = len(stream.cipher_ids)
    if not pairs:
        return sp.csr_matrix((n, n)), sp.csr_matrix((n, n))
    prev, cur = np.concatenate(pairs, axis=1)
    left = sp.coo_matrix((np.ones(len(cur)), (cur, prev)), shape=(n, n)).tocsr()
    return left, left.T.tocsr()


def belief_matrix(plain_of_row: np.ndarray | None, beliefs: tuple[np.ndarray, np.ndarray] | None,
                  vocab_size: int, n_rows: int) -> sp.csr_matrix:
    """(R, V) sparse beliefs about each row's plaintext: one-hot rows from a hard mapping (-1: unknown, empty row)
    or the (top candidates, probabilities) of a soft one."""
    if beliefs is None:
        ok = plain_of_row >= 0
        return sp.csr_matrix((np.ones(int(ok.sum())), (np.flatnonzero(ok), plain_of_row[ok])),
                             shape=(n_rows, vocab_size))
    cols, probs = beliefs
    rows = np.repeat(np.arange(n_rows), cols.shape[1])
    return sp.csr_matrix((probs.ravel(), (rows, cols.ravel())), shape=(n_rows, vocab_size))


def context_scores(model: BigramModel, left: sp.csr_matrix, right: sp.csr_matrix, belief: sp.csr_matrix,
                   columns: np.ndarray) -> np.ndarray:
    """(R, C) expected log-likelihood lift of each candidate column from the row's neighbours under the current
    beliefs: ``sum_q left[r,q] E_q[lift(u, v)] + sum_q right[r,q] E_q[lift(v, w)]`` (the base terms are added by
    ``unigram_scores``; the right neighbour's base does not depend on v)."""
    ctx_left = left @ belief  # (R, V) expected counts of each plaintext left neighbour
    ctx_right = right @ belief
    scores = np.asarray((ctx_left @ model.lift[:, columns]).todense(), np.float64)
    scores += np.asarray((ctx_right @ model.lift[columns, :].T).todense(), np.float64)
    return scores


def unigram_scores(model: BigramModel, counts: np.ndarray, total: int, columns: np.ndarray) -> np.ndarray:
    """(R, C) Poisson log-likelihood of each row's observed count if it were the candidate:
    ``n_r log p(v) - N p(v)`` (up to terms constant in v). The ``- N p(v)`` part is what keeps a rare cipher id
    off a frequent plaintext token."""
    p = model.unigram[columns]
    return counts[:, None] * np.log(p)[None, :] - total * p[None, :]


def soft_beliefs(scores: np.ndarray, columns: np.ndarray, fixed: dict[int, int], temperature: float,
                 top_k: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Mean-field beliefs: per row, the top-k candidates and their softmax(scores / T) weights; anchors one-hot."""
    k = min(top_k, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    val = np.take_along_axis(scores, top, axis=1) / temperature
    val = np.exp(val - val.max(axis=1, keepdims=True))
    val /= val.sum(axis=1, keepdims=True)
    cols = columns[top]
    for r, v in fixed.items():
        cols[r] = v
        val[r] = 0.0
        val[r, 0] = 1.0
    return cols, val


def assign_one_to_one(scores: np.ndarray, columns: np.ndarray, fixed: dict[int, int], top_k: int = 16
                      ) -> tuple[np.ndarray, np.ndarray]:
    """A 1:1 row -> plain assignment, most confident first. ``fixed``: row -> plain (anchors), assigned first and
    kept. Confidence of (row, candidate) = the candidate's log-posterior in its row (softmax over the row), so rows
    seen often do not win only by magnitude. Returns (plain per row, -1 where no free candidate remained; the
    winning log-posterior per row)."""
    n_rows = scores.shape[0]
    out = np.full(n_rows, -1, np.int64)
    conf = np.full(n_rows, -np.inf)
    taken: set[int] = set()
    for r, v in fixed.items():
        out[r], conf[r] = v, 0.0
        taken.add(v)
    lse = np.logaddexp.reduce(scores, axis=1, keepdims=True)
    post = scores - lse
    k = min(top_k, scores.shape[1])
    top = np.argpartition(-post, k - 1, axis=1)[:, :k]
    cand_rows = np.repeat(np.arange(n_rows), k)
    cand_cols = top.ravel()
    cand_post = post[cand_rows, cand_cols]
    for j in np.argsort(-cand_post, kind="stable"):
        r, v = int(cand_rows[j]), int(columns[cand_cols[j]])
        if out[r] >= 0 or v in taken:
            continue
        out[r], conf[r] = v, float(cand_post[j])
        taken.add(v)
    return out, conf


@dataclass
class LMScorer:
    """Scores candidates with a causal LM over deciphered requests. ``model(input_ids, attention_mask)`` returns
    logits (the public model, any device); ``batch`` requests per forward pass."""

    model: torch.nn.Module
    batch: int = 4
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def _log_probs(self, stream: ObservedStream, plain_of_row: np.ndarray, part: Sequence[int], bos: int | None):
        """Deciphered requests ``part`` through the LM: (log-probs (B, T, V), the row at each position, the
        position shift: logits at index t - shift predict token t)."""
        chunk = [stream.rows[i] for i in part]
        plain = [np.where(plain_of_row[r] >= 0, plain_of_row[r], 0) for r in chunk]
        if bos is not None:
            plain = [np.concatenate([[bos], p]) for p in plain]
        n = max(len(p) for p in plain)
        ids = torch.zeros(len(plain), n, dtype=torch.long)
        mask = torch.zeros(len(plain), n, dtype=torch.long)
        for j, p in enumerate(plain):
            ids[j, :len(p)] = torch.as_tensor(p)
            mask[j, :len(p)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return torch.log_softmax(logits.float(), dim=-1), chunk, (0 if bos is not None else 1)

    def _scored_positions(self, stream: ObservedStream, plain_of_row: np.ndarray, requests: Sequence[int],
                          scored: np.ndarray, bos: int | None):
        """Per request and batch: (the LM's log-probs predicting each scored position (P, V), the rows there).
        Scored = positions with a left context (all with ``bos``) whose row is in ``scored``."""
        for a in range(0, len(requests), self.batch):
            logp, chunk, shift = self._log_probs(stream, plain_of_row, requests[a:a + self.batch], bos)
            for j, rows in enumerate(chunk):
                pos = np.arange(shift, len(rows))
                pos = pos[scored[rows[pos]]]
                if len(pos):
                    yield logp[j, torch.as_tensor(pos - shift, device=self.device)], rows[pos]

    @torch.no_grad()
    def scores(self, stream: ObservedStream, plain_of_row: np.ndarray, requests: Sequence[int], columns: np.ndarray,
               scored: np.ndarray, bos: int | None = None) -> np.ndarray:
        """(R, C) sum over the chosen requests' positions (where ``scored[row]``) of log P_LM(candidate | deciphered
        left context). Position 0 has no left context and is skipped unless ``bos`` is given."""
        out = torch.zeros(len(stream.cipher_ids), len(columns), dtype=torch.float64)
        cols = torch.as_tensor(columns, device=self.device)
        for logp, rows in self._scored_positions(stream, plain_of_row, requests, scored, bos):
            out.index_add_(0, torch.as_tensor(rows), logp[:, cols].double().cpu())
        return out.numpy()

    @torch.no_grad()
    def loss(self, stream: ObservedStream, plain_of_row: np.ndarray, requests: Sequence[int], scored: np.ndarray,
             bos: int | None = None) -> float:
        """Mean negative log-likelihood, under the LM, of the deciphered tokens at positions where ``scored[row]``:
        the observer's key-free yardstick (the traffic was written for, and partly by, this model)."""
        total, n = 0.0, 0
        for logp, rows in self._scored_positions(stream, plain_of_row, requests, scored, bos):
            tok = torch.as_tensor(np.where(plain_of_row[rows] >= 0, plain_of_row[rows], 0), device=logp.device)
            total -= float(logp.gather(1, tok[:, None]).sum())
            n += len(rows)
        return total / max(n, 1)


def anneal_mapping(left: sp.csr_matrix, right: sp.csr_matrix, prior: np.ndarray, log_bigram: np.ndarray, start: np.ndarray,
                   fixed: dict[int, int], proposals: np.ndarray, weights: np.ndarray, steps: int,
                   t_start: float = 3.0, t_end: float = 0.05, seed: int = 0, unary: np.ndarray | None = None
                   ) -> np.ndarray:
    """Simulated annealing over the 1:1 mapping row -> candidate column, on the exact bigram log-likelihood of the
    observed stream plus the unigram (Poisson) term.

    ``left[r, q]``: times row q precedes row r. ``prior`` (C,): ``- N p(c)``, the part of the Poisson count
    likelihood that the sequence likelihood lacks (a rare id on a frequent token is penalised).
    ``log_bigram`` (C, C): log P(col b | col a). ``unary`` (R, C), optional: more evidence per row and column
    (the public LM's log-probabilities). ``start`` (R,): a column per row, all distinct. A move re-maps a row (drawn by ``weights``) to one of its
    ``proposals`` (R, k) columns; if another row holds that column the two swap. Anchors never move."""
    rng = np.random.default_rng(seed)
    m = start.copy()
    holder = {int(c): r for r, c in enumerate(m)}
    l_ptr, l_idx, l_val = left.indptr, left.indices, left.data
    r_ptr, r_idx, r_val = right.indptr, right.indices, right.data
    movable = np.array([r for r in range(len(m)) if r not in fixed])
    w = weights[movable] / weights[movable].sum()
    rows = rng.choice(movable, size=steps, p=w)
    picks = rng.integers(0, proposals.shape[1], size=steps)
    temps = t_start * (t_end / t_start) ** (np.arange(steps) / max(1, steps - 1))
    accept = rng.random(steps)

    def energy(r: int, c: int) -> float:
        li, lv = l_idx[l_ptr[r]:l_ptr[r + 1]], l_val[l_ptr[r]:l_ptr[r + 1]]
        ri, rv = r_idx[r_ptr[r]:r_ptr[r + 1]], r_val[r_ptr[r]:r_ptr[r + 1]]
        own = prior[c] if unary is None else prior[c] + unary[r, c]
        return float(own + lv @ log_bigram[m[li], c] + rv @ log_bigram[c, m[ri]])

    for r, j, temp, u in zip(rows.tolist(), picks.tolist(), temps.tolist(), accept.tolist()):
        c_new = int(proposals[r, j])
        c_old = int(m[r])
        if c_new == c_old:
            continue
        s = holder.get(c_new)
        if s is not None and s in fixed:
            continue
        if s is None:
            before = energy(r, c_old)
            m[r] = c_new
            delta = energy(r, c_new) - before
        else:
            # pairs between r and s are counted in both rows' energies, before and after alike
            before = energy(r, c_old) + energy(s, c_new)
            m[r], m[s] = c_new, c_old
            delta = energy(r, c_new) + energy(s, c_old) - before
        if delta >= 0 or u < np.exp(delta / temp):
            holder.pop(c_old, None)
            holder[c_new] = r
            if s is not None:
                holder[c_old] = s
        else:
            m[r] = c_old
            if s is not None:
                m[s] = c_new
    return m


def anneal_stage(model: BigramModel, left: sp.csr_matrix, right: sp.csr_matrix, scores: np.ndarray, columns: np.ndarray,
                 plain_of_row: np.ndarray, fixed: dict[int, int], counts: np.ndarray, total: int, steps: int,
                 n_candidates: int, seed: int, top_k: int = 12, wide: int = 4, lm_scores: np.ndarray | None = None,
                 t_start: float = 3.0) -> np.ndarray:
    """Anneal the 1:1 mapping on a dense candidate set: the ``n_candidates`` most frequent reference tokens plus
    every token the current mapping uses. Proposals per row: its ``top_k`` columns by ``scores`` (the mean-field
    evidence) and ``wide`` random columns of similar reference frequency."""
    rng = np.random.default_rng(seed)
    assigned = plain_of_row[plain_of_row >= 0]
    cand = np.union1d(columns[:n_candidates] if len(columns) > n_candidates else columns, assigned)
    # columns are sorted by id in ``columns``: rank them by reference frequency for the "similar frequency" moves
    p = model.unigram
    by_freq = cand[np.argsort(-p[cand], kind="stable")]
    index_of = np.full(len(p), -1, np.int64)
    index_of[cand] = np.arange(len(cand))
    log_bigram = model.base[cand][None, :] + np.asarray(model.lift[cand][:, cand].todense())
    prior = -total * p[cand]
    in_cand = index_of[columns] >= 0
    sc = np.where(in_cand[None, :], scores, -np.inf)
    k = min(top_k, int(in_cand.sum()))
    top = index_of[columns[np.argpartition(-sc, k - 1, axis=1)[:, :k]]]
    rank_of_row = np.empty(len(counts), np.int64)
    rank_of_row[np.argsort(-counts, kind="stable")] = np.arange(len(counts))
    spread = np.clip(rank_of_row[:, None] + rng.integers(-50, 51, (len(counts), wide)) * np.maximum(
        1, rank_of_row[:, None] // 20), 0, len(cand) - 1)
    proposals = np.concatenate([top, index_of[by_freq[spread]]], axis=1)
    start = index_of[np.where(plain_of_row >= 0, plain_of_row, cand[0])]
    fixed_idx = {r: int(index_of[v]) for r, v in fixed.items()}
    # a row without a column (the greedy ran out) takes a free one so that the start is a 1:1 mapping
    free_cols = iter(np.setdiff1d(np.arange(len(cand)), start[plain_of_row >= 0]))
    for r in np.flatnonzero(plain_of_row < 0):
        start[r] = next(free_cols)
    unary = None
    if lm_scores is not None:
        unary = np.zeros((len(counts), len(cand)), np.float32)
        unary[:, index_of[columns[in_cand]]] = lm_scores[:, in_cand]
    m = anneal_mapping(left, right, prior, log_bigram, start, fixed_idx, proposals, np.sqrt(counts), steps,
                       t_start=t_start, seed=seed, unary=unary)
    return cand[m]


def stream_log_likelihood(model: BigramModel, left: sp.csr_matrix, plain_of_row: np.ndarray) -> float:
    """Bigram log-likelihood of the observed stream deciphered by ``plain_of_row`` (``left[r, q]``: times q precedes
    r): the model-free observer's key-free yardstick for choosing between mappings."""
    pairs = left.tocoo()
    cur, prev = plain_of_row[pairs.row], plain_of_row[pairs.col]
    logp = model.base[cur] + np.asarray(model.lift[prev, cur]).ravel()
    return float((pairs.data * logp).sum())


@dataclass
class DecipherResult:
    """The observer's guess and how it got there."""

    obf_to_plain: np.ndarray  # (V,) guess per cipher id (-1: never observed / unassigned)
    anchors: int  # known pairs from the template
    trace: list[dict]  # per iteration: stage, seconds, tokens the LM read, and (if scored) recovery
    seconds: float


def frequency_seed(stream: ObservedStream, reference_counts: np.ndarray, columns: np.ndarray,
                   fixed: dict[int, int]) -> np.ndarray:
    """TFMA restricted to the candidates: free rows by observed count meet free columns by reference count."""
    out = np.full(len(stream.cipher_ids), -1, np.int64)
    for r, v in fixed.items():
        out[r] = v
    used = set(fixed.values())
    free_rows = [r for r in np.argsort(-stream.counts, kind="stable") if r not in fixed]
    free_cols = [int(c) for c in columns[np.argsort(-reference_counts[columns], kind="stable")] if int(c) not in used]
    for r, v in zip(free_rows, free_cols):
        out[r] = v
    return out


def decipher_stream(requests: Sequence[Sequence[int]], vocab_size: int, reference: Sequence[Sequence[int]],
                    prefix: Sequence[int] = (), suffix: Sequence[int] = (), *,
                    lm: LMScorer | None = None, lm_weights: Sequence[float] = (0.3,), restarts: int = 0,
                    lm_tokens: int = 20_000, lm_judge_tokens: int = 3_000,
                    lm_seconds: float = 600.0, max_candidates: int = 30_000,
                    temperatures: Sequence[float] = (16.0, 8.0, 4.0, 2.0, 1.0), anneal_steps: int = 300,
                    anneal_candidates: int = 8000, bos: int | None = None,
                    seed: int = 0, progress: Callable[[dict, np.ndarray], dict] | None = None) -> DecipherResult:
    """Decipher the observed ``requests`` (cipher ids, one sequence per request) into plaintext ids.

    ``reference``: public plaintext token sequences (the observer's text). ``prefix`` / ``suffix``: the public chat
    template's constant ids around a user message (anchors). ``restarts``: more annealing runs, the likeliest kept
    (under the bigram model, or under ``lm`` when given). ``lm``: the public model, judging those and one LM-refined mapping per ``lm_weights`` entry on ``lm_judge_tokens`` tokens;
    ``lm_tokens`` / ``lm_seconds``: what it reads to refine (requests sampled until the token budget; reading
    stops at the time budget). ``max_candidates``: plaintext tokens considered (most frequent in the reference first, anchors
    always). ``progress(entry, obf_to_plain)`` may score an iteration (the caller holds the key) and returns
    fields to record."""
    t0 = time.perf_counter()
    stream = ObservedStream.of(requests)
    row_of = {int(c): r for r, c in enumerate(stream.cipher_ids)}
    fixed = {row_of[c]: p for c, p in template_anchors(prefix, suffix, requests) if c in row_of} if prefix or suffix \
        else {}
    ref_counts = np.bincount(np.concatenate([np.asarray(s, np.int64) for s in reference]), minlength=vocab_size)
    seen = np.flatnonzero(ref_counts)
    columns = seen[np.argsort(-ref_counts[seen], kind="stable")][:max_candidates]
    columns = np.union1d(columns, np.fromiter(fixed.values(), np.int64, len(fixed)))
    model = bigram_model(reference, vocab_size)
    plain_of_row = frequency_seed(stream, ref_counts, columns, fixed)
    trace: list[dict] = []

    def to_full(p: np.ndarray) -> np.ndarray:
        full = np.full(vocab_size, -1, np.int64)
        full[stream.cipher_ids] = p
        return full

    def record(entry: dict) -> None:
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        if progress is not None:
            entry.update(progress(entry, to_full(plain_of_row)))
        trace.append(entry)

    record({"stage": "frequency seed", "anchors": len(fixed)})
    free = np.ones(len(stream.cipher_ids), bool)
    free[list(fixed)] = False
    total = int(stream.counts[free].sum())
    counts = stream.counts.astype(np.float64)
    uni = unigram_scores(model, counts, total, columns)
    left, right = adjacency(stream)
    # mean-field annealing: beliefs start from the counts alone and sharpen as the temperature falls
    beliefs = soft_beliefs(uni, columns, fixed, temperatures[0]) if temperatures else None
    if not temperatures:  # no mean-field: the frequency seed's context scores the 1:1 assignment
        scores = uni + context_scores(model, left, right, belief_matrix(plain_of_row, None, vocab_size, len(counts)),
                                      columns)
    for it, temp in enumerate(temperatures):
        scores = uni + context_scores(model, left, right, belief_matrix(None, beliefs, vocab_size, len(counts)),
                                      columns)
        beliefs = soft_beliefs(scores, columns, fixed, temp)
        plain_of_row = columns[np.argmax(scores, axis=1)]
        plain_of_row[list(fixed)] = list(fixed.values())
        record({"stage": f"mean-field T={temp:g}"})
    plain_of_row, _ = assign_one_to_one(scores, columns, fixed)
    record({"stage": "1:1 assignment"})
    start_of_anneal = plain_of_row
    if anneal_steps:
        plain_of_row = anneal_stage(model, left, right, scores, columns, plain_of_row, fixed, counts, total,
                                    anneal_steps * len(counts), anneal_candidates, seed)
        record({"stage": "annealing", "steps": anneal_steps * len(counts)})
        if lm is None and restarts:
            # more annealing runs; the observer keeps the mapping under which its own bigram model finds the stream
            # likeliest (no key). Measured: the likeliest is not reliably the most accurate (docs/security.md)
            best_ll = stream_log_likelihood(model, left, plain_of_row)
            trace[-1]["log_likelihood"] = round(best_ll, 1)
            for i in range(restarts):
                cand = anneal_stage(model, left, right, scores, columns, start_of_anneal, fixed, counts, total,
                                    anneal_steps * len(counts), anneal_candidates, seed + 100 + i)
                ll = stream_log_likelihood(model, left, cand)
                kept = ll > best_ll
                if kept:
                    best_ll, plain_of_row = ll, cand
                record({"stage": f"restart seed {seed + 100 + i}", "log_likelihood": round(ll, 1), "kept": kept})
    if lm is not None:
        order = np.random.default_rng(seed).permutation(len(requests))
        lengths = np.array([len(r) for r in stream.rows])
        chosen = order[: int(np.searchsorted(np.cumsum(lengths[order]), lm_tokens) + 1)].tolist()
        judge = chosen[: int(np.searchsorted(np.cumsum(lengths[chosen]), lm_judge_tokens) + 1)]
        best_loss = lm.loss(stream, plain_of_row, judge, free, bos)
        record({"stage": "lm judge: annealed", "lm_loss": round(best_loss, 4)})
        candidates = [("restart", seed + 100 + i) for i in range(restarts)] + [("lm", w) for w in lm_weights]
        for kind, arg in candidates:
            t_lm = time.perf_counter()
            if kind == "restart":
                # another annealing run from the same evidence; the LM decides which mapping reads better
                cand = anneal_stage(model, left, right, scores, columns, start_of_anneal, fixed, counts, total,
                                    anneal_steps * len(counts), anneal_candidates, int(arg))
                entry: dict = {"stage": f"restart seed {arg}"}
            else:
                # the LM reads the requests through the current best mapping: where that context is right, its
                # next-token distribution pins the id; a low-temperature anneal reconciles it with the bigram
                lm_scores = np.zeros((len(stream.cipher_ids), len(columns)))
                read: list[int] = []
                for a in range(0, len(chosen), lm.batch):
                    lm_scores += lm.scores(stream, plain_of_row, chosen[a:a + lm.batch], columns, free, bos)
                    read += chosen[a:a + lm.batch]
                    if time.perf_counter() - t_lm > lm_seconds:
                        break
                cand = anneal_stage(model, left, right, scores + arg * lm_scores, columns, plain_of_row, fixed, counts,
                                    total, anneal_steps * len(counts) // 2, anneal_candidates, seed + 1,
                                    lm_scores=arg * lm_scores, t_start=1.0)
                entry = {"stage": f"lm-refined w={arg:g}", "lm_tokens": int(lengths[read].sum())}
            loss = lm.loss(stream, cand, judge, free, bos)
            entry.update({"lm_loss": round(loss, 4), "lm_seconds": round(time.perf_counter() - t_lm, 1)})
            if loss < best_loss:
                best_loss, plain_of_row = loss, cand
                entry["kept"] = True
            record(entry)
    return DecipherResult(to_full(plain_of_row), len(fixed), trace, round(time.perf_counter() - t0, 1))


# --- the observer's public text (the registered attacks: aloepri.attacks.log_reader) -----------------------------

def public_reference(tokenizer, max_tokens: int) -> list[np.ndarray]:
    """The observer's text: fortunes + debian-reference (Debian packages; neither is the client's source), one
    token sequence per document (each encoded once per tokenizer and process: ``corpora.encode_text``)."""
    from ..corpora import corpus, encode_text

    out, total = [], 0
    for name in ("fortunes", "debian-reference"):
        for doc in corpus(name):
            ids = encode_text(tokenizer, doc).copy()
            out.append(ids)
            total += len(ids)
            if total >= max_tokens:
                return out
    return out
