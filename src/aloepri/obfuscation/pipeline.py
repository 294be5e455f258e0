"""Offline obfuscation of a whole checkpoint, streamed layer by layer."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..keyfile import (FINGERPRINTED, MODEL_META_FILE, MODEL_META_FORMAT, KeyFile, check_key_outside,  # noqa: F401
                       existing_key_problem, fingerprint_update, publish_key, recover_or_clean_staged_keys, stage_key)
from ..storage.staging import check_writable_destination
from .archs import LINEAR_ROLES, ArchSpec
from . import keymat
from .blocks import LayerContext, attention_kind, feed_forward_kind
from .checkpoint import (AtomicOutputDir, BlockFp8Writer, CheckpointError, ShardedWriter, SourceCheckpoint,
                         clean_stale_outputs, open_checkpoint)
from .fp8 import RELEASE_BLOCK, BlockFp8
from .params import ObfuscationParams
from .secrets import ModelShape, SecretSampler, effective_h, resolve_seed
from .sharding import check_tensor_parallel, layout_of
from .transforms import obfuscate_embedding, obfuscate_head, padded_rope_theta, split_norm_weight

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
FP8 = "fp8"  # block-quantized float8_e4m3fn linear weights, the rest bfloat16 (the FP8 releases' format)
OUTPUT_DTYPES = (*sorted(_DTYPES), FP8)


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
    return ModelShape(
        d=d, vocab_size=int(cfg["vocab_size"]), num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), intermediate_size=int(cfg["intermediate_size"]),
        rope_base=rope_base, qk_norm=spec.qk_norm, **attention_kind(spec).shape_fields(cfg),
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
    else:
        kw.update(attention_kind(spec).config_fields(shape))
    kw.update(spec.output_overrides)
    if spec.output_model_type == "llama":
        kw["attention_bias"] = has_qkv_bias
        kw.setdefault("mlp_bias", False)
    cfg = AutoConfig.for_model(spec.output_model_type, **kw)
    d = cfg.to_dict()
    d["architectures"] = [spec.output_architecture]
    d["dtype"] = str(dtype).replace("torch.", "")
    return d


def output_layout(source: SourceCheckpoint, shape: ModelShape, hidden: int):
    """The widths of the output that a tensor-parallel engine splits (sharding.ShardLayout): the source's head
    counts and feed-forward sizes; per-head width the source's, or hidden / heads where heads are padded."""
    cfg, spec = source.config, source.spec
    ffn = {}
    if any(not source.is_moe_layer(i) for i in range(shape.num_layers)):
        ffn["dense"] = int(cfg["intermediate_size"])
    if spec.moe is not None and any(source.is_moe_layer(i) for i in range(shape.num_layers)):
        ffn["expert"] = int(cfg[spec.moe.expert_intermediate_key])
        if spec.moe.shared_expert:
            ffn["shared expert"] = spec.moe.shared_intermediate_size(cfg)
    head_dim = hidden // shape.num_heads if spec.pad_heads else shape.head_dim
    return layout_of(cfg, spec.attention == "mla", head_dim, ffn)


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


def product_dtype(out_dtype: torch.dtype, params: ObfuscationParams) -> torch.dtype:
    """The dtype the weight products run in. float64 for a float64 output and for a noiseless (``is_exact``)
    preset, whose purpose is exactness: float32 products double its float32 logit error on Qwen2.5-Coder-0.5B.
    float32 otherwise, about twice as fast: its rounding (1e-7 relative) is six orders below the noise the
    preset adds (docs/performance.md, "Precision"; benchmarks/product_precision.py)."""
    return torch.float64 if out_dtype == torch.float64 or params.is_exact else torch.float32


