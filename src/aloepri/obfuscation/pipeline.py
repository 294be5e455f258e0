"""Offline obfuscation of a whole checkpoint, streamed layer by layer.

The driver has three parts that plug together: ``plan_obfuscation`` decides everything before a weight is
transformed (shapes, secrets, dtypes, device); ``obfuscated_tensors(plan)`` is a generator of the output tensors,
block by block (the vocabulary matrices as row-block streams, blocks.VocabularyBlocks; every decoder layer's
attention and feed-forward, blocks.py); the writer (checkpoint.ShardedWriter) consumes them into shards while the
fingerprint is hashed beside it. Another source format is another reader, another device a ``device`` argument,
another output format another consumer of the same generator.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..keyfile import (FINGERPRINTED, MODEL_META_FILE, MODEL_META_FORMAT, KeyFile, check_key_outside,  # noqa: F401
                       existing_key_problem, fingerprint_begin, fingerprint_update, publish_key,
                       recover_or_clean_staged_keys, stage_key)
from ..progress import Progress
from ..storage.staging import check_writable_destination
from ..storage.devices import resolve_device
from .archs import ArchSpec, TensorNames
from . import keymat, residual
from .blocks import VOCABULARY, LayerContext, StreamedTensor, attention_kind, feed_forward_kind
from .checkpoint import (AtomicOutputDir, BlockFp8Writer, CheckpointError, ShardedWriter, SourceCheckpoint,
                         clean_stale_outputs, open_checkpoint)
from .fp8 import RELEASE_BLOCK, BlockFp8
from .params import MAX_OUTLIER_DIMS, PRESETS, ObfuscationParams
from .residual import KeptDims
from .secrets import SecretSampler, resolve_seed
from .shape import ModelShape, effective_h
from .sharding import check_tensor_parallel, layout_of
from .transforms import padded_rope_theta, split_norm_weight

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
    block_seconds: dict[str, float] | None = None  # wall time per block (embedding, head, layer i), writing included
    kept_dims: tuple = ()  # the residual dimensions kept out of the key's mixing
    kept_dims_rule: str = "none"  # how they were chosen (residual.KeptDims.rule)


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
        # a published config's scaling (Llama-3.1's "llama3", DeepSeek's "yarn") and its base in one entry: passed
        # on as rope_scaling beside rope_parameters, the scaling would replace the parameters and the base would
        # fall back to 10000 while the plaintext model loads with its own (500000 for Llama-3.1)
        rope = dict(kw.pop("rope_scaling", None) or {"rope_type": "default"})
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope.pop("type")
        rope["rope_theta"] = src_cfg["rope_theta"]
        kw["rope_parameters"] = rope
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
    if spec.attention_bias_with_o:
        kw["attention_bias"] = has_qkv_bias
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
    """The dtype the weight products run in: float32 unless the output is float64, or float32 and the preset is
    noiseless (``is_exact``).

    - float64 output: float64 products, nothing less is worth storing in it.
    - float32 output of a noiseless preset: float64, because exactness is that preset's purpose and float32
      products double its float32 logit error on Qwen2.5-Coder-0.5B (docs/performance.md, "Precision").
    - 16-bit outputs: float32 whatever the preset. The storage rounding (2^-9 relative for bf16) is ~10^4 times a
      float32 product's error: measured at width 2048 with a real key, 0.04% of bf16 entries (0.19% of fp16)
      differ between float32 and float64 products, each by one rounding step (experiment product_rounding).
    - a noisy preset: float32, its rounding (1e-7 relative) six orders below the noise it adds."""
    if out_dtype == torch.float64 or (params.is_exact and out_dtype == torch.float32):
        return torch.float64
    return torch.float32


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


def default_output_dtype(source: SourceCheckpoint) -> str:
    """The output precision when none is asked for: the one rule of the Python API (``obfuscate``) and the CLI
    (docs/accuracy.md, "Output precision for a quantized GGUF source").

    - an FP8 source: fp8, its own format;
    - a GGUF source stored in less than float32 (quantized, or F16/BF16): bfloat16. Its float32 output would be
      2-7x the file (7 GB from Qwen2.5-Coder-1.5B's 1.1 GB Q4_K_M); computed in float32 the bfloat16 output is
      within 1e-4 nats of the plaintext model, computed in bfloat16 it costs about what the plaintext model costs
      in bfloat16 (experiment output_precision, per model: docs/accuracy.md);
    - otherwise the source's own precision (float32 when its config names none, as for an F32 GGUF)."""
    if source.fp8 is not None:
        return FP8
    if getattr(source, "below_float32", False):
        return "bfloat16"
    src_dtype = str(source.config.get("dtype") or source.config.get("torch_dtype") or "float32")
    return src_dtype if src_dtype in _DTYPES else "float32"


def serving_dtype(src: str | Path) -> str:
    """The output precision ``obfuscate`` and ``aloepri obfuscate`` write from ``src`` when none is asked for
    (``default_output_dtype``)."""
    with contextlib.closing(open_checkpoint(src)) as source:
        return default_output_dtype(source)


def obfuscate(
    src: str | Path,
    out: str | Path,
    key_out: str | Path,
    params: ObfuscationParams | None = None,
    seed: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 256 << 20,
    overwrite: bool = False,
    progress: bool = True,
    allow_weak_seed: bool = False,
    noise_factors: tuple | None = None,
    device: str = "cpu",
    tp: int = 1,
) -> ObfuscationResult:
    """Obfuscate ``src`` (HF checkpoint directory or .gguf) into ``out`` (server artifact) and ``key_out``.

    ``params`` defaults to the ``default`` preset (lossless: logits equal plaintext's up to float rounding).

    ``seed`` is the whole secret: None (the default) draws 256 bits from the OS CSPRNG. An explicit seed of fewer
    than 128 bits is refused unless ``allow_weak_seed`` (a reproducible, insecure key: tests and benchmarks only).

    ``dtype``: the output precision, one of OUTPUT_DTYPES; default ``default_output_dtype``: the source's own,
    except bfloat16 from a GGUF stored below float32 (the CLI's rule too). ``tp``: refuse an output a ``tp``-GPU
    tensor-parallel engine could not split.

    Every destination is checked before any work. The model is written into a temporary sibling directory and
    the key into a temporary sibling file (mode 0600); the model directory is renamed into place first, then
    the key. A rerun removes what a killed run left (see storage/staging.py) and never finds an orphan key in place.

    ``device`` ("cpu", "cuda", "cuda:1", ...) runs the weight products there; the secrets are drawn on the CPU
    from the key's streams whatever the device, so a seed gives the same model (up to the device's rounding).
    """
    t0 = time.perf_counter()
    out, key_out = Path(out).resolve(), Path(key_out).resolve()
    check_key_outside(key_out, out)
    seed = resolve_seed(seed, allow_weak_seed)
    if params is None:
        params = PRESETS["default"]
    if not isinstance(params, ObfuscationParams):
        raise ValueError(f"params must be an ObfuscationParams (see resolve_params), got {type(params).__name__}")
    if params.needs_noise_factors != (noise_factors is not None):
        raise ValueError("noise_shape 'fisher' with noise needs noise_factors=aloepri.runtime.sensitivity."
                         "fisher_noise_factors(src) (the CLI computes them), and only it takes them")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(OUTPUT_DTYPES)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer (the tensor-parallel GPU count), got {tp!r}")
    device = obfuscation_device(device)
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
                                 t0, noise_factors, device, tp)


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


