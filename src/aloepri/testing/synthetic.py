"""Random-weight checkpoints with the published widths of real model families, written shard by shard.

``write_synthetic_checkpoint("llama-3.1-8b", directory, num_layers=2)`` writes a Hugging Face safetensors
directory whose config.json carries the published values of Llama-3.1-8B (hidden size, heads, feed-forward and
vocabulary width, RoPE) with fewer decoder layers, so obfuscation time and memory can be measured at full width
on a machine that holds neither the real weights nor the real depth. Every tensor is drawn in row blocks and
streamed into its shard (storage/safetensors_stream.py): memory stays at one block whatever the model's size.

The weights are Gaussian with the scale a trained model's have (std 0.02, the families' ``initializer_range``;
norm weights near 1), so products and their rounding behave as on the real model. They are not a language model:
equivalence checks compare the obfuscated model's logits with this plaintext's, nothing more.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch

from ..obfuscation.archs import fp8_weight_pattern, role_shapes, spec_for_hf
from ..obfuscation.fp8 import RELEASE_BLOCK, SCALE_SUFFIX, BlockFp8, quantize_blockwise, scale_name
from ..storage.safetensors_dir import INDEX_FILE
from ..storage.safetensors_stream import StreamedFile

# config.json values as published with each model (bf16 releases; DeepSeek-V3.1 is released in FP8 and carries a
# quantization_config there, which write_synthetic_checkpoint(dtype="fp8") adds)
_LLAMA31 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
    bos_token_id=128000, eos_token_id=128001, hidden_act="silu", initializer_range=0.02,
    max_position_embeddings=131072, mlp_bias=False, pretraining_tp=1, rms_norm_eps=1e-05,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=128256,
)
_QWEN3 = dict(
    attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128,
    hidden_act="silu", initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-06,
    rope_scaling=None, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, use_sliding_window=False, vocab_size=151936,
)
_QWEN3_MOE = dict(
    _QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, num_experts=128, num_experts_per_tok=8, output_router_logits=False,
    router_aux_loss_coef=0.001,
)

PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(_LLAMA31, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_hidden_layers=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA31, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                          num_hidden_layers=80, num_key_value_heads=8),
    "qwen2.5-14b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151643, hidden_act="silu", hidden_size=5120, initializer_range=0.02, intermediate_size=13824,
        max_position_embeddings=131072, max_window_layers=48, num_attention_heads=40, num_hidden_layers=48,
        num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=131072,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
        vocab_size=152064),
    "qwen3-32b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=5120,
                      intermediate_size=25600, max_window_layers=64, num_attention_heads=64, num_hidden_layers=64,
                      num_key_value_heads=8),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, max_window_layers=48,
                          moe_intermediate_size=768, num_attention_heads=32, num_hidden_layers=48,
                          num_key_value_heads=4),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, max_window_layers=94,
                            moe_intermediate_size=1536, num_attention_heads=64, num_hidden_layers=94,
                            num_key_value_heads=4),
    "deepseek-v3.1": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=1, first_k_dense_replace=3, hidden_act="silu",
        hidden_size=7168, initializer_range=0.02, intermediate_size=18432, kv_lora_rank=512,
        max_position_embeddings=163840, moe_intermediate_size=2048, moe_layer_freq=1, n_group=8,
        n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128,
        num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128, num_nextn_predict_layers=1,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False,
        topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16", use_cache=True, v_head_dim=128,
        vocab_size=129280),
}
FAMILIES = tuple(PUBLISHED_CONFIGS)

WEIGHT_STD = 0.02  # the families' initializer_range; trained weights have about this scale
_BLOCK_ELEMENTS = 1 << 24  # rows drawn per block: 16M values, 64 MB in float32


def synthetic_config(family: str, num_layers: int | None = None, vocab_size: int | None = None,
                     num_experts: int | None = None) -> dict[str, Any]:
    """The published config of ``family`` with its depth, vocabulary or routed-expert count reduced."""
    if family not in PUBLISHED_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {list(FAMILIES)}")
    cfg = json.loads(json.dumps(PUBLISHED_CONFIGS[family]))
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = min(cfg["max_window_layers"], num_layers)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
        for k in ("bos_token_id", "eos_token_id"):
            cfg[k] = min(cfg[k], vocab_size - 1)
    if num_experts is not None:
        moe = spec_for_hf(cfg["architectures"]).moe
        key = next((k for k in moe.num_experts_keys if k in cfg), None) if moe is not None else None
        if key is None:
            raise ValueError(f"{family} has no routed experts")
        groups = int(cfg.get(moe.expert_groups_key) or 1) if moe.expert_groups_key else 1
        if num_experts % groups:
            raise ValueError(f"{family} routes over {groups} expert groups; num_experts must be a multiple of it")
        cfg[key] = num_experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], num_experts)
        if "topk_group" in cfg:  # DeepSeek picks topk_group groups, then experts inside them
            per_group = num_experts // groups
            cfg["topk_group"] = max(cfg["topk_group"], -(-cfg["num_experts_per_tok"] // per_group))
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a checkpoint with config ``cfg`` (Hugging Face names and layouts), in file order: what the
    architecture's ArchSpec says its layers hold (roles, biases, MoE routing), shaped by the config."""
    spec = spec_for_hf(cfg["architectures"])
    names, shapes, biased = spec.hf_names, role_shapes(spec, cfg), spec.biased_roles(cfg)
    yield names.of("embed"), shapes["embed"]
    for i in range(cfg["num_hidden_layers"]):
        roles = spec.attention_roles(cfg) + spec.mlp_roles(cfg, i)
        if spec.is_moe_layer(cfg, i) and spec.moe.router_bias:  # DeepSeek-V3's selection-only routing bias
            roles.insert(roles.index("router") + 1, "router_bias")
        for role in roles:
            role, expert = role if isinstance(role, tuple) else (role, None)
            yield names.of(role, i, expert=expert), shapes[role]
            if role in biased:
                yield names.of(role, i, "bias", expert), shapes[role][:1]
    yield names.of("final_norm"), shapes["final_norm"]
    yield names.of("head"), shapes["head"]


