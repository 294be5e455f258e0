"""Per-kind obfuscation of the model's blocks: the vocabulary matrices (embedding, head), and in every decoder
layer attention (GQA or MLA) and feed-forward (dense or MoE).

The pipeline driver asks ``attention_kind(spec)`` and ``feed_forward_kind(source, layer)`` for a strategy and
never branches on the architecture itself. A new attention or feed-forward kind is one class here plus its
pure transform in transforms.py (see docs/architecture.md).

Every block reads its weights on the CPU, runs its products on the context's device and hands its outputs back
on the CPU in the output dtype; the secrets are always drawn on the CPU (secrets.py), so a key gives the same
model on every device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .archs import ArchSpec, UnsupportedArchitectureError
from .params import ObfuscationParams
from .secrets import SecretSampler
from .transforms import (mlp_reader, mlp_writer, obfuscate_attention, obfuscate_embedding_blocks,
                         obfuscate_head_blocks, obfuscate_mla, obfuscate_router, pad_attention_heads,
                         split_norm_weight, transform_reader_input)

Put = Callable[..., None]  # put(role, tensor, part="weight", expert=None): writes one output tensor


@dataclass
class LayerContext:
    """What every block transform of one model needs: the source reader, the secrets, the output writer."""
    source: Any  # checkpoint.SourceCheckpoint
    secrets: SecretSampler
    shape: Any  # shape.ModelShape
    spec: ArchSpec
    params: ObfuscationParams
    has_qkv_bias: bool
    put: Put
    reader_norms: dict[str, Any]  # "attn_norm"/"ffn_norm" -> the RMSNorm weight its readers fold (split_norm_weight)
    compute_dtype: torch.dtype = torch.float64  # dtype of the big products (pipeline.product_dtype)
    device: torch.device = torch.device("cpu")  # where the products run


def linear_flops(D: int, *weights: torch.Tensor) -> float:
    """A reader (out, d) -> (out, D) or writer (d, in) -> (D, in) transform costs 2 * numel * D."""
    return float(sum(2.0 * w.numel() * D for w in weights))


def _biases(source, i: int, roles: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {f"{r}_bias": source.get(r, i, "bias") for r in roles if source.has(r, i, "bias")}


def _put_all(put: Put, tensors: dict[str, torch.Tensor]) -> None:
    """Write transform outputs keyed by role ("q") or role + "_bias" ("q_bias")."""
    for key, tensor in tensors.items():
        if key.endswith("_bias"):
            put(key[:-5], tensor, "bias")
        else:
            put(key, tensor)


# --- attention --------------------------------------------------------------------------------------------------

class _OneStep:
    """A block whose outputs come all at once: ``steps`` yields its FLOPs once, after every ``put``."""

    def steps(self, ctx: LayerContext, i: int) -> Iterator[float]:
        yield self.obfuscate(ctx, i)


class GQAAttention(_OneStep):
    """Multi-head, grouped-query and multi-query attention: q/k/v/o projections (optionally with q/k norms)."""

    def shape_fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return {"head_dim": int(cfg.get("head_dim") or d // heads)}

    def config_fields(self, shape) -> dict[str, Any]:
        return {"head_dim": shape.head_dim}

    def obfuscate(self, ctx: LayerContext, i: int) -> float:
        source, secrets, shape, spec = ctx.source, ctx.secrets, ctx.shape, ctx.spec
        w = {r: source.get(r, i, dtype=ctx.compute_dtype).to(ctx.device) for r in ("q", "k", "v", "o")}
        w.update(_biases(source, i, ("q", "k", "v", "o")))
        if spec.qk_norm:
            w["q_norm"] = source.get("q_norm", i)
            w["k_norm"] = source.get("k_norm", i)
        flops = linear_flops(secrets.hidden_size, *(w[r] for r in ("q", "k", "v", "o")))
        attn = obfuscate_attention(
            w, ctx.reader_norms["attn_norm"], secrets.reader_Q("q", i), secrets.reader_Q("k", i),
            secrets.reader_Q("v", i), secrets.writer_P("o", i), secrets.attention(i), shape.num_heads,
            shape.num_kv_heads, shape.head_dim,
        )
        if spec.pad_heads:
            attn = {k: t.cpu() for k, t in attn.items()}  # the padding draws its fill on the CPU
            attn = pad_attention_heads(attn, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                       secrets.hidden_size // shape.num_heads, secrets.rng("head-padding", i))
        if ctx.has_qkv_bias and spec.attention_bias_with_o and "o_bias" not in attn:
            # the output's attention_bias switch also declares o_proj.bias; a source without one gets zeros
            attn["o_bias"] = torch.zeros(attn["o"].shape[0], dtype=torch.float64)
        _put_all(ctx.put, attn)
        return flops


class MLAAttention(_OneStep):
    """DeepSeek's multi-head latent attention: low-rank q (q_a/q_b or q), joint kv_a/kv_b, decoupled RoPE part."""

    def shape_fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return dict(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                    qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                    v_head_dim=int(cfg["v_head_dim"]), head_dim=int(cfg["qk_rope_head_dim"]),
                    # DeepSeek-V2 always rotates adjacent pairs; V3 does when rope_interleave (its default)
                    rope_interleaved=bool(cfg.get("rope_interleave", True)))

    def config_fields(self, shape) -> dict[str, Any]:
        return {}  # MLA's head dims are its own config keys (passed through); head_dim is derived

    def obfuscate(self, ctx: LayerContext, i: int) -> float:
        # float64 whatever ctx.compute_dtype, and on the CPU whatever ctx.device: float32 MLA products were never
        # measured against a real MLA model, and the attention is a small part of an MLA model's weights
        source, secrets, shape = ctx.source, ctx.secrets, ctx.shape
        roles = [r for r in source.attention_roles(i) if r != "attn_norm"]
        w = {r: source.get(r, i) for r in roles}
        w.update(_biases(source, i, ("q_a", "kv_a", "o")))
        flops = linear_flops(secrets.hidden_size, *(w[r] for r in ("q_a", "q", "kv_a", "o") if r in w))
        q_reader = "q_a" if "q_a" in w else "q"
        attn = obfuscate_mla(
            w, ctx.reader_norms["attn_norm"], secrets.reader_Q(q_reader, i), secrets.reader_Q("kv_a", i),
            secrets.writer_P("o", i), secrets.mla(i), shape.num_heads, shape.qk_nope_head_dim,
            shape.qk_rope_head_dim, shape.v_head_dim, shape.kv_lora_rank,
        )
        _put_all(ctx.put, attn)
        return flops