def obfuscation_device(device: str | torch.device | None) -> torch.device:
    """The torch device the products run on (the one device check, storage.devices.resolve_device), limited to
    cpu and cuda: the exact products are float64, which other accelerators (mps) do not run."""
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device type {dev.type!r} is not supported for obfuscation; use cpu or cuda")
    return dev


@dataclass
class ObfuscationPlan:
    """Everything decided before a weight is transformed: the source, shapes, secrets, dtypes and device.
    ``flops`` counts the weight products as the generator runs them."""
    source: SourceCheckpoint
    spec: ArchSpec
    shape: ModelShape
    params: ObfuscationParams
    secrets: SecretSampler
    vocab_perm: np.ndarray
    kappa: float
    out_dtype: torch.dtype  # the embedding, head and (FP8 output) every unquantized tensor
    layer_dtype: torch.dtype  # the decoder layers' tensors as handed to the writer (float32 when it quantizes)
    compute_dtype: torch.dtype
    device: torch.device
    has_qkv_bias: bool
    noise_factors: tuple | None = None
    fp8_out: BlockFp8 | None = None  # the block format the writer quantizes the linear weights to, if FP8 output
    flops: float = 0.0
    kept: KeptDims = KeptDims((), "none")  # the residual dimensions kept out of the key's mixing, and how chosen


