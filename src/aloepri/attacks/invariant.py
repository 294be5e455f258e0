"""Invariant attacks (the paper's Appendix "Potential Threats", after Lin et al. 2024): Gate-IA and Attn-IA.

What the attacker uses: the public plaintext model and the obfuscated weights; no key, no pairs. Each attack
computes, for every vocabulary token, a vector of quantities that the obfuscation leaves (nearly) unchanged,
once from the plaintext weights and once from the obfuscated ones, and matches every queried obfuscated token to
the nearest plaintext token over the FULL vocabulary (Euclidean).

Gate-IA (paper): the invariant of token e at layer l is Avg(e W_gate,l), the mean over the FFN neurons of its
gate pre-activation (the neuron permutation Z does not change a mean; the key matrices cancel). One scalar per
layer, all layers stacked. Each layer's scalar is divided by its RMS over the vocabulary on each side (a
permutation-invariant statistic), which removes the global scale the obfuscated RMSNorm constant introduces.
Only alpha_e noise breaks it (as the paper says).

Attn-IA (paper): for query head i and RoPE block j (the 2 dimensions rotated together), with q = e W_q^(i)[:, j]
(1 x 2) and Q = W_e W_q^(i)[:, j] (n x 2, all tokens), the invariant is q (Q^T Q)^-1 q^T: the token's leverage
in that block. Any invertible 2 x 2 map of the block (AloePri's R H per block) and any row permutation leave it
unchanged; the key matrices cancel. The paper's attack reads the invariants in head/block order, so AloePri's head
and block permutations break the alignment; the features are matched on a log scale (leverages are heavy-tailed).

``attn-ia-sorted`` is our extension, not in the paper: it sorts each layer's (head, block) invariants before
matching, which removes the head and block permutations the way VMA's row sort removes Z.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import AttackResult, AttackTarget, Budget, PrivateData, register_variant
from .vma import CheckpointWeights, as_weights, match_features, spread_layers, target_weights

Tensor = torch.Tensor

IA_BUDGETS: dict[str, dict] = {
    "ci": {"attn_layers": 2, "vocab_sample": 256},
    "small": {"attn_layers": 8, "vocab_sample": 1024},
    "full": {"attn_layers": 1000, "vocab_sample": 4096},  # all layers
}


def gate_invariants(model) -> Tensor:
    """(n, layers): Avg over FFN neurons of e diag(w) W_gate^T, each column scaled to unit RMS over the vocabulary.
    ``model``: a loaded model or a weights reader (``vma.CheckpointWeights``: the embedding and one layer's gate
    held at a time)."""
    w = as_weights(model)
    emb = w.get("embed")
    cols = []
    for i in range(w.num_layers):
        if not w.has("gate", i):
            continue  # MoE layers have no single gate; their experts are not used here
        gate = w.get("gate", i) * w.get("ffn_norm", i)[None, :]
        cols.append(emb @ gate.mean(dim=0))  # Avg_j (e W)_j = e . mean_j W_j: no (n, ffn) product needed
        del gate
    return _scaled_columns(cols)


def _scaled_columns(cols: list[Tensor]) -> Tensor:
    if not cols:
        raise ValueError("Gate-IA needs dense FFN layers (gate_proj); this model has none")
    f = torch.stack(cols, dim=1)
    return f / f.square().mean(dim=0, keepdim=True).sqrt().clamp_min(1e-30)


def gate_invariants_of_checkpoint(path) -> Tensor:
    """``gate_invariants`` read from a checkpoint (a Hugging Face directory or a .gguf file) tensor by tensor, no
    model built: the same numbers bit for bit (the same float32 weights, the same products), holding the embedding
    and one layer's gate at a time instead of the model."""
    w = CheckpointWeights(path)
    try:
        return gate_invariants(w)
    finally:
        w.close()


def target_gate_invariants(target: AttackTarget, side: str) -> Tensor:
    """Gate-IA's features of one side ('plain' or 'obf') of ``target``: from the model when it is loaded (or was
    built in memory), else streamed from its checkpoint (``vma.target_weights``), so that Gate-IA loads neither
    model."""
    with target_weights(target, side) as w:
        return gate_invariants(w)


def block_leverages(q: Tensor, num_heads: int, eps: float = 1e-12) -> Tensor:
    """q: (n, heads * dh) query projections of every vocabulary token. Returns (n, heads, dh/2): for each token,
    head and RoPE block (dims j and j + dh/2, Hugging Face's rotate_half pairing), q_b (Q_b^T Q_b)^-1 q_b^T."""
    n = q.shape[0]
    dh = q.shape[1] // num_heads
    half = dh // 2
    qh = q.reshape(n, num_heads, 2, half).double()  # (n, H, 2, half): [dims j], [dims j + half]
    a, b = qh[:, :, 0], qh[:, :, 1]  # (n, H, half) the two coordinates of every block
    # the (H, half) 2 x 2 Gram matrices entry by entry, and the quadratic form written out: the same sums as
    # einsum("nhbi,nhbj->hbij") and einsum("nhbi,hbij,nhbj->nhb"), whose three-operand form took 40x longer
    g = torch.stack([torch.stack([(a * a).sum(0), (a * b).sum(0)], -1),
                     torch.stack([(a * b).sum(0), (b * b).sum(0)], -1)], -2)  # (H, half, 2, 2)
    g = g + eps * torch.eye(2, dtype=g.dtype) * g.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    ginv = torch.linalg.inv(g)
    return (ginv[..., 0, 0] * a * a + (ginv[..., 0, 1] + ginv[..., 1, 0]) * a * b + ginv[..., 1, 1] * b * b).float()