ATTENTION_KINDS = {"gqa": GQAAttention(), "mla": MLAAttention()}


def attention_kind(spec: ArchSpec):
    try:
        return ATTENTION_KINDS[spec.attention]
    except KeyError:
        raise UnsupportedArchitectureError(f"{spec.name}: unknown attention kind {spec.attention!r}") from None


# --- feed-forward -----------------------------------------------------------------------------------------------

def swiglu_block(ctx: LayerContext, i: int, size: int, label: str, roles: tuple[str, str, str],
                 expert: int | None = None, slot: int | None = None) -> float:
    """One SwiGLU block (a dense MLP, a shared expert or a routed expert): Z_ffn and H_ffn of its own.
    A routed expert is read under its stored index ``expert`` and written into its new ``slot``. One matrix is read,
    transformed and handed on at a time: a 70B feed-forward matrix is 0.9 GB in float32."""
    source, secrets, put = ctx.source, ctx.secrets, ctx.put
    gate_r, up_r, down_r = roles
    labels = (label, i) if expert is None else (label, i, expert)
    perm, scale = secrets.ffn(size, *labels)
    norm = ctx.reader_norms["ffn_norm"]
    flops = 0.0
    for role, scaled in ((gate_r, False), (up_r, True)):
        w = source.get(role, i, expert=expert, dtype=None).to(ctx.device)  # stored precision, converted after the gather
        flops += linear_flops(secrets.hidden_size, w)
        put(role, mlp_reader(w, norm, secrets.reader_Q(role, *labels[1:]), perm, scale if scaled else None,
                             ctx.compute_dtype), expert=slot)
        del w
    w = source.get(down_r, i, expert=expert, dtype=None).to(ctx.device)
    flops += linear_flops(secrets.hidden_size, w)
    put(down_r, mlp_writer(w, secrets.writer_P(down_r, *labels[1:]), perm, scale, ctx.compute_dtype), expert=slot)
    return flops


class DenseFeedForward(_OneStep):
    def obfuscate(self, ctx: LayerContext, i: int) -> float:
        return swiglu_block(ctx, i, int(ctx.source.config["intermediate_size"]), "mlp", ("gate", "up", "down"))


