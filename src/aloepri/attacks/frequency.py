"""Frequency and known-pair attacks on the vocabulary permutation.

- **TFMA** (the paper's token frequency matching attack, Appendix "Potential Threats"): the server counts how often
  each obfuscated id occurs in the client's traffic, the attacker counts plaintext token frequencies in a prior
  corpus, and matches the two by frequency rank. Top-k: the k plaintext tokens whose prior rank is nearest.
- **Known-pair ridge** (beyond the paper): with k known (plain id, obfuscated id) pairs, fit a linear map from
  obfuscated embedding/head rows to plaintext ones (``W~_e = Pi (W_e + noise) P`` is linear in the plaintext
  rows, the key matrix P only adds a linear map), then match every obfuscated row to its nearest plaintext row
  over the full vocabulary. Uses the key for the k pairs (an oracle, said in ``uses``).
- **Frequency-bootstrapped ridge** (beyond the paper, no oracle): the pairs are TFMA's most confident matches,
  cleaned by cross-validated consistency and refined by self-training on the most confident full-vocabulary
  matches.

The math is in pure functions on numpy arrays (``tfma_match``, ``fit_ridge``, ``nearest_rows``, ...); the
registered attacks wire them to an ``AttackTarget``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .base import (AttackResult, AttackTarget, Budget, PrivateData, has_tokenizer, register, score_mapping,
                   score_predictions)

# --- TFMA -----------------------------------------------------------------------------------------------------


def token_counts(ids: np.ndarray | Sequence[int], vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got [{ids.min()}, {ids.max()}]")
    return np.bincount(ids, minlength=vocab_size)


def _rank_order(counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Ids sorted by decreasing count; ties broken at random (seeded) so no id order leaks into the match."""
    return np.lexsort((rng.random(len(counts)), -counts))


