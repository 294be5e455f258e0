"""The shape of a model as the obfuscation sees it (widths, heads, RoPE, MLA ranks), and the expanded width."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelShape:
    d: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_base: float
    qk_norm: bool
    # multi-head latent attention (DeepSeek); zero when absent
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False


def effective_h(d: int, h: int, num_heads: int) -> int:
    """Smallest even h' >= h such that num_heads divides d + 2h' (transformers requires it, even with an
    explicit head_dim)."""
    hh = h
    while (d + 2 * hh) % num_heads:
        hh += 1
    return hh if hh % 2 == 0 else effective_h(d, hh + 1, num_heads)
