"""Tiny random-weight float64 checkpoints of every supported architecture, built with stock classes.

Every registered ArchSpec has at least one entry in TINY_ARCHS (tests/obfuscation/test_arch_conformance.py fails
otherwise): a new architecture comes with its tiny model here. Tests and benchmarks import them from this module."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=False,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, attention_bias=True,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None,
                                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, attention_bias=False,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # mixture of experts: 8 experts, top-2, tiny experts; a dense first layer where the architecture has one
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=False, qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        tie_word_embeddings=False, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        # theta 1e4, not Mixtral's 1e6: head padding 8 -> 52 dims raises theta to theta^6.5 (1e6 would overflow
        # float32; real models pad by a few percent)
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # multi-head latent attention + grouped routing (2 groups of 4, one picked) + a shared expert + dense layer 0
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=6, head_dim=None,
        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # MLA without the q latent (DeepSeek-V2-Lite style q_proj) and HF-style (non-interleaved) rope pairs
    "deepseek_v3_noqlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=2, num_key_value_heads=6, head_dim=None,
        moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # DeepSeek-V2: softmax router with group-limited greedy top-k, RoPE on adjacent pairs (complex form)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=6, head_dim=None,
        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, topk_method="group_limited_greedy", first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_noqlora", "deepseek_v2")


def build_tiny(arch: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """``overrides`` change config values (benchmarks build wider/deeper variants of the same architectures)."""
    import transformers

    cfg_name, model_name, extra = TINY_ARCHS[arch]
    kwargs = {**TINY_COMMON, **extra, **overrides}
    cfg = getattr(transformers, cfg_name)(**{k: v for k, v in kwargs.items() if v is not None})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights so fusing them is really tested
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only router bias: must follow the experts
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(directory)
    return directory


def to_fp8_release(src: Path, directory: Path, block: tuple[int, int], mtp: bool = False) -> Path:
    """A copy of the tiny checkpoint ``src`` in the FP8 release format (DeepSeek-V3, Qwen3-FP8): every linear weight
    of archs.FP8_ROLES as float8_e4m3fn plus its float32 ``weight_scale_inv`` per ``block``, the rest bfloat16, a
    ``quantization_config`` in config.json. ``mtp``: also a DeepSeek multi-token-prediction layer (index
    num_hidden_layers: enorm/hnorm, eh_proj on the concatenation of two normed vectors, its own decoder block and
    shared head), declared by num_nextn_predict_layers = 1."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ..obfuscation.archs import fp8_weight_pattern, spec_for_hf
    from ..obfuscation.fp8 import BlockFp8, quantize_blockwise, scale_name

    directory.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    spec = spec_for_hf(cfg["architectures"])
    quantized, names = fp8_weight_pattern(spec), spec.hf_names
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if mtp:
        n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
        last = names.layer_prefix.format(i=n - 1)
        g = torch.Generator().manual_seed(5)
        for name in [k for k in tensors if k.startswith(last)]:
            tensors[f"model.layers.{n}." + name[len(last):]] = tensors[name] + 0.01 * torch.randn(
                tensors[name].shape, generator=g, dtype=tensors[name].dtype)
        prefix = names.layer_prefix.format(i=n)
        tensors[prefix + "enorm.weight"] = torch.ones(d, dtype=torch.float64)
        tensors[prefix + "hnorm.weight"] = torch.ones(d, dtype=torch.float64)
        tensors[prefix + "eh_proj.weight"] = 0.2 * torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
        tensors[prefix + "shared_head.norm.weight"] = torch.ones(d, dtype=torch.float64)
        tensors[prefix + "shared_head.head.weight"] = tensors[names.of("head")].clone()
        tensors[prefix + "embed_tokens.weight"] = tensors[names.of("embed")].clone()
        cfg["num_nextn_predict_layers"] = 1
    out = {}
    for name, t in tensors.items():
        if quantized.fullmatch(name) or name.endswith("eh_proj.weight"):
            out[name], out[scale_name(name)] = quantize_blockwise(t, block)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = BlockFp8(block).config()
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, directory / extra)
    return directory


def dequantized_copy(src: Path, directory: Path) -> Path:
    """The FP8 checkpoint ``src`` dequantized into float64 by aloepri's functions, quantization_config removed:
    what `exact` must reproduce, loadable by the stock classes on CPU."""
    import json
    import shutil

    from safetensors.torch import save_file

    from ..obfuscation.fp8 import SCALE_SUFFIX, dequantize_blockwise, parse_quantization_config, scale_name
    from ..storage.safetensors_dir import SafetensorsDir

    cfg = json.loads((src / "config.json").read_text())
    block = parse_quantization_config(cfg).block
    stored = SafetensorsDir(src)
    out = {}
    for name in stored.names():
        if name.endswith(SCALE_SUFFIX):
            continue
        if stored.dtype(name) == "F8_E4M3":
            t = dequantize_blockwise(stored.get(name, fp8=True), stored.get(scale_name(name)), block)
        else:
            t = stored.get(name)
        out[name] = t.to(torch.float64)
    directory.mkdir(parents=True)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float64"
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", directory / "generation_config.json")
    return directory


def tiny_variants(spec) -> list[str]:
    """The TINY_ARCHS entries built as one of ``spec``'s Hugging Face architectures (an archs.ArchSpec)."""
    return [name for name, (_, model, _) in TINY_ARCHS.items() if model in spec.hf_architectures]
