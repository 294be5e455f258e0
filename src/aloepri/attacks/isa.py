"""State-inversion attacks: ISA on hidden states, on attention scores, and through an anchor-fitted map (ours).

ISA (paper Appendix "Potential Threats", after Dong et al. 2025): the server records internal states of the
victim's obfuscated forward pass and optimises a relaxed plaintext input through the PUBLIC plaintext model until
its states match. An obfuscated state is ``h P`` for a secret key matrix ``P``, so the two cannot be compared
directly; we match what the key leaves (nearly) unchanged:

- ``isa_hidden``: the position-by-position cosine matrix and the centred log-norms of the residual stream at
  one layer. For an orthogonal key (``lam = 0``, no C/E energy, the ``exact`` preset) they are exactly invariant
  (``hP (hP)^T = s^2 h h^T``); ``lam > 0`` and the C/E blocks distort them.
- ``isa_attention``: the attention probabilities of every head of the first layers. Key matrices cancel in
  ``q k^T``; head permutations (tau_kv, tau_group) only relabel heads, which we undo by solving the head
  assignment (Hungarian matching of observed to candidate heads, re-solved during the optimisation); RoPE block
  permutation (beta > 1) changes the scores themselves.

Both propose k candidate tokens per position, search them left to right with a beam on the loss of the prefix
(causal model: the observed prefix states are the prefix's own), then refine by coordinate descent, scoring every
candidate exactly. Candidates come from relaxing the input as free embedding vectors (Adam) and taking each
position's k nearest plaintext tokens, or, when states are matched directly (no key matrix), from a codebook of
every token's own state at that layer: the relaxation alone found the true token too rarely on a real 49k
vocabulary (SmolLM2: 54% of tokens on the unprotected model), the codebook finds it at once. ``isa_attention``
proposes them exhaustively: the first layer's attention depends on the tokens alone, so every vocabulary token
can be scored exactly at every position from two tables of queries and keys (the first two positions jointly,
over all vocab^2 pairs); the relaxation found 0% on the unprotected SmolLM2, the exhaustive proposal 100%.

``isa_anchor`` (our attack, the strongest hidden-state one here): the invariant matching above fails even through
the ``exact`` key on a real vocabulary, because the relaxation proposes the wrong candidates. Instead, fit the key
itself: run both models on random sequences of the anchor tokens the server gets for free (chat-template positions,
published special ids), fit one least-squares map from the obfuscated residual stream (width d + 2h) to the
plaintext one over every layer, carry the victim's states through it and invert them like the unprotected model's
(codebook proposal, direct matching). Every reader of the residual stream decodes it linearly (``P Q = I``), so
such a map exists at every expansion h (docs/expansion.md measures it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..progress import stage
from ..runtime.modules import ModelModules
from ..runtime.probe import FirstLayerQK, layer_states, residual_streams
from ..storage.devices import model_device
from .base import AttackResult, AttackTarget, Budget, PrivateData, register, score_attacked_prompts


# --- ISA: invariants and the relaxed optimisation ---------------------------------------------------------------


def hidden_invariants(h: torch.Tensor, center: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine matrix across positions, centred log-norms) of states ``h`` (..., n, D). Both are unchanged by
    ``h -> s h B`` for any scalar s and orthogonal B (the exact preset's key matrix). ``center`` first subtracts
    the mean over positions 1.. (it maps the same way, so the invariance holds); measured worse on tiny models,
    so the attacks use the raw states."""
    if center:
        mu = h[..., 1:, :].mean(dim=-2, keepdim=True) if h.shape[-2] > 2 else h.mean(dim=-2, keepdim=True)
        c = h - mu
    else:
        c = h
    norms = c.norm(dim=-1).clamp_min(1e-8)
    u = c / norms.unsqueeze(-1)
    logn = torch.log(norms)
    return u @ u.transpose(-1, -2), logn - logn.mean(dim=-1, keepdim=True)


def hidden_loss(h: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor], center: bool = True) -> torch.Tensor:
    """Per-sequence mismatch of the invariants of ``h`` (batch, n, D) against the observed ones."""
    cos, logn = hidden_invariants(h, center)
    cos_t, logn_t = target
    return ((cos - cos_t) ** 2).mean(dim=(-1, -2)) + ((logn - logn_t) ** 2).mean(dim=-1)


ATTN_FLOOR = 1e-6  # attention probabilities are compared in log space, floored here


def _log_attn(a: torch.Tensor) -> torch.Tensor:
    # log-probabilities floored: the scores themselves (up to a per-row constant) are what the key leaves intact
    return torch.log(a.clamp_min(ATTN_FLOOR))