def attn_invariants(model, layers: list[int], sort_within_layer: bool, emb: Tensor | None = None) -> Tensor:
    """(n, features): log leverages of every (layer, head, RoPE block); sorted within each layer if asked.
    ``model``: a loaded model or a weights reader (``vma.CheckpointWeights``); ``emb``: its embedding, when
    already read."""
    w = as_weights(model)
    emb = w.get("embed") if emb is None else emb
    feats = []
    for i in layers:
        if not w.has("q", i) or w.has("q_norm", i):
            raise ValueError("Attn-IA needs plain q_proj attention without per-head q norms (not MLA / Qwen3)")
        wq = w.get("q", i) * w.get("attn_norm", i)[None, :]
        lev = block_leverages(emb @ wq.T, w.num_heads).reshape(emb.shape[0], -1)
        lev = lev.clamp_min(1e-30).log()
        feats.append(torch.sort(lev, dim=1).values if sort_within_layer else lev)
    return torch.cat(feats, dim=1)


def target_attn_invariants(target: AttackTarget, side: str, layers: list[int], sort_within_layer: bool) -> Tensor:
    """``attn_invariants`` of one side ('plain' or 'obf') of ``target`` (streamed from its checkpoint unless its model
    is loaded: ``vma.target_weights``); the leverages are computed once per target (``AttackTarget.memo``), so
    attn-ia and attn-ia-sorted share them."""
    with target_weights(target, side) as w:
        emb: list[Tensor] = []  # read once, on the first layer not computed yet

        def layer(i: int) -> Tensor:
            if not emb:
                emb.append(w.get("embed"))
            return attn_invariants(w, [i], False, emb[0])

        per_layer = [target.memo(("attn_invariants", side, i), lambda i=i: layer(i)) for i in layers]
    return torch.cat([torch.sort(f, dim=1).values if sort_within_layer else f for f in per_layer], dim=1)


def run_gate_ia(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    cfg = IA_BUDGETS.get(budget.name, IA_BUDGETS["full"])
    plain_f, obf_f = target_gate_invariants(target, "plain"), target_gate_invariants(target, "obf")
    queries, sampled, _, scores = match_features(target, data, plain_f, obf_f, cfg["vocab_sample"], seed)
    return AttackResult(
        "gate-ia", scores["ttrsr"], scores["piirsr"], scores,
        budget={"budget": budget.name, "candidate_pool": plain_f.shape[0], "candidate_pool_is_full_vocabulary": True,
                "features": f"Avg(e W_gate) for {plain_f.shape[1]} layers", "vocab_sample": int(len(sampled)),
                "queries": int(len(queries))},
        uses="public plaintext weights + obfuscated embedding and gate weights; no key, no pairs")


def run_attn_ia(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
                sort_within_layer: bool = False) -> AttackResult:
    cfg = IA_BUDGETS.get(budget.name, IA_BUDGETS["full"])
    with target_weights(target, "plain") as w:
        layers = spread_layers(w.num_layers, cfg["attn_layers"])
    plain_f, obf_f = (target_attn_invariants(target, side, layers, sort_within_layer) for side in ("plain", "obf"))
    queries, sampled, _, scores = match_features(target, data, plain_f, obf_f, cfg["vocab_sample"], seed)
    name = "attn-ia-sorted" if sort_within_layer else "attn-ia"
    return AttackResult(
        name, scores["ttrsr"], scores["piirsr"], scores,
        budget={"budget": budget.name, "candidate_pool": plain_f.shape[0], "candidate_pool_is_full_vocabulary": True,
                "layers": layers, "features": int(plain_f.shape[1]), "vocab_sample": int(len(sampled)),
                "queries": int(len(queries)), "sorted_within_layer": sort_within_layer},
        uses="public plaintext weights + obfuscated embedding and W_query; no key, no pairs")


gate_ia = register_variant(
    "gate-ia", run_gate_ia,
    "Gate-IA: per-layer mean gate pre-activation of every token, nearest neighbour over the full vocabulary.")
attn_ia = register_variant(
    "attn-ia", run_attn_ia,
    "Attn-IA: per (layer, head, RoPE block) leverage of every token, in head/block order (the paper's attack).",
    sort_within_layer=False)
attn_ia_sorted = register_variant(
    "attn-ia-sorted", run_attn_ia,
    "Attn-IA with each layer's invariants sorted (our extension: immune to head and block permutations).",
    sort_within_layer=True)