def check_key_matrix_memory(shape: ModelShape, params: ObfuscationParams) -> None:
    """Refuse an expansion h whose (d+2h)^2 float64 key matrices cannot fit in memory, before sampling them
    (otherwise a MemoryError, or the OOM killer, arrives after minutes of work)."""
    D = shape.d + 2 * effective_h(shape.d, params.h, shape.num_heads)
    need = 4 * D * D * 8  # Z, the Gaussian it is drawn from and its QR factors, float64
    available = _available_memory()
    if available is not None and need > available:
        raise ValueError(f"h={params.h} makes the hidden size {D} (model width {shape.d}); its key matrices need "
                         f"{need / 2**30:.1f} GiB but {available / 2**30:.1f} GiB are available; choose a smaller "
                         "--h (the paper uses 128)")


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def obfuscate(
    src: str | Path,
    out: str | Path,
    key_out: str | Path,
    params: ObfuscationParams,
    seed: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    progress: bool = True,
    allow_weak_seed: bool = False,
    noise_factors: tuple | None = None,
    tp: int = 1,
) -> ObfuscationResult:
    """Obfuscate ``src`` (HF checkpoint directory or .gguf) into ``out`` (server artifact) and ``key_out``.

    ``seed`` is the whole secret: None (the default) draws 256 bits from the OS CSPRNG. An explicit seed of fewer
    than 128 bits is refused unless ``allow_weak_seed`` (a reproducible, insecure key: tests and benchmarks only).

    ``dtype``: the output precision, one of OUTPUT_DTYPES; default the source's (``fp8`` for a block-quantized FP8
    source, float32 for GGUF). ``tp``: refuse an output a ``tp``-GPU tensor-parallel engine could not split.

    Every destination is checked before any work. The model is written into a temporary sibling directory and
    the key into a temporary sibling file (mode 0600); the model directory is renamed into place first, then
    the key. A rerun removes what a killed run left (see storage/staging.py) and never finds an orphan key in place.
    """
    t0 = time.perf_counter()
    out, key_out = Path(out).resolve(), Path(key_out).resolve()
    check_key_outside(key_out, out)
    seed = resolve_seed(seed, allow_weak_seed)
    if not isinstance(params, ObfuscationParams):
        raise ValueError(f"params must be an ObfuscationParams (see resolve_params), got {type(params).__name__}")
    if params.needs_noise_factors != (noise_factors is not None):
        raise ValueError("noise_shape 'fisher' with noise needs noise_factors=aloepri.eval.sensitivity."
                         "fisher_noise_factors(src) (the CLI computes them), and only it takes them")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(OUTPUT_DTYPES)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer (the tensor-parallel GPU count), got {tp!r}")
    clean_stale_outputs(out)
    recover_or_clean_staged_keys(key_out, out)
    if key_out.exists() and not overwrite:
        raise FileExistsError(existing_key_problem(key_out, out))
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose a new output path or pass --force")
    check_writable_destination(out, "output directory")
    check_writable_destination(key_out, "key file")
    with _gc_paused(), contextlib.closing(open_checkpoint(src)) as source, keymat.single_threaded_blas():
        return _obfuscate_source(source, src, out, key_out, params, seed, dtype, max_shard_bytes, overwrite, progress,
                                 t0, noise_factors, tp)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector, off for the run: its full passes walk every object of the imported
    libraries (transformers, torch) and cost ~0.8 s of a Qwen2.5-Coder-0.5B obfuscation (docs/performance.md),
    while the run itself makes no big reference cycles (same peak memory measured with it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _obfuscate_source(source: SourceCheckpoint, src, out: Path, key_out: Path, params: ObfuscationParams, seed: int,
                      dtype: str | None, max_shard_bytes: int, overwrite: bool, progress: bool,
                      t0: float, noise_factors: tuple | None = None, tp: int = 1) -> ObfuscationResult:
    source.validate()
    spec, cfg = source.spec, source.config
    shape = model_shape(cfg, spec)
    if shape.head_dim % 2:
        raise CheckpointError(f"head_dim {shape.head_dim} is odd; RoPE pairs need an even head_dim")
    source_fp8 = source.fp8
    if dtype is None:
        src_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        dtype = FP8 if source_fp8 is not None else src_dtype if src_dtype in _DTYPES else "float32"
    fp8_out = (source_fp8 or BlockFp8(RELEASE_BLOCK)) if dtype == FP8 else None
    # FP8 output: the layers hand float32 to the writer, which quantizes their linear weights; the rest bfloat16
    out_dtype = torch.bfloat16 if fp8_out else _DTYPES[dtype]
    layer_dtype = torch.float32 if fp8_out else out_dtype
    compute_dtype = product_dtype(_DTYPES.get(dtype, torch.float32), params)
    check_key_matrix_memory(shape, params)
    check_tensor_parallel(output_layout(source, shape, shape.d + 2 * effective_h(shape.d, params.h, shape.num_heads)),
                          tp, fp8_out.block if fp8_out else None)

    if params.outlier_dims >= shape.d:  # before the extra pass over the feed-forward weights
        raise ValueError(f"outlier_dims={params.outlier_dims} must be smaller than the hidden size {shape.d}")
    outliers = massive_activation_dims(source, shape.num_layers, params.outlier_dims) if params.outlier_dims else ()
    secrets = SecretSampler(seed, params, shape, outliers)
    vocab_perm = secrets.vocab_permutation()
    D = secrets.hidden_size
    flops = 0.0
    staged_key = writer = None
    staging = AtomicOutputDir(out, overwrite=overwrite)
    # one worker thread overlaps the work that does not need the layers with them: the fingerprint's sha256 of
    # the vocabulary matrices and the output config (the first use of transformers' config classes imports them);
    # hashlib and torch's kernels release the GIL
    background = ThreadPoolExecutor(max_workers=1)
    try:
        writer = ShardedWriter(staging.tmp, max_shard_bytes)
        if fp8_out:
            writer = BlockFp8Writer(writer, fp8_out, spec)
        fp = hashlib.sha256()
        steps = tqdm(total=shape.num_layers + 2, desc="obfuscating", unit="block", disable=not progress)
        has_qkv_bias = source.has("q", 0, "bias")
        out_cfg = background.submit(output_config, cfg, spec, shape, D, float(cfg.get("rms_norm_eps", 1e-6)),
                                    has_qkv_bias, out_dtype, vocab_perm)

        embed = source.get("embed", dtype=None)  # stored precision; converted chunk by chunk
        calib = None
        if params.kappa_mode == "embedding":
            idx = secrets.rng("kappa-calibration").choice(embed.shape[0], size=min(4096, embed.shape[0]), replace=False)
            calib = embed[torch.from_numpy(np.sort(idx))].to(torch.float64).numpy()
        kappa = secrets.kappa(calib)
        f_embed, f_head = noise_factors if noise_factors is not None else (None, None)
        e_obf = obfuscate_embedding(embed, vocab_perm, secrets.writer_P("embed"), params.alpha_e,
                                    secrets.rng("noise", "embed"), out_dtype, params.noise_shape,
                                    f_embed if params.alpha_e > 0 else None, compute_dtype)
        flops += 2.0 * embed.shape[0] * shape.d * D
        hashed = [background.submit(fingerprint_update, fp, "model.embed_tokens.weight", e_obf)]
        writer.add("model.embed_tokens.weight", e_obf)
        head_plain = embed if source.tied_embeddings else source.get("head", dtype=None)
        del embed, e_obf
        final_server_norm, final_reader_norm = split_norm_weight(source.get("final_norm"), kappa,
                                                                 secrets.kept_columns, D)
        h_obf = obfuscate_head(head_plain, final_reader_norm, vocab_perm, secrets.reader_Q("head"),
                               params.alpha_h, secrets.rng("noise", "head"), out_dtype, params.noise_shape,
                               f_head if params.alpha_h > 0 else None, compute_dtype)
        flops += 2.0 * head_plain.shape[0] * shape.d * D
        hashed.append(background.submit(fingerprint_update, fp, "lm_head.weight", h_obf))  # in order: one worker
        writer.add("lm_head.weight", h_obf)
        writer.add("model.norm.weight", final_server_norm.to(out_dtype))
        del head_plain, h_obf
        steps.update(2)

        for i in range(shape.num_layers):
            flops += _obfuscate_layer(source, writer, secrets, i, shape, layer_dtype, kappa, has_qkv_bias, spec,
                                      params, compute_dtype)
            steps.update(1)
        steps.close()
        writer.finish()

        for done in hashed:
            done.result()
        fingerprint = fp.hexdigest()
        out_cfg = out_cfg.result()
        if fp8_out:
            out_cfg["quantization_config"] = fp8_out.config()
        (staging.tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True, allow_nan=False) + "\n")
        special = _special_ids(source)
        gen = {k: _map_ids(v, vocab_perm) for k, v in special.items()}
        gen["_from_model_config"] = False
        (staging.tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, allow_nan=False) + "\n")
        from .server_tokenizer import write_hf_tokenizer  # neutral tokenizer: one opaque symbol per id, EOS only

        write_hf_tokenizer(staging.tmp, int(out_cfg["vocab_size"]), gen.get("eos_token_id"),
                           out_cfg.get("max_position_embeddings"))
        meta = {"format": MODEL_META_FORMAT, "version": 1, "model_fingerprint": fingerprint,
                "fingerprint_tensors": list(FINGERPRINTED), "hidden_size": D, "source_architecture": spec.name}
        (staging.tmp / MODEL_META_FILE).write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")

        key = KeyFile(
            vocab_permutation=vocab_perm.tolist(), model_fingerprint=fingerprint, params=params.to_dict(),
            seed=int(seed), h_effective=secrets.h, hidden_size=D, source=str(Path(src).resolve()),
            architecture=spec.name, special_tokens=special, tokenizer=source.tokenizer_kwargs(),
            chat_template=getattr(source, "chat_template", None),
        )
        staged_key = stage_key(key, key_out)
        staging.commit()
    except BaseException:
        if writer is not None:
            writer.abandon()  # no shard write may still be running when the staging directory goes
        staging.abort()
        if staged_key is not None:
            staged_key.unlink(missing_ok=True)
        raise
    finally:
        background.shutdown(cancel_futures=True)
    publish_key(staged_key, key_out)  # after the model: a key in place always has its model
    return ObfuscationResult(out, key_out, fingerprint, D, secrets.h, time.perf_counter() - t0, writer.total_bytes, flops)


