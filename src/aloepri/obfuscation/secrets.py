"""Sampling of every secret of one obfuscation, each from its own labelled stream of the seed.

The seed is the whole key: every matrix and permutation is a deterministic function of it. It therefore comes
from the operating system's CSPRNG (256 bits) unless a caller explicitly asks for a reproducible, insecure one.
"""
from __future__ import annotations

import os

import numpy as np

from . import keymat
from .params import ObfuscationParams
from .shape import ModelShape, effective_h
from .transforms import (AttentionSecrets, MLASecrets, pair_permutation_matrix, pair_scaling,
                         rope_pair_rotation)


SEED_BITS = 256  # entropy of a fresh seed
MIN_SEED_BITS = 128  # an explicit seed below 2**(MIN_SEED_BITS - 1) is "short": a search over it is feasible


def fresh_seed() -> int:
    """A new secret seed from the OS CSPRNG."""
    return int.from_bytes(os.urandom(SEED_BITS // 8), "big")


def resolve_seed(seed: int | None, allow_weak_seed: bool = False) -> int:
    """The seed an obfuscation uses: a fresh CSPRNG seed when ``seed`` is None; an explicit seed must be a
    non-negative integer of at least MIN_SEED_BITS bits unless ``allow_weak_seed`` (reproducible but insecure:
    anyone can try every small seed against the public server files, as docs/security.md shows)."""
    if seed is None:
        return fresh_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        what = "a negative integer" if isinstance(seed, int) and not isinstance(seed, bool) else type(seed).__name__
        raise ValueError(f"seed must be a non-negative integer, got {what}")  # the value is not echoed: a secret
    if seed.bit_length() < MIN_SEED_BITS and not allow_weak_seed:
        raise ValueError(
            f"the seed has {seed.bit_length()} bits, fewer than {MIN_SEED_BITS}: anyone holding the server files "
            "can recover the whole key by trying small seeds; omit --seed for a fresh 256-bit secret, or pass "
            "--allow-weak-seed (API: allow_weak_seed=True) if you want a reproducible, INSECURE key for a test")
    return seed


def expert_order(seed: int, layer: int, num_experts: int, groups: int = 1) -> np.ndarray:
    """Z_router of one MoE layer (see SecretSampler.expert_order); a function of the seed alone, so the key holder
    can map routing decisions without the model's shape."""
    if num_experts % groups:
        raise ValueError(f"{num_experts} experts do not split into {groups} groups")
    rng = keymat.derive_rng(seed, "experts", layer)
    size = num_experts // groups
    group_order = rng.permutation(groups)
    return np.concatenate([g * size + rng.permutation(size) for g in group_order])


class SecretSampler:
    """All secrets of one (seed, params, shape). Calling a method twice returns the same secret."""

    def __init__(self, seed: int, params: ObfuscationParams, shape: ModelShape, outlier_dims: tuple = ()):
        """``outlier_dims``: the residual dimensions kept out of the key's mixing (params.outlier_dims of them,
        chosen from the weights by :func:`aloepri.obfuscation.pipeline.massive_activation_dims`, or those
        params.outlier_rms picks: :func:`aloepri.obfuscation.pipeline.kept_dimensions`)."""
        self.seed, self.params, self.shape = int(seed), params, shape
        if not params.outlier_rms and len(outlier_dims) != params.outlier_dims:
            raise ValueError(f"params ask for {params.outlier_dims} outlier dimensions, {len(outlier_dims)} given")
        self.h = effective_h(shape.d, params.h, shape.num_heads)
        self.base = keymat.init_key_base(self.rng("base"), shape.d, self.h, params.lam, params.e_scale,
                                         kept=tuple(outlier_dims))
        C = keymat.sample_C(self.rng("C", "shared"), self.base, params.c_scale)
        # P and Q's common part (every reader needs it) are independent products: side by side
        self._shared_P, self._Q_common = keymat.run_side_by_side(lambda: keymat.key_matrix(self.base, C),
                                                                 self._common_Q)
        self._P_common: np.ndarray | None = None

    def rng(self, *labels: object) -> np.random.Generator:
        return keymat.derive_rng(self.seed, *labels)

    @property
    def kept_columns(self) -> dict[int, int]:
        """Kept residual dimension -> the one server coordinate it maps to (row i of Z is one-hot there)."""
        return {int(i): int(np.flatnonzero(self.base.Z[i])[0]) for i in self.base.kept}

    @property
    def hidden_size(self) -> int:
        return self.shape.d + 2 * self.h

    def vocab_permutation(self) -> np.ndarray:
        return keymat.random_permutation(self.rng("vocab"), self.shape.vocab_size)

    def writer_P(self, *labels: object) -> np.ndarray:
        if self.params.shared_c:
            return self._shared_P
        # fresh C per writer: P = s([B 0 E] Z) + s C Z[d:d+h], the first term shared by all writers
        b = self.base
        C = keymat.sample_C(self.rng("C", *labels), b, self.params.c_scale)
        if self._P_common is None:
            self._P_common = keymat.key_matrix(b, np.zeros_like(C))
        return self._P_common + b.scale * (C @ b.Z[b.d: b.d + b.h])

    def reader_Q(self, *labels: object) -> np.ndarray:
        """Q = Z^T [B^-1; F; D] / s with a fresh D per reader. Only D differs between readers, so the common part
        is computed once: a reader then costs 2(d+2h)hd flops instead of 2(d+2h)^2 d (it matters with hundreds
        of experts per layer, each with two readers)."""
        b = self.base
        D = keymat.sample_D(self.rng("D", *labels), b)
        return self._Q_common + (b.Z.T[:, b.d + b.h:] @ D) / b.scale

    def _common_Q(self) -> np.ndarray:
        """Z^T[:, :d+h] [B^-1; F] / s, the part of Q = Z^T [B^-1; F; D] / s that no reader's D changes."""
        b = self.base
        right = np.concatenate([b.B_inv, b.F], axis=0) if b.h else b.B_inv
        Q = b.Z.T[:, : b.d + b.h] @ right
        Q /= b.scale
        return Q

    def kappa(self, calibration_rows: np.ndarray | None = None) -> float:
        """Constant RMSNorm weight: kappa = sqrt(d/D) * E||xP|| / ||x||.

        'isotropic': x ~ N(0, I) gives E||xP||^2/||x||^2 = ||P||_F^2 / d. 'embedding': the mean ratio over the
        model's own embedding rows (real, anisotropic vectors). With C = E = 0 and lambda = 0 both equal 1.
        """
        P = self._shared_P
        d, D = self.shape.d, self.hidden_size
        if self.params.kappa_mode == "embedding" and calibration_rows is not None:
            x = calibration_rows
            ratio = float(np.mean(np.linalg.norm(x @ P, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-12)))
        else:
            ratio = float(np.sqrt((P * P).sum() / d))
        return float(np.sqrt(d / D) * ratio)

    def attention(self, layer: int) -> AttentionSecrets:
        s, p = self.shape, self.params
        G = s.num_heads // s.num_kv_heads
        half = s.head_dim // 2
        rng = self.rng("attn", layer)
        if p.head_permutation:
            kv_order = rng.permutation(s.num_kv_heads)
            group_orders = [rng.permutation(G) for _ in range(s.num_kv_heads)]
        else:
            kv_order = np.arange(s.num_kv_heads)
            group_orders = [np.arange(G) for _ in range(s.num_kv_heads)]

        def block_order() -> np.ndarray:
            return keymat.block_permutation(rng, half, p.beta, p.gamma, s.rope_base)

        q_maps, k_maps, vo_mix = [], [], []
        if s.qk_norm:
            # The per-head q/k RMSNorm weight is shared by all heads and sits between the projection and RoPE:
            # only maps commuting with an elementwise weight survive. Sign flips of a pair (rotation by pi) do;
            # H_qk and the block permutation move into the (shared) norm weights.
            order = block_order()
            Zb = pair_permutation_matrix(order)
            scales = keymat.log_uniform(rng, half, p.qk_scale_range)
            for g in range(s.num_kv_heads):
                R = rope_pair_rotation(np.pi * rng.integers(0, 2, half))
                q_maps.append(R @ Zb)
                k_maps.append(R @ Zb)
            full = np.concatenate([scales, scales])
            extra = dict(q_norm_scale=full, k_norm_scale=1.0 / full, norm_order=order)
        else:
            extra = {}
            for g in range(s.num_kv_heads):
                R = rope_pair_rotation(rng.uniform(0.0, 2 * np.pi, half))
                sc = np.concatenate([keymat.log_uniform(rng, half, p.qk_scale_range)] * 2)
                Zb = pair_permutation_matrix(block_order())
                q_maps.append(R @ np.diag(sc) @ Zb)
                k_maps.append(R @ np.diag(1.0 / sc) @ Zb)
        for g in range(s.num_kv_heads):
            vo_mix.append(self._vo_mixing(rng))
        return AttentionSecrets(kv_order, group_orders, q_maps, k_maps, vo_mix, **extra)

    def _vo_mixing(self, rng: np.random.Generator) -> np.ndarray:
        """U_vo: v gets U, o gets U^-1, so cond(U) multiplies the rounding error of low-precision v/o weights."""
        dh, p = self.shape.head_dim, self.params
        if p.vo_mixing == "gaussian":  # the paper's choice
            return rng.normal(0.0, 1.0 / np.sqrt(dh), (dh, dh))
        return self._conditioned(rng, dh, p.vo_scale_range)

    def mlp(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ffn(self.shape.intermediate_size, "mlp", layer)

    def ffn(self, size: int, *labels: object) -> tuple[np.ndarray, np.ndarray]:
        """Z_ffn (a permutation of the ``size`` hidden units) and H_ffn of one feed-forward block."""
        rng = self.rng(*labels)
        return rng.permutation(size), keymat.log_uniform(rng, size, self.params.ffn_scale_range)

    def expert_order(self, layer: int, num_experts: int, groups: int = 1) -> np.ndarray:
        """Z_router: new expert slot s holds old expert order[s]. With ``groups`` > 1 (DeepSeek's group-limited
        routing over consecutive experts) groups map onto groups: permute the groups, then inside each group."""
        return expert_order(self.seed, layer, num_experts, groups)

    def mla(self, layer: int) -> MLASecrets:
        s, p = self.shape, self.params
        rng = self.rng("mla", layer)
        heads = rng.permutation(s.num_heads) if p.head_permutation else np.arange(s.num_heads)
        q_latent = keymat.haar_orthogonal(rng, s.q_lora_rank) if s.q_lora_rank else None
        kv_latent = keymat.haar_orthogonal(rng, s.kv_lora_rank)
        nope = [self._conditioned(rng, s.qk_nope_head_dim, p.qk_scale_range) for _ in range(s.num_heads)]
        half = s.qk_rope_head_dim // 2
        R = rope_pair_rotation(rng.uniform(0.0, 2 * np.pi, half), s.rope_interleaved)
        H = keymat.log_uniform(rng, half, p.qk_scale_range)
        Zb = pair_permutation_matrix(keymat.block_permutation(rng, half, p.beta, p.gamma, s.rope_base),
                                     s.rope_interleaved)
        rope_q = R @ pair_scaling(H, s.rope_interleaved) @ Zb
        rope_k = R @ pair_scaling(1.0 / H, s.rope_interleaved) @ Zb
        v = [self._conditioned(rng, s.v_head_dim, p.vo_scale_range) for _ in range(s.num_heads)]
        return MLASecrets(heads, q_latent, kv_latent, nope, rope_q, rope_k, v)

    @staticmethod
    def _conditioned(rng: np.random.Generator, n: int, max_ratio: float) -> np.ndarray:
        """O1 diag(s) O2 with s log-uniform in [1/r, r]: invertible with condition number <= r^2."""
        singular = keymat.log_uniform(rng, n, max_ratio)  # drawn first: keeps the secrets of existing seeds
        return keymat.haar_orthogonal(rng, n) @ np.diag(singular) @ keymat.haar_orthogonal(rng, n)
