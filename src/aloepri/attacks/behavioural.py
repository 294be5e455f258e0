"""Behavioural attacks: the server runs the obfuscated model AND the public plaintext model on inputs
of its choice and matches the vocabularies by what the two models *do*, not by their weights.

What the attacker uses, exactly (no key, no weight compared):
- the public plaintext model, its tokenizer and chat template, and public text (Python's own stdlib sources);
- the obfuscated model it serves, run as a black box (logits only), and its server directory's config.json /
  generation_config.json (the permuted BOS/EOS/pad ids are published there);
- the obfuscated ids of the requests it serves: every request opens and closes with the chat template's constant
  tokens, so aligning an observed request's fixed prefix/suffix positions with the plaintext template's tokens pairs
  them (``template_anchors``). The victim's side of that simulation (wrapping and encoding the prompts) uses the
  key, as the client would; the attacker only reads the resulting ids.

Stages (``run_behavioural``):
1. **Anchors**: template pairs + published special ids (+ any pairs handed in by another attack: composition).
2. **Generation alignment**: greedy decoding of both models from the same known prompt (a chat request whose user
   text is made of known tokens); while every token so far is known in both vocabularies the two greedy next
   tokens correspond, so (obfuscated argmax, plaintext argmax) is a pair when both are confident (large top-1
   margin, equal top-1 probability). Known plaintext choices are written into the obfuscated stream too, so the
   two prefixes stay aligned; a sequence stops at the first step neither side can vouch for.
3. **Output-profile matching**: many contexts written in both vocabularies (random sequences of known tokens and,
   once enough tokens are known, windows of public text); both models' logits at every position, standardised
   per context (removes the log-normaliser); each id's column over the contexts is its output profile. Profiles
   are projected on the top singular directions of the plaintext profile matrix and every obfuscated id is
   matched to the most correlated plaintext token (candidates: every token not already paired). Mutual nearest
   neighbours become anchors of the next round (more tokens -> more natural contexts -> sharper profiles).
4. **Input-side profiles**: for the ids still unsure (not mutual) among those the server observed, the id is put
   after known contexts and the next-token distribution over the known part of the vocabulary is compared with
   the plaintext model's for each of the top output-profile candidates; candidates are re-ranked by the sum of the
   two correlations.
The result is a full vocabulary mapping (obfuscated id -> plaintext id), scored by ``score_mapping``.

``behavioural-composed``: VMA's unanimous pairs as extra anchors -> behavioural -> a ridge map (frequency.py)
fitted on the behavioural mutual pairs re-ranks the unsure ids with the weights as a third opinion.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .base import AttackResult, AttackTarget, Budget, PrivateData, has_tokenizer, register, score_mapping
from .engines import Engine

Tensor = torch.Tensor

# Contexts per round = sequences x length positions. 'ci' runs on tiny models in the test suite in seconds.
BEHAVIOURAL_BUDGETS: dict[str, dict[str, Any]] = {
    "ci": {"round_seqs": (32, 64), "length": 12, "rank": 64, "gen_seqs": 8, "gen_steps": 12, "rerank_ids": 64,
           "rerank_k": 4, "rerank_contexts": 2, "batch": 16, "basis_columns": 4096, "stop_unknown_fraction": 0.001},
    "small": {"round_seqs": (96, 160), "length": 16, "rank": 256, "gen_seqs": 16, "gen_steps": 48,
              "rerank_ids": 100, "rerank_k": 6, "rerank_contexts": 2, "batch": 16, "basis_columns": 8192,
              "stop_unknown_fraction": 0.001},
    "full": {"round_seqs": (128, 256, 256), "length": 16, "rank": 384, "gen_seqs": 32, "gen_steps": 64,
             "rerank_ids": 400, "rerank_k": 8, "rerank_contexts": 3, "batch": 16, "basis_columns": 12288,
             "stop_unknown_fraction": 0.0},
}


@dataclass
class Pairs:
    """Known (obfuscated id -> plaintext id) pairs with where each came from; conflicting pairs are refused."""

    vocab: int
    obf_to_plain: np.ndarray = field(init=False)
    plain_to_obf: np.ndarray = field(init=False)
    source: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.obf_to_plain = np.full(self.vocab, -1, dtype=np.int64)
        self.plain_to_obf = np.full(self.vocab, -1, dtype=np.int64)

    def add(self, obf: int, plain: int, source: str) -> bool:
        obf, plain = int(obf), int(plain)
        if not (0 <= obf < self.vocab and 0 <= plain < self.vocab):
            return False
        if self.obf_to_plain[obf] >= 0 or self.plain_to_obf[plain] >= 0:
            return self.obf_to_plain[obf] == plain  # already known (True) or conflicting (refused)
        self.obf_to_plain[obf], self.plain_to_obf[plain] = plain, obf
        self.source[obf] = source
        return True

    def add_many(self, obf: Sequence[int], plain: Sequence[int], source: str) -> int:
        """How many of the pairs are (now) known: new ones plus repeats of known ones; conflicts are not counted."""
        return int(sum(self.add(o, p, source) for o, p in zip(obf, plain)))

    @property
    def known_obf(self) -> np.ndarray:
        return np.flatnonzero(self.obf_to_plain >= 0)

    def __len__(self) -> int:
        return int((self.obf_to_plain >= 0).sum())

    def count(self, source: str) -> int:
        return sum(1 for s in self.source.values() if s == source)


# --- anchors from what the server observes ---------------------------------------------------------------------

_SENTINEL = "Zq7 sentinel"


def chat_template_ids(tokenizer) -> tuple[list[int], list[int]]:
    """Plaintext ids of the chat template's constant prefix and suffix around one user message (generation prompt
    included): the public tokenizer's own template, rendered around a sentinel."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not echo the user message; cannot locate its constant tokens")
    pre, post = text.split(_SENTINEL, 1)
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"]) if s else []  # noqa: E731
    return enc(pre), enc(post)