def attention_cost(obs: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """cost[i, j] = mismatch between observed head i and candidate head j, over the causal lower triangle.
    obs, cand: (heads, n, n) attention probabilities."""
    n = obs.shape[-1]
    tri = torch.tril(torch.ones(n, n, dtype=torch.bool))
    lo, lc = _log_attn(obs)[:, tri], _log_attn(cand)[:, tri]  # (heads, n(n+1)/2)
    return ((lo[:, None, :] - lc[None, :, :]) ** 2).mean(-1)


def solve_head_assignment(obs_layers: Sequence[torch.Tensor], cand_layers: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Per layer, the candidate head matched to each observed head (Hungarian on ``attention_cost``): undoes the
    secret head permutation whenever the scores themselves are preserved."""
    from scipy.optimize import linear_sum_assignment

    out = []
    for o, c in zip(obs_layers, cand_layers):
        cost = attention_cost(o, c.detach()).double().numpy()
        rows, cols = linear_sum_assignment(cost)
        out.append(cols[np.argsort(rows)])
    return out


def matched_attention_loss(cand_layers: Sequence[torch.Tensor], obs_layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sequence mismatch with the head assignment solved for each candidate sequence separately (no gradient:
    used to score discrete candidates). cand_layers: (batch, heads, n, n); obs_layers: (heads, n, n)."""
    from scipy.optimize import linear_sum_assignment

    n = obs_layers[0].shape[-1]
    tri = torch.tril(torch.ones(n, n, dtype=torch.bool))
    total = torch.zeros(cand_layers[0].shape[0], dtype=torch.float64)
    for o, c in zip(obs_layers, cand_layers):
        lo, lc = _log_attn(o)[:, tri], _log_attn(c)[:, :, tri]  # (H, T), (b, H, T)
        cost = ((lo[None, :, None, :] - lc[:, None, :, :]) ** 2).mean(-1).double().numpy()  # (b, obs H, cand H)
        for i in range(cost.shape[0]):
            r, col = linear_sum_assignment(cost[i])
            total[i] += float(cost[i][r, col].mean())
    return total / len(obs_layers)


def attention_loss(cand_layers: Sequence[torch.Tensor], obs_layers: Sequence[torch.Tensor],
                   assignment: Sequence[np.ndarray]) -> torch.Tensor:
    """Per-sequence mismatch of candidate attention (list of (batch, heads, n, n)) against the observed heads
    under the given head assignment."""
    n = obs_layers[0].shape[-1]
    tri = torch.tril(torch.ones(n, n, dtype=torch.bool))
    total = 0.0
    for o, c, perm in zip(obs_layers, cand_layers, assignment):
        lc = _log_attn(c[:, torch.as_tensor(perm)])[..., tri]  # (batch, heads, T)
        lo = _log_attn(o)[..., tri]
        total = total + ((lc - lo) ** 2).mean(dim=(-1, -2))
    return total / len(obs_layers)


@dataclass
class ISAConfig:
    layer: int = 1  # hidden states after this many decoder layers / attention of the first `layer` layers
    steps: int = 300
    lr: float = 0.05
    refine_k: int = 16  # candidates per position in the discrete refinement (capped at the vocabulary size)
    refine_sweeps: int = 2
    greedy: bool = True  # a left-to-right beam search over the candidates on the prefix loss before the sweeps
    beam: int = 8
    center: bool = False  # centre the states over positions before the invariants (measured worse on tiny models)
    match: str = "auto"  # "direct": the states themselves (needs equal widths: no key matrix); "invariant": cosine
    # matrix + log-norms (survive an orthogonal key); "auto": direct when the widths agree, else invariant
    relax: str = "embedding"  # "embedding": free input vectors, candidates = nearest tokens; "pez": the same with
    # straight-through projection; "softmax": a distribution over the vocabulary per position (worse on SmolLM2)
    max_prompts: int = 20
    max_len: int = 48  # positions per prompt inverted (prompts are cut here; the rest is left unscored)
    proposal: str = "auto"  # where each position's candidates come from. "relaxed": the relaxation above;
    # "codebook": the observed state's nearest entries in a table of every token's own state at the layer (needs
    # direct matching); "exhaustive" (isa_attention): every token scored exactly on the first layer's attention;
    # "auto": codebook (isa_hidden, direct matching) or relaxed (isa_hidden otherwise), exhaustive (isa_attention)
    first_pool: int | None = None  # exhaustive proposal: token 0 of the first pair searched among this many most
    # probable first tokens under the public model (None: the whole vocabulary). The vocab^2 pair search is most
    # of isa_attention's time; the registered attack sets it at budget ci only

    @classmethod
    def for_budget(cls, budget: Budget, **kw: Any) -> "ISAConfig":
        s = budget.scale
        cfg = cls(steps=max(30, int(400 * s)), max_prompts=max(2, int(round(40 * s))), max_len=32)
        return cfg if not kw else ISAConfig(**{**cfg.__dict__, **kw})


def _relax_and_refine(plain_model, n: int, batch_loss: Callable[[torch.Tensor], torch.Tensor],
                      cfg: ISAConfig, gen: torch.Generator,
                      on_step: Callable[[torch.Tensor, int], None] | None = None,
                      prefix_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      refine_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      candidates: torch.Tensor | None = None,
                      ) -> tuple[list[int], dict[str, float]]:
    """Minimise ``batch_loss(inputs_embeds (batch, n, d)) -> (batch,)`` over plaintext token sequences of length n:
    a continuous relaxation over the full vocabulary (Adam), then each position's top-k candidates (nearest tokens
    to the relaxed vectors) are searched left to right with a beam on ``prefix_loss`` and refined by coordinate
    descent on ``refine_loss`` (default ``batch_loss``). The relaxation only proposes candidates: when the true
    token is not among a position's top-k, the discrete search cannot find it. Given ``candidates`` (n, k) the
    relaxation is skipped and the search runs on them."""
    emb = ModelModules(plain_model).embed.weight.detach()
    vocab = emb.shape[0]
    if candidates is not None:
        return _search(emb, candidates, batch_loss, cfg, prefix_loss, refine_loss, relaxed_loss=float("nan"))
    if cfg.relax == "softmax":
        # drawn on the CPU generator, then moved: the same start on every device
        param = (0.01 * torch.randn(n, vocab, generator=gen)).to(emb.device).requires_grad_(True)
        embed = lambda: torch.softmax(param, dim=-1) @ emb  # noqa: E731
    else:
        noise = torch.randn(n, emb.shape[1], generator=gen).to(emb.device)
        param = (emb.mean(0) + emb.std(0) * noise).requires_grad_(True)
        embed = (lambda: param) if cfg.relax == "embedding" else (lambda: _straight_through(param, emb, unit))
    unit = F.normalize(emb, dim=-1)
    opt = torch.optim.Adam([param], lr=cfg.lr)
    for step in range(cfg.steps):
        x = embed().unsqueeze(0)
        if on_step is not None:
            on_step(x.detach(), step)
        loss = batch_loss(x)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # candidates: top relaxed probabilities, or the nearest tokens to the free vectors
        scores = param if cfg.relax == "softmax" else F.normalize(param, dim=-1) @ unit.T
        cands = scores.topk(min(cfg.refine_k, vocab), dim=-1).indices  # (n, k)
    return _search(emb, cands, batch_loss, cfg, prefix_loss, refine_loss, relaxed_loss=float(loss.detach()))


def _search(emb: torch.Tensor, cands: torch.Tensor, batch_loss: Callable[[torch.Tensor], torch.Tensor],
            cfg: ISAConfig, prefix_loss: Callable[[torch.Tensor], torch.Tensor] | None,
            refine_loss: Callable[[torch.Tensor], torch.Tensor] | None, relaxed_loss: float
            ) -> tuple[list[int], dict[str, float]]:
    """Discrete part of the inversion: beam over each position's candidates on the prefix loss, then coordinate
    descent sweeps, every candidate scored exactly."""
    n = cands.shape[0]
    batch_loss = refine_loss or batch_loss
    seq = cands[:, 0].clone()
    with torch.no_grad():
        if prefix_loss is not None and n >= 2:
            seq = _beam_search(emb, cands, prefix_loss, cfg.beam)
        best = float(batch_loss(emb[seq].unsqueeze(0))[0])
        for _ in range(cfg.refine_sweeps):
            for t in range(n):
                trial = seq.unsqueeze(0).repeat(cands.shape[1], 1)
                trial[:, t] = cands[t]
                losses = batch_loss(emb[trial])
                j = int(torch.argmin(losses))
                if float(losses[j]) < best:
                    best, seq = float(losses[j]), trial[j].clone()
    return seq.tolist(), {"relaxed_loss": relaxed_loss, "final_loss": best}


def _straight_through(param: torch.Tensor, emb: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """relax="pez": forward the nearest real tokens, step the free vectors (straight-through estimator)."""
    with torch.no_grad():
        near = emb[(F.normalize(param, dim=-1) @ unit.T).argmax(-1)]
    return param + (near - param).detach()


def state_codebook(model, layer: int, anchor_id: int, batch: int = 1024) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every vocabulary token's own state after ``layer`` decoder layers, at position 0 (alone) and at position 1
    (after the public token ``anchor_id``): two (unit rows of the centred table (vocab, d), the mean (d,)). An
    early-layer state is dominated by its own token, so an observed state's nearest entries are a short
    candidate list (measured on SmolLM2-135M, 4 Faker prompts x 32 tokens, unprotected: the true token is among
    the 16 nearest for 100% of positions at layer 1, 91% at layer 2)."""
    vocab = ModelModules(model).embed.weight.shape[0]
    dev = ModelModules(model).embed.weight.device
    alone, after = [], []
    with torch.no_grad():
        for i in range(0, vocab, batch):
            ids = torch.arange(i, min(i + batch, vocab), device=dev)
            alone.append(layer_states(model, layer, input_ids=ids.unsqueeze(1))[:, 0].float())
            pair = torch.stack([torch.full_like(ids, anchor_id), ids], 1)
            after.append(layer_states(model, layer, input_ids=pair)[:, 1].float())
    out = []
    for table in (torch.cat(alone), torch.cat(after)):
        mu = table.mean(0)
        out.append((F.normalize(table - mu, dim=-1), mu))
    return out


def codebook_candidates(h_obs: torch.Tensor, codebook: list[tuple[torch.Tensor, torch.Tensor]], k: int
                        ) -> torch.Tensor:
    """(n, k): each observed state's (n, d) k nearest codebook tokens by cosine after the codebook's centring."""
    out = []
    for t, h in enumerate(h_obs):
        unit, mu = codebook[0 if t == 0 else 1]
        sim = unit @ F.normalize(h.float() - mu, dim=-1)
        out.append(sim.topk(min(k, unit.shape[0])).indices)
    return torch.stack(out)

# --- exhaustive first-layer attention proposal (tables: runtime.probe.FirstLayerQK) ---------------------------

def _row_cost(logits: torch.Tensor, log_obs_row: torch.Tensor) -> torch.Tensor:
    """logits (C, heads, m) of C candidates for one attention row; log_obs_row (heads, m) observed. Mismatch of
    the floored log-probabilities, each observed head matched to its closest candidate head (a relaxation of the
    head assignment that is exact, zero, for the true tokens whatever the head permutation)."""
    lc = _log_attn(torch.softmax(logits, dim=-1)).double()
    lo = log_obs_row.double()
    # sum (a - b)^2 = |a|^2 - 2 a.b + |b|^2: no (C, heads, heads, m) difference tensor; float64 keeps the
    # true tokens' zero exact to ~1e-12
    cost = (lc ** 2).sum(-1)[:, None, :] - 2 * torch.einsum("chm,om->coh", lc, lo) + (lo ** 2).sum(-1)[None, :, None]
    cost = cost / lc.shape[-1]  # (C, obs heads, cand heads)
    return cost.min(dim=-1).values.mean(-1).float()


def first_pair_candidates(qk: FirstLayerQK, obs_row1: torch.Tensor, top: int, chunk: int = 128,
                          first: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """The ``top`` (token 0, token 1) pairs whose row-1 attention best matches the observed one, over all vocab^2
    pairs (SmolLM2: 2.4e9 pairs, about 1.4e12 multiply-adds, chunked; exact).

    Row 1 of head h is softmax(x_h, 0) with x_h = score(q_1, k_0) - score(q_1, k_1), so it is the vector of the
    heads' log-odds, compared as a multiset (sorted) because a head permutation may have relabelled the heads: the
    true pair matches exactly whatever the permutation. A cheap screen (max, min and mean over heads) keeps
    16 x ``top`` pairs for the sorted comparison. Log-odds are clipped where the observed probabilities are floored.
    obs_row1: (heads, 2) observed probabilities. ``first``: the token-0 ids searched (default: every token)."""
    vocab = qk.q.shape[0]
    first = torch.arange(vocab) if first is None else torch.as_tensor(first, dtype=torch.long)
    n0 = len(first)
    g = qk.group()
    clip = -float(np.log(ATTN_FLOOR))
    log_row = _log_attn(obs_row1)
    y = (log_row[:, 0] - log_row[:, 1]).clamp(-clip, clip)
    y_sorted = torch.sort(y).values
    k0 = qk.rope(qk.k[first], 0)[:, g].permute(1, 2, 0).contiguous()  # (H, hd, V0) the token-0 keys at position 0
    q1, k1 = qk.rope(qk.q, 1), qk.rope(qk.k, 1)[:, g]
    own = ((q1 * k1).sum(-1) * qk.scaling).T.contiguous()  # (H, V) token 1's score against itself
    q1 = q1.permute(1, 0, 2).contiguous()  # (H, V, hd)
    screen = 16 * top
    cost = torch.full((0,), float("inf"))
    pairs = torch.zeros((0, 2), dtype=torch.long)
    for c0 in range(0, vocab, chunk):
        # (H, C1, V0) log-odds for every pair, one batched matmul per chunk
        x = torch.bmm(q1[:, c0:c0 + chunk], k0).mul_(qk.scaling).sub_(own[:, c0:c0 + chunk, None]).clamp_(-clip, clip)
        proxy = ((x.amax(0) - y.max()) ** 2 + (x.amin(0) - y.min()) ** 2 + (x.mean(0) - y.mean()) ** 2).flatten()
        vals, idx = torch.topk(-proxy, min(screen, proxy.numel()))
        cand = torch.stack([first[idx % n0], idx // n0 + c0], 1)  # (token 0, token 1)
        exact = ((torch.sort(x.flatten(1)[:, idx].T, -1).values - y_sorted) ** 2).mean(-1)
        cost, pairs = torch.cat([cost, exact]), torch.cat([pairs, cand])
        keep = torch.argsort(cost)[:top]
        cost, pairs = cost[keep], pairs[keep]
    return [(int(a), int(b)) for a, b in pairs]


def exhaustive_attention_candidates(qk: FirstLayerQK, obs_layer0: torch.Tensor, k: int, passes: int = 2,
                                    chunk: int = 4096, seeds: int = 32, shortlist: int = 256, window: int = 6,
                                    first: torch.Tensor | None = None) -> torch.Tensor:
    """(n, k) candidates per position from the observed first-layer attention (heads, n, n), every vocabulary
    token scored exactly (``FirstLayerQK``).

    Row 0 is trivial and row 1 needs two tokens at once, so positions 0 and 1 are seeded by the ``seeds`` best
    (token 0, token 1) pairs over all vocab^2 pairs (``first_pair_candidates``); each seed is extended over the
    next few positions, each position scored over the whole vocabulary on its own row, and the most consistent
    seed is decoded to the end. Later passes re-score each position on every row it enters within ``window``
    (its query in its own row, its key in the later rows), the others fixed, over a shortlist (its ``shortlist``
    best tokens on its own row; for positions 0 and 1, the tokens of the seed pairs). Column 0 is each position's
    best token. ``first``: token 0 of the seed pairs searched among these ids only (default: every token)."""
    n = obs_layer0.shape[-1]
    vocab = qk.q.shape[0]
    g = qk.group()
    log_obs = _log_attn(obs_layer0.float())
    seq = torch.zeros(n, dtype=torch.long)
    cands = torch.zeros(n, min(k, vocab), dtype=torch.long)
    short: list[torch.Tensor] = [torch.arange(vocab)] * n

    # RoPE moved to the few fixed vectors: <R_t q, v> = <q, R_t^T v> and <R_t q, R_t k> = sum q k (cos_t^2 + sin_t^2),
    # so the candidates' raw rows are used as they are and no vocabulary-sized table is rotated per call
    half = qk.cos.shape[-1] // 2
    if not (torch.equal(qk.cos[:, :half], qk.cos[:, half:]) and torch.equal(qk.sin[:, :half], qk.sin[:, half:])):
        raise ValueError("RoPE tables that differ between the two halves of a head are not supported")
    kg = qk.k[:, g]  # (V, H, hd) every token's key, per query head
    qk_own = qk.q * kg  # (V, H, hd): summed against cos_t^2 + sin_t^2, a token's score against itself at t

    def costs(t: int, rows: Sequence[int], ids: torch.Tensor | None = None) -> torch.Tensor:
        fixed_k = torch.stack([qk.rope(qk.k[int(seq[j])], j) for j in range(n)])[:, g]  # (n, H, hd)
        out = torch.zeros(vocab if ids is None else len(ids))
        pre_k = qk.unrope(fixed_k[:t], t).permute(1, 2, 0)  # (H, hd, t): the prefix keys seen from position t
        own_w = qk.cos[t] ** 2 + qk.sin[t] ** 2
        for c0 in range(0, len(out), chunk):
            sel = slice(c0, c0 + chunk) if ids is None else ids[c0:c0 + chunk]
            total = torch.zeros(len(out[c0:c0 + chunk]))
            for u in rows:
                if u == t:  # the candidate's own row: its query against the prefix keys and its own key
                    pre = torch.bmm(qk.q[sel].transpose(0, 1), pre_k).transpose(0, 1)  # (C, H, t)
                    own = (qk_own[sel] @ own_w).unsqueeze(-1)
                    logits = torch.cat([pre, own], -1)
                else:  # a later row: the candidate only changes the key at column t
                    qu = qk.rope(qk.q[int(seq[u])], u)  # (H, hd)
                    base = torch.einsum("hd,jhd->hj", qu, fixed_k[:u + 1])
                    logits = base.unsqueeze(0).repeat(len(total), 1, 1)
                    logits[:, :, t] = (kg[sel] * qk.unrope(qu, t)).sum(-1)
                total += _row_cost(logits * qk.scaling, log_obs[:, u, :u + 1])
            out[c0:c0 + chunk] = total
        return out

    def decode_from(pair: tuple[int, int], upto: int) -> float:  # own rows, left to right, after a seed pair
        seq[0], seq[1] = pair
        total = 0.0
        for t in range(2, upto):
            c = costs(t, [t])
            seq[t] = int(torch.argmin(c))
            cands[t] = torch.topk(-c, cands.shape[1]).indices
            short[t] = torch.topk(-c, min(shortlist, vocab)).indices
            total += float(c[seq[t]])
        return total

    with torch.no_grad():
        if n < 2:
            return cands
        pairs = first_pair_candidates(qk, obs_layer0[:, 1, :2].float(), seeds, first=first)
        probe = min(n, 5)
        best = min(pairs, key=lambda pr: (decode_from(pr, probe) if probe > 2 else 0.0, pr))
        decode_from(best, n)
        short[0] = torch.unique(torch.tensor([p[0] for p in pairs]))
        short[1] = torch.unique(torch.tensor([p[1] for p in pairs]))
        cands[0], cands[1] = seq[0], seq[1]
        for _ in range(passes):
            for t in range(n):
                ids = short[t]
                c = costs(t, list(range(max(t, 1), min(n, t + window))), ids)
                order = torch.argsort(c)
                seq[t] = int(ids[order[0]])
                top = ids[order[:cands.shape[1]]]
                cands[t, :len(top)] = top
                cands[t, len(top):] = top[0]
    return cands


def likely_first_tokens(model, n: int) -> torch.Tensor:
    """The ``n`` most probable first tokens of a text under the public model (its next-token distribution after
    its BOS, else EOS, token): an attacker's prior for token 0, no victim data."""
    start = next((t for t in (model.config.bos_token_id, model.config.eos_token_id, 0) if isinstance(t, int)), 0)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[start]], device=model_device(model))).logits[0, -1]
    return torch.topk(logits.float().cpu(), min(n, logits.shape[-1])).indices