def massive_activation_dims(source: SourceCheckpoint, num_layers: int, count: int) -> tuple:
    """The ``count`` residual dimensions with the largest feed-forward output rows, summed over layers: where the
    massive activations are written (on SmolLM2 the top three are the residual stream's three largest dimensions,
    one of which holds 98% of its mean square over a chat prompt). MoE layers count their shared expert, or their
    routed experts when they have none. Public weights only: the server can compute the same list,
    so choosing by it reveals nothing the public model does not."""
    energy = None
    for i in range(num_layers):
        role = next((r for r in ("down", "shared_down") if _has_role(source, r, i)), None)
        if role is not None:
            rows = _row_energy(source.get(role, i, dtype=None))
        else:  # routed experts only (Mixtral): their down projections, a third of the layer's weights
            rows = sum(_row_energy(source.get("expert_down", i, expert=e, dtype=None))
                       for e in range(source.num_experts))
        energy = rows if energy is None else energy + rows
    return tuple(sorted(int(i) for i in torch.argsort(energy, descending=True)[:count]))


def _row_energy(w: torch.Tensor) -> torch.Tensor:
    """Squared row norms in float64, without a float64 copy of the (stored-precision) weight."""
    return torch.linalg.vector_norm(w, dim=1, dtype=torch.float64).square()


