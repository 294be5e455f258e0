"""VMA: the Vocabulary-Matching Attack (Thomas et al.; the paper's Appendix "Potential Threats").

What the attacker uses: the public plaintext model and the obfuscated weights the server holds. No key, no
plaintext/obfuscated pairs, no prompts (the observed ids are only what it decodes with the recovered mapping).

Each weight combination of the paper's Table "Weight combinations to recover Pi" has the form Y = Pi X Z, with X
computable from the public model and Y from the obfuscated one (the key matrices cancel, P Q = I):

    embed.head        Pi (W_e+N) diag(w) (W_h+N')^T Pi^T        (Z = Pi^T)
    embed.qk (layer)  Pi W_e Wq (W_e Wk)^T Pi^T                  (per-pair R H / R H^-1 cancel in q.k; heads
                                                                  and blocks are permuted together, so the sum
                                                                  over heads is unchanged; RoPE offset 0)
    embed.gate        Pi W_e diag(w) W_gate^T Z_ffn
    embed.up          Pi W_e diag(w) W_up^T H_ffn Z_ffn
    down.head         Pi W_h diag(w) W_down H_ffn^-1 Z_ffn      (the table's down.head, transposed)
    embed.router      Pi W_e diag(w) W_router^T Z_router         (MoE only)

RowSort(Y) = RowSort(X Z) removes the column permutation Z; a per-column normalisation first (each column divided
by its norm over the whole vocabulary) removes the diagonal scalings H (and any global scale such as the constant
RMSNorm weight kappa). Each obfuscated row is then matched to the nearest plaintext row over the FULL vocabulary
(Euclidean on row-sorted signatures, compressed to ``sketch`` evenly spaced order statistics so every source
fits in memory), per source (product x layer), and the sources vote (majority of per-source nearest neighbours,
ties broken by the summed distance).

Weights: each side is read through ``target_weights``: streamed from its checkpoint (a Hugging Face directory or a
.gguf file) one tensor at a time when its model is not loaded, the embedding, the head and the final norm held
throughout and the chosen layers' readers one layer at a time, one side after the other; else from the loaded
model. The same float32 numbers either way (tests/attacks/test_vma_streamed.py), so memory follows the vocabulary
and the width, not the depth.

Queries: every distinct observed obfuscated id of the private prompts, plus a seeded sample of the vocabulary to
estimate vocabulary-level recovery (``vocab_recovery_sampled``; the sample size is reported).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..progress import stage
from ..runtime.modules import ModelModules
from .base import AttackResult, AttackTarget, Budget, PrivateData, has_tokenizer, register, score_mapping

Tensor = torch.Tensor

# --- reading weights by role: from a loaded model, or streamed from its checkpoint ---------------------------------


def _w(module) -> Tensor:
    return module.weight.detach().to(torch.float32)


class ModelWeights:
    """The weights of a loaded Hugging Face causal LM (plain or obfuscated: same layout) by role, float32
    (``runtime.modules``; ``get`` gives None for a role the model lacks)."""

    _GLOBAL = {"embed": "embed", "head": "head", "final_norm": "final_norm"}
    _LAYER = ("attn_norm", "ffn_norm", "q", "k", "q_norm", "gate", "up", "down", "router")

    def __init__(self, model):
        self.model, self.mods = model, ModelModules(model)
        cfg = model.config
        self.num_layers = len(self.mods)
        self.num_heads, self.num_kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)

    def _module(self, role: str, layer: int | None):
        if layer is None:
            return getattr(self.mods, self._GLOBAL[role])
        if role not in self._LAYER:
            raise KeyError(f"no layer role {role!r}")
        return getattr(self.mods.layer(layer), role)

    def rows(self, role: str) -> int:
        return int(self._module(role, None).weight.shape[0])

    def has(self, role: str, layer: int | None = None) -> bool:
        return self._module(role, layer) is not None

    def get(self, role: str, layer: int | None = None) -> Tensor | None:
        m = self._module(role, layer)
        return None if m is None else _w(m)

    def close(self) -> None:
        pass


class CheckpointWeights:
    """The same roles read from a checkpoint (a Hugging Face directory or a .gguf file) tensor by tensor
    (``obfuscation.checkpoint.open_checkpoint``), float32 on ``device``, no model built: the same numbers as
    ``ModelWeights`` of the loaded model. A tied head is the embedding (no ``lm_head`` stored, or the config ties
    them); an architecture the reader does not know is refused when it opens."""

    def __init__(self, path, device: torch.device | str = "cpu"):
        from ..obfuscation.checkpoint import open_checkpoint

        self.ck = open_checkpoint(path)
        self.device = torch.device(device)
        cfg = self.ck.config
        self.num_layers = self.ck.num_layers
        self.num_heads = int(cfg["num_attention_heads"])
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or self.num_heads)
        self.tied = cfg.get("tie_word_embeddings") is True or not self.has("head")

    def _role(self, role: str) -> str:
        return "embed" if role == "head" and getattr(self, "tied", False) else role

    def has(self, role: str, layer: int | None = None) -> bool:
        from ..obfuscation.checkpoint import CheckpointError

        try:
            return self.ck.has(self._role(role), layer)
        except CheckpointError:  # a role this checkpoint format does not name (a router in a dense GGUF)
            return False

    def rows(self, role: str) -> int:
        return int(self.ck.tensor_shape(self.ck.name_of(self._role(role)))[0])

    def get(self, role: str, layer: int | None = None) -> Tensor | None:
        if not self.has(role, layer):
            return None
        return self.ck.get(self._role(role), layer, dtype=torch.float32).to(self.device)

    def close(self) -> None:
        self.ck.close()


def as_weights(model_or_weights):
    """``ModelWeights`` of a loaded model; a weights reader as it is."""
    return model_or_weights if isinstance(model_or_weights, (ModelWeights, CheckpointWeights)) \
        else ModelWeights(model_or_weights)


def streamed_checkpoint(target: AttackTarget, side: str):
    """The checkpoint of one side ('plain' or 'obf') of ``target`` to stream its weights from, or None to read the
    model: when it is loaded already (or was built in memory), or the source is no checkpoint on disk."""
    attr, path = ("plain_model", target.plain_src) if side == "plain" else ("obf_model", target.obfuscated_dir)
    if attr in target.__dict__ or not (path.is_file() or (path / "config.json").is_file()):
        return None
    return path


@contextmanager
def target_weights(target: AttackTarget, side: str):
    """The weights of one side of ``target`` by role: streamed from its checkpoint one tensor at a time when it is
    not loaded (``streamed_checkpoint``), else read from the model; on ``target.device``."""
    path = streamed_checkpoint(target, side)
    w = as_weights(getattr(target, "plain_model" if side == "plain" else "obf_model")) if path is None \
        else CheckpointWeights(path, target.device)
    try:
        yield w
    finally:
        w.close()


def embed_matrix(model) -> Tensor:
    return as_weights(model).get("embed")


def head_matrix(model) -> Tensor:
    """Head rows with the final RMSNorm weight fused (what multiplies the normalised last hidden state)."""
    w = as_weights(model)
    return w.get("head") * w.get("final_norm")[None, :]


def num_layers(model) -> int:
    return as_weights(model).num_layers


def mlp_readers(model, i: int) -> dict[str, Tensor]:
    """Dense FFN weights of layer i, RMSNorm weight fused into the readers: gate/up (ffn, width), down (width, ffn),
    and the MoE router (experts, width) when the layer has one. Empty for layers without them."""
    w = as_weights(model)
    out: dict[str, Tensor] = {}
    has_gate, has_router = w.has("gate", i), w.has("router", i)
    if not (has_gate or has_router):
        return out
    norm = w.get("ffn_norm", i)
    if has_gate:
        out["gate"] = w.get("gate", i) * norm[None, :]
        out["up"] = w.get("up", i) * norm[None, :]
        out["down"] = w.get("down", i)
    if has_router:
        out["router"] = w.get("router", i) * norm[None, :]
    return out


def has_qk_bilinear(model, i: int) -> bool:
    """Whether layer i's attention score is a bilinear form of the tokens (plain q/k projections, no per-head q/k
    norms: Qwen3's make it non-bilinear; MLA has no q projection)."""
    w = as_weights(model)
    return w.has("q", i) and not w.has("q_norm", i)