@dataclass
class TfmaMatch:
    """Rank matching of observed obfuscated frequencies to prior plaintext frequencies."""

    obf_to_plain: np.ndarray  # (V,) top-1 guess per obfuscated id; -1 for ids never observed
    obf_rank: np.ndarray  # (V,) frequency rank of each obfuscated id in the observed stream (V for unobserved)
    plain_by_rank: np.ndarray  # (V,) plaintext ids in decreasing prior frequency

    def candidates(self, obf_ids: np.ndarray, k: int) -> np.ndarray:
        """(n, k) plaintext candidates per obfuscated id: the k prior ranks nearest its observed rank."""
        v = len(self.plain_by_rank)
        k = min(k, v)
        r = np.minimum(self.obf_rank[np.asarray(obf_ids)], v - 1)
        start = np.clip(r - k // 2, 0, v - k)
        return self.plain_by_rank[start[:, None] + np.arange(k)[None, :]]


def tfma_match(observed_obf_ids: np.ndarray, prior_plain_ids: np.ndarray, vocab_size: int, seed: int = 0) -> TfmaMatch:
    """TFMA: the i-th most frequent observed obfuscated id is guessed to be the i-th most frequent prior token."""
    rng = np.random.default_rng(seed)
    obs = token_counts(observed_obf_ids, vocab_size)
    prior = token_counts(prior_plain_ids, vocab_size)
    obf_order = _rank_order(obs, rng)
    plain_order = _rank_order(prior, rng)
    obf_rank = np.full(vocab_size, vocab_size, dtype=np.int64)
    n_seen = int((obs > 0).sum())
    obf_rank[obf_order[:n_seen]] = np.arange(n_seen)
    obf_to_plain = np.full(vocab_size, -1, dtype=np.int64)
    obf_to_plain[obf_order[:n_seen]] = plain_order[:n_seen]
    return TfmaMatch(obf_to_plain, obf_rank, plain_order)


def tfma_stream_recovery(match: TfmaMatch, observed_obf_ids: np.ndarray, true_plain_ids: np.ndarray,
                         ks: Sequence[int] = (1, 10, 100), top_types: Sequence[int] = (10, 100)) -> dict[str, float]:
    """Recovery on the observed stream: token-weighted top-k (true token among the k candidates), and top-1 over
    the n most frequent observed types (the two readings of the paper's 'Top-10 / Top-100')."""
    obs = np.asarray(observed_obf_ids)
    truth = np.asarray(true_plain_ids)
    types, first, counts = np.unique(obs, return_index=True, return_counts=True)
    type_truth = truth[first]  # a permutation: every occurrence of an obfuscated id has the same plaintext
    out: dict[str, float] = {}
    for k in ks:
        hit = (match.candidates(types, k) == type_truth[:, None]).any(axis=1)
        out[f"stream_top{k}"] = float((hit * counts).sum() / counts.sum())
    by_freq = np.argsort(-counts, kind="stable")
    for n in top_types:
        sel = by_freq[:n]
        out[f"top{n}_types_top1"] = float(np.mean(match.obf_to_plain[types[sel]] == type_truth[sel]))
    out["stream_tokens"] = int(len(obs))
    out["stream_types"] = int(len(types))
    return out


# --- ridge and nearest-neighbour matching ----------------------------------------------------------------------


def fit_ridge(x: np.ndarray, y: np.ndarray, lam_rel: float) -> np.ndarray:
    """W minimising ||x W - y||^2 + lam ||W||^2 with lam = lam_rel * mean squared row norm of x (scale-free).
    Solved in the dual (k x k) when there are fewer pairs than features."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k, d = x.shape
    lam = lam_rel * float(np.mean(np.sum(x * x, axis=1)))
    if k < d:
        return x.T @ np.linalg.solve(x @ x.T + lam * np.eye(k), y)
    return np.linalg.solve(x.T @ x + lam * np.eye(d), x.T @ y)


def _unit(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


class RowIndex:
    """Candidate rows of several paired spaces, unit-normalised and side by side once, for ``nearest_rows``
    queries in chunks: the candidates are copied once and a query only one chunk at a time (at a 150k vocabulary
    and width 1536 the whole normalised query set alone is gigabytes)."""

    def __init__(self, candidates: Sequence[np.ndarray]):
        # spaces whose candidate rows are identical (a tied plaintext head) are fused: sum of cosines = one product
        self.groups: list[list[int]] = []  # indices of the spaces in each group; the group's rows are its first's
        for j, ca in enumerate(candidates):
            for g in self.groups:
                gc = candidates[g[0]]
                if gc.shape == ca.shape and (gc is ca or np.array_equal(gc, ca)):
                    g.append(j)
                    break
            else:
                self.groups.append([j])
        widths = [candidates[g[0]].shape[1] for g in self.groups]
        c = np.empty((candidates[0].shape[0], sum(widths)), dtype=np.float32)
        at = 0
        for g, w in zip(self.groups, widths):
            c[:, at:at + w] = _unit(candidates[g[0]])
            at += w
        self.c = torch.from_numpy(c)

    def query(self, queries: Sequence[np.ndarray], top: int = 2, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """For each query row, the candidate rows with the largest summed cosine similarity over the spaces
        (``queries[j]`` is compared with ``candidates[j]``). Returns (top indices (n, top), their scores)."""
        n = len(queries[0])
        idx_out = np.empty((n, top), dtype=np.int64)
        val_out = np.empty((n, top), dtype=np.float32)
        for s in range(0, n, chunk):
            q = np.concatenate([sum(_unit(queries[j][s:s + chunk]) for j in g) for g in self.groups], axis=1)
            sim = torch.from_numpy(q) @ self.c.T
            v, i = torch.topk(sim, top, dim=1)
            idx_out[s:s + chunk] = i.numpy()
            val_out[s:s + chunk] = v.numpy()
        return idx_out, val_out


def nearest_rows(queries: Sequence[np.ndarray], candidates: Sequence[np.ndarray], chunk: int = 1024,
                 top: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """For each query row, the candidate rows with the largest summed cosine similarity over the paired spaces
    (``queries[j]`` is compared with ``candidates[j]``). Returns (top indices (n, top), their scores)."""
    return RowIndex(candidates).query(queries, top, chunk)


@dataclass
class RowSpaces:
    """Embedding and head rows, per token: obfuscated (indexed by obfuscated id) and plaintext (by plain id)."""

    obf: list[np.ndarray]
    plain: list[np.ndarray]
    names: list[str]
    _index: RowIndex | None = field(default=None, repr=False, compare=False)
    _subsets: dict = field(default_factory=dict, repr=False, compare=False)

    def plain_index(self) -> RowIndex:
        """``RowIndex`` of the plaintext rows, built once (every ridge fit and cross-validation fold of an attack,
        and the attacks sharing these spaces, match against the same candidates)."""
        if self._index is None:
            self._index = RowIndex(self.plain)
        return self._index


def row_spaces(target: AttackTarget, use: Sequence[str] = ("embed", "head")) -> RowSpaces:
    """The public rows the attacker matches: input embedding and LM head, obfuscated and plaintext. A tied
    plaintext head is the embedding (the obfuscated head is still separate: independent noise and key). Read from
    the models when they are loaded, else streamed from the checkpoints (``vma.target_weights``)."""
    bad = set(use) - {"embed", "head"}
    if bad or not use:
        raise ValueError(f"use must be a non-empty subset of ('embed', 'head'); got {use}")
    # once per target (AttackTarget.memo): the ridge attacks and the composed behavioural attack share the rows
    # and their plaintext index
    return target.memo(("row_spaces", tuple(use)), lambda: _row_spaces(target, use))


def _row_spaces(target: AttackTarget, use: Sequence[str]) -> RowSpaces:
    from .vma import target_weights

    def rows(side: str) -> list[np.ndarray]:
        with target_weights(target, side) as w:  # the ridge maps run in numpy, on the CPU
            return [w.get(which).to("cpu").numpy() for which in use]

    obf = rows("obf")
    plain = rows("plain")
    if obf[0].shape[0] != plain[0].shape[0]:
        raise ValueError(f"vocabulary sizes differ: obfuscated {obf[0].shape[0]} vs plaintext {plain[0].shape[0]}")
    return RowSpaces(obf, plain, list(use))


def select_lambda(spaces: RowSpaces, obf_ids: np.ndarray, plain_ids: np.ndarray, seed: int,
                  grid: Sequence[float] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0), folds: int = 5) -> tuple[float, dict]:
    """Pick the ridge strength by k-fold retrieval accuracy on the attacker's own pairs (held-out pairs matched
    against the full plaintext vocabulary): uses nothing but the pairs."""
    k = len(obf_ids)
    folds = max(2, min(folds, k))
    part = np.random.default_rng(seed).permutation(k) % folds
    scores = {}
    for lam in grid:
        hit = 0
        for f in range(folds):
            tr, te = part != f, part == f
            preds = [sp_obf[obf_ids[te]] @ fit_ridge(sp_obf[obf_ids[tr]], sp_pl[plain_ids[tr]], lam)
                     for sp_obf, sp_pl in zip(spaces.obf, spaces.plain)]
            idx, _ = spaces.plain_index().query(preds, top=1)
            hit += int((idx[:, 0] == plain_ids[te]).sum())
        scores[lam] = hit / k
    best = max(grid, key=lambda g: (scores[g], -g))  # ties: the smallest regularisation
    return best, scores


def subset(spaces: RowSpaces, names: Sequence[str]) -> RowSpaces:
    """The spaces ``names`` of ``spaces`` (made once per set of names, with its own plaintext index)."""
    if list(names) == spaces.names:
        return spaces
    if tuple(names) not in spaces._subsets:
        pick = [spaces.names.index(n) for n in names]
        spaces._subsets[tuple(names)] = RowSpaces([spaces.obf[i] for i in pick], [spaces.plain[i] for i in pick],
                                                  list(names))
    return spaces._subsets[tuple(names)]


def select_spaces_and_lambda(spaces: RowSpaces, obf_ids: np.ndarray, plain_ids: np.ndarray,
                             seed: int) -> tuple[RowSpaces, float, dict]:
    """The attacker's model selection, on its own pairs only: which row spaces to match (embedding, head or
    both: their noise levels differ, and a noisy space can drown a clean one) and the ridge strength."""
    options = [spaces.names] + ([[n] for n in spaces.names] if len(spaces.names) > 1 else [])
    best, table = None, {}
    for names in options:
        sub = subset(spaces, names)
        lam, scores = select_lambda(sub, obf_ids, plain_ids, seed)
        table["+".join(names)] = {str(g): v for g, v in scores.items()}
        if best is None or scores[lam] > best[2]:
            best = (sub, lam, scores[lam])
    return best[0], best[1], table


def ridge_map(spaces: RowSpaces, obf_ids: np.ndarray, plain_ids: np.ndarray, lam_rel: float,
              query_obf_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fit one ridge map per row space from the pairs, predict plaintext rows for the queried obfuscated ids
    (all by default) and match each to the nearest plaintext row over the full vocabulary.
    Returns (top-2 plaintext candidates per query, their summed-cosine scores)."""
    v = spaces.obf[0].shape[0]
    q = np.arange(v) if query_obf_ids is None else np.asarray(query_obf_ids)
    maps = [fit_ridge(sp_obf[obf_ids], sp_pl[plain_ids], lam_rel).astype(np.float32)
            for sp_obf, sp_pl in zip(spaces.obf, spaces.plain)]
    index = spaces.plain_index()
    idx, val = np.empty((len(q), 2), dtype=np.int64), np.empty((len(q), 2), dtype=np.float32)
    step = 16 * 1024  # predictions a block of queries at a time (a multiple of the query chunk)
    for s in range(0, len(q), step):
        preds = [sp_obf[q[s:s + step]] @ w for sp_obf, w in zip(spaces.obf, maps)]
        idx[s:s + step], val[s:s + step] = index.query(preds, top=2)
    return idx, val