def wrap_requests(prefix: Sequence[int], suffix: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The plaintext ids a client sends: template prefix + prompt + template suffix (the victim's side)."""
    return [list(prefix) + list(p) + list(suffix) for p in prompts]


def template_anchors(prefix: Sequence[int], suffix: Sequence[int], observed: Sequence[Sequence[int]]
                     ) -> list[tuple[int, int]]:
    """Pair the plaintext template's constant tokens with the observed requests' ids at the same positions
    (prefix from the start, suffix from the end). A position counts only if every observed request carries the
    same id there (a boundary token merged with the user's text varies and is dropped)."""
    pairs = []
    obs = [list(o) for o in observed if len(o) >= len(prefix) + len(suffix)]
    if not obs:
        return pairs
    for i, p in enumerate(prefix):
        ids = {o[i] for o in obs}
        if len(ids) == 1:
            pairs.append((ids.pop(), int(p)))
    for j in range(1, len(suffix) + 1):
        ids = {o[-j] for o in obs}
        if len(ids) == 1:
            pairs.append((ids.pop(), int(suffix[-j])))
    return pairs


def _special_ids_of(cfg: dict) -> dict[str, list[int]]:
    out = {}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(k)
        if v is not None:
            out[k] = [int(x) for x in (v if isinstance(v, list) else [v])]
    return out


def published_special_anchors(plain_config, server_dir: str | Path) -> list[tuple[int, int]]:
    """(obfuscated, plaintext) special-token pairs: the server directory's config.json / generation_config.json
    against the public model's config (same keys, same order)."""
    server = Path(server_dir)
    if not server.is_dir():
        return []
    plain = _special_ids_of(plain_config.to_dict() if hasattr(plain_config, "to_dict") else dict(plain_config))
    pairs = []
    for name in ("config.json", "generation_config.json"):
        f = server / name
        if not f.is_file():
            continue
        obf = _special_ids_of(json.loads(f.read_text()))
        for k, ids in obf.items():
            if k in plain and len(plain[k]) == len(ids):
                pairs += list(zip(ids, plain[k]))
    return sorted(set(pairs))


def public_text_ids(tokenizer, max_tokens: int = 200_000) -> np.ndarray:
    """Public text the attacker can always get offline: the Python standard library's own sources (each file
    encoded once per tokenizer and process: ``corpora.encode_text``)."""
    import sysconfig

    from ..corpora import tokenize_texts

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return tokenize_texts(tokenizer, (p.read_text(encoding="utf-8", errors="replace") for p in files), max_tokens)


# --- running the two models ------------------------------------------------------------------------------------


@torch.no_grad()
def standardised_logits(engine: Engine, seqs: Tensor, batch: int) -> Tensor:
    """Logits at every position of every sequence, each row centred and scaled over the vocabulary (removes
    the log-normaliser and the temperature). (n_seqs * length, vocab) float32 on the engine's device."""
    rows = []
    for s in range(0, seqs.shape[0], batch):
        z = engine.logits(seqs[s:s + batch])
        z = z.reshape(-1, z.shape[-1])
        z = z - z.mean(dim=1, keepdim=True)
        rows.append(z / z.std(dim=1, keepdim=True).clamp_min(1e-6))
    return torch.cat(rows)


def random_contexts(pairs: Pairs, n: int, length: int, rng: np.random.Generator,
                    text_ids: np.ndarray | None = None, prefix: Sequence[int] = ()) -> tuple[Tensor, Tensor]:
    """n sequences written in both vocabularies (plain, obfuscated): half windows of public text whose tokens are
    all known (when there are enough), the rest random sequences of known tokens; each starts with ``prefix``
    (plain ids, known) when given."""
    known_plain = np.flatnonzero(pairs.plain_to_obf >= 0)
    body = length - len(prefix)
    if body < 1:
        raise ValueError(f"context length {length} leaves no room after a prefix of {len(prefix)} tokens")
    seqs: list[np.ndarray] = []
    if text_ids is not None and len(text_ids) > body:
        ok = pairs.plain_to_obf[text_ids] >= 0
        # windows fully known: a run-length test on the known mask
        csum = np.concatenate([[0], np.cumsum(~ok)])
        starts = np.flatnonzero(csum[body:] - csum[:-body] == 0)
        starts = starts[starts + body <= len(text_ids)]
        if len(starts) >= 4 * n:  # enough distinct windows to be worth it
            for s in rng.choice(starts, size=n // 2, replace=False):
                seqs.append(text_ids[s:s + body])
    while len(seqs) < n:
        seqs.append(rng.choice(known_plain, size=body))
    plain = np.stack([np.concatenate([np.asarray(prefix, dtype=np.int64), s]) for s in seqs]).astype(np.int64)
    return torch.from_numpy(plain), torch.from_numpy(pairs.plain_to_obf[plain])


@dataclass
class Matches:
    best: np.ndarray  # best plaintext candidate per obfuscated id (-1 = not queried)
    topk: np.ndarray  # (vocab, k) candidates, best first
    topk_score: np.ndarray
    mutual: np.ndarray  # bool: obfuscated id and its best candidate are each other's nearest neighbour
    margin: np.ndarray


def match_profiles(plain_prof: Tensor, obf_prof: Tensor, pairs: Pairs, rank: int, basis_columns: int,
                   rng: np.random.Generator, k: int = 8, chunk: int = 2048) -> Matches:
    """Correlation matching of output profiles (columns of the standardised logit matrices). Profiles live in a
    low-rank space (logits = hidden states x head rows), so both are projected on the top ``rank`` left singular
    directions of the plaintext matrix (estimated on a column sample), then each unknown obfuscated id is
    matched against every plaintext token not already paired."""
    n_ctx, v = plain_prof.shape
    dev = plain_prof.device
    cols = torch.from_numpy(np.sort(rng.choice(v, size=min(basis_columns, v), replace=False))).to(dev)
    # float64 for the basis only: one (contexts x contexts) Gram matrix and its eigendecomposition
    sub = plain_prof[:, cols].double()
    evals, evecs = torch.linalg.eigh(sub @ sub.T)
    r = max(1, min(rank, n_ctx, v))
    basis = evecs[:, -r:].float()  # (contexts, r)
    a = basis.T @ plain_prof  # (r, vocab) plaintext profiles
    b = basis.T @ obf_prof
    a = a / a.norm(dim=0, keepdim=True).clamp_min(1e-12)
    b = b / b.norm(dim=0, keepdim=True).clamp_min(1e-12)
    free_plain = torch.from_numpy(pairs.plain_to_obf < 0).to(dev)
    queries = np.flatnonzero(pairs.obf_to_plain < 0)
    k = min(k, int(free_plain.sum()))
    topk = np.full((v, max(k, 1)), -1, dtype=np.int64)
    topk_score = np.full((v, max(k, 1)), -np.inf, dtype=np.float32)
    col_best = torch.full((v,), -float("inf"), device=dev)
    col_arg = torch.full((v,), -1, dtype=torch.long, device=dev)
    for s in range(0, len(queries), chunk):
        q = torch.from_numpy(queries[s:s + chunk]).to(dev)
        sim = b[:, q].T @ a  # (chunk, vocab)
        sim[:, ~free_plain] = -float("inf")
        val, idx = sim.topk(k, dim=1)
        topk[queries[s:s + chunk]] = idx.cpu().numpy()
        topk_score[queries[s:s + chunk]] = val.cpu().numpy()
        # each plaintext column's best query so far: the maxima first (amax: 15x faster than max(dim=0) on a
        # (chunk, vocab) block), the arg-max only over the columns this chunk improves (fewer at every chunk)
        cmax = sim.amax(dim=0)
        better = torch.nonzero(cmax > col_best).flatten()
        col_best[better] = cmax[better]
        col_arg[better] = q[sim.argmax(dim=0)[better] if 2 * len(better) > v else sim[:, better].argmax(dim=0)]
    best = topk[:, 0].copy()
    mutual = np.zeros(v, dtype=bool)
    qb = best[queries]
    mutual[queries] = (qb >= 0) & (col_arg.cpu().numpy()[np.maximum(qb, 0)] == queries)
    margin = np.zeros(v, dtype=np.float32)
    if k > 1:
        margin[queries] = topk_score[queries, 0] - topk_score[queries, 1]
    return Matches(best, topk, topk_score, mutual, margin)


@torch.no_grad()
def greedy_alignment(plain: Engine, obf: Engine, pairs: Pairs, starts_plain: Tensor, steps: int,
                     min_margin: float = 1.0, max_prob_gap: float = 0.1, batch: int | None = None
                     ) -> list[tuple[int, int]]:
    """Decode both models greedily from the same known prompts (``starts_plain``, all tokens known). At each
    step the two argmaxes are a pair when both models are confident (log-prob margin over the runner-up >=
    ``min_margin``) and agree on how confident (top-1 probabilities within ``max_prob_gap``); the plaintext
    choice is appended to both streams (through the pairs, or the new pair), so the prefixes stay aligned. A
    sequence stops at a step that yields no trustworthy pair for an unknown token. ``batch`` sequences are
    decoded together (None: the engine's own: all for torch, one for llama.cpp, which keeps one sequence's
    prefix in its cache); the sequences do not interact, so the pairs do not depend on it."""
    found: dict[tuple[int, int], int] = {}
    n = starts_plain.shape[0]
    batch = batch or plain.decode_batch or max(n, 1)
    for s in range(0, n, batch):
        _greedy_chunk(plain, obf, pairs, starts_plain[s:s + batch], steps, min_margin, max_prob_gap, found)
    # a pair is kept when neither of its ids was paired differently elsewhere
    by_o: dict[int, set] = {}
    by_t: dict[int, set] = {}
    for (o, t) in found:
        by_o.setdefault(o, set()).add(t)
        by_t.setdefault(t, set()).add(o)
    return sorted((o, t) for (o, t) in found if len(by_o[o]) == 1 and len(by_t[t]) == 1)


def _greedy_chunk(plain: Engine, obf: Engine, pairs: Pairs, starts_plain: Tensor, steps: int, min_margin: float,
                  max_prob_gap: float, found: dict[tuple[int, int], int]) -> None:
    """``greedy_alignment`` on one batch of sequences, adding its candidate pairs to ``found``. The models run on
    their engines' device; the per-step decisions read three small vectors back (one transfer per step, not per
    token)."""
    dev = plain.device
    p_in = starts_plain.to(dev)
    o_in = torch.from_numpy(pairs.plain_to_obf[starts_plain.numpy()]).to(dev)
    alive = [True] * starts_plain.shape[0]
    p_dec, o_dec = plain.decoder(), obf.decoder()
    for _ in range(steps):
        lp = torch.log_softmax(p_dec.step(p_in), dim=-1).topk(2, dim=-1)
        lo = torch.log_softmax(o_dec.step(o_in), dim=-1).topk(2, dim=-1)
        t, o = lp.indices[:, 0], lo.indices[:, 0]
        confident = ((lp.values[:, 0] - lp.values[:, 1]) >= min_margin) & \
                    ((lo.values[:, 0] - lo.values[:, 1]) >= min_margin) & \
                    ((lp.values[:, 0].exp() - lo.values[:, 0].exp()).abs() <= max_prob_gap)
        t_list, o_list, conf_list = t.tolist(), o.tolist(), confident.tolist()
        next_o = list(o_list)
        for i, (ti, oi) in enumerate(zip(t_list, o_list)):
            if not alive[i]:
                continue
            known_o = int(pairs.plain_to_obf[ti])
            if known_o >= 0:
                next_o[i] = known_o  # the plaintext choice, written in the obfuscated vocabulary
            elif conf_list[i] and pairs.obf_to_plain[oi] < 0:
                found[(oi, ti)] = found.get((oi, ti), 0) + 1
                next_o[i] = oi
            else:
                alive[i] = False
        if not any(alive):
            break
        p_in, o_in = t[:, None], torch.tensor(next_o, device=dev)[:, None]


@torch.no_grad()
def input_side_rerank(plain: Engine, obf: Engine, pairs: Pairs, ids: np.ndarray, candidates: np.ndarray,
                      out_scores: np.ndarray, contexts: Tensor, batch: int) -> np.ndarray:
    """Re-rank each id's candidates by input-side profiles: the id (or candidate) is appended to known contexts
    (``contexts``, plain ids, all known) and the next-token log-probs over the known vocabulary are compared
    (correlation) between the obfuscated model (the id) and the plaintext model (each candidate). The new choice
    maximises output-profile + input-side correlation. Returns the chosen plaintext id per ``ids``."""
    dev = plain.device
    known_obf = pairs.known_obf
    known_plain = torch.from_numpy(pairs.obf_to_plain[known_obf]).to(dev)
    known_obf_t = torch.from_numpy(known_obf).to(dev)
    ctx_o = torch.from_numpy(pairs.plain_to_obf[contexts.numpy()]).to(dev)
    contexts = contexts.to(dev)

    def feats(engine: Engine, ctx: Tensor, tokens: Tensor, cols: Tensor) -> Tensor:
        tokens = tokens.to(dev)
        out = []
        for c in range(ctx.shape[0]):
            rows = []
            for s in range(0, len(tokens), batch):
                tk = tokens[s:s + batch]
                seq = torch.cat([ctx[c].expand(len(tk), -1), tk[:, None]], dim=1)
                z = torch.log_softmax(engine.next_logits(seq), dim=-1)[:, cols]
                z = z - z.mean(dim=1, keepdim=True)
                rows.append(z / z.norm(dim=1, keepdim=True).clamp_min(1e-12))
            out.append(torch.cat(rows))
        return torch.cat(out, dim=1) / np.sqrt(ctx.shape[0])

    f_obf = feats(obf, ctx_o, torch.from_numpy(ids), known_obf_t)
    k = candidates.shape[1]
    f_plain = feats(plain, contexts, torch.from_numpy(candidates.reshape(-1)), known_plain)
    f_plain = f_plain.reshape(len(ids), k, -1)
    inp = (f_plain * f_obf[:, None, :]).sum(-1).cpu().numpy()
    total = inp + out_scores
    return candidates[np.arange(len(ids)), total.argmax(axis=1)]


# --- the attack ------------------------------------------------------------------------------------------------


@dataclass
class BehaviouralOutcome:
    mapping: np.ndarray  # obfuscated id -> plaintext guess (every id)
    confident: np.ndarray  # bool per obfuscated id: anchor, harvested pair or mutual nearest neighbour
    trace: list[dict[str, Any]]
    info: dict[str, Any]


def behavioural_mapping(plain: Engine, obf: Engine, pairs: Pairs, cfg: dict[str, Any], seed: int,
                        prefix: Sequence[int] = (), chat_prompt: tuple[Sequence[int], Sequence[int]] | None = None,
                        text_ids: np.ndarray | None = None, rerank_ids: np.ndarray | None = None,
                        truth: np.ndarray | None = None, log: Callable[[str], None] | None = None
                        ) -> BehaviouralOutcome:
    """Stages 2-4 of the module doc from the anchors in ``pairs`` (modified in place). ``truth`` (obfuscated ->
    plain, from the key) is used ONLY to record per-stage accuracy in the trace, never to decide anything."""
    rng = np.random.default_rng(seed)
    v = pairs.vocab
    trace: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def note(stage: str, **kw) -> None:
        known = pairs.known_obf
        entry = {"stage": stage, "known_pairs": int(len(known)), "seconds": round(time.perf_counter() - t0, 1), **kw}
        if truth is not None and len(known):
            entry["known_pairs_correct"] = float(np.mean(truth[known] == pairs.obf_to_plain[known]))
        trace.append(entry)
        if log:
            log(f"behavioural: {entry}")

    note("anchors")
    # 2. generation alignment from chat requests whose user text is made of known tokens
    if cfg["gen_seqs"] > 0 and len(pairs) >= 2:
        pre, post = chat_prompt if chat_prompt else ((), ())
        known_plain = np.flatnonzero(pairs.plain_to_obf >= 0)
        starts = np.stack([np.concatenate([np.asarray(pre, dtype=np.int64), rng.choice(known_plain, size=3),
                                           np.asarray(post, dtype=np.int64)]) for _ in range(cfg["gen_seqs"])])
        got = greedy_alignment(plain, obf, pairs, torch.from_numpy(starts), cfg["gen_steps"],
                               batch=cfg.get("gen_batch"))
        pairs.add_many([o for o, _ in got], [t for _, t in got], "generation")
        note("generation alignment", harvested=len(got))
    # 3. output-profile rounds
    matches = None
    for r, n_seq in enumerate(cfg["round_seqs"]):
        plain_seqs, obf_seqs = random_contexts(pairs, n_seq, cfg["length"], rng, text_ids)
        plain_prof = standardised_logits(plain, plain_seqs, cfg["batch"])
        obf_prof = standardised_logits(obf, obf_seqs, cfg["batch"])
        matches = match_profiles(plain_prof, obf_prof, pairs, cfg["rank"], cfg["basis_columns"], rng,
                                 k=max(cfg["rerank_k"], 2))
        del plain_prof, obf_prof
        mutual = np.flatnonzero(matches.mutual)
        # under noise many mutual neighbours are wrong: keep those whose margin beats what non-mutual (mostly
        # wrong) matches reach (their 99th percentile), so wrong anchors do not poison the next round's contexts
        queried = np.flatnonzero(pairs.obf_to_plain < 0)
        null = matches.margin[queried[~matches.mutual[queried]]]
        threshold = float(np.quantile(null, 0.99)) if len(null) >= 200 else 0.0
        accepted = mutual[matches.margin[mutual] > threshold]
        extra = {}
        if truth is not None:
            q = np.flatnonzero(pairs.obf_to_plain < 0)
            extra = {"round_top1_on_unknown": float(np.mean(matches.best[q] == truth[q])) if len(q) else None,
                     "mutual_correct": float(np.mean(matches.best[mutual] == truth[mutual])) if len(mutual) else None,
                     "accepted_correct": float(np.mean(matches.best[accepted] == truth[accepted]))
                     if len(accepted) else None}
        last = r == len(cfg["round_seqs"]) - 1
        if not last:
            pairs.add_many(accepted, matches.best[accepted], f"profile-round-{r}")
        note(f"output profiles round {r}", contexts=int(plain_seqs.numel()), mutual=int(len(mutual)),
             margin_threshold=threshold, accepted=int(len(accepted)), **extra)
        if not last and (pairs.obf_to_plain < 0).sum() <= cfg["stop_unknown_fraction"] * v:
            break  # (almost) everything is paired already: another round would only re-rank a handful of ids
    mapping = pairs.obf_to_plain.copy()
    confident = mapping >= 0
    if matches is not None:
        unknown = mapping < 0
        mapping[unknown] = matches.best[unknown]
        confident |= matches.mutual & (matches.margin > threshold)
    # 4. input-side re-ranking of the unsure ids the server observed
    if matches is not None and rerank_ids is not None and cfg["rerank_ids"] > 0 and len(pairs) >= 8:
        unsure = np.asarray([i for i in np.unique(rerank_ids) if not confident[i] and matches.topk[i, 0] >= 0],
                            dtype=np.int64)
        unsure = unsure[np.argsort(matches.margin[unsure])][: cfg["rerank_ids"]]  # least sure first
        if len(unsure):
            ctx_plain, _ = random_contexts(pairs, cfg["rerank_contexts"], len(prefix) + 1, rng, text_ids, prefix)
            k = cfg["rerank_k"]
            chosen = input_side_rerank(plain, obf, pairs, unsure, matches.topk[unsure, :k],
                                       matches.topk_score[unsure, :k], ctx_plain,
                                       cfg.get("rerank_batch") or cfg["batch"] * 8)
            before = mapping[unsure].copy()
            mapping[unsure] = chosen
            extra = {}
            if truth is not None:
                extra = {"reranked_correct_before": float(np.mean(before == truth[unsure])),
                         "reranked_correct_after": float(np.mean(chosen == truth[unsure]))}
            note("input-side rerank", reranked=int(len(unsure)), **extra)
    info = {"pairs_by_source": {s: pairs.count(s) for s in sorted(set(pairs.source.values()))}}
    return BehaviouralOutcome(mapping, confident, trace, info)


def attacker_view(target: AttackTarget, data: PrivateData, template: tuple[Sequence[int], Sequence[int]] | None
                  ) -> tuple[Pairs, dict[str, Any]]:
    """The anchors the server gets for free: template pairs from the observed requests and the published special
    ids. ``template`` overrides the tokenizer's chat template. A model that ships no tokenizer (test and synthetic
    checkpoints) has no chat template either: its requests are wrapped in the stand-in of ``routing_leak``
    (``template_prefix``: fixed public ids, the last 3 of them after the prompt), as a real model's are in its own
    public template; ``template_kind`` says which."""
    v = target.vocab_size
    pairs = Pairs(v)
    info: dict[str, Any] = {}
    if template is None and has_tokenizer(target) and getattr(target.tokenizer, "chat_template", None):
        template = chat_template_ids(target.tokenizer)
        info["template_kind"] = "the public chat template"
    elif template is None and not has_tokenizer(target):
        from .routing_leak import template_prefix

        ids, kind = template_prefix(target, 0)
        template = (ids[:-3], ids[-3:])
        info["template_kind"] = kind
    if template is not None:
        requests = wrap_requests(template[0], template[1], data.plain_ids)
        observed = [target.obfuscate_ids(r) for r in requests]  # victim side: what the server receives
        found = template_anchors(template[0], template[1], observed)
        info["template_positions_paired"] = pairs.add_many([o for o, _ in found], [p for _, p in found], "template")
    specials = published_special_anchors(target.plain_config, target.obfuscated_dir)
    info["special_pairs"] = pairs.add_many([o for o, _ in specials], [p for _, p in specials], "special")
    return pairs, {**info, "template": [list(template[0]), list(template[1])] if template else None}


def run_behavioural(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                    extra_pairs: Sequence[tuple[int, int]] = (), extra_source: str = "",
                    template: tuple[Sequence[int], Sequence[int]] | None = None,
                    config: dict | None = None, log: Callable[[str], None] | None = None,
                    name: str = "behavioural") -> tuple[AttackResult, BehaviouralOutcome]:
    cfg = {**BEHAVIOURAL_BUDGETS.get(budget.name, BEHAVIOURAL_BUDGETS["full"]), **(config or {})}
    if budget.batch is not None:  # one probe batch for every stage (the stages' own defaults differ)
        cfg.update(batch=budget.batch, gen_batch=budget.batch, rerank_batch=budget.batch)
    v = target.vocab_size
    obf_vocab = int(json.loads((target.obfuscated_dir / "config.json").read_text())["vocab_size"]) \
        if (target.obfuscated_dir / "config.json").is_file() else int(target.obf_model.config.vocab_size)
    if obf_vocab != v:
        raise ValueError(f"vocabulary sizes differ: plain {v}, obfuscated {obf_vocab}")
    plain, obf = target.engines()
    if plain.vocab_size != v or obf.vocab_size != v:
        raise ValueError(f"the {plain.describe()} engine gives {plain.vocab_size} / {obf.vocab_size} logits per row, "
                         f"the models have {v} tokens")
    pairs, info = attacker_view(target, data, template)
    if extra_pairs:
        info["extra_pairs"] = pairs.add_many([o for o, _ in extra_pairs], [p for _, p in extra_pairs],
                                             extra_source or "extra")
    if len(pairs) < 2:
        raise ValueError(f"only {len(pairs)} anchor pair(s): the behavioural attack needs a chat template, published "
                         "special ids or pairs from another attack")
    tok_ok = has_tokenizer(target)
    text_ids = public_text_ids(target.tokenizer) if tok_ok else None
    prefix = info["template"][0] if info["template"] else ()
    chat_prompt = (info["template"][0], info["template"][1]) if info["template"] else None
    observed = data.observed(target)
    truth = np.argsort(target.true_permutation())  # scoring / trace only
    # input-side contexts open like a user turn: the template prefix's last (known) tokens
    user_turn = [p for p in prefix[-3:] if pairs.plain_to_obf[p] >= 0]
    out = behavioural_mapping(plain, obf, pairs, cfg, seed, prefix=user_turn,
                              chat_prompt=chat_prompt, text_ids=text_ids,
                              rerank_ids=np.concatenate([np.asarray(o) for o in observed]), truth=truth, log=log)
    scores = score_mapping(target, data, out.mapping, text_metrics=tok_ok)
    scores["vocab_recovery_confident_only"] = float(np.mean(out.mapping[out.confident] == truth[out.confident])) \
        if out.confident.any() else None
    scores["confident_fraction"] = float(out.confident.mean())
    scores["trace"] = out.trace
    res = AttackResult(
        name, scores["ttrsr"], scores["piirsr"], scores,
        budget={"budget": budget.name, "candidate_pool": v, "candidate_pool_is_full_vocabulary": True,
                **{k: (list(x) if isinstance(x, tuple) else x) for k, x in cfg.items()},
                "anchors": {k: x for k, x in info.items() if k != "template"}, **out.info,
                "threads": torch.get_num_threads(), "device": str(plain.device), "engine": target.engine_record()},
        uses="public plaintext model + tokenizer/chat template + public text (stdlib sources); the obfuscated model "
             "run as a black box (logits) and its published config special ids; the observed requests' template "
             f"positions; both models on {plain.describe()}; no key, no weights compared"
             + (f"; plus {extra_source} pairs" if extra_source else ""))
    return res, out


# --- composition -----------------------------------------------------------------------------------------------


def vma_confident_pairs(target: AttackTarget, vma_budget: str, seed: int, sample: int) -> list[tuple[int, int]]:
    """VMA (sources of ``vma_budget``) on a seeded sample of obfuscated ids; pairs where every voting weight
    source agrees, kept when the plaintext side is unique (weights only, no key)."""
    from .vma import ALL_PRODUCTS, VMA_BUDGETS, source_signatures, spread_layers, target_weights, vote_match

    cfg = VMA_BUDGETS[vma_budget]
    v = target.vocab_size
    with target_weights(target, "plain") as w:  # streamed from the checkpoints unless the models are loaded
        L = w.num_layers
    prods = tuple(p for p in ALL_PRODUCTS if p != "embed.head" or cfg["embed_head"])
    layers, qk = spread_layers(L, cfg["mlp_layers"]), spread_layers(L, cfg["qk_layers"])
    q = np.sort(np.random.default_rng(seed + 1).choice(v, size=min(sample, v), replace=False))
    _, cand, qry = source_signatures(target, prods, layers, qk, cfg["sketch"], q)
    fused, per_source, _, keep = vote_match(qry, cand)
    unanimous = (per_source[keep] == fused[None, :]).all(axis=0) if len(keep) > 1 else np.ones(len(q), bool)
    vals, counts = np.unique(fused[unanimous], return_counts=True)
    unique_plain = set(vals[counts == 1].tolist())
    return [(int(o), int(p)) for o, p, u in zip(q, fused, unanimous) if u and int(p) in unique_plain]


def ridge_refine(target: AttackTarget, outcome: BehaviouralOutcome, lam_rel: float = 1e-2,
                 query_ids: np.ndarray | None = None, spaces=None) -> np.ndarray:
    """Behavioural mutual pairs -> ridge map between obfuscated and plaintext embedding/head rows (frequency.py);
    ids that were not confident take the ridge's nearest plaintext row when it is still free. ``query_ids``: only
    these ids are re-ranked (None: every unsure id). Each id's new guess depends only on its own candidates and
    the confident pairs, so re-ranking the ids the server observed gives their guesses unchanged, at a fraction
    of the cost: every unsure id is a (vocabulary x vocabulary x width) product, 20 min on 2 cores at a 150k
    vocabulary. ``spaces``: the rows (``frequency.row_spaces``) when already taken."""
    from .frequency import ridge_map, row_spaces

    conf = np.flatnonzero(outcome.confident)
    spaces = spaces if spaces is not None else row_spaces(target)
    unsure = np.flatnonzero(~outcome.confident)
    if query_ids is not None:
        unsure = np.intersect1d(unsure, np.asarray(query_ids, dtype=np.int64))
    mapping = outcome.mapping.copy()
    if len(unsure) == 0 or len(conf) < 16:
        return mapping
    rng = np.random.default_rng(0)
    fit = conf if len(conf) <= 20000 else rng.choice(conf, 20000, replace=False)  # memory / time bound
    idx, _ = ridge_map(spaces, fit, mapping[fit], lam_rel, query_obf_ids=unsure)
    taken = np.zeros(len(mapping), dtype=bool)
    taken[mapping[outcome.confident]] = True
    for o, cands in zip(unsure, idx):
        for p in cands:
            if not taken[p]:
                mapping[o] = p
                break
    return mapping


def run_composed(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                 vma_sample: int | None = None, log: Callable[[str], None] | None = None,
                 config: dict | None = None, ridge_ids: str = "observed") -> AttackResult:
    """VMA unanimous pairs -> behavioural -> ridge on the behavioural mutual pairs. ``ridge_ids``: 'observed'
    (the ridge re-ranks the unsure ids of the observed traffic: the prompt figures are those of 'all', and the
    vocabulary recovery counts the ridge on those ids only) or 'all' (every unsure id)."""
    if ridge_ids not in ("observed", "all"):
        raise ValueError(f"ridge_ids must be 'observed' or 'all', not {ridge_ids!r}")
    t0 = time.perf_counter()
    # VMA's cheapest source set (its 'ci' budget: first and last layer) on a large id sample: the anchors only
    # need to be right, not many (the behavioural stage does the rest)
    sample = vma_sample or {"ci": 256, "small": 4096}.get(budget.name, 8192)
    vma_pairs = vma_confident_pairs(target, "ci", seed, sample)
    spaces = None
    if target.engine != "torch":
        # the weights the ridge needs (embedding and head rows) are taken now, and the torch models are freed
        # before the engine loads: the models are held once, by the engine
        from .frequency import row_spaces

        spaces = row_spaces(target)
        target.release(models=True, engines=False)
    t_vma = time.perf_counter() - t0
    res, out = run_behavioural(target, data, budget, seed, extra_pairs=vma_pairs, extra_source="vma", log=log,
                               name="behavioural-composed", config=config)
    t1 = time.perf_counter()
    observed = np.unique(np.concatenate([np.asarray(o, dtype=np.int64) for o in data.observed(target)]))
    mapping = ridge_refine(target, out, query_ids=observed if ridge_ids == "observed" else None, spaces=spaces)
    t_ridge = time.perf_counter() - t1
    truth = np.argsort(target.true_permutation())  # scoring only
    scores = score_mapping(target, data, mapping, text_metrics=has_tokenizer(target))
    scores["before_ridge"] = {k: res.metrics[k] for k in ("ttrsr", "piirsr", "vocab_recovery")}
    scores["vma_pairs"] = len(vma_pairs)
    scores["vma_pairs_correct"] = float(np.mean([truth[o] == p for o, p in vma_pairs])) if vma_pairs else None
    scores["trace"] = res.metrics["trace"]
    res.metrics = scores
    res.ttrsr, res.piirsr = scores["ttrsr"], scores["piirsr"]
    res.budget.update({"vma_sample": sample, "vma_sources": "VMA budget ci", "ridge_ids": ridge_ids,
                       "stage_seconds": {"vma": round(t_vma, 1), "ridge": round(t_ridge, 1)}})
    res.uses = "VMA (obfuscated + public weights) unanimous pairs, then " + res.uses + \
               ", then a ridge map between obfuscated and public embedding/head rows fitted on the mutual pairs"
    return res


@register("behavioural", on_device=True, uses_engine=True)
def behavioural(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """Run both models: template/special-id anchors -> greedy alignment -> output-profile matching -> input-side."""
    return run_behavioural(target, data, budget, seed)[0]


@register("behavioural-composed", on_device=True, uses_engine=True)
def behavioural_composed(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """VMA's unanimous pairs as extra anchors -> behavioural -> ridge map on the behavioural pairs."""
    return run_composed(target, data, budget, seed)