def _draw(name: str, shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Row blocks of one tensor: norms near 1, biases and weights N(0, WEIGHT_STD)."""
    if len(shape) == 1:
        if "norm" in name:
            yield (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
        else:  # biases, DeepSeek's routing correction bias
            yield (WEIGHT_STD * torch.randn(shape, generator=generator)).to(dtype)
        return
    rows = max(1, _BLOCK_ELEMENTS // shape[1])
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        yield (WEIGHT_STD * torch.randn((n, shape[1]), generator=generator)).to(dtype)


def _fp8_entries(name: str, shape: tuple[int, ...], quantized) -> list[tuple[str, str, tuple[int, ...]]]:
    """The stored tensors of one weight in an FP8 release: float8 values and their float32 block scales for the
    quantized linear weights, bf16 for the rest (embedding, head, norms, routers, biases)."""
    if quantized.fullmatch(name):
        return [(name, "float8_e4m3fn", shape), (scale_name(name), "float32", BlockFp8(RELEASE_BLOCK).scale_shape(shape))]
    return [(name, "bfloat16", shape)]


def _draw_fp8(name: str, shape: tuple[int, ...], generator: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, block) of one quantized weight: its row blocks, drawn in bands of whole 128-row blocks and
    quantized as the releases are (quantize_blockwise), then its scales."""
    rows = max(RELEASE_BLOCK[0], _BLOCK_ELEMENTS // shape[1] // RELEASE_BLOCK[0] * RELEASE_BLOCK[0])
    scales = []
    for start in range(0, shape[0], rows):
        n = min(rows, shape[0] - start)
        q, s = quantize_blockwise(WEIGHT_STD * torch.randn((n, shape[1]), generator=generator), RELEASE_BLOCK)
        scales.append(s)
        yield name, q
    yield scale_name(name), torch.cat(scales)


def write_synthetic_checkpoint(family: str, directory: str | Path, num_layers: int | None = None,
                               vocab_size: int | None = None, num_experts: int | None = None,
                               dtype: str = "bfloat16", seed: int = 0, max_shard_bytes: int = 2 << 30) -> Path:
    """Write a random-weight checkpoint of ``family`` (see PUBLISHED_CONFIGS) into ``directory`` (created; it must
    not hold a checkpoint already). Full width; ``num_layers`` / ``vocab_size`` / ``num_experts`` reduce depth,
    vocabulary (for an equivalence reference that fits in memory) and routed experts per MoE layer.
    ``dtype="fp8"``: the FP8 release format (DeepSeek-V3.1's, Qwen3-FP8's): the decoder layers' linear weights
    block-quantized to float8_e4m3fn with float32 ``weight_scale_inv`` per 128 x 128 block, everything else bf16,
    and ``quantization_config`` in config.json. Returns the directory."""
    if dtype not in ("bfloat16", "float16", "float32", "float64", "fp8"):
        raise ValueError(f"dtype must be bfloat16, float16, float32, float64 or fp8, got {dtype!r}")
    cfg = synthetic_config(family, num_layers, vocab_size, num_experts)
    fp8 = dtype == "fp8"
    cfg["torch_dtype"] = "bfloat16" if fp8 else dtype
    if fp8:
        cfg["quantization_config"] = BlockFp8(RELEASE_BLOCK).config()
        quantized = fp8_weight_pattern(spec_for_hf(cfg["architectures"]))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX_FILE).exists() or (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a checkpoint")
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(cfg):
        entries = _fp8_entries(name, shape, quantized) if fp8 else [(name, dtype, shape)]
        nbytes = sum(math.prod(s) * torch.empty((), dtype=getattr(torch, t)).element_size() for _, t, s in entries)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(entries)
        size += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k, entries in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        f = StreamedFile(out / fname, entries)
        try:
            for name, tdtype, shape in entries:
                if tdtype == "float8_e4m3fn":  # writes the scales that follow it too
                    for stored, block in _draw_fp8(name, shape, generator):
                        f.write(stored, block)
                        weight_map[stored] = fname
                elif not (fp8 and name.endswith(SCALE_SUFFIX)):
                    for block in _draw(name, shape, generator, getattr(torch, tdtype)):
                        f.write(name, block)
                    weight_map[name] = fname
        except BaseException:
            f.abort()
            raise
        f.close()
        total += f.total_bytes
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