class MoEFeedForward:
    """Router (input-side key matrix, experts permuted by Z_router), every routed expert as a dense SwiGLU block
    in its new slot, the shared expert(s) and the shared expert's gate. One expert in memory at a time: ``steps``
    yields after every expert, so the driver can hand its outputs on before the next one is read."""

    def obfuscate(self, ctx: LayerContext, i: int) -> float:
        return sum(self.steps(ctx, i))

    def steps(self, ctx: LayerContext, i: int) -> Iterator[float]:
        source, secrets, put, params = ctx.source, ctx.secrets, ctx.put, ctx.params
        moe, cfg = ctx.spec.moe, source.config
        n = source.num_experts
        groups = int(cfg.get(moe.expert_groups_key) or 1) if moe.expert_groups_key else 1
        order = secrets.expert_order(i, n, groups)
        ffn_norm = ctx.reader_norms["ffn_norm"]
        router = source.get("router", i).to(ctx.device)
        put("router", obfuscate_router(router, ffn_norm, secrets.reader_Q("router", i), order,
                                       normalize=params.router_normalize))
        if moe.router_bias:
            put("router_bias", source.get("router_bias", i)[torch.from_numpy(order)])
        yield linear_flops(secrets.hidden_size, router)
        size = int(cfg[moe.expert_intermediate_key])
        for slot, old in enumerate(order):
            yield swiglu_block(ctx, i, size, "expert", ("expert_gate", "expert_up", "expert_down"),
                               expert=int(old), slot=slot)
        if moe.shared_expert:
            yield swiglu_block(ctx, i, moe.shared_intermediate_size(cfg), "shared",
                               ("shared_gate", "shared_up", "shared_down"))
        if moe.shared_expert_gate:
            g = source.get("shared_expert_gate", i).to(ctx.device)
            put("shared_expert_gate", transform_reader_input(g, ffn_norm, secrets.reader_Q("shared_expert_gate", i)))
            yield linear_flops(secrets.hidden_size, g)


DENSE, MOE = DenseFeedForward(), MoEFeedForward()


def feed_forward_kind(source, layer: int):
    return MOE if source.is_moe_layer(layer) else DENSE


# --- vocabulary matrices ----------------------------------------------------------------------------------------

@dataclass
class StreamedTensor:
    """An output tensor too large to hold whole: its name, shape and dtype up front, then its rows in blocks
    (CPU tensors, in order). A writer must consume ``blocks`` before it asks for the next output tensor."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Iterator[torch.Tensor]



class VocabularyBlocks:
    """The embedding (rows permuted, noise, times the writer key P) and the head (the final norm's reader part,
    the reader key Q, rows permuted) plus the final norm the server keeps. ``plan`` is the pipeline's
    ObfuscationPlan; FLOPs are added to ``plan.flops``. Only the stored-precision source matrix is whole in
    memory; the result streams out in row blocks."""

    def embedding(self, plan) -> Iterator[Any]:
        secrets, params = plan.secrets, plan.params
        embed = plan.source.get("embed", dtype=None)  # stored precision; converted block by block
        factor = plan.noise_factors[0] if plan.noise_factors is not None and params.alpha_e > 0 else None
        plan.flops += 2.0 * embed.shape[0] * plan.shape.d * secrets.hidden_size
        yield StreamedTensor(plan.spec.hf_names.of("embed"), (embed.shape[0], secrets.hidden_size), plan.out_dtype,
                             obfuscate_embedding_blocks(embed, plan.vocab_perm, secrets.writer_P("embed"),
                                                        params.alpha_e, secrets.rng("noise", "embed"), plan.out_dtype,
                                                        params.noise_shape, factor, plan.compute_dtype, plan.device))

    def head(self, plan) -> Iterator[Any]:
        source, secrets, params = plan.source, plan.secrets, plan.params
        D = secrets.hidden_size
        head = source.get("embed" if source.tied_embeddings else "head", dtype=None)
        server_norm, reader_norm = split_norm_weight(source.get("final_norm"), plan.kappa, secrets.kept_columns, D)
        factor = plan.noise_factors[1] if plan.noise_factors is not None and params.alpha_h > 0 else None
        plan.flops += 2.0 * head.shape[0] * plan.shape.d * D
        yield StreamedTensor(plan.spec.hf_names.of("head"), (head.shape[0], D), plan.out_dtype,
                             obfuscate_head_blocks(head, reader_norm, plan.vocab_perm, secrets.reader_Q("head"),
                                                   params.alpha_h, secrets.rng("noise", "head"), plan.out_dtype,
                                                   params.noise_shape, factor, plan.compute_dtype, plan.device))
        yield plan.spec.hf_names.of("final_norm"), server_norm.to(plan.out_dtype)


VOCABULARY = VocabularyBlocks()