def _chunked(loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    return torch.cat([loss(x[i:i + chunk]) for i in range(0, len(x), chunk)])


def _beam_search(emb: torch.Tensor, cands: torch.Tensor, prefix_loss: Callable[[torch.Tensor], torch.Tensor],
                 beam: int) -> torch.Tensor:
    """Left to right over each position's candidates, keeping the ``beam`` best prefixes by the loss of the prefix
    (causal models: a prefix's states/attention are the observed prefix's). The first two positions are searched
    jointly (the first one alone is unconstrained).

    When ``prefix_loss`` is a mean of per-position errors and carries ``position_error(prefixes (B, t, d),
    extensions (B, k, d)) -> (B, k)`` (the error at position t of each prefix followed by each extension), a
    trial's loss is its beam's error sum plus that one error: the beams run once per step and each of their k
    extensions costs one position (``extension_states``), not the whole prefix again."""
    k = cands.shape[1]
    beams = torch.stack([cands[0].repeat_interleave(k), cands[1].repeat(k)], 1)
    losses = _chunked(prefix_loss, emb[beams])
    order = torch.argsort(losses)[:beam]
    beams, losses = beams[order], losses[order]
    position_error = getattr(prefix_loss, "position_error", None)
    for t in range(2, cands.shape[0]):
        trial = torch.cat([beams.repeat_interleave(k, 0), cands[t].repeat(len(beams)).unsqueeze(1)], 1)
        if position_error is None:
            losses = _chunked(prefix_loss, emb[trial])
        else:
            err = position_error(emb[beams], emb[cands[t]].unsqueeze(0).expand(len(beams), -1, -1))
            losses = ((losses[:, None] * t + err) / (t + 1)).reshape(-1)
        order = torch.argsort(losses)[:beam]
        beams, losses = trial[order], losses[order]
    return beams[0].clone()


def extension_states(model, layer: int, prefixes: torch.Tensor, extensions: torch.Tensor) -> torch.Tensor:
    """States after ``layer`` (>= 1) decoder layers at the position that follows each prefix, for each of its
    extensions: prefixes (B, t, d) and extensions (B, k, d) input embeddings -> (B, k, D). The prefixes run once
    and fill a KV cache that every extension reuses (a causal layer's keys and values at a position do not depend
    on what follows it): the same states as running each whole sequence, up to float rounding."""
    from ..runtime.inference import _cache_argument
    from ..runtime.probe import first_layers, forward_hooks, module_output

    b, k = extensions.shape[:2]
    captured: dict[str, torch.Tensor] = {}
    with first_layers(model, layer) as decoder:
        name = _cache_argument(type(decoder))  # past_key_values, or cache (transformers 5.2x)
        with forward_hooks([("h", decoder.layers[layer - 1])],
                           lambda _name, out: captured.__setitem__("h", module_output(out))):
            cache = getattr(decoder(inputs_embeds=prefixes, use_cache=True), name)
            cache.batch_repeat_interleave(k)
            decoder(inputs_embeds=extensions.reshape(b * k, 1, -1), use_cache=True, **{name: cache})
    return captured["h"][:, -1].reshape(b, k, -1)


def _prompts(data: PrivateData, observed: list[list[int]], cfg: ISAConfig) -> list[int]:
    return list(range(min(len(observed), cfg.max_prompts)))


def isa_hidden_attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                      cfg: ISAConfig | None = None,
                      state_map: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AttackResult:
    """``state_map`` (optional) carries each observed obfuscated state into the plaintext model's state space
    before matching (``isa_anchor``: a linear map fitted on anchor pairs); the states are then compared directly."""
    cfg = cfg or ISAConfig.for_budget(budget)
    gen = torch.Generator().manual_seed(seed)
    observed = data.observed(target)
    idx = _prompts(data, observed, cfg)
    plain = target.plain_model
    predicted, losses, matches, proposals = [], [], [], []
    codebook = None
    dev = model_device(target.obf_model)
    for i in idx:
        obs_ids = torch.tensor([observed[i][: cfg.max_len]], device=dev)
        with torch.no_grad():
            h_obs = layer_states(target.obf_model, cfg.layer, input_ids=obs_ids)[0].float()
            if state_map is not None:
                h_obs = state_map(h_obs).float()
        tgt = tuple(t.detach() for t in hidden_invariants(h_obs, cfg.center))
        scale = h_obs.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        match = cfg.match if cfg.match != "auto" else (
            "direct" if h_obs.shape[-1] == plain.config.hidden_size else "invariant")
        matches.append(match)
        proposal = cfg.proposal if cfg.proposal != "auto" else ("codebook" if match == "direct" else "relaxed")
        if proposal == "codebook" and match != "direct":
            raise ValueError("the codebook proposal compares states directly: it needs match='direct'")
        proposals.append(proposal)
        cands = None
        if proposal == "codebook":
            if codebook is None:  # one table per attack: the public model's own states, no victim data
                anchor = next((t for t in (plain.config.bos_token_id, plain.config.eos_token_id, 0)
                               if isinstance(t, int)), 0)
                # isa_hidden and isa_anchor share it (AttackTarget.memo)
                codebook = target.memo(("state_codebook", cfg.layer, anchor),
                                       lambda: state_codebook(plain, cfg.layer, anchor))
            cands = codebook_candidates(h_obs, codebook, cfg.refine_k)

        def batch_loss(x: torch.Tensor, tgt=tgt, h_obs=h_obs, scale=scale) -> torch.Tensor:
            h = layer_states(plain, cfg.layer, inputs_embeds=x).float()
            if match == "direct":
                if h.shape[-1] != h_obs.shape[-1]:
                    raise ValueError("direct matching needs states of equal width (an unprotected target)")
                return (((h - h_obs) / scale) ** 2).sum(-1).mean(-1)
            return hidden_loss(h, tgt, cfg.center)

        def prefix_loss(x: torch.Tensor, h_obs=h_obs) -> torch.Tensor:
            # states are causal: the observed prefix states are those of the prompt's prefix alone
            t = x.shape[1]
            if match == "direct":
                return (((layer_states(plain, cfg.layer, inputs_embeds=x).float() - h_obs[:t]) / scale[:t]) ** 2
                        ).sum(-1).mean(-1)
            return hidden_loss(layer_states(plain, cfg.layer, inputs_embeds=x).float(),
                               hidden_invariants(h_obs[:t], cfg.center), cfg.center)

        if match == "direct" and cfg.layer >= 1:  # a mean of per-position errors: the beam extends it (_beam_search)
            def position_error(prefixes: torch.Tensor, ext: torch.Tensor, h_obs=h_obs, scale=scale) -> torch.Tensor:
                t = prefixes.shape[1]
                h = extension_states(plain, cfg.layer, prefixes, ext).float()
                return (((h - h_obs[t]) / scale[t]) ** 2).sum(-1)

            prefix_loss.position_error = position_error

        seq, info = _relax_and_refine(plain, obs_ids.shape[1], batch_loss, cfg, gen,
                                      prefix_loss=prefix_loss if cfg.greedy else None, candidates=cands)
        predicted.append(seq)
        losses.append(info["final_loss"])
    metrics = score_attacked_prompts(target, data, predicted, idx, cfg.max_len)
    metrics["mean_final_loss"] = float(np.mean(losses))
    return AttackResult(
        "isa_hidden", metrics["ttrsr"], metrics["piirsr"], metrics,
        budget={"budget": budget.name, "layer": cfg.layer, "steps": cfg.steps, "lr": cfg.lr,
                "refine_k": cfg.refine_k, "refine_sweeps": cfg.refine_sweeps, "prompts": len(idx),
                "match": sorted(set(matches)), "proposal": sorted(set(proposals)), "relax": cfg.relax, "greedy": cfg.greedy, "beam": cfg.beam,
                "center": cfg.center, "max_len": cfg.max_len,
                "candidate_pool": f"full vocabulary ({plain.config.vocab_size})"},
        uses=f"obfuscated residual stream after decoder layer {cfg.layer} for each victim prompt (matched "
             f"{'/'.join(sorted(set(matches)))}: directly when it has the plaintext width, else its cosine matrix "
             "across positions and centred log-norms, invariant to an orthogonal key matrix); the public plaintext "
             "model for candidate proposal (a codebook of every token's own state when matching directly, else "
             "gradient-based relaxation) and exact scoring; no key, no obfuscated weights")


# --- ISA through a linear map fitted on anchor contexts ---------------------------------------------------------


@dataclass
class AnchorMapConfig:
    contexts: int = 64  # random sequences of anchor tokens run through both models
    context_len: int = 32
    ridge: float = 1e-6  # relative to the mean diagonal of the Gram matrix
    batch: int = 16

    @classmethod
    def for_budget(cls, budget: Budget, **kw: Any) -> "AnchorMapConfig":
        cfg = cls(contexts=max(16, int(round(256 * budget.scale))))
        return cfg if not kw else AnchorMapConfig(**{**cfg.__dict__, **kw})


def fit_state_map(plain_model, obf_model, anchors: Sequence[tuple[int, int]], cfg: AnchorMapConfig, seed: int
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """W (D, d) with (obfuscated residual state) @ W ~ (plaintext residual state), least squares over every layer
    and position of random sequences made of the anchor tokens (``anchors``: (obfuscated id, plaintext id)).

    Why it works: every AloePri residual state is ``h P`` for one key matrix P (d x (d+2h)) shared by all layers
    (shared C), so one linear map inverts all of them; the expansion only adds the 2h input columns W has to learn
    (they are a fixed linear function of the other d, so any rank-d data determines the map). Rows are weighted
    by 1 / |plaintext state| so the large-norm positions (attention sinks) do not dominate. Noise (alpha_e, alpha_h)
    makes the relation approximate; the fit error is reported."""
    if len(anchors) < 2:
        raise ValueError(f"only {len(anchors)} anchor pair(s): the anchor map needs a chat template or published "
                         "special ids")
    dev = model_device(plain_model)
    obf_ids = torch.tensor([o for o, _ in anchors], device=dev)
    plain_ids = torch.tensor([p for _, p in anchors], device=dev)
    rng = np.random.default_rng(seed)
    pick = torch.as_tensor(rng.integers(0, len(anchors), size=(cfg.contexts, cfg.context_len))).to(dev)
    gram = rhs = None
    rows = 0
    for i in range(0, cfg.contexts, cfg.batch):
        sel = pick[i:i + cfg.batch]
        for ho, hp in zip(residual_streams(obf_model, obf_ids[sel]), residual_streams(plain_model, plain_ids[sel])):
            x, y = ho.reshape(-1, ho.shape[-1]), hp.reshape(-1, hp.shape[-1])
            w = 1.0 / y.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            x, y = x * w, y * w
            gram = x.T @ x if gram is None else gram + x.T @ x
            rhs = x.T @ y if rhs is None else rhs + x.T @ y
            rows += x.shape[0]
    reg = cfg.ridge * gram.diagonal().mean()
    W = torch.linalg.solve(gram + reg * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device), rhs)
    eig = torch.linalg.eigvalsh(gram)
    info = {"anchor_pairs": len(anchors), "fit_rows": rows, "contexts": cfg.contexts, "context_len": cfg.context_len,
            "ridge": cfg.ridge, "obf_width": int(gram.shape[0]), "plain_width": int(rhs.shape[1]),
            "gram_effective_rank": int((eig > 1e-9 * eig.max()).sum())}
    return W, info


def isa_anchor_attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                      cfg: ISAConfig | None = None, map_cfg: AnchorMapConfig | None = None,
                      anchors: Sequence[tuple[int, int]] | None = None,
                      template: tuple[Sequence[int], Sequence[int]] | None = None,
                      vocab_sample: int | None = None) -> AttackResult:
    """Hidden-state ISA with a real alignment: fit ``fit_state_map`` on the anchors the server gets for free
    (chat-template positions of the observed requests, published special ids: ``behavioural.attacker_view``; or
    ``anchors`` given), carry each observed state into plaintext space, then invert it like the unprotected model
    (codebook proposal + beam + coordinate descent, direct matching). Also reports the whole-vocabulary recovery
    of the same map applied to the obfuscated embedding table (nearest plaintext embedding row by cosine), over
    every obfuscated id, or over ``vocab_sample`` of them drawn uniformly (seeded; the size is reported)."""
    from .behavioural import attacker_view

    cfg = cfg or ISAConfig.for_budget(budget)
    map_cfg = map_cfg or AnchorMapConfig.for_budget(budget)
    if anchors is None:
        pairs, view = attacker_view(target, data, template)
        anchors = [(int(o), int(pairs.obf_to_plain[o])) for o in pairs.known_obf]
    stage("fitting the state map on the anchors")
    W = fit_state_map(target.plain_model, target.obf_model, anchors, map_cfg, seed)
    W, map_info = W
    stage("inverting the mapped states")
    to_plain = lambda h: (h.double() @ W).float()  # noqa: E731
    res = isa_hidden_attack(target, data, budget, seed, cfg=cfg, state_map=to_plain)
    # diagnostics (ground truth used for scoring only): fit error on the victim's own states, vocabulary recovery
    stage("diagnostics")
    observed = data.observed(target)
    idx = _prompts(data, observed, cfg)
    errs = []
    dev = model_device(target.obf_model)
    with torch.no_grad():
        for i in idx:
            ho = layer_states(target.obf_model, cfg.layer,
                              input_ids=torch.tensor([observed[i][: cfg.max_len]], device=dev))[0]
            hp = layer_states(target.plain_model, cfg.layer,
                              input_ids=torch.tensor([data.plain_ids[i][: cfg.max_len]], device=dev))[0].double()
            errs.append(float(((to_plain(ho).double() - hp).norm(dim=-1) / hp.norm(dim=-1).clamp_min(1e-12)).mean()))
        plain_emb = F.normalize(ModelModules(target.plain_model).embed.weight.float(), dim=-1)
        obf_emb = ModelModules(target.obf_model).embed.weight
        v = obf_emb.shape[0]
        rows = torch.arange(v) if vocab_sample is None or vocab_sample >= v else \
            torch.from_numpy(np.sort(np.random.default_rng(seed + 2).choice(v, size=vocab_sample, replace=False)))
        obf_emb = obf_emb[rows.to(obf_emb.device)].double()
        # the map in float64, the cosines against the whole plaintext vocabulary in float32 (half the time of
        # float64); 1024 rows at a time. Over every id this is the largest step of the attack at budget ci
        guess = torch.cat([(F.normalize(obf_emb[i:i + 1024] @ W, dim=-1).float() @ plain_emb.T).argmax(-1)
                           for i in range(0, obf_emb.shape[0], 1024)]).cpu()
    truth = torch.as_tensor(np.argsort(target.true_permutation()))[rows]  # obfuscated id -> plaintext id
    metrics = {**res.metrics, "map_relative_error_on_victim_states": float(np.mean(errs)),
               "vocab_recovery_from_mapped_embedding": float((guess == truth).double().mean()),
               "vocab_recovery_from_mapped_embedding_ids": int(len(rows))}
    return AttackResult(
        "isa_anchor", res.ttrsr, res.piirsr, metrics, budget={**res.budget, "map": map_info},
        uses=f"{map_info['anchor_pairs']} anchor pairs (chat-template positions of the observed requests and "
             "published special ids, or given); both models run on random sequences of anchor tokens to fit one "
             "linear map obfuscated -> plaintext residual state (all layers pooled); then the obfuscated residual "
             f"stream after decoder layer {cfg.layer} of each victim prompt, mapped, inverted against the public "
             "model (state codebook, beam, direct matching); no key, no weights compared")


