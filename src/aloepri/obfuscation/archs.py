"""Architecture specs as data: which tensor plays which role, and how the obfuscated model is declared.

A spec is registered by the ``architectures`` names of ``config.json`` (and by GGUF ``general.architecture``).
An unknown architecture is a hard error listing what is supported; there is no fallback.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

# Roles of per-layer tensors: role -> (Hugging Face name, GGUF name). Linear roles name the module (".weight" /
# ".bias" appended); norm roles name the weight tensor itself.
_LAYER_ROLES = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "q": ("self_attn.q_proj", "attn_q"),
    "k": ("self_attn.k_proj", "attn_k"),
    "v": ("self_attn.v_proj", "attn_v"),
    "o": ("self_attn.o_proj", "attn_output"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "ffn_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "gate": ("mlp.gate_proj", "ffn_gate"),
    "up": ("mlp.up_proj", "ffn_up"),
    "down": ("mlp.down_proj", "ffn_down"),
}
HF_LAYER_ROLES = {role: hf for role, (hf, _) in _LAYER_ROLES.items()}
GGUF_LAYER_ROLES = {role: gguf for role, (_, gguf) in _LAYER_ROLES.items()}
HF_GLOBAL_ROLES = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "final_norm": "model.norm.weight"}
GGUF_GLOBAL_ROLES = {"embed": "token_embd.weight", "head": "output.weight", "final_norm": "output_norm.weight"}
HF_LAYER_PREFIX = "model.layers.{i}."
GGUF_LAYER_PREFIX = "blk.{i}."

# Roles of MoE and MLA tensors (HF names; "{e}" is the expert index). Architectures that name them differently
# override single roles in ArchSpec.hf_roles (Mixtral: block_sparse_moe.*, w1/w3/w2).
HF_MOE_MLA_ROLES = {
    "router": "mlp.gate",
    "router_bias": "mlp.gate.e_score_correction_bias",  # DeepSeek-V3: selection-only bias, permuted with experts
    "expert_gate": "mlp.experts.{e}.gate_proj",
    "expert_up": "mlp.experts.{e}.up_proj",
    "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj",
    "shared_up": "mlp.shared_expert.up_proj",
    "shared_down": "mlp.shared_expert.down_proj",
    "shared_expert_gate": "mlp.shared_expert_gate",  # Qwen2-MoE: sigmoid gate of the shared expert (1 x d)
    "q_a": "self_attn.q_a_proj",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj",
    "kv_a": "self_attn.kv_a_proj_with_mqa",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b": "self_attn.kv_b_proj",
}

LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down", "router", "expert_gate", "expert_up", "expert_down",
                "shared_gate", "shared_up", "shared_down", "shared_expert_gate", "q_a", "q_b", "kv_a", "kv_b")
# Linear roles whose weights FP8 releases block-quantize (and an FP8 output quantizes): all but the routers and
# Qwen2-MoE's one-row shared-expert gate, which engines build unquantized
FP8_ROLES = tuple(r for r in LINEAR_ROLES if r not in ("router", "shared_expert_gate"))


class UnknownRoleError(KeyError):
    """A tensor role the naming scheme has no name for (e.g. an expert role in GGUF)."""


@dataclass(frozen=True)
class TensorNames:
    """Full tensor names by role in one naming scheme (a Hugging Face architecture, or GGUF): the one place that
    turns (role, layer, part, expert) into a stored name, for reading, writing and export alike.

    Linear roles name a module, so ``part`` ("weight" / "bias") is appended; every other role names its tensor.
    """

    global_roles: dict[str, str]
    layer_roles: dict[str, str]
    layer_prefix: str  # "{i}" is the layer index

    def of(self, role: str, layer: int | None = None, part: str = "weight", expert: int | None = None) -> str:
        if layer is None:
            return self.global_roles[role]
        if role not in self.layer_roles:
            raise UnknownRoleError(role)
        base = self.layer_prefix.format(i=layer) + self.layer_roles[role].format(e=expert)
        return f"{base}.{part}" if role in LINEAR_ROLES else base

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a stored name belongs to, or None for a global tensor."""
        head, _, tail = self.layer_prefix.partition("{i}")
        if not name.startswith(head):
            return None
        index = name[len(head):].partition(tail)[0]
        return int(index) if index.isdigit() else None

    def layer_pattern(self) -> str:
        """A regular expression matching the prefix of every layer's tensors."""
        head, _, tail = self.layer_prefix.partition("{i}")
        return re.escape(head) + r"\d+" + re.escape(tail)


