"""Offline obfuscation of a whole checkpoint, streamed layer by layer."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .archs import LINEAR_ROLES, ArchSpec
from .checkpoint import AtomicOutputDir, CheckpointError, ShardedWriter, SourceCheckpoint, open_checkpoint
from .keyfile import KeyFile, check_key_outside, write_key
from .params import ObfuscationParams
from .secrets import ModelShape, SecretSampler
from .transforms import (obfuscate_attention, obfuscate_embedding, obfuscate_head, obfuscate_mla, obfuscate_mlp,
                         obfuscate_router, pad_attention_heads, padded_rope_theta, transform_reader_input)

MODEL_META_FILE = "aloepri_model.json"  # public metadata in the server directory: no secret inside
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class ObfuscationResult:
    output_dir: Path
    key_path: Path
    fingerprint: str
    hidden_size: int
    h: int
    seconds: float
    bytes_written: int
    flops: float


def model_shape(cfg: dict[str, Any], spec: ArchSpec) -> ModelShape:
    heads = int(cfg["num_attention_heads"])
    d = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    rope_base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    mla = {}
    if spec.attention == "mla":
        mla = dict(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]),
                   # DeepSeek-V2 always rotates adjacent pairs; V3 does when rope_interleave (its default)
                   rope_interleaved=bool(cfg.get("rope_interleave", True)))
    head_dim = int(cfg.get("head_dim") or d // heads) if spec.attention != "mla" else mla["qk_rope_head_dim"]
    return ModelShape(
        d=d, vocab_size=int(cfg["vocab_size"]), num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]), rope_base=rope_base, qk_norm=spec.qk_norm, **mla,
    )


def output_config(src_cfg: dict[str, Any], spec: ArchSpec, shape: ModelShape, hidden: int, kappa_eps: float,
                  has_qkv_bias: bool, dtype: torch.dtype, vocab_perm: np.ndarray) -> dict[str, Any]:
    """config.json of the obfuscated model, built through the stock config class so it is sure to load."""
    from transformers import AutoConfig

    kw = {k: src_cfg[k] for k in spec.passthrough_config if k in src_cfg and src_cfg[k] is not None}
    if "rope_parameters" not in kw and "rope_theta" in src_cfg:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": src_cfg["rope_theta"]}
        kw.pop("rope_theta", None)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if kw.get(k) is not None:
            kw[k] = _map_ids(kw[k], vocab_perm)
    kw.update(hidden_size=hidden, tie_word_embeddings=False, rms_norm_eps=kappa_eps,
              num_key_value_heads=shape.num_kv_heads)
    if spec.pad_heads:  # heads padded to hidden / heads; RoPE base moved so every original pair keeps its frequency
        padded = hidden // shape.num_heads
        rope = dict(kw.get("rope_parameters") or {"rope_type": "default", "rope_theta": shape.rope_base})
        if rope.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(f"head padding ({spec.name}) keeps RoPE exact only for default/linear RoPE, not "
                             f"{rope.get('rope_type')!r}")
        rope["rope_theta"] = padded_rope_theta(shape.rope_base, shape.head_dim, padded)
        if rope["rope_theta"] > 1e37:  # engines compute theta ** x in float32 (max 3.4e38): it would overflow
            raise ValueError(f"head padding {shape.head_dim} -> {padded} needs rope_theta {rope['rope_theta']:.3g}, "
                             "beyond float32; choose a smaller h (--h) so the padded heads stay close to the original")
        kw.update(rope_parameters=rope, head_dim=padded)
    elif spec.attention != "mla":  # MLA's head dims are its own keys (passed through); head_dim is derived
        kw["head_dim"] = shape.head_dim
    kw.update(spec.output_overrides)
    if spec.output_model_type == "llama":
        kw["attention_bias"] = has_qkv_bias
        kw.setdefault("mlp_bias", False)
    cfg = AutoConfig.for_model(spec.output_model_type, **kw)
    d = cfg.to_dict()
    d["architectures"] = [spec.output_architecture]
    d["dtype"] = str(dtype).replace("torch.", "")
    return d


def _map_ids(ids: Any, perm: np.ndarray) -> Any:
    if isinstance(ids, list):
        return [int(perm[i]) for i in ids]
    return int(perm[int(ids)])


def _special_ids(src: SourceCheckpoint) -> dict[str, Any]:
    cfg = src.config
    out = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    gen = getattr(src, "path", None)
    if gen is not None and Path(gen).is_dir() and (Path(gen) / "generation_config.json").is_file():
        g = json.loads((Path(gen) / "generation_config.json").read_text())
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if g.get(k) is not None:
                out[k] = g[k]
    return out


def fingerprint_update(hasher: "hashlib._Hash", name: str, tensor: torch.Tensor) -> None:
    hasher.update(name.encode())
    hasher.update(str(tensor.dtype).encode())
    hasher.update(repr(tuple(tensor.shape)).encode())
    hasher.update(tensor.contiguous().view(torch.uint8).numpy())  # buffer protocol: no copy of a big matrix


FINGERPRINTED = ("model.embed_tokens.weight", "lm_head.weight")


def obfuscate(
    src: str | Path,
    out: str | Path,
    key_out: str | Path,
    params: ObfuscationParams,
    seed: int,
    dtype: str | None = None,
    max_shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    progress: bool = True,
) -> ObfuscationResult:
    """Obfuscate ``src`` (HF checkpoint directory or .gguf) into ``out`` (server artifact) and ``key_out``.

    The output is written into a temporary sibling directory and renamed into place only when complete; the
    key is written (mode 0600) only after the model is complete, and never inside ``out``.
    """
    t0 = time.perf_counter()
    out, key_out = Path(out).resolve(), Path(key_out).resolve()
    check_key_outside(key_out, out)
    if key_out.exists() and not overwrite:
        raise FileExistsError(f"{key_out} already exists; refusing to overwrite a key (pass --force)")
    source = open_checkpoint(src)
    source.validate()
    spec, cfg = source.spec, source.config
    shape = model_shape(cfg, spec)
    if shape.head_dim % 2:
        raise CheckpointError(f"head_dim {shape.head_dim} is odd; RoPE pairs need an even head_dim")
    if dtype is None:
        src_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        dtype = src_dtype if src_dtype in _DTYPES else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    out_dtype = _DTYPES[dtype]

    secrets = SecretSampler(seed, params, shape)
    vocab_perm = secrets.vocab_permutation()
    D = secrets.hidden_size
    flops = 0.0
    staging = AtomicOutputDir(out, overwrite=overwrite)
    try:
        writer = ShardedWriter(staging.tmp, max_shard_bytes)
        fp = hashlib.sha256()
        steps = tqdm(total=shape.num_layers + 2, desc="obfuscating", unit="block", disable=not progress)

        embed = source.get("embed", dtype=None)  # stored precision; converted chunk by chunk
        calib = None
        if params.kappa_mode == "embedding":
            idx = secrets.rng("kappa-calibration").choice(embed.shape[0], size=min(4096, embed.shape[0]), replace=False)
            calib = embed[torch.from_numpy(np.sort(idx))].to(torch.float64).numpy()
        kappa = secrets.kappa(calib)
        norm_const = torch.full((D,), kappa, dtype=out_dtype)

        e_obf = obfuscate_embedding(embed, vocab_perm, secrets.writer_P("embed"), params.alpha_e,
                                    secrets.rng("noise", "embed"), out_dtype, params.noise_shape)
        flops += 2.0 * embed.shape[0] * shape.d * D
        fingerprint_update(fp, "model.embed_tokens.weight", e_obf)
        writer.add("model.embed_tokens.weight", e_obf)
        head_plain = embed if source.tied_embeddings else source.get("head", dtype=None)
        del embed, e_obf
        h_obf = obfuscate_head(head_plain, source.get("final_norm"), vocab_perm, secrets.reader_Q("head"),
                               params.alpha_h, secrets.rng("noise", "head"), out_dtype, params.noise_shape)
        flops += 2.0 * head_plain.shape[0] * shape.d * D
        fingerprint_update(fp, "lm_head.weight", h_obf)
        writer.add("lm_head.weight", h_obf)
        writer.add("model.norm.weight", norm_const.clone())
        del head_plain, h_obf
        steps.update(2)

        has_qkv_bias = source.has("q", 0, "bias")
        for i in range(shape.num_layers):
            flops += _obfuscate_layer(source, writer, secrets, i, shape, out_dtype, norm_const, has_qkv_bias, spec,
                                      params)
            steps.update(1)
        steps.close()
        writer.finish()

        fingerprint = fp.hexdigest()
        out_cfg = output_config(cfg, spec, shape, D, float(cfg.get("rms_norm_eps", 1e-6)), has_qkv_bias,
                                out_dtype, vocab_perm)
        (staging.tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
        special = _special_ids(source)
        gen = {k: _map_ids(v, vocab_perm) for k, v in special.items()}
        gen["_from_model_config"] = False
        (staging.tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        from .server_tokenizer import write_hf_tokenizer  # neutral tokenizer: one opaque symbol per id, EOS only

        write_hf_tokenizer(staging.tmp, int(out_cfg["vocab_size"]), gen.get("eos_token_id"),
                           out_cfg.get("max_position_embeddings"))
        meta = {"format": "aloepri-obfuscated-model", "version": 1, "model_fingerprint": fingerprint,
                "fingerprint_tensors": list(FINGERPRINTED), "hidden_size": D, "source_architecture": spec.name}
        (staging.tmp / MODEL_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

        key = KeyFile(
            vocab_permutation=vocab_perm.tolist(), model_fingerprint=fingerprint, params=params.to_dict(),
            seed=int(seed), h_effective=secrets.h, hidden_size=D, source=str(Path(src).resolve()),
            architecture=spec.name, special_tokens=special, tokenizer=source.tokenizer_kwargs(),
            chat_template=getattr(source, "chat_template", None),
        )
        write_key(key, key_out, overwrite=overwrite)
        staging.commit()
    except BaseException:
        staging.abort()
        raise
    finally:
        source.close()
    return ObfuscationResult(out, key_out, fingerprint, D, secrets.h, time.perf_counter() - t0, writer.total_bytes, flops)


def _obfuscate_layer(source: SourceCheckpoint, writer: ShardedWriter, secrets: SecretSampler, i: int,
                     shape: ModelShape, out_dtype: torch.dtype, norm_const: torch.Tensor, has_qkv_bias: bool,
                     spec: ArchSpec, params: ObfuscationParams) -> float:
    """One decoder layer: attention (GQA or MLA), then the feed-forward block (dense or MoE). Returns FLOPs."""
    prefix = f"model.layers.{i}."
    names = spec.hf_role_names()

    def put(role: str, tensor: torch.Tensor, part: str = "weight", expert: int | None = None) -> None:
        name = prefix + names[role].format(e=expert)
        writer.add(name + f".{part}" if role in LINEAR_ROLES else name, tensor.to(out_dtype))

    if spec.attention == "mla":
        flops = _obfuscate_mla_layer(source, put, secrets, i, shape)
    else:
        flops = _obfuscate_gqa_layer(source, put, secrets, i, shape, has_qkv_bias, spec)
    writer.add(prefix + "input_layernorm.weight", norm_const.clone())
    if source.is_moe_layer(i):
        flops += _obfuscate_moe_block(source, put, secrets, i, spec, params)
    else:
        flops += _obfuscate_dense_mlp(source, put, secrets, i, int(source.config["intermediate_size"]), "mlp",
                                      ("gate", "up", "down"))
    writer.add(prefix + "post_attention_layernorm.weight", norm_const.clone())
    return flops


def _linear_flops(D: int, *weights: torch.Tensor) -> float:
    """A reader (out, d) -> (out, D) or writer (d, in) -> (D, in) transform costs 2 * numel * D."""
    return float(sum(2.0 * w.numel() * D for w in weights))


def _biases(source: SourceCheckpoint, i: int, roles: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {f"{r}_bias": source.get(r, i, "bias") for r in roles if source.has(r, i, "bias")}


def _obfuscate_gqa_layer(source, put, secrets: SecretSampler, i: int, shape: ModelShape, has_qkv_bias: bool,
                         spec: ArchSpec) -> float:
    attn_norm = source.get("attn_norm", i)
    w = {r: source.get(r, i) for r in ("q", "k", "v", "o")}
    w.update(_biases(source, i, ("q", "k", "v", "o")))
    if spec.qk_norm:
        w["q_norm"] = source.get("q_norm", i)
        w["k_norm"] = source.get("k_norm", i)
    flops = _linear_flops(secrets.hidden_size, *(w[r] for r in ("q", "k", "v", "o")))
    attn = obfuscate_attention(
        w, attn_norm, secrets.reader_Q("q", i), secrets.reader_Q("k", i), secrets.reader_Q("v", i),
        secrets.writer_P("o", i), secrets.attention(i), shape.num_heads, shape.num_kv_heads, shape.head_dim,
    )
    if spec.pad_heads:
        attn = pad_attention_heads(attn, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                   secrets.hidden_size // shape.num_heads, secrets.rng("head-padding", i))
    if has_qkv_bias and spec.output_model_type == "llama" and "o_bias" not in attn:
        # Llama's attention_bias switch also declares o_proj.bias; Qwen2 has none, so it is zero (and stays zero).
        attn["o_bias"] = torch.zeros(attn["o"].shape[0], dtype=torch.float64)
    _put_all(put, attn)
    return flops


def _put_all(put, tensors: dict[str, torch.Tensor]) -> None:
    """Write transform outputs keyed by role ("q") or role + "_bias" ("q_bias")."""
    for key, tensor in tensors.items():
        if key.endswith("_bias"):
            put(key[:-5], tensor, "bias")
        else:
            put(key, tensor)


def _obfuscate_mla_layer(source, put, secrets: SecretSampler, i: int, shape: ModelShape) -> float:
    roles = [r for r in source.attention_roles(i) if r != "attn_norm"]
    w = {r: source.get(r, i) for r in roles}
    w.update(_biases(source, i, ("q_a", "kv_a", "o")))
    flops = _linear_flops(secrets.hidden_size, *(w[r] for r in ("q_a", "q", "kv_a", "o") if r in w))
    q_reader = "q_a" if "q_a" in w else "q"
    attn = obfuscate_mla(
        w, source.get("attn_norm", i), secrets.reader_Q(q_reader, i), secrets.reader_Q("kv_a", i),
        secrets.writer_P("o", i), secrets.mla(i), shape.num_heads, shape.qk_nope_head_dim, shape.qk_rope_head_dim,
        shape.v_head_dim, shape.kv_lora_rank,
    )
    _put_all(put, attn)
    return flops


def _obfuscate_dense_mlp(source, put, secrets: SecretSampler, i: int, size: int, label: str,
                         roles: tuple[str, str, str], expert: int | None = None, slot: int | None = None) -> float:
    """One SwiGLU block (a dense MLP, a shared expert or a routed expert): Z_ffn and H_ffn of its own.
    A routed expert is read under its stored index ``expert`` and written into its new ``slot``."""
    gate_r, up_r, down_r = roles
    gate, up, down = (source.get(r, i, expert=expert) for r in roles)
    labels = (label, i) if expert is None else (label, i, expert)
    perm, scale = secrets.ffn(size, *labels)
    g, u, dn = obfuscate_mlp(gate, up, down, source.get("ffn_norm", i), secrets.reader_Q(gate_r, *labels[1:]),
                             secrets.reader_Q(up_r, *labels[1:]), secrets.writer_P(down_r, *labels[1:]), perm, scale)
    put(gate_r, g, expert=slot)
    put(up_r, u, expert=slot)
    put(down_r, dn, expert=slot)
    return _linear_flops(secrets.hidden_size, gate, up, down)


def _obfuscate_moe_block(source, put, secrets: SecretSampler, i: int, spec: ArchSpec,
                         params: ObfuscationParams) -> float:
    """Router (input-side key matrix, experts permuted by Z_router), every routed expert as a dense SwiGLU block
    in its new slot, the shared expert(s) and the shared expert's gate. One expert in memory at a time."""
    moe, cfg = spec.moe, source.config
    n = source.num_experts
    groups = int(cfg.get(moe.expert_groups_key) or 1) if moe.expert_groups_key else 1
    order = secrets.expert_order(i, n, groups)
    ffn_norm = source.get("ffn_norm", i)
    router = source.get("router", i)
    put("router", obfuscate_router(router, ffn_norm, secrets.reader_Q("router", i), order,
                                   normalize=params.router_normalize))
    flops = _linear_flops(secrets.hidden_size, router)
    if moe.router_bias:
        put("router_bias", source.get("router_bias", i)[torch.from_numpy(order)])
    size = int(cfg[moe.expert_intermediate_key])
    for slot, old in enumerate(order):
        flops += _obfuscate_dense_mlp(source, put, secrets, i, size, "expert",
                                      ("expert_gate", "expert_up", "expert_down"), expert=int(old), slot=slot)
    if moe.shared_expert:
        flops += _obfuscate_dense_mlp(source, put, secrets, i, moe.shared_intermediate_size(cfg), "shared",
                                      ("shared_gate", "shared_up", "shared_down"))
    if moe.shared_expert_gate:
        g = source.get("shared_expert_gate", i)
        put("shared_expert_gate", transform_reader_input(g, ffn_norm, secrets.reader_Q("shared_expert_gate", i)))
        flops += _linear_flops(secrets.hidden_size, g)
    return flops