def _has_role(source: SourceCheckpoint, role: str, layer: int) -> bool:
    try:
        return source.has(role, layer)
    except CheckpointError:  # the architecture has no such role at all
        return False


def _obfuscate_layer(source: SourceCheckpoint, writer: ShardedWriter, secrets: SecretSampler, i: int,
                     shape: ModelShape, out_dtype: torch.dtype, kappa: float, has_qkv_bias: bool,
                     spec: ArchSpec, params: ObfuscationParams, compute_dtype: torch.dtype = torch.float64) -> float:
    """One decoder layer: its attention block, then its feed-forward block, each by the strategy of its kind
    (blocks.py). Returns FLOPs."""
    prefix = f"model.layers.{i}."
    names = spec.hf_role_names()

    def put(role: str, tensor: torch.Tensor, part: str = "weight", expert: int | None = None) -> None:
        name = prefix + names[role].format(e=expert)
        writer.add(name + f".{part}" if role in LINEAR_ROLES else name, tensor.to(out_dtype))

    norms = {role: split_norm_weight(source.get(role, i), kappa, secrets.kept_columns, secrets.hidden_size)
             for role in ("attn_norm", "ffn_norm")}
    ctx = LayerContext(source, secrets, shape, spec, params, has_qkv_bias, put,
                       reader_norms={role: reader for role, (_, reader) in norms.items()}, compute_dtype=compute_dtype)
    flops = attention_kind(spec).obfuscate(ctx, i)
    writer.add(prefix + "input_layernorm.weight", norms["attn_norm"][0].to(out_dtype))
    flops += feed_forward_kind(source, i).obfuscate(ctx, i)
    writer.add(prefix + "post_attention_layernorm.weight", norms["ffn_norm"][0].to(out_dtype))
    return flops