GGUF_NAMES = TensorNames(GGUF_GLOBAL_ROLES, GGUF_LAYER_ROLES, GGUF_LAYER_PREFIX)


@dataclass(frozen=True)
class GGUFArch:
    """What llama.cpp's graph for one ``general.architecture`` expects of the tensors (reading and export)."""

    qk_rows_interleaved: bool = False  # q/k rows stored as adjacent RoPE pairs (its converter permutes them)
    o_bias: bool = True  # the graph reads attn_output.bias


GGUF_ARCHS = {"llama": GGUFArch(qk_rows_interleaved=True), "qwen2": GGUFArch(), "qwen3": GGUFArch(o_bias=False)}


@dataclass(frozen=True)
class MoESpec:
    """Where an architecture has routed experts, and what goes with them.

    layer_rule: which decoder layers are sparse. "all"; "sparse_step" (Qwen-MoE: not in ``mlp_only_layers`` and
    (i + 1) % ``decoder_sparse_step`` == 0); "first_k_dense" (DeepSeek: i >= ``first_k_dense_replace``).
    expert_groups_key: DeepSeek's ``n_group`` -- routing first picks groups of consecutive experts, so the expert
    permutation must map groups onto groups (permute the groups, then experts inside each group).
    """

    num_experts_keys: tuple[str, ...]  # config keys naming the routed-expert count, first present wins
    layer_rule: str = "all"
    shared_expert: bool = False
    shared_expert_gate: bool = False
    router_bias: bool = False
    expert_groups_key: str | None = None
    expert_intermediate_key: str = "moe_intermediate_size"
    shared_intermediate_key: str | None = None  # None: moe_intermediate_size * n_shared_experts (DeepSeek)

    def is_sparse_layer(self, cfg: dict[str, Any], layer: int) -> bool:
        if self.layer_rule == "all":
            return True
        if self.layer_rule == "sparse_step":
            step = int(cfg.get("decoder_sparse_step") or 1)
            return layer not in (cfg.get("mlp_only_layers") or []) and self.num_experts(cfg) > 0 \
                and (layer + 1) % step == 0
        if self.layer_rule == "first_k_dense":
            return layer >= int(cfg.get("first_k_dense_replace") or 0)
        raise ValueError(f"unknown MoE layer rule {self.layer_rule!r}")

    def num_experts(self, cfg: dict[str, Any]) -> int:
        for k in self.num_experts_keys:
            if cfg.get(k) is not None:
                return int(cfg[k])
        raise KeyError(f"config has none of {self.num_experts_keys} (number of routed experts)")

    def shared_intermediate_size(self, cfg: dict[str, Any]) -> int:
        if self.shared_intermediate_key is not None:
            return int(cfg[self.shared_intermediate_key])
        return int(cfg[self.expert_intermediate_key]) * int(cfg.get("n_shared_experts") or 1)


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
    # config keys copied verbatim from the source config when present
    passthrough_config: tuple[str, ...] = field(default=())
    attention: str = "gqa"  # "gqa" (MHA/GQA/MQA: q/k/v/o) or "mla" (DeepSeek's multi-head latent attention)
    moe: MoESpec | None = None
    hf_roles: dict[str, str] = field(default_factory=dict)  # overrides of HF_LAYER_ROLES / HF_MOE_MLA_ROLES
    # llama.cpp architecture (GGUF_ARCHS) `aloepri export-gguf` writes the output as; None: no GGUF export
    # (MoE and MLA outputs are served from safetensors)
    gguf_export: str | None = None
    # the output config's one ``attention_bias`` switch declares q/k/v AND o_proj biases (Llama): it is set from the
    # source's q bias, and an o_proj bias the source lacks (Qwen2) is written as zeros
    attention_bias_with_o: bool = False
    # Engines derive head_dim = hidden_size // num_heads for this architecture (vLLM and SGLang Qwen2-MoE, SGLang
    # Mixtral): pad every head to (d + 2h) / num_heads so the output loads there unchanged
    # (transforms.pad_attention_heads)
    pad_heads: bool = False
    output_overrides: dict[str, Any] = field(default_factory=dict)  # config values forced in the output
    # linear roles that carry a bias: config switch -> roles biased when it is true ("": always, Qwen2's q/k/v)
    linear_biases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def hf_role_names(self) -> dict[str, str]:
        return {**HF_LAYER_ROLES, **HF_MOE_MLA_ROLES, **self.hf_roles}

    def attention_roles(self, cfg: dict[str, Any]) -> list[str]:
        """Roles of a decoder layer's attention block (its input norm first)."""
        if self.attention == "mla":
            q = ["q_a", "q_a_norm", "q_b"] if cfg.get("q_lora_rank") else ["q"]
            return ["attn_norm", *q, "kv_a", "kv_a_norm", "kv_b", "o"]
        return ["attn_norm", "q", "k", "v", "o"] + (["q_norm", "k_norm"] if self.qk_norm else [])

    def is_moe_layer(self, cfg: dict[str, Any], layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse_layer(cfg, layer)

    def mlp_roles(self, cfg: dict[str, Any], layer: int) -> list:
        """Roles of the feed-forward block of ``layer`` (its input norm first); for MoE layers the routed experts'
        as (role, expert) pairs."""
        if not self.is_moe_layer(cfg, layer):
            return ["ffn_norm", "gate", "up", "down"]
        moe = self.moe
        roles = ["ffn_norm", "router"]
        roles += ["shared_gate", "shared_up", "shared_down"] if moe.shared_expert else []
        roles += ["shared_expert_gate"] if moe.shared_expert_gate else []
        experts = range(moe.num_experts(cfg))
        return roles + [(r, e) for e in experts for r in ("expert_gate", "expert_up", "expert_down")]

    def biased_roles(self, cfg: dict[str, Any]) -> set[str]:
        """The linear roles whose modules have a bias under ``cfg``."""
        return {r for key, roles in self.linear_biases.items() if key == "" or cfg.get(key) for r in roles}

    @property
    def hf_names(self) -> TensorNames:
        """Tensor names of this architecture's Hugging Face checkpoints (sources and outputs alike)."""
        return TensorNames(HF_GLOBAL_ROLES, self.hf_role_names(), HF_LAYER_PREFIX)


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

_QKVO = ("q", "k", "v", "o")

SPECS: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    unknown = [a for a in (*spec.gguf_architectures, spec.gguf_export) if a is not None and a not in GGUF_ARCHS]
    if unknown:
        raise ValueError(f"{spec.name}: GGUF architecture(s) {unknown} have no entry in GGUF_ARCHS")
    SPECS[spec.name] = spec
    return spec


register(ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), "llama", "LlamaForCausalLM",
                  passthrough_config=_COMMON + ("mlp_bias",), gguf_export="llama", attention_bias_with_o=True,
                  linear_biases={"attention_bias": _QKVO, "mlp_bias": ("gate", "up", "down")}))