def plan_obfuscation(source: SourceCheckpoint, params: ObfuscationParams, seed: int, dtype: str | None = None,
                     device: torch.device = torch.device("cpu"), noise_factors: tuple | None = None,
                     tp: int = 1) -> ObfuscationPlan:
    """Validate the source against its config, choose the dtypes and draw the secrets (on the CPU)."""
    source.validate()
    spec, cfg = source.spec, source.config
    shape = model_shape(cfg, spec)
    if shape.head_dim % 2:
        raise CheckpointError(f"head_dim {shape.head_dim} is odd; RoPE pairs need an even head_dim")
    source_fp8 = source.fp8
    if dtype is None:
        dtype = default_output_dtype(source)
    fp8_out = (source_fp8 or BlockFp8(RELEASE_BLOCK)) if dtype == FP8 else None
    # FP8 output: the layers hand float32 to the writer, which quantizes their linear weights; the rest bfloat16
    out_dtype = torch.bfloat16 if fp8_out else _DTYPES[dtype]
    layer_dtype = torch.float32 if fp8_out else out_dtype
    compute_dtype = product_dtype(_DTYPES.get(dtype, torch.float32), params)
    check_key_matrix_memory(shape, params)
    check_tensor_parallel(output_layout(source, shape, shape.d + 2 * effective_h(shape.d, params.h, shape.num_heads)),
                          tp, fp8_out.block if fp8_out else None)
    kept = kept_dimensions(source, shape, params)
    secrets = SecretSampler(seed, params, shape, kept.dims)
    calib = None
    if params.kappa_mode == "embedding":
        embed = source.get("embed", dtype=None)
        idx = secrets.rng("kappa-calibration").choice(embed.shape[0], size=min(4096, embed.shape[0]), replace=False)
        calib = embed[torch.from_numpy(np.sort(idx))].to(torch.float64).numpy()
        del embed
    return ObfuscationPlan(source, spec, shape, params, secrets, secrets.vocab_permutation(), secrets.kappa(calib),
                           out_dtype, layer_dtype, compute_dtype, device, source.has("q", 0, "bias"), noise_factors,
                           fp8_out, kept=kept)


def kept_dimensions(source: SourceCheckpoint, shape: ModelShape, params: ObfuscationParams) -> KeptDims:
    """The residual dimensions the key keeps out of its mixing: by params.outlier_rms (measured on the public
    model, residual.py), by params.outlier_dims (the weights' largest feed-forward output rows), or none."""
    limit = min(MAX_OUTLIER_DIMS, shape.d - 1)
    if params.outlier_rms:
        return residual.kept_dims(source, params.outlier_rms, limit, _available_memory(),
                                  lambda: massive_activation_dims(source, shape.num_layers,
                                                                  min(residual.FALLBACK_COUNT, limit)))
    if params.outlier_dims >= shape.d:  # before the extra pass over the feed-forward weights
        raise ValueError(f"outlier_dims={params.outlier_dims} must be smaller than the hidden size {shape.d}")
    if params.outlier_dims:
        return KeptDims(massive_activation_dims(source, shape.num_layers, params.outlier_dims), "weights")
    return KeptDims((), "none")


def obfuscated_tensors(plan: ObfuscationPlan) -> Iterator[tuple[str, torch.Tensor] | StreamedTensor]:
    """Every output tensor of the obfuscated model, in writing order: the embedding and the head (row-block
    streams: consume each before asking for the next), the final norm, then decoder layer after decoder layer.
    About one layer, or one source vocabulary matrix, is in memory at a time."""
    yield from VOCABULARY.embedding(plan)
    yield from VOCABULARY.head(plan)
    for i in range(plan.shape.num_layers):
        yield from _obfuscate_layer(plan, i)


def _block_of(names: TensorNames, name: str) -> str:
    """The block an output tensor belongs to, for timing: embedding, head (with the final norm) or layer i."""
    layer = names.layer_of(name)
    if layer is not None:
        return f"layer {layer}"
    return "embedding" if name == names.of("embed") else "head"


