"""Architecture specs as data: which tensor plays which role, and how the obfuscated model is declared.

A spec is registered by the ``architectures`` names of ``config.json`` (and by GGUF ``general.architecture``).
An unknown architecture is a hard error listing what is supported; there is no fallback.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Roles of per-layer tensors. Linear roles name the module (".weight"/".bias" appended); norm roles name the
# weight tensor itself.
HF_LAYER_ROLES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
HF_GLOBAL_ROLES = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "final_norm": "model.norm.weight"}
HF_LAYER_PREFIX = "model.layers.{i}."

GGUF_LAYER_ROLES = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
GGUF_GLOBAL_ROLES = {"embed": "token_embd.weight", "head": "output.weight", "final_norm": "output_norm.weight"}
GGUF_LAYER_PREFIX = "blk.{i}."

LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class ArchSpec:
    """Per-architecture differences, nothing else.

    output_model_type: the stock transformers model type the obfuscated checkpoint is declared as. Qwen2 is
    written as ``llama`` because vLLM's Qwen2 ignores ``head_dim`` (it assumes hidden_size / num_heads, which
    the expansion d+2h breaks) while its Llama reads ``head_dim`` and honours ``attention_bias``.
    """

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    output_model_type: str
    output_architecture: str
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    gguf_qk_rows_interleaved: bool = False  # llama.cpp's converter permutes q/k rows for the llama arch
    # config keys copied verbatim from the source config when present
    passthrough_config: tuple[str, ...] = field(default=())


_COMMON = (
    "vocab_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

SPECS: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    SPECS[spec.name] = spec
    return spec


register(ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), "llama", "LlamaForCausalLM",
                  gguf_qk_rows_interleaved=True, passthrough_config=_COMMON + ("mlp_bias",)))
register(ArchSpec("mistral", ("MistralForCausalLM",), (), "mistral", "MistralForCausalLM",
                  passthrough_config=_COMMON + ("sliding_window",)))
register(ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "llama", "LlamaForCausalLM",
                  passthrough_config=_COMMON))
register(ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", "Qwen3ForCausalLM", qk_norm=True,
                  passthrough_config=_COMMON + ("attention_bias",)))


def supported_architectures() -> list[str]:
    return sorted(a for s in SPECS.values() for a in s.hf_architectures)


class UnsupportedArchitectureError(ValueError):
    pass


def spec_for_hf(architectures: list[str] | None) -> ArchSpec:
    for arch in architectures or []:
        for spec in SPECS.values():
            if arch in spec.hf_architectures:
                return spec
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures!r}: aloepri supports {supported_architectures()} "
        "(config.json 'architectures'). Adding one means writing an ArchSpec in aloepri/archs.py."
    )


def spec_for_gguf(arch: str) -> ArchSpec:
    for spec in SPECS.values():
        if arch in spec.gguf_architectures:
            return spec
    gg = sorted(a for s in SPECS.values() for a in s.gguf_architectures)
    raise UnsupportedArchitectureError(f"unsupported GGUF architecture {arch!r}: aloepri reads GGUF files of {gg}")