register(ArchSpec("mistral", ("MistralForCausalLM",), (), "mistral", "MistralForCausalLM",
                  passthrough_config=_COMMON + ("sliding_window",), gguf_export="llama"))
register(ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "llama", "LlamaForCausalLM",
                  passthrough_config=_COMMON, gguf_export="llama", attention_bias_with_o=True,
                  linear_biases={"": ("q", "k", "v")}))
register(ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", "Qwen3ForCausalLM", qk_norm=True,
                  passthrough_config=_COMMON + ("attention_bias",), gguf_export="qwen3",
                  linear_biases={"attention_bias": _QKVO}))

# --- mixture of experts and multi-head latent attention (safetensors sources only) ---------------------------
_MOE_COMMON = ("num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")
_QWEN_MOE = _MOE_COMMON + ("num_experts", "num_local_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                           "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
register(ArchSpec("qwen2_moe", ("Qwen2MoeForCausalLM",), (), "qwen2_moe", "Qwen2MoeForCausalLM",
                  passthrough_config=_COMMON + _QWEN_MOE + ("shared_expert_intermediate_size", "qkv_bias"),
                  moe=MoESpec(("num_experts",), "sparse_step", shared_expert=True, shared_expert_gate=True,
                              shared_intermediate_key="shared_expert_intermediate_size"),
                  pad_heads=True, linear_biases={"qkv_bias": ("q", "k", "v")}))
register(ArchSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), (), "qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True,
                  passthrough_config=_COMMON + _QWEN_MOE + ("attention_bias",),
                  moe=MoESpec(("num_local_experts", "num_experts"), "sparse_step"),
                  linear_biases={"attention_bias": _QKVO}))
register(ArchSpec("mixtral", ("MixtralForCausalLM",), (), "mixtral", "MixtralForCausalLM",
                  passthrough_config=_COMMON + _MOE_COMMON + ("num_local_experts", "sliding_window",
                                                              "router_jitter_noise"),
                  moe=MoESpec(("num_local_experts",), "all", expert_intermediate_key="intermediate_size"),
                  hf_roles={"router": "block_sparse_moe.gate", "expert_gate": "block_sparse_moe.experts.{e}.w1",
                            "expert_up": "block_sparse_moe.experts.{e}.w3",
                            "expert_down": "block_sparse_moe.experts.{e}.w2"},
                  pad_heads=True))  # SGLang's Mixtral ignores head_dim (vLLM's reads it)