def isa_attention_attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                         cfg: ISAConfig | None = None, reassign_every: int = 10) -> AttackResult:
    cfg = cfg or ISAConfig.for_budget(budget)
    gen = torch.Generator().manual_seed(seed)
    observed = data.observed(target)
    idx = _prompts(data, observed, cfg)
    plain = target.plain_model
    predicted, losses, proposals = [], [], []
    qk = first = None
    for i in idx:
        obs_ids = torch.tensor([observed[i][: cfg.max_len]])
        with torch.no_grad():
            _, attn = layer_states(target.obf_model, cfg.layer, input_ids=obs_ids, attentions=True)
        obs = [a[0].float() for a in attn]  # per layer (heads, n, n)
        state: dict[str, Any] = {"assign": None}

        def on_step(x: torch.Tensor, step: int, obs=obs, state=state) -> None:
            if state["assign"] is None or step % reassign_every == 0:
                with torch.no_grad():
                    _, cand = layer_states(plain, cfg.layer, inputs_embeds=x, attentions=True)
                state["assign"] = solve_head_assignment(obs, [c[0].float() for c in cand])

        def batch_loss(x: torch.Tensor, obs=obs, state=state) -> torch.Tensor:
            if state["assign"] is None:
                on_step(x.detach(), 0)
            _, cand = layer_states(plain, cfg.layer, inputs_embeds=x, attentions=True)
            return attention_loss([c.float() for c in cand], obs, state["assign"])

        def refine_loss(x: torch.Tensor, obs=obs) -> torch.Tensor:
            _, cand = layer_states(plain, cfg.layer, inputs_embeds=x, attentions=True)
            t = x.shape[1]  # a prefix: attention is causal, its rows are the observed prefix rows
            return matched_attention_loss([c.float() for c in cand], [o[:, :t, :t] for o in obs])

        proposal = cfg.proposal if cfg.proposal != "auto" else "exhaustive"
        if proposal == "codebook":
            raise ValueError("isa_attention proposes candidates by 'exhaustive' or 'relaxed', not 'codebook'")
        proposals.append(proposal)
        if proposal == "exhaustive":
            if qk is None:  # one table per attack; prompts are cut at max_len, the RoPE table's length
                qk = FirstLayerQK.of(plain, cfg.max_len)
                first = likely_first_tokens(plain, cfg.first_pool) if cfg.first_pool else None
            cands = exhaustive_attention_candidates(qk, obs[0], cfg.refine_k, first=first)
            # the candidates' column 0 is already a full decoding: refine it (exact Hungarian scoring of all the
            # observed layers) rather than restart a beam from scratch
            seq, info = _relax_and_refine(plain, obs_ids.shape[1], batch_loss, cfg, gen, candidates=cands,
                                          refine_loss=refine_loss)
        else:
            seq, info = _relax_and_refine(plain, obs_ids.shape[1], batch_loss, cfg, gen, on_step,
                                          prefix_loss=refine_loss if cfg.greedy else None, refine_loss=refine_loss)
        predicted.append(seq)
        losses.append(info["final_loss"])
    metrics = score_attacked_prompts(target, data, predicted, idx, cfg.max_len)
    metrics["mean_final_loss"] = float(np.mean(losses))
    return AttackResult(
        "isa_attention", metrics["ttrsr"], metrics["piirsr"], metrics,
        budget={"budget": budget.name, "attention_layers": cfg.layer, "steps": cfg.steps, "lr": cfg.lr,
                "reassign_every": reassign_every, "beam": cfg.beam, "refine_k": cfg.refine_k,
                "proposal": sorted(set(proposals)),
                "first_pair_token0_pool": cfg.first_pool or f"full vocabulary ({plain.config.vocab_size})",
                "refine_sweeps": cfg.refine_sweeps,
                "prompts": len(idx), "max_len": cfg.max_len,
                "candidate_pool": f"full vocabulary ({plain.config.vocab_size})"},
        uses=f"attention probabilities of every head of the first {cfg.layer} obfuscated decoder layers for each "
             "victim prompt; head permutation undone by Hungarian matching against the candidate's heads; the "
             "public plaintext model to propose candidates (every vocabulary token scored exactly on the first "
             "layer's attention, or gradient-based relaxation) and to score them; no key, no obfuscated weights")