def mapping_from_matches(v: int, query_obf_ids: np.ndarray, best_plain: np.ndarray) -> np.ndarray:
    out = np.full(v, -1, dtype=np.int64)
    out[query_obf_ids] = best_plain
    return out


# --- attack drivers -------------------------------------------------------------------------------------------


def _budgeted_tokens(budget: Budget, full_tokens: int) -> int:
    return max(20_000, int(full_tokens * budget.scale))


FULL_STREAM_TOKENS = 1_000_000  # tokens per side (prior / observed private corpus) at budget 'full'


def frequency_streams(target: AttackTarget, data: PrivateData, setting: str, budget: Budget, seed: int,
                      tokens: int | None = None, perturb: Callable[[np.ndarray], np.ndarray] | None = None,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """(prior plain ids, observed obfuscated ids, their plaintext truth, budget info) for a knowledge setting.
    The observed stream is the client's private corpus followed by the PII prompts (the server sees both).
    ``perturb`` is the client's online token perturbation (aloepri.runtime.perturb), applied to its plaintext ids
    before the key; the truth stays the client's real tokens."""
    from ..corpora import tokenize_texts
    from .data import frequency_setting

    n = tokens if tokens is not None else _budgeted_tokens(budget, FULL_STREAM_TOKENS)
    prior_texts, private_texts = frequency_setting(setting, seed)
    tok = target.tokenizer
    prior = tokenize_texts(tok, prior_texts, n)
    private = tokenize_texts(tok, private_texts, n)
    prompts = np.asarray([t for ids in data.plain_ids for t in ids], dtype=np.int64)
    truth = np.concatenate([private, prompts])
    perm = target.true_permutation()  # the victim's encoding of its own traffic, not attacker knowledge
    sent = truth if perturb is None else np.asarray(perturb(truth), dtype=np.int64)
    observed = perm[sent]
    info = {"setting": setting, "prior_tokens": int(len(prior)), "private_corpus_tokens": int(len(private)),
            "prompt_tokens": int(len(prompts)), "candidate_pool": "full vocabulary"}
    if perturb is not None:
        info["perturbed_token_fraction"] = float((sent != truth).mean())
    return prior, observed, truth, info


def observed_prompts(observed: np.ndarray, data: PrivateData) -> list[np.ndarray]:
    """The prompts' part of an observed stream (its tail, see ``frequency_streams``), one array per prompt."""
    lengths = [len(s) for s in data.plain_ids]
    tail = observed[len(observed) - sum(lengths):]
    return np.split(tail, np.cumsum(lengths)[:-1])


def run_tfma(target: AttackTarget, data: PrivateData, setting: str, budget: Budget, seed: int = 0,
             tokens: int | None = None, perturb: Callable[[np.ndarray], np.ndarray] | None = None) -> AttackResult:
    prior, observed, truth, info = frequency_streams(target, data, setting, budget, seed, tokens, perturb)
    v = target.vocab_size
    match = tfma_match(observed, prior, v, seed)
    prompts_seen = observed_prompts(observed, data)
    if perturb is None:
        metrics = score_mapping(target, data, match.obf_to_plain)
    else:  # the server saw perturbed prompts: score the guesses for what it saw against the real tokens
        metrics = score_predictions(target, data, [match.obf_to_plain[s] for s in prompts_seen],
                                    text_metrics=has_tokenizer(target))
    metrics.update(tfma_stream_recovery(match, observed, truth))
    metrics["stream_top1_tokenwise"] = float((match.obf_to_plain[observed] == truth).mean())
    obs_prompt = np.concatenate(prompts_seen)
    true_prompt = np.asarray([t for ids in data.plain_ids for t in ids])
    for k in (10, 100):
        metrics[f"prompt_top{k}"] = float((match.candidates(obs_prompt, k) == true_prompt[:, None]).any(axis=1).mean())
    return AttackResult(f"tfma-{setting}", metrics["ttrsr"], metrics["piirsr"], metrics, {**info, "seed": seed},
                        uses=f"obfuscated token ids of the client's traffic (counts only) and a public prior "
                             f"corpus ({setting}); no weights")


def sampled_queries(target: AttackTarget, data: PrivateData, v: int, n: int | None, seed: int
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(obfuscated ids to match, the uniform sample the vocabulary recovery is estimated on): every id when ``n``
    is None or covers the vocabulary, else the ids of the victim's prompts (their TTRSR stays exact) and ``n``
    ids drawn uniformly (seeded)."""
    if n is None or n >= v:
        return None, None
    sample = np.sort(np.random.default_rng(seed + 1).choice(v, size=n, replace=False))
    seen = np.asarray([o for obs in data.observed(target) for o in obs], dtype=np.int64)
    return np.union1d(sample, seen), sample


def score_sampled(target: AttackTarget, data: PrivateData, mapping: np.ndarray, sample: np.ndarray | None,
                  text_metrics: bool = True) -> dict[str, Any]:
    """``score_mapping``, with the vocabulary recovery estimated on ``sample`` when only it (and the prompts'
    ids) were matched."""
    out = score_mapping(target, data, mapping, text_metrics)
    if sample is not None:
        inv = np.argsort(target.true_permutation())
        out["vocab_recovery"] = float(np.mean(mapping[sample] == inv[sample]))
        out["vocab_recovery_sample"] = int(len(sample))
    return out


CI_QUERY_SAMPLE = 8192  # budget ci: obfuscated ids matched besides the prompts' (every id at the other budgets)


def run_known_pair_ridge(target: AttackTarget, data: PrivateData, k: int, budget: Budget, seed: int = 0,
                         spaces: RowSpaces | None = None, use: Sequence[str] = ("embed", "head"),
                         text_metrics: bool = True, query_sample: int | None = None) -> AttackResult:
    """k known pairs drawn uniformly (seeded) from the vocabulary; map fitted obf -> plain; full-vocabulary
    nearest neighbour for every obfuscated id (``query_sample``: for the prompts' ids and that many drawn
    uniformly, the vocabulary recovery then estimated on the draw)."""
    spaces = spaces or row_spaces(target, use)
    v = spaces.obf[0].shape[0]
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, {v}], got {k}")
    perm = target.true_permutation()
    plain_known = np.random.default_rng(seed).choice(v, size=k, replace=False)
    obf_known = perm[plain_known]  # the oracle: k pairs the attacker is assumed to know
    chosen, lam, cv_table = select_spaces_and_lambda(spaces, obf_known, plain_known, seed)
    query, sample = sampled_queries(target, data, v, query_sample, seed)
    idx, _ = ridge_map(chosen, obf_known, plain_known, lam, query_obf_ids=query)
    mapping = idx[:, 0] if query is None else mapping_from_matches(v, query, idx[:, 0])
    mapping[obf_known] = plain_known  # known pairs are known
    metrics = score_sampled(target, data, mapping, sample, text_metrics)
    inv = np.argsort(perm)
    unknown = np.setdiff1d(np.arange(v) if sample is None else sample, obf_known)
    metrics["vocab_recovery_unknown_only"] = float(np.mean(mapping[unknown] == inv[unknown]))
    metrics["cv_retrieval"] = cv_table  # held-out retrieval on the known pairs, per row spaces and lambda
    budget_info = {"k_known_pairs": k, "pairs": "uniform over the vocabulary", "lambda_rel": lam,
                   "row_spaces": chosen.names, "row_spaces_selection": "5-fold CV on the known pairs",
                   "candidate_pool": "full vocabulary",
                   "queries": "every obfuscated id" if query is None else
                   f"the prompts' ids and {len(sample)} drawn uniformly ({len(query)})", "seed": seed}
    return AttackResult(f"ridge-k{k}", metrics["ttrsr"], metrics["piirsr"], metrics, budget_info,
                        uses=f"obfuscated and public plaintext {'/'.join(chosen.names)} rows, plus {k} known "
                             "(plain, obfuscated) token pairs from the key (oracle; beyond the paper)")


def _cv_consistent(spaces: RowSpaces, obf_ids: np.ndarray, plain_ids: np.ndarray, lam: float, seed: int,
                   folds: int = 5, top: int = 2) -> np.ndarray:
    """Which pairs a map fitted on the other folds predicts back (true pair among the top candidates)."""
    part = np.random.default_rng(seed).permutation(len(obf_ids)) % folds
    ok = np.zeros(len(obf_ids), dtype=bool)
    for f in range(folds):
        tr, te = part != f, part == f
        idx, _ = ridge_map(spaces, obf_ids[tr], plain_ids[tr], lam, query_obf_ids=obf_ids[te])
        ok[te] = (idx[:, :top] == plain_ids[te][:, None]).any(axis=1)
    return ok


def run_bootstrapped_ridge(target: AttackTarget, data: PrivateData, setting: str, budget: Budget, seed: int = 0,
                           n_seed_pairs: int = 300, self_train_rounds: int = 1, self_train_pairs: int = 3000,
                           lam_rel: float = 1e-2, spaces: RowSpaces | None = None, tokens: int | None = None,
                           use: Sequence[str] = ("embed", "head"), query_sample: int | None = None,
                           self_train_sample: bool = False) -> AttackResult:
    """No oracle: seed pairs = TFMA's matches for the n most frequent observed ids, kept when a map fitted on the
    other seed pairs predicts them back (cross-validated consistency); then self-training rounds that refit on
    the most confident mutual matches over the full vocabulary. ``query_sample``: the last round matches the
    prompts' ids and that many drawn uniformly (the vocabulary recovery then estimated on the draw); the
    self-training rounds match every id too, except at budget ci, where they match the same ids as the last
    round (``self_train_sample``: the next round's pairs are then the most confident of those)."""
    prior, observed, _, info = frequency_streams(target, data, setting, budget, seed, tokens)
    spaces = spaces or row_spaces(target, use)
    v = spaces.obf[0].shape[0]
    match = tfma_match(observed, prior, v, seed)
    seen = np.flatnonzero(match.obf_to_plain >= 0)
    top_obf = seen[np.argsort(match.obf_rank[seen])][:n_seed_pairs]
    top_plain = match.obf_to_plain[top_obf]
    perm = target.true_permutation()  # scoring only below
    inv = np.argsort(perm)
    trace: list[dict[str, Any]] = [{"stage": "tfma seed pairs", "pairs": int(len(top_obf)),
                                    "pairs_correct": float(np.mean(inv[top_obf] == top_plain))}]
    keep = _cv_consistent(spaces, top_obf, top_plain, lam_rel, seed)
    pairs_obf, pairs_plain = top_obf[keep], top_plain[keep]
    trace.append({"stage": "cv-consistent seed pairs", "pairs": int(keep.sum()),
                  "pairs_correct": float(np.mean(inv[pairs_obf] == pairs_plain)) if keep.any() else None})
    if len(pairs_obf) < 2:  # nothing consistent: fall back to the raw TFMA pairs
        pairs_obf, pairs_plain = top_obf, top_plain
    mapping = match.obf_to_plain.copy()
    query, sample = sampled_queries(target, data, v, query_sample, seed)
    for r in range(self_train_rounds + 1):
        last = r == self_train_rounds
        sampled = query is not None and (last or self_train_sample)
        idx, val = ridge_map(spaces, pairs_obf, pairs_plain, lam_rel, query_obf_ids=query if sampled else None)
        mapping = mapping_from_matches(v, query, idx[:, 0]) if sampled else idx[:, 0].copy()
        margin = np.full(v, -np.inf, dtype=np.float32)
        margin[query if sampled else slice(None)] = val[:, 0] - val[:, 1]
        on = sample if sampled else np.arange(v)
        trace.append({"stage": f"ridge round {r}", "pairs": int(len(pairs_obf)),
                      "vocab_recovery": float(np.mean(mapping[on] == inv[on]))})
        if last:
            break
        # mutual nearest neighbours with the largest margins become the next round's pairs
        first = np.full(v, -1, dtype=np.int64)
        order = np.argsort(-margin)
        chosen = []
        for o in order:
            p = mapping[o]
            if p < 0:  # not matched (self_train_sample): every matched id comes first in this order
                break
            if first[p] < 0:
                first[p] = o
                chosen.append(o)
            if len(chosen) >= self_train_pairs:
                break
        pairs_obf = np.asarray(chosen, dtype=np.int64)
        pairs_plain = mapping[pairs_obf]
        trace[-1]["next_pairs_correct"] = float(np.mean(inv[pairs_obf] == pairs_plain))
    metrics = score_sampled(target, data, mapping, sample)
    metrics["trace"] = trace
    budget_info = {**info, "n_seed_pairs": n_seed_pairs, "self_train_rounds": self_train_rounds,
                   "last_round_queries": "every obfuscated id" if query is None else
                   f"the prompts' ids and {len(sample)} drawn uniformly ({len(query)})",
                   "self_train_queries": "the last round's" if self_train_sample and query is not None else
                   "every obfuscated id",
                   "self_train_pairs": self_train_pairs, "lambda_rel": lam_rel, "row_spaces": spaces.names,
                   "seed": seed}
    return AttackResult(f"freq-ridge-{setting}", metrics["ttrsr"], metrics["piirsr"], metrics, budget_info,
                        uses=f"obfuscated token counts of the client's traffic, a public prior corpus ({setting}), "
                             f"obfuscated and plaintext {'/'.join(spaces.names)} rows; no key (beyond the paper)")


# --- registry -------------------------------------------------------------------------------------------------


@register("tfma")
def tfma(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """TFMA, distribution-aware setting (the strongest prior of the paper's three)."""
    return run_tfma(target, data, "distribution-aware", budget, seed)


@register("tfma-domain-aware")
def tfma_domain(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """TFMA, domain-aware setting (prior: another corpus of the client's domain)."""
    return run_tfma(target, data, "domain-aware", budget, seed)


@register("tfma-zero-knowledge")
def tfma_zero(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """TFMA, zero-knowledge setting (prior: general public text)."""
    return run_tfma(target, data, "zero-knowledge", budget, seed)


def _register_ridge(k: int) -> None:
    def attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
        return run_known_pair_ridge(target, data, k, budget, seed,
                                    query_sample=CI_QUERY_SAMPLE if budget.name == "ci" else None)

    attack.__name__ = f"ridge_k{k}"
    attack.__doc__ = f"Known-pair ridge with k={k} oracle pairs (beyond the paper)."
    register(f"ridge-k{k}")(attack)


for _k in (20, 300, 1000):
    _register_ridge(_k)


@register("freq-ridge")
def freq_ridge(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """Frequency-bootstrapped ridge, distribution-aware prior, no oracle (beyond the paper)."""
    # ci: the self-training round, too, matches the prompts' ids and 8,192 drawn uniformly (not all 49k: 6x less)
    return run_bootstrapped_ridge(target, data, "distribution-aware", budget, seed,
                                  query_sample=CI_QUERY_SAMPLE if budget.name == "ci" else None,
                                  self_train_sample=budget.name == "ci")