_DEEPSEEK = _COMMON + _MOE_COMMON + (
    "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group",
    "topk_group", "topk_method", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "rope_interleave", "attention_bias", "mlp_bias", "scoring_func",
)  # num_nextn_predict_layers is forced to 0: the multi-token-prediction layers are not written (docs/moe-mla.md)
_DEEPSEEK_MOE = MoESpec(("n_routed_experts", "num_local_experts"), "first_k_dense", shared_expert=True, expert_groups_key="n_group")
# MLA's attention_bias covers the projections from the residual stream and o; the latent up-projections have none
_DEEPSEEK_BIASES = {"attention_bias": ("q_a", "kv_a", "o"), "mlp_bias": ("gate", "up", "down")}
_DEEPSEEK_ROLES = {"shared_gate": "mlp.shared_experts.gate_proj", "shared_up": "mlp.shared_experts.up_proj",
                   "shared_down": "mlp.shared_experts.down_proj"}
register(ArchSpec("deepseek_v3", ("DeepseekV3ForCausalLM",), (), "deepseek_v3", "DeepseekV3ForCausalLM",
                  passthrough_config=_DEEPSEEK, attention="mla",
                  moe=dataclasses.replace(_DEEPSEEK_MOE, router_bias=True), hf_roles=_DEEPSEEK_ROLES,
                  output_overrides={"num_nextn_predict_layers": 0}, linear_biases=_DEEPSEEK_BIASES))
register(ArchSpec("deepseek_v2", ("DeepseekV2ForCausalLM",), (), "deepseek_v2", "DeepseekV2ForCausalLM",
                  passthrough_config=_DEEPSEEK, attention="mla", moe=_DEEPSEEK_MOE, hf_roles=_DEEPSEEK_ROLES,
                  linear_biases=_DEEPSEEK_BIASES))


def fp8_weight_pattern(spec: ArchSpec) -> re.Pattern:
    """Full names of the decoder-layer weights an FP8 checkpoint of ``spec`` stores block-quantized."""
    names = spec.hf_names
    roles = "|".join(re.escape(names.layer_roles[r]).replace(re.escape("{e}"), r"\d+") for r in FP8_ROLES)
    return re.compile(r"%s(?:%s)\.weight" % (names.layer_pattern(), roles))


def role_shapes(spec: ArchSpec, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape (Hugging Face order, [out, in]) of every tensor role a checkpoint of ``spec`` with config ``cfg``
    holds (a role's bias: its first dimension). Raises KeyError for a config key the architecture needs."""
    d, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "head": (vocab, d), "final_norm": (d,),
                                          "attn_norm": (d,), "ffn_norm": (d,)}
    if spec.attention == "mla":
        q_rank, kv_rank = int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"])
        nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
        shapes.update(q=(heads * (nope + rope), d), kv_a=(kv_rank + rope, d), kv_a_norm=(kv_rank,),
                      kv_b=(heads * (nope + v), kv_rank), o=(d, heads * v))
        if q_rank:
            shapes.update(q_a=(q_rank, d), q_a_norm=(q_rank,), q_b=(heads * (nope + rope), q_rank))
    else:
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or d // heads)
        shapes.update(q=(heads * head_dim, d), k=(kv * head_dim, d), v=(kv * head_dim, d), o=(d, heads * head_dim),
                      q_norm=(head_dim,), k_norm=(head_dim,))
    swiglu = {"": int(cfg["intermediate_size"])}
    if spec.moe is not None:
        experts = spec.moe.num_experts(cfg)
        shapes.update(router=(experts, d), router_bias=(experts,), shared_expert_gate=(1, d))
        swiglu["expert_"] = int(cfg[spec.moe.expert_intermediate_key])
        if spec.moe.shared_expert:
            swiglu["shared_"] = spec.moe.shared_intermediate_size(cfg)
    for prefix, size in swiglu.items():
        shapes.update({prefix + "gate": (size, d), prefix + "up": (size, d), prefix + "down": (d, size)})
    return shapes


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
        "(config.json 'architectures'). Adding one means writing an ArchSpec in aloepri/obfuscation/archs.py."
    )


def spec_for_gguf(arch: str) -> ArchSpec:
    for spec in SPECS.values():
        if arch in spec.gguf_architectures:
            return spec
    gg = sorted(a for s in SPECS.values() for a in s.gguf_architectures)
    raise UnsupportedArchitectureError(f"unsupported GGUF architecture {arch!r}: aloepri reads GGUF files of {gg}")
