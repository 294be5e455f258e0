"""Covariant weight transforms, named by the role of the weight. Pure tensor-in/tensor-out.

Precision: a transform computes in the dtype of the weight it is given (the keys, float64 numpy arrays, are
converted to it after any small float64 factor is formed). float64 keeps ``exact`` to float64 rounding; the pipeline
hands float32 weights only where its output is stored in 32 bits or fewer and the preset adds noise, whose size
dwarfs a float32 product's error (measured: docs/performance.md, "Precision"; pipeline.product_dtype).

Layout: weights are in the Hugging Face ``nn.Linear`` layout (out_features, in_features), ``y = x W^T + b``.
Hidden states are row vectors; the obfuscated residual stream is ``x @ P`` (P: d x D, D = d + 2h) and a
reader recovers ``x`` with ``Q`` (D x d), ``P @ Q = I``.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

Tensor = torch.Tensor


def _t(a: np.ndarray | Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    """A key (numpy, float64) as a tensor, converted to the dtype and moved to the device of the weight it meets."""
    t = a if isinstance(a, Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    return t if dtype is None and device is None else t.to(dtype=dtype, device=device)


def _index(a: np.ndarray, like: Tensor) -> Tensor:
    """An index array (permutation, gather order) on the device of the tensor it indexes."""
    return torch.from_numpy(np.asarray(a)).to(like.device)


# --- residual-stream readers and writers ---------------------------------------------------------------


def transform_reader_input(weight: Tensor, norm_weight: Tensor | None, Q: np.ndarray) -> Tensor:
    """A linear layer that reads the (normalised) residual stream: fuse the RMSNorm weight, then undo P.

    Math: W~ = Q diag(w) W  ->  HF layout (out, D) = W_hf diag(w) Q^T. diag(w) is applied to Q^T (d x D), not to
    the weight: one small scaling instead of a copy of the weight, formed in float64 and then converted to the
    weight's dtype.
    """
    right = _t(Q).T
    if norm_weight is not None:
        right = norm_weight.to(right.dtype)[:, None] * right
    return weight @ right.to(dtype=weight.dtype, device=weight.device)


# Largest |norm weight| (in units of kappa) a kept dimension keeps on the server's norm (split_norm_weight):
# measured on llama.cpp q8_0, 1 is at or near the best for both SmolLM2 and Qwen2.5 (docs/serving-gguf.md).
KEPT_NORM_WEIGHT_MAX = 1.0


def split_norm_weight(norm_weight: Tensor, kappa: float, kept_columns: dict[int, int], width: int
                      ) -> tuple[Tensor, Tensor]:
    """An RMSNorm weight (d,) -> (the server's norm weight (D,), the weight its readers fold in (d,)).

    diag(w) does not commute with the key's mixing, so a mixed dimension's weight is folded into the readers and
    the server's norm weight is the constant kappa there. A kept dimension i reaches the server as one coordinate
    j = kept_columns[i] (P e_i = +-s e_j), so any split of w_i between the server's norm (at j) and the readers
    keeps the products unchanged. It matters for 8-bit activation rounding (one scale per block of 32 inputs): a
    massive-activation dimension reaches ~sqrt(d) after normalisation, and its weight decides how much of the
    block it takes. Up to |w_i| <= 1 the weight stays on the server (kappa w_i; a tiny w_i damps the dimension as
    in plaintext); a larger one is clipped to +-kappa there, the rest folded into the readers, so a kept
    coordinate is never amplified beyond the mixed ones (Qwen2.5's dim 62 has w up to 3: llama.cpp q8_0 KL 7.7x
    plaintext's unclipped, 1.2x clipped; docs/serving-gguf.md)."""
    server = torch.full((width,), float(kappa), dtype=torch.float64)
    reader = norm_weight.to(torch.float64).clone()
    if kept_columns:
        dims = torch.tensor(sorted(kept_columns), dtype=torch.long)
        on_server = reader[dims].clamp(-KEPT_NORM_WEIGHT_MAX, KEPT_NORM_WEIGHT_MAX)
        server[torch.tensor([kept_columns[int(i)] for i in dims])] = float(kappa) * on_server
        reader[dims] = torch.where(on_server == reader[dims], torch.ones_like(on_server), reader[dims] / on_server)
    return server, reader


def transform_writer_output(weight: Tensor, P: np.ndarray) -> Tensor:
    """A linear layer that writes into the residual stream: W~ = W P  ->  HF layout (D, in) = P^T W_hf."""
    return _t(P, weight.dtype, weight.device).T @ weight


def transform_writer_bias(bias: Tensor, P: np.ndarray) -> Tensor:
    return bias @ _t(P, bias.dtype, bias.device)


# --- embedding and head --------------------------------------------------------------------------------


NOISE_SHAPES = ("isotropic", "column", "row", "fisher")


def _noise_profile(weight: Tensor, shape: str, chunk_rows: int) -> tuple[Tensor, float]:
    """Per-column noise std (d,) and the rms row norm, for a total noise energy equal to the isotropic one.

    isotropic: std(W) everywhere (the paper). column: proportional to each column's own std (noise follows the
    embedding's per-dimension spread). row: std(W) per column, and every row's noise is scaled by its own norm
    over the rms norm (each token perturbed by the same *relative* amount).
    """
    d = weight.shape[1]
    s1 = torch.zeros(d, dtype=torch.float64)
    s2 = torch.zeros(d, dtype=torch.float64)
    norms = 0.0
    # column sums as a vector-matrix product per chunk (BLAS; 10x faster than float64 reductions), accumulated in
    # float64 across chunks: ~1e-7 relative error on a noise scale, which needs no more
    acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    ones = torch.ones(chunk_rows, dtype=acc_dtype)
    for start in range(0, weight.shape[0], chunk_rows):
        c = weight[start : start + chunk_rows].to(acc_dtype)
        cc = c * c
        s1 += (ones[: c.shape[0]] @ c).to(torch.float64)
        s2 += (ones[: c.shape[0]] @ cc).to(torch.float64)
        if shape == "row":  # only the row shape needs the row norms
            norms += float(cc.sum(dtype=torch.float64))
    n = weight.shape[0]
    col_var = (s2 - s1 * s1 / n) / (n - 1)
    total_std = float(np.sqrt(max(float(s2.sum() - s1.sum() ** 2 / (n * d)), 0.0) / (n * d - 1)))
    if shape == "column":
        col = col_var.clamp_min(0).sqrt()
        col = col * (total_std / float(col.pow(2).mean().sqrt()))
    else:
        col = torch.full((d,), total_std, dtype=torch.float64)
    return col, float(np.sqrt(norms / n))  # rms row norm: the row-shaped noise keeps the total energy


def permute_noise_project_blocks(
    weight: Tensor, vocab_perm: np.ndarray, right: Tensor, alpha: float, rng: np.random.Generator,
    out_dtype: torch.dtype, column_scale: Tensor | None = None, chunk_rows: int = 8192, noise_shape: str = "isotropic",
    noise_factor: Tensor | None = None, compute_dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu",
) -> Iterator[Tensor]:
    """Rows of a vocabulary matrix (n, d): permute, add alpha-scaled Gaussian noise (shaped by ``noise_shape``,
    see _noise_profile), scale columns, multiply by ``right`` (d, D). Yields the result's rows in order, one block
    of ``chunk_rows`` rows at a time in ``out_dtype`` on the CPU, so neither the result nor a wide copy of the
    input is ever whole in memory.

    Drawing the noise costs more than the product, so every chunk has its own generator (seeded from ``rng``: the
    result still depends on ``rng`` alone, and on the CPU whatever ``device`` runs the products) and the next
    chunks are drawn by worker threads while the current one is multiplied; numpy's generators release the GIL.
    The draws are float32 whatever the compute dtype (a float32 Gaussian is as random as a float64 one, half the
    memory traffic, and the same noise either way)."""
    n, d = weight.shape
    device = torch.device(device)
    if noise_shape not in NOISE_SHAPES:
        raise ValueError(f"noise_shape must be one of {NOISE_SHAPES}")
    if alpha > 0 and (noise_shape == "fisher") != (noise_factor is not None):
        raise ValueError("noise_shape 'fisher' needs a noise_factor (obfuscation/noise.py), and only it takes one")
    factor_t = None if noise_factor is None else noise_factor.to(compute_dtype).T.contiguous().to(device)
    col_std, rms_norm = _noise_profile(weight, noise_shape, chunk_rows) if alpha > 0 else (None, 1.0)
    plain_rows = torch.from_numpy(np.argsort(vocab_perm))  # obfuscated row j holds plain token plain_rows[j]
    if column_scale is not None:  # diag(c) on the small (d, D) factor instead of on every chunk of rows
        right = column_scale.to(right.dtype)[:, None] * right
    right = right.to(compute_dtype).contiguous().to(device)
    # buffers reused across chunks: fresh 50-80 MB allocations per chunk cost page faults, not arithmetic
    rows_buf = torch.empty((chunk_rows, d), dtype=compute_dtype, device=device)
    prod_buf = torch.empty((chunk_rows, right.shape[1]), dtype=compute_dtype, device=device)
    starts = list(range(0, n, chunk_rows))
    if alpha > 0:
        col_std = col_std.to(compute_dtype).to(device)
        seeds = rng.integers(0, 2**63, size=(len(starts), 4))  # 252 bits per chunk, all from rng
    ahead = max(1, torch.get_num_threads()) if alpha > 0 else 0
    noise_bufs = [np.empty((chunk_rows, d), dtype=np.float32) for _ in range(ahead + 1)] if alpha > 0 else []

    def draw(k: int) -> np.ndarray:
        buf = noise_bufs[k % len(noise_bufs)][: min(n, starts[k] + chunk_rows) - starts[k]]
        np.random.default_rng(seeds[k]).standard_normal(out=buf, dtype=np.float32)
        return buf

    with ThreadPoolExecutor(max_workers=max(1, ahead)) as pool:
        pending = [pool.submit(draw, k) for k in range(min(ahead, len(starts)))]
        for k, start in enumerate(starts):
            stop = min(n, start + chunk_rows)
            rows = rows_buf[: stop - start]
            rows.copy_(weight.index_select(0, plain_rows[start:stop]))
            if alpha > 0:
                # a copy only for float64 or another device
                noise = torch.from_numpy(pending.pop(0).result()).to(dtype=compute_dtype, device=device)
                if k + ahead < len(starts):  # its buffer is free: chunk k - 1 is done with it
                    pending.append(pool.submit(draw, k + ahead))
                if factor_t is not None:  # rows of z @ F^T: covariance F F^T (sensitivity-shaped, trace d)
                    noise = noise @ factor_t
                noise.mul_(col_std[None, :])
                if noise_shape == "row":
                    noise.mul_(rows.norm(dim=1, keepdim=True) / rms_norm)
                rows.add_(noise, alpha=alpha)
            prod = prod_buf[: stop - start]
            torch.matmul(rows, right, out=prod)
            yield prod.to(device="cpu", dtype=out_dtype, copy=True)  # its own memory: the buffer is reused


def _permute_noise_project(weight: Tensor, vocab_perm: np.ndarray, right: Tensor, alpha: float,
                           rng: np.random.Generator, out_dtype: torch.dtype, **kw) -> Tensor:
    """permute_noise_project_blocks, gathered into one (n, D) tensor."""
    return _gather(permute_noise_project_blocks(weight, vocab_perm, right, alpha, rng, out_dtype, **kw), weight.shape[0])


def obfuscate_embedding_blocks(weight: Tensor, vocab_perm: np.ndarray, P: np.ndarray, alpha: float,
                               rng: np.random.Generator, out_dtype: torch.dtype, noise_shape: str = "isotropic",
                               noise_factor: Tensor | None = None, compute_dtype: torch.dtype = torch.float64,
                               device: torch.device | str = "cpu") -> Iterator[Tensor]:
    """W~_e = Pi (W_e + alpha sigma_e N) P, row block by row block; row vocab_perm[i] of the result is plain token i."""
    return permute_noise_project_blocks(weight, vocab_perm, _t(P), alpha, rng, out_dtype, noise_shape=noise_shape,
                                        noise_factor=noise_factor, compute_dtype=compute_dtype, device=device)


def obfuscate_head_blocks(weight: Tensor, norm_weight: Tensor, vocab_perm: np.ndarray, Q: np.ndarray, alpha: float,
                          rng: np.random.Generator, out_dtype: torch.dtype, noise_shape: str = "isotropic",
                          noise_factor: Tensor | None = None, compute_dtype: torch.dtype = torch.float64,
                          device: torch.device | str = "cpu") -> Iterator[Tensor]:
    """W~_h = Q diag(w_norm) (W_h + alpha sigma_h N) Pi^T, HF layout (n, D), row block by row block; row
    vocab_perm[i] = plain token i."""
    return permute_noise_project_blocks(weight, vocab_perm, _t(Q).T, alpha, rng, out_dtype, column_scale=norm_weight,
                                        noise_shape=noise_shape, noise_factor=noise_factor,
                                        compute_dtype=compute_dtype, device=device)


def _gather(blocks: Iterator[Tensor], rows: int) -> Tensor:
    first = next(blocks)
    out = torch.empty((rows, first.shape[1]), dtype=first.dtype)
    out[: first.shape[0]] = first
    start = first.shape[0]
    for block in blocks:
        out[start: start + block.shape[0]] = block
        start += block.shape[0]
    return out


def obfuscate_embedding(weight: Tensor, vocab_perm: np.ndarray, P: np.ndarray, alpha: float,
                        rng: np.random.Generator, out_dtype: torch.dtype, noise_shape: str = "isotropic",
                        noise_factor: Tensor | None = None, compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """obfuscate_embedding_blocks as one tensor."""
    return _gather(obfuscate_embedding_blocks(weight, vocab_perm, P, alpha, rng, out_dtype, noise_shape, noise_factor,
                                              compute_dtype), weight.shape[0])


def obfuscate_head(weight: Tensor, norm_weight: Tensor, vocab_perm: np.ndarray, Q: np.ndarray, alpha: float,
                   rng: np.random.Generator, out_dtype: torch.dtype, noise_shape: str = "isotropic",
                   noise_factor: Tensor | None = None, compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """obfuscate_head_blocks as one tensor."""
    return _gather(obfuscate_head_blocks(weight, norm_weight, vocab_perm, Q, alpha, rng, out_dtype, noise_shape,
                                         noise_factor, compute_dtype), weight.shape[0])


# --- attention -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSecrets:
    """Secrets of one attention layer.

    kv_order[s]      old kv head placed in new kv slot s (tau_kv)
    group_orders[s]  order of the q heads inside new group s (tau_group, one per group)
    qk_maps[g]       (dh x dh) maps applied to q and k columns of old kv group g: R H Zb and R H^-1 Zb
    vo_mix[g]        (dh x dh) invertible U_vo of old kv group g
    q_norm_scale / k_norm_scale / norm_order: for per-head q/k RMSNorm (Qwen3): H and Zb move into the norm
                     weights (shared by all heads), the projections only get R (sign flips) and Zb
    """

    kv_order: np.ndarray
    group_orders: list[np.ndarray]
    q_maps: list[np.ndarray]
    k_maps: list[np.ndarray]
    vo_mix: list[np.ndarray]
    q_norm_scale: np.ndarray | None = None
    k_norm_scale: np.ndarray | None = None
    norm_order: np.ndarray | None = None

    def q_head_sources(self) -> list[tuple[int, int]]:
        """(old q head, old kv group) for every new q head slot, in order."""
        G = len(self.group_orders[0])
        out = []
        for s, g in enumerate(self.kv_order):
            for j in self.group_orders[s]:
                out.append((int(g) * G + int(j), int(g)))
        return out


def rope_pairs(half: int, interleaved: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Dimension indices (a_j, b_j) of RoPE pair j: Hugging Face's (j, j + dh/2), or adjacent (2j, 2j + 1) when the
    model rotates interleaved pairs (DeepSeek's ``rope_interleave``, llama.cpp)."""
    j = np.arange(half)
    return (2 * j, 2 * j + 1) if interleaved else (j, j + half)


def interleave_rope_rows(w, n_head: int):
    """q/k rows (or biases) from rotate-half order, pairs (i, i + head_dim/2) per head (Hugging Face), to adjacent
    pairs (2i, 2i+1) (llama.cpp's GGUF layout): a row permutation per head. numpy or torch, any trailing shape."""
    return _swap_rope_row_order(w, n_head, to_interleaved=True)


def deinterleave_rope_rows(w, n_head: int):
    """The inverse of :func:`interleave_rope_rows`: adjacent pairs back to rotate-half order."""
    return _swap_rope_row_order(w, n_head, to_interleaved=False)


def _swap_rope_row_order(w, n_head: int, to_interleaved: bool):
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot split {rows} q/k rows into {n_head} heads of even size")
    half = rows // n_head // 2
    split = (2, half) if to_interleaved else (half, 2)
    return w.reshape(n_head, *split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_pair_rotation(angles: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Block rotation acting on the RoPE pairs.

    Each 2x2 block is in SO(2), so it commutes with RoPE's own rotation of that pair, and applying the same
    rotation to q and k leaves q.k unchanged.
    """
    half = len(angles)
    a, b = rope_pairs(half, interleaved)
    R = np.zeros((2 * half, 2 * half))
    c, s = np.cos(angles), np.sin(angles)
    R[a, a] = c
    R[a, b] = s
    R[b, a] = -s
    R[b, b] = c
    return R


def pair_permutation_matrix(order: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Permutation of RoPE pairs: new pair j takes old pair order[j] (both of its dims)."""
    half = len(order)
    a, b = rope_pairs(half, interleaved)
    src = np.empty(2 * half, dtype=int)
    src[a], src[b] = a[order], b[order]
    M = np.zeros((2 * half, 2 * half))
    M[src, np.arange(2 * half)] = 1.0
    return M


def pair_scaling(scales: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """Diagonal matrix scaling both dims of RoPE pair j by scales[j] (commutes with RoPE's rotation)."""
    a, b = rope_pairs(len(scales), interleaved)
    v = np.empty(2 * len(scales))
    v[a], v[b] = scales, scales
    return np.diag(v)


def obfuscate_attention(
    w: dict[str, Tensor],
    norm_weight: Tensor,
    Q_q: np.ndarray, Q_k: np.ndarray, Q_v: np.ndarray, P_o: np.ndarray,
    secrets: AttentionSecrets,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> dict[str, Tensor]:
    """Intra-head transforms (Algorithm 2) and inter-head permutation of one attention layer.

    ``w`` holds q/k/v/o weights (HF layout) and optional q/k/v/o biases and q_norm/k_norm weights.
    Returns the same keys, obfuscated.
    """
    G = num_heads // num_kv_heads
    dh = head_dim
    out: dict[str, Tensor] = {}
    sources = secrets.q_head_sources()

    def heads(t: Tensor, n: int) -> Tensor:  # (n*dh, ...) -> (n, dh, ...)
        return t.reshape(n, dh, *t.shape[1:])

    # Output-side maps M act on columns in math layout (x W M), i.e. rows in HF layout: rows -> M^T rows. They act
    # on the output rows, so they are applied to the plain weight's rows (d columns) before the reader product
    # (D columns), all heads in one batched product; the result is the same matrix.
    q_src = _index(np.array([i for i, _ in sources]), w["q"])
    q_grp = [g for _, g in sources]
    kv_src = _index(secrets.kv_order, w["q"])

    def per_head(maps: list[np.ndarray], groups, t: Tensor, n: int, picked: Tensor) -> Tensor:
        mt = torch.stack([_t(maps[g], t.dtype, t.device).T for g in groups])  # (slots, dh, dh)
        return torch.bmm(mt, heads(t, n).index_select(0, picked)).reshape(-1, t.shape[1])

    out["q"] = transform_reader_input(per_head(secrets.q_maps, q_grp, w["q"], num_heads, q_src), norm_weight, Q_q)
    out["k"] = transform_reader_input(per_head(secrets.k_maps, secrets.kv_order, w["k"], num_kv_heads, kv_src),
                                      norm_weight, Q_k)
    out["v"] = transform_reader_input(per_head(secrets.vo_mix, secrets.kv_order, w["v"], num_kv_heads, kv_src),
                                      norm_weight, Q_v)
    if "q_bias" in w:
        qb = heads(w["q_bias"], num_heads)
        out["q_bias"] = torch.cat([qb[i] @ _t(secrets.q_maps[g], qb.dtype, qb.device) for i, g in sources])
    if "k_bias" in w:
        kb = heads(w["k_bias"], num_kv_heads)
        out["k_bias"] = torch.cat([kb[g] @ _t(secrets.k_maps[g], kb.dtype, kb.device) for g in secrets.kv_order])
    if "v_bias" in w:
        vb = heads(w["v_bias"], num_kv_heads)
        out["v_bias"] = torch.cat([vb[g] @ _t(secrets.vo_mix[g], vb.dtype, vb.device) for g in secrets.kv_order])

    # o_proj: math rows of head i get U_vo^-1 of its kv group; then the writer's P on the output side.
    o_math = heads(w["o"].T, num_heads)  # (m, dh, d)
    vo_inv = [np.linalg.inv(m) for m in secrets.vo_mix]  # once per kv group, not once per q head
    inv_t = torch.stack([_t(vo_inv[g], o_math.dtype, o_math.device) for g in q_grp])
    o_rows = torch.bmm(inv_t, o_math.index_select(0, q_src)).reshape(-1, o_math.shape[2])  # (m dh, d)
    out["o"] = transform_writer_output(o_rows.T, P_o)  # HF layout (D, m dh) = P^T o_rows^T
    if "o_bias" in w:
        out["o_bias"] = transform_writer_bias(w["o_bias"], P_o)

    if "q_norm" in w:
        order = np.concatenate([secrets.norm_order, secrets.norm_order + dh // 2])
        out["q_norm"] = (w["q_norm"] * _t(secrets.q_norm_scale, device=w["q_norm"].device))[_index(order, w["q_norm"])]
        out["k_norm"] = (w["k_norm"] * _t(secrets.k_norm_scale, device=w["k_norm"].device))[_index(order, w["k_norm"])]
    return out


# --- feed-forward --------------------------------------------------------------------------------------


def obfuscate_mlp(
    gate: Tensor, up: Tensor, down: Tensor, norm_weight: Tensor,
    Q_gate: np.ndarray, Q_up: np.ndarray, P_down: np.ndarray,
    ffn_perm: np.ndarray, ffn_scale: np.ndarray, compute_dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor]:
    """W~_gate = Q diag(w) W_gate Z, W~_up = Q diag(w) W_up H Z, W~_down = Z^T H^-1 W_down P.

    SiLU acts elementwise, so a permutation Z commutes with it; H scales only the up branch, which enters
    the Hadamard product linearly. The three products are independent: mlp_reader / mlp_writer compute one each
    (the pipeline reads, transforms and hands on one matrix at a time)."""
    return (mlp_reader(gate, norm_weight, Q_gate, ffn_perm, None, compute_dtype),
            mlp_reader(up, norm_weight, Q_up, ffn_perm, ffn_scale, compute_dtype),
            mlp_writer(down, P_down, ffn_perm, ffn_scale, compute_dtype))


def mlp_reader(weight: Tensor, norm_weight: Tensor, Q: np.ndarray, ffn_perm: np.ndarray,
               ffn_scale: np.ndarray | None, compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """The gate (``ffn_scale`` None) or up projection of obfuscate_mlp: Q diag(w) W Z (H for up).

    Z and H act on the intermediate units: the plain weight (d wide) is permuted and scaled before the product
    (D wide) rather than the product gathered afterwards; the result is the same matrix. The weight may come in its
    stored precision: gathering first moves half the bytes, and the conversion to the compute dtype (exact when it
    is float64) happens in the same pass as the scaling."""
    perm = _index(ffn_perm, weight)
    rows = weight.index_select(0, perm).to(compute_dtype)
    if ffn_scale is not None:
        rows = rows * _t(ffn_scale, compute_dtype, weight.device)[perm][:, None]
    return transform_reader_input(rows, norm_weight, Q)


def mlp_writer(down: Tensor, P: np.ndarray, ffn_perm: np.ndarray, ffn_scale: np.ndarray,
               compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """The down projection of obfuscate_mlp: Z^T H^-1 W_down P."""
    perm = _index(ffn_perm, down)
    scale = _t(ffn_scale, compute_dtype, down.device)[perm]
    return transform_writer_output(down.index_select(1, perm).to(compute_dtype) / scale[None, :], P)


# --- mixture of experts ----------------------------------------------------------------------------------


def obfuscate_router(weight: Tensor, norm_weight: Tensor, Q: np.ndarray, expert_order: np.ndarray,
                     normalize: bool = False) -> Tensor:
    """W~_router = Q diag(w) W_router' Z_router: new expert slot s holds old expert expert_order[s].

    ``normalize`` is the paper's variant: each expert's router vector is scaled to unit norm first. That changes
    the router logits, hence which experts are chosen (measured in docs/moe-mla.md); off by default.
    """
    w = weight
    if normalize:
        w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-30)
    out = transform_reader_input(w, norm_weight, Q)
    return out[_index(expert_order, out)]


# --- multi-head latent attention (DeepSeek-V2/V3) ---------------------------------------------------------


@dataclass(frozen=True)
class MLASecrets:
    """Secrets of one MLA layer (math layout: row vectors times matrices).

    head_order[s]  old head placed in new head slot s (all heads share the latent kv and the rope key)
    q_latent       orthogonal map of the q latent (q_lora_rank); None without q_lora. RMS-preserving, so the
                   q_a_layernorm stays exact; its weight moves into q_b
    kv_latent      orthogonal map of the compressed kv latent (kv_lora_rank), same reasoning for kv_a_layernorm
    nope_maps[i]   invertible (d_nope x d_nope) map of old head i's non-rotary q/k part: q gets M, k gets M^-T
    rope_q/rope_k  (d_rope x d_rope) maps of the rotary part, R H Zb and R H^-1 Zb; shared by all heads because
                   the rotary key is one vector shared by every head (MQA-style)
    v_maps[i]      invertible (d_v x d_v) map of old head i's value; o gets its inverse
    """

    head_order: np.ndarray
    q_latent: np.ndarray | None
    kv_latent: np.ndarray
    nope_maps: list[np.ndarray]
    rope_q: np.ndarray
    rope_k: np.ndarray
    v_maps: list[np.ndarray]


def _per_head_columns(w_math: Tensor, num_heads: int, widths: tuple[int, ...], maps: list[list[np.ndarray]],
                      head_order: np.ndarray) -> Tensor:
    """Columns of ``w_math`` are heads of ``sum(widths)`` dims split into parts; part p of old head i is multiplied
    by maps[i][p]; heads are then reordered (new slot s = old head head_order[s])."""
    per = sum(widths)
    blocks = w_math.reshape(w_math.shape[0], num_heads, per)
    out = []
    for i in head_order:
        parts, start = [], 0
        for p, width in enumerate(widths):
            parts.append(blocks[:, i, start:start + width] @ _t(maps[i][p]))
            start += width
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=1)


def obfuscate_mla(
    w: dict[str, Tensor], norm_weight: Tensor, Q_q: np.ndarray, Q_kv: np.ndarray, P_o: np.ndarray,
    secrets: MLASecrets, num_heads: int, nope_dim: int, rope_dim: int, v_dim: int, kv_rank: int,
) -> dict[str, Tensor]:
    """Covariant obfuscation of one MLA layer (design and proof: docs/moe-mla.md).

    ``w`` (HF layout) holds q_a/q_a_norm/q_b (or q), kv_a/kv_a_norm/kv_b, o and optional q_a/kv_a/o biases.
    Returns the same keys; the inner norm weights come back as ones (they are fused into q_b / kv_b).
    """
    out: dict[str, Tensor] = {}
    nope_inv_t = [np.linalg.inv(m).T for m in secrets.nope_maps]
    q_maps = [[secrets.nope_maps[i], secrets.rope_q] for i in range(num_heads)]
    if "q_a" in w:
        O = _t(secrets.q_latent)
        out["q_a"] = O.T @ transform_reader_input(w["q_a"], norm_weight, Q_q)  # math: Q diag(w) W_qa O
        if "q_a_bias" in w:
            out["q_a_bias"] = w["q_a_bias"] @ O
        out["q_a_norm"] = torch.ones_like(w["q_a_norm"])
        qb_math = O.T @ (w["q_b"] * w["q_a_norm"][None, :]).T  # math: O^T diag(w_qa) W_qb
        out["q_b"] = _per_head_columns(qb_math, num_heads, (nope_dim, rope_dim), q_maps, secrets.head_order).T.contiguous()
    else:
        q_math = transform_reader_input(w["q"], norm_weight, Q_q).T
        out["q"] = _per_head_columns(q_math, num_heads, (nope_dim, rope_dim), q_maps, secrets.head_order).T.contiguous()

    kv_math = transform_reader_input(w["kv_a"], norm_weight, Q_kv).T  # (D, kv_rank + rope_dim)
    Okv = _t(secrets.kv_latent)
    out["kv_a"] = torch.cat([kv_math[:, :kv_rank] @ Okv, kv_math[:, kv_rank:] @ _t(secrets.rope_k)], dim=1).T.contiguous()
    if "kv_a_bias" in w:
        b = w["kv_a_bias"]
        out["kv_a_bias"] = torch.cat([b[:kv_rank] @ Okv, b[kv_rank:] @ _t(secrets.rope_k)])
    out["kv_a_norm"] = torch.ones_like(w["kv_a_norm"])
    kvb_math = Okv.T @ (w["kv_b"] * w["kv_a_norm"][None, :]).T  # (kv_rank, H (nope + v))
    kv_maps = [[nope_inv_t[i], secrets.v_maps[i]] for i in range(num_heads)]
    out["kv_b"] = _per_head_columns(kvb_math, num_heads, (nope_dim, v_dim), kv_maps, secrets.head_order).T.contiguous()

    o_math = w["o"].T.reshape(num_heads, v_dim, -1)  # rows of head i
    o_rows = torch.cat([_t(np.linalg.inv(secrets.v_maps[i])) @ o_math[i] for i in secrets.head_order])
    out["o"] = (o_rows @ _t(P_o)).T.contiguous()
    if "o_bias" in w:
        out["o_bias"] = transform_writer_bias(w["o_bias"], P_o)
    return out


# --- head padding for engines that derive head_dim from hidden_size -------------------------------------


def padded_rope_theta(theta: float, head_dim: int, padded_dim: int) -> float:
    """RoPE base for padded heads: pair j of a padded head turns at theta'^(-2j/hd') = theta^(-2j/hd), the
    frequency of the original pair j, when theta' = theta^(hd'/hd)."""
    return float(theta) ** (padded_dim / head_dim)


def pad_attention_heads(attn: dict[str, Tensor], num_heads: int, num_kv_heads: int, head_dim: int, padded_dim: int,
                        rng: np.random.Generator) -> dict[str, Tensor]:
    """Widen every head from ``head_dim`` to ``padded_dim`` = hidden_size / num_heads (exactly).

    For engines whose attention derives head_dim = hidden_size // num_heads (vLLM/SGLang Qwen2-MoE): the original
    dims of a head go to [0, hd/2) and [hd'/2, hd'/2 + hd/2), so Hugging Face's (j, j + hd'/2) RoPE pairing keeps
    pair j with the frequency of padded_rope_theta; k and v get zero rows in the new dims (so the new dims add
    nothing to q.k or to the output) while q and o get random ones there, and q is scaled by sqrt(hd'/hd) to keep
    the 1/sqrt(head_dim) attention scaling. The zero rows show the server which dims are padding, nothing more.
    """
    half, phalf = head_dim // 2, padded_dim // 2
    place = torch.from_numpy(np.concatenate([np.arange(half), phalf + np.arange(half)]))
    q_scale = float(np.sqrt(padded_dim / head_dim))

    def pad_rows(t: Tensor, n: int, random_fill: bool, scale: float = 1.0) -> Tensor:
        blocks = (t * scale).reshape(n, head_dim, *t.shape[1:])
        if random_fill:
            std = float(blocks.std()) if blocks.numel() > 1 else 1.0
            out = torch.from_numpy(rng.standard_normal((n, padded_dim, *t.shape[1:])) * std).to(t.dtype)
        else:
            out = torch.zeros((n, padded_dim, *t.shape[1:]), dtype=t.dtype)
        out[:, place] = blocks
        return out.reshape(n * padded_dim, *t.shape[1:])

    out = dict(attn)
    out["q"] = pad_rows(attn["q"], num_heads, True, q_scale)
    out["k"] = pad_rows(attn["k"], num_kv_heads, False)
    out["v"] = pad_rows(attn["v"], num_kv_heads, False)
    if "q_bias" in attn:
        out["q_bias"] = pad_rows(attn["q_bias"], num_heads, True, q_scale)
    for r in ("k_bias", "v_bias"):
        if r in attn:
            out[r] = pad_rows(attn[r], num_kv_heads, False)
    out["o"] = pad_rows(attn["o"].T, num_heads, True).T.contiguous()
    return out