def qk_bilinear(model, i: int) -> Tensor | None:
    """M = sum over query heads h of Wq_h^T Wk_kv(h) (width x width), norm fused: the attention score of two
    tokens at RoPE offset 0 is x M y^T. None when the layer has per-head q/k norms (Qwen3), which make it
    non-bilinear. (q/k biases, Qwen2's, are not read: the form is of the weights.)"""
    w = as_weights(model)
    if not has_qk_bilinear(w, i):
        return None
    nh, nkv = w.num_heads, w.num_kv_heads
    norm = w.get("attn_norm", i)
    wq = w.get("q", i) * norm[None, :]
    wk = w.get("k", i) * norm[None, :]
    dh = wq.shape[0] // nh
    wk_rep = wk.reshape(nkv, dh, -1).repeat_interleave(nh // nkv, dim=0).reshape(nh * dh, -1)
    return wq.T @ wk_rep


# --- signatures ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One weight combination: Y = left @ right (n x m). ``column_normalize`` divides each column by its norm over
    all n rows (kills H and global scales); otherwise the whole matrix is scaled to unit RMS (computed exactly from
    Gram matrices, so a query subset gets the same scale as the full matrix)."""

    name: str
    layer: int | None
    left: Tensor  # (n, a)
    right: Tensor  # (a, m)
    column_normalize: bool
    left_gram: Tensor  # left^T left in float64 (shared by the sources with the same left factor)


def _column_scale(src: Source) -> Tensor:
    gram = src.left_gram
    r = src.right.double()
    if src.column_normalize:
        return ((gram @ r) * r).sum(0).clamp_min(1e-30).rsqrt().float()  # 1 / column norms
    fro2 = float(((gram @ r) * r).sum())
    rms = (fro2 / (src.left.shape[0] * src.right.shape[1])) ** 0.5
    return torch.full((src.right.shape[1],), 1.0 / max(rms, 1e-30), device=src.right.device)


def gram(m: Tensor, chunk: int = 8192) -> Tensor:
    """m^T m in float64, chunk by chunk (no float64 copy of m), on m's device. float64 because the column scales
    come from it as differences of large sums; it is one (width x width) product per model, cheap even on a GPU
    with slow float64."""
    out = torch.zeros(m.shape[1], m.shape[1], dtype=torch.float64, device=m.device)
    for s in range(0, m.shape[0], chunk):
        c = m[s:s + chunk].double()
        out += c.T @ c
    return out


def sketch_positions(m: int, k: int) -> Tensor:
    """Evenly spaced order statistics of a sorted row of length m (all of them when m <= k)."""
    if m <= k:
        return torch.arange(m)
    return torch.linspace(0, m - 1, k).round().long()


def signatures(src: Source, rows: Tensor | None, sketch: int, chunk: int = 1024) -> Tensor:
    """Row-sorted, normalised rows of Y = left @ right (all rows, or ``rows``), compressed to ``sketch`` columns.
    Scaled by sqrt(m / k) so distances do not depend on the sketch size. Computed and returned on the weights'
    device."""
    dev = src.left.device
    scale = _column_scale(src)
    right = src.right * scale[None, :]
    idx = torch.arange(src.left.shape[0], device=dev) if rows is None else rows.to(dev)
    pos = sketch_positions(right.shape[1], sketch).to(dev)
    out = torch.empty(len(idx), len(pos), device=dev)
    for s in range(0, len(idx), chunk):
        y = src.left[idx[s:s + chunk]] @ right
        out[s:s + chunk] = order_statistics(y, pos)
    return out * (right.shape[1] / len(pos)) ** 0.5


def order_statistics(y: Tensor, pos: Tensor) -> Tensor:
    """The entries at ``pos`` of each row of ``y`` sorted ascending. On the CPU through numpy's vectorised sort
    (measured on (1024, 1536) float32 rows, one thread: 0.014 s against torch.sort's 0.090; most of the weight
    signatures' time was that sort): the same values bit for bit, a sort moves values and computes none (a -0.0
    and a 0.0 may trade places: equal, and equal in every product after). torch.sort elsewhere."""
    if y.device.type == "cpu" and y.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(y.detach().numpy(), axis=1)[:, pos.cpu().numpy()])
    return torch.sort(y, dim=1).values[:, pos]


def candidate_signatures(target: AttackTarget, src: Source, sketch: int) -> Tensor:
    """``signatures`` of every row of a plaintext source, computed once per target (``AttackTarget.memo``): VMA
    and the composed behavioural attack match against the same ones."""
    return target.memo(("vma_signatures", "plain", src.name, src.layer, sketch, str(src.left.device)),
                       lambda: signatures(src, None, sketch))


def source_plan(model, products: tuple[str, ...], layers: list[int], qk_layers: list[int]
                ) -> list[tuple[str, int | None]]:
    """(name, layer) of the paper's weight combinations one model (plain or obfuscated) exposes, in the fixed order
    ``iter_sources`` yields them; from which tensors exist, none read."""
    w = as_weights(model)
    out: list[tuple[str, int | None]] = [("embed.head", None)] if "embed.head" in products else []
    out += [("embed.qk", i) for i in qk_layers if "embed.qk" in products and has_qk_bilinear(w, i)]
    for i in layers:
        if w.has("gate", i):
            out += [(p, i) for p in ("embed.gate", "embed.up", "down.head") if p in products]
        if w.has("router", i) and "embed.router" in products:
            out.append(("embed.router", i))
    return out


def iter_sources(model, products: tuple[str, ...], layers: list[int], qk_layers: list[int]) -> Iterator[Source]:
    """The sources of ``source_plan``, one at a time: the embedding (and the head, when a product uses it) are held
    throughout, each layer's weights only while its sources are used, so a checkpoint (``CheckpointWeights``)
    is read in the memory of those matrices and one layer's, never the model's."""
    w = as_weights(model)
    emb = w.get("embed")
    g_emb = gram(emb)
    head = head_matrix(w) if ("embed.head" in products or "down.head" in products) else None
    if "embed.head" in products:
        yield Source("embed.head", None, emb, head.T, False, g_emb)
    if "embed.qk" in products:
        for i in qk_layers:
            m = qk_bilinear(w, i)
            if m is not None:
                yield Source("embed.qk", i, emb, m @ emb.T, False, g_emb)
            del m
    g_head = gram(head) if "down.head" in products else None
    for i in layers:
        r = mlp_readers(w, i)
        if "gate" in r and "embed.gate" in products:
            yield Source("embed.gate", i, emb, r["gate"].T, True, g_emb)
        if "up" in r and "embed.up" in products:
            yield Source("embed.up", i, emb, r["up"].T, True, g_emb)
        if "down" in r and head is not None and "down.head" in products:
            yield Source("down.head", i, head, r["down"], True, g_head)
        if "router" in r and "embed.router" in products:
            yield Source("embed.router", i, emb, r["router"].T, True, g_emb)
        del r


def vma_sources(model, products: tuple[str, ...], layers: list[int], qk_layers: list[int]) -> list[Source]:
    """The paper's weight combinations for one model (plain or obfuscated), in a fixed order, all held at once
    (``iter_sources`` yields them one at a time)."""
    return list(iter_sources(model, products, layers, qk_layers))


def source_signatures(target: AttackTarget, products: tuple[str, ...], layers: list[int], qk_layers: list[int],
                      sketch: int, queries: np.ndarray, log: Callable[[str], None] | None = None
                      ) -> tuple[list[str], list[Tensor], list[Tensor]]:
    """(source names, plaintext signatures of every row, obfuscated signatures of the ``queries`` rows), source by
    source, one side after the other (``target_weights``: each side streamed from its checkpoint unless its model
    is loaded). Refused before any product when the two sides differ in vocabulary or in the sources they expose
    (architecture mismatch)."""
    with target_weights(target, "plain") as wp, target_weights(target, "obf") as wo:
        n, n_obf = wp.rows("embed"), wo.rows("embed")
        if n_obf != n:
            raise ValueError(f"vocabulary sizes differ: plain {n}, obfuscated {n_obf}")
        plan = source_plan(wp, products, layers, qk_layers)
        if plan != source_plan(wo, products, layers, qk_layers):
            raise ValueError("plain and obfuscated models expose different weight combinations (architecture "
                             "mismatch)")
    if not plan:
        raise ValueError(f"no VMA weight combination available for products {products}")
    names = [f"{nm}@{i}" if i is not None else nm for nm, i in plan]
    cand: list[Tensor] = []
    qry: list[Tensor] = []
    with target_weights(target, "plain") as wp:
        for j, src in enumerate(iter_sources(wp, products, layers, qk_layers)):
            stage(f"weight signatures {j + 1}/{2 * len(plan)} (public model)")
            cand.append(candidate_signatures(target, src, sketch))
            del src
    with target_weights(target, "obf") as wo:
        for j, src in enumerate(iter_sources(wo, products, layers, qk_layers)):
            stage(f"weight signatures {len(plan) + j + 1}/{2 * len(plan)} (obfuscated model)")
            qry.append(signatures(src, torch.from_numpy(queries).to(src.left.device), sketch))
            del src
            if log:
                log(f"VMA source {names[j]} ready")
    if [len(cand), len(qry)] != [len(plan)] * 2:  # iter_sources follows source_plan: a mismatch is a bug
        raise RuntimeError(f"VMA built {len(cand)} / {len(qry)} sources for a plan of {len(plan)}")
    return names, cand, qry


# --- matching --------------------------------------------------------------------------------------------------


def _nearest(query_sigs: list[Tensor], cand_sigs: list[Tensor], chunk: int) -> np.ndarray:
    """Per-source nearest candidate of every query: (sources, q)."""
    q = query_sigs[0].shape[0]
    out = np.empty((len(query_sigs), q), dtype=np.int64)
    for s in range(0, q, chunk):
        for j, (qs, cs) in enumerate(zip(query_sigs, cand_sigs)):
            out[j, s:s + chunk] = torch.cdist(qs[s:s + chunk], cs).argmin(dim=1).cpu().numpy()
    return out


def consistent_sources(per_source: np.ndarray, min_agreement: float = 0.02) -> np.ndarray:
    """Indices of the sources whose nearest neighbours agree with at least one other source on >= min_agreement
    of the queries (chance agreement is ~1/vocabulary). Unsupervised: no key, no truth. All sources when fewer
    than two pass."""
    k = per_source.shape[0]
    if k == 1:
        return np.arange(1)
    agree = np.zeros((k, k))
    for a in range(k):
        for b in range(a + 1, k):
            agree[a, b] = agree[b, a] = float((per_source[a] == per_source[b]).mean())
    keep = np.flatnonzero(agree.max(axis=1) >= min_agreement)
    return keep if len(keep) >= 2 else np.arange(k)


def vote_match(query_sigs: list[Tensor], cand_sigs: list[Tensor], chunk: int = 256
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Nearest candidate row per query, per source and fused. Returns (fused guess (q,), per-source guesses
    (sources, q), summed-distance guess (q,), kept source indices). Fusion: the sources that agree with another
    source more often than chance (``consistent_sources``) vote with their nearest neighbours; among the
    candidates with the most votes, the one with the smallest summed squared distance over those sources wins."""
    per_source = _nearest(query_sigs, cand_sigs, chunk)
    if len(query_sigs) == 1:
        return per_source[0], per_source, per_source[0], np.arange(1)
    keep = consistent_sources(per_source)
    q = query_sigs[0].shape[0]
    fused = np.empty(q, dtype=np.int64)
    summed = np.empty(q, dtype=np.int64)
    for s in range(0, q, chunk):
        total = None
        for j in keep:
            d = torch.cdist(query_sigs[j][s:s + chunk], cand_sigs[j]).square_()
            total = d if total is None else total.add_(d)
        summed[s:s + chunk] = total.argmin(dim=1).cpu().numpy()
        total = total.cpu()  # the tie-breaks below read single entries: one transfer per chunk, not per query
        for r in range(total.shape[0]):
            cands, counts = np.unique(per_source[keep, s + r], return_counts=True)
            best = cands[counts == counts.max()]
            fused[s + r] = best[int(total[r, torch.from_numpy(best)].argmin())] if len(best) > 1 else best[0]
    return fused, per_source, summed, keep


def query_ids(observed: list[list[int]], vocab: int, sample: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(all query obfuscated ids, the seeded uniform sample among them used for vocabulary-level recovery)."""
    rng = np.random.default_rng(seed)
    sampled = np.sort(rng.choice(vocab, size=min(sample, vocab), replace=False))
    seen = np.unique(np.fromiter((i for ids in observed for i in ids), dtype=np.int64))
    return np.union1d(seen, sampled), sampled


def match_features(target: AttackTarget, data: PrivateData, plain_feats: Tensor, obf_feats: Tensor, sample: int,
                   seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Nearest-neighbour match of per-token features (obfuscated rows of the observed ids plus a seeded vocabulary
    sample, against every plaintext row), scored: returns (queries, sampled, guesses, scores)."""
    n = plain_feats.shape[0]
    if obf_feats.shape != plain_feats.shape:
        raise ValueError(f"feature shapes differ: plain {tuple(plain_feats.shape)}, obfuscated "
                         f"{tuple(obf_feats.shape)} (different architecture or head layout)")
    queries, sampled = query_ids(data.observed(target), n, sample, seed)
    fused, _, _, _ = vote_match([obf_feats[torch.from_numpy(queries).to(obf_feats.device)]], [plain_feats])
    mapping = np.full(n, -1, dtype=np.int64)
    mapping[queries] = fused
    scores = score_mapping(target, data, mapping, text_metrics=has_tokenizer(target))
    scores.pop("vocab_recovery", None)
    truth = np.argsort(target.true_permutation())[queries]  # scoring only
    in_sample = np.isin(queries, sampled)
    scores["vocab_recovery_sampled"] = float((fused[in_sample] == truth[in_sample]).mean())
    return queries, sampled, fused, scores


# Budgets: candidate pool is ALWAYS the full vocabulary; these set the sources and the query sample.
VMA_BUDGETS: dict[str, dict] = {
    "ci": {"mlp_layers": 2, "qk_layers": 0, "embed_head": False, "vocab_sample": 256, "sketch": 128},
    "small": {"mlp_layers": 4, "qk_layers": 1, "embed_head": True, "vocab_sample": 1024, "sketch": 128},
    "full": {"mlp_layers": 8, "qk_layers": 2, "embed_head": True, "vocab_sample": 4096, "sketch": 128},
}
ALL_PRODUCTS = ("embed.head", "embed.qk", "embed.gate", "embed.up", "down.head", "embed.router")


def spread_layers(total: int, k: int) -> list[int]:
    """k layers evenly spread over the depth (all when k >= total)."""
    if k <= 0:
        return []
    return sorted({int(x) for x in np.linspace(0, total - 1, min(k, total)).round()})


def run_vma(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
            products: tuple[str, ...] = ALL_PRODUCTS, config: dict | None = None,
            log: Callable[[str], None] | None = None) -> AttackResult:
    cfg = dict(VMA_BUDGETS.get(budget.name, VMA_BUDGETS["full"]))
    cfg.update(config or {})
    stage("reading the weights")
    with target_weights(target, "plain") as wp:
        n, L = wp.rows("embed"), wp.num_layers
    layers = spread_layers(L, cfg["mlp_layers"])
    qk_layers = spread_layers(L, cfg["qk_layers"])
    prods = tuple(p for p in products if p != "embed.head" or cfg["embed_head"])
    observed = data.observed(target)
    queries, sampled = query_ids(observed, n, cfg["vocab_sample"], seed)
    names, cand, qry = source_signatures(target, prods, layers, qk_layers, cfg["sketch"], queries, log)
    stage("matching")
    fused, per_source, summed, keep = vote_match(qry, cand)

    mapping = np.full(n, -1, dtype=np.int64)
    mapping[queries] = fused
    scores = score_mapping(target, data, mapping, text_metrics=has_tokenizer(target))
    scores.pop("vocab_recovery", None)  # only the queried ids are mapped: report the sampled estimate instead
    truth = np.argsort(target.true_permutation())[queries]  # scoring only
    in_sample = np.isin(queries, sampled)
    scores["vocab_recovery_sampled"] = float((fused[in_sample] == truth[in_sample]).mean())
    scores["vocab_recovery_sampled_sum_fusion"] = float((summed[in_sample] == truth[in_sample]).mean())
    scores["per_source_vocab_recovery"] = {nm: float((per_source[j][in_sample] == truth[in_sample]).mean())
                                          for j, nm in enumerate(names)}
    return AttackResult(
        "vma", scores["ttrsr"], scores["piirsr"], scores,
        budget={"budget": budget.name, "candidate_pool": n, "candidate_pool_is_full_vocabulary": True,
                "sources": names, "sources_voting": [names[j] for j in keep],
                "sketch_order_statistics": cfg["sketch"], "vocab_sample": int(len(sampled)),
                "queries": int(len(queries)), "device": str(target.device)},
        uses="public plaintext weights + obfuscated weights (embedding, head, q/k, gate/up/down, router); no key, "
             "no pairs")


@register("vma", on_device=True)
def vma(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """Vocabulary matching on every weight combination of the paper's Table (row sort + full-vocabulary NN + vote)."""
    return run_vma(target, data, budget, seed)