CI_FIRST_POOL = 4096  # isa_attention at budget ci: token 0 of the first pair among the public model's likeliest
CI_VOCAB_SAMPLE = 4096  # isa_anchor at budget ci: obfuscated ids its vocabulary diagnostic maps (all at the others)


@register("isa_hidden", on_device=True)
def isa_hidden(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """ISA on hidden states: invert key-invariant statistics of the residual stream at a shallow layer."""
    return isa_hidden_attack(target, data, budget, seed)


@register("isa_anchor", on_device=True)
def isa_anchor(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """ISA on hidden states through a linear map fitted on free anchor pairs (template, special ids)."""
    # ci: the mapped embedding table's recovery (a diagnostic, not the prompts') on 4,096 ids drawn uniformly
    return isa_anchor_attack(target, data, budget, seed, vocab_sample=CI_VOCAB_SAMPLE if budget.name == "ci" else None)


@register("isa_attention")
def isa_attention(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """ISA on attention scores: invert attention probabilities, head permutation solved by matching."""
    # ci: the first pair over 4,096 x vocab instead of vocab^2 pairs (12x less on a 49k vocabulary)
    cfg = ISAConfig.for_budget(budget, first_pool=CI_FIRST_POOL if budget.name == "ci" else None)
    return isa_attention_attack(target, data, budget, seed, cfg=cfg)