def _obfuscate_source(source: SourceCheckpoint, src, out: Path, key_out: Path, params: ObfuscationParams, seed: int,
                      dtype: str | None, max_shard_bytes: int, overwrite: bool, progress: bool,
                      t0: float, noise_factors: tuple | None = None,
                      device: torch.device = torch.device("cpu"), tp: int = 1) -> ObfuscationResult:
    plan = plan_obfuscation(source, params, seed, dtype, device, noise_factors, tp)
    fp8_out = plan.fp8_out
    spec, cfg, shape, secrets, vocab_perm = plan.spec, source.config, plan.shape, plan.secrets, plan.vocab_perm
    D = secrets.hidden_size
    staged_key = writer = steps = None
    staging = AtomicOutputDir(out, overwrite=overwrite)
    # one worker thread overlaps the work that does not need the products with them: the fingerprint's sha256 of
    # the vocabulary matrices (block by block, in order) and the output config (the first use of transformers'
    # config classes imports them); hashlib and torch's kernels release the GIL
    background = ThreadPoolExecutor(max_workers=1)
    block_seconds: dict[str, float] = {}
    try:
        writer = ShardedWriter(staging.tmp, max_shard_bytes)
        if fp8_out:
            writer = BlockFp8Writer(writer, fp8_out, spec)
        fp = hashlib.sha256()
        steps = Progress(shape.num_layers + 2, "obfuscating", unit="block", enabled=progress)
        out_cfg = background.submit(output_config, cfg, spec, shape, D, float(cfg.get("rms_norm_eps", 1e-6)),
                                    plan.has_qkv_bias, plan.out_dtype, vocab_perm)
        hashed = []

        def hash_block(block: torch.Tensor) -> None:
            hashed.append(background.submit(fp.update, block.view(torch.uint8).numpy()))

        tensors = obfuscated_tensors(plan)
        t, block = time.perf_counter(), None
        for item in tensors:
            name = item.name if isinstance(item, StreamedTensor) else item[0]
            if _block_of(spec.hf_names, name) != block:
                if block is not None:
                    steps.advance()
                block = _block_of(spec.hf_names, name)
            if isinstance(item, StreamedTensor):
                if name in FINGERPRINTED:  # in FINGERPRINTED's order: the embedding, then the head
                    hashed.append(background.submit(fingerprint_begin, fp, name, item.dtype, item.shape))
                writer.add_stream(name, item.shape, item.dtype, item.blocks,
                                  hash_block if name in FINGERPRINTED else None)
            else:
                writer.add(name, item[1])
            now = time.perf_counter()
            block_seconds[block] = block_seconds.get(block, 0.0) + now - t
            t = now
        steps.advance()
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
        if steps is not None:
            steps.close()  # idempotent; stops the bar's redrawing thread on an error too
        background.shutdown(cancel_futures=True)
    publish_key(staged_key, key_out)  # after the model: a key in place always has its model
    return ObfuscationResult(out, key_out, fingerprint, D, secrets.h, time.perf_counter() - t0, writer.total_bytes,
                             plan.flops, block_seconds, plan.kept.dims, plan.kept.rule)


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


def _obfuscate_layer(plan: ObfuscationPlan, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One decoder layer: its attention block, then its feed-forward block, each by the strategy of its kind
    (blocks.py). Yields its output tensors (CPU, output dtype) in writing order, a MoE layer's expert by expert;
    adds its FLOPs to the plan."""
    source, secrets, spec, out_dtype = plan.source, plan.secrets, plan.spec, plan.layer_dtype
    names = spec.hf_names
    ready: list[tuple[str, torch.Tensor]] = []

    def put(role: str, tensor: torch.Tensor, part: str = "weight", expert: int | None = None) -> None:
        ready.append((names.of(role, i, part, expert), tensor.to(device="cpu", dtype=out_dtype)))

    norms = {role: split_norm_weight(source.get(role, i), plan.kappa, secrets.kept_columns, secrets.hidden_size)
             for role in ("attn_norm", "ffn_norm")}
    ctx = LayerContext(source, secrets, plan.shape, spec, plan.params, plan.has_qkv_bias, put,
                       reader_norms={role: reader for role, (_, reader) in norms.items()},
                       compute_dtype=plan.compute_dtype, device=plan.device)
    for kind, norm_role in ((attention_kind(spec), "attn_norm"), (feed_forward_kind(source, i), "ffn_norm")):
        for flops in kind.steps(ctx, i):
            plan.flops += flops
            yield from ready
            ready.clear()
        yield names.of(norm_role, i), norms[norm_role][0].to(out_dtype)
