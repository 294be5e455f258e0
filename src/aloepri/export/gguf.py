"""Export an aloepri-obfuscated Hugging Face directory to a GGUF file that stock llama.cpp loads.

The obfuscated model is a stock Llama/Mistral (llama.cpp arch ``llama``) or Qwen3 (arch ``qwen3``) with an
expanded hidden size D = d + 2h and an explicit head_dim (so heads * head_dim != D): GGUF declares that with
``attention.key_length`` / ``value_length``, which both archs honour (their tensors are created as
[D, n_head * head_dim] and the graph reshapes by head_dim). For the ``llama`` arch, llama.cpp rotates adjacent
RoPE pairs (2i, 2i+1) while HF rotates (i, i + head_dim/2), so q/k rows (and biases) are permuted per head the
same way llama.cpp's own converter does; ``qwen3`` uses the NEOX (HF) layout and needs no permutation.

The tokenizer written into the file is the neutral one (see obfuscation/server_tokenizer.py): it leaks nothing of the
vocabulary permutation and stops exactly on the permuted EOS id(s).

Tensors are read one at a time and streamed into a temporary file that is renamed into place when complete.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..keyfile import MODEL_META_FILE, MODEL_META_FORMAT, read_model_meta
from ..obfuscation.archs import GGUF_ARCHS, GGUF_NAMES, LINEAR_ROLES, SPECS, ArchSpec, UnsupportedArchitectureError, \
    spec_for_hf
from ..obfuscation.transforms import interleave_rope_rows
from ..obfuscation.server_tokenizer import add_gguf_tokenizer, eos_ids_of
from ..storage.safetensors_dir import SafetensorsDir, SafetensorsError
from ..storage.staging import check_writable_destination, clean_stale, give_ordinary_modes, make_staging_file

log = logging.getLogger(__name__)

QTYPES = ("f32", "f16", "q8_0", "q4_0", "q5_0")
# K-quants: gguf-py cannot write them, so the file is written as f32 and requantized by llama.cpp's own quantizer
# (llama-cpp-python's llama_model_quantize), the way llama.cpp users make them; value: its LLAMA_FTYPE name
KQUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
           "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
ALL_TYPES = QTYPES + tuple(KQUANTS)
BLOCK = 32  # block size of q8_0 / q4_0 / q5_0
# The file's chat template: a Jinja comment (it renders nothing) that names the public model fingerprint. llama.cpp's
# llama-server publishes no other metadata of the file, but it shows the template in /props, where `aloepri proxy`
# reads the fingerprint and checks its key against it at start (aloepri.serving.client.guard.fingerprint_in_props).
# The server holds no chat template it could use anyway: it sees neutral symbols, and chat is rendered by the client.
FINGERPRINT_TEMPLATE = "{{#- aloepri model_fingerprint={fingerprint} -#}}"


class GGUFExportError(ValueError):
    """The directory cannot be expressed as a llama.cpp GGUF (clear reason in the message)."""


PLAINTEXT_REFERENCE_FORMAT = "aloepri-plaintext-reference"


def _aloepri_meta(model_dir: Path) -> dict[str, Any] | None:
    """The aloepri_model.json of a directory aloepri wrote, or None."""
    meta = read_model_meta(model_dir)
    return meta if meta is not None and meta.get("format") in (MODEL_META_FORMAT, PLAINTEXT_REFERENCE_FORMAT) else None


@dataclass
class ExportResult:
    outfile: Path
    arch: str
    qtype: str
    n_tensors: int
    bytes_written: int
    seconds: float


def _gguf_types(qtype: str):
    import gguf

    Q, F = gguf.GGMLQuantizationType, gguf.LlamaFileType
    return {
        "f32": (Q.F32, Q.F32, F.ALL_F32),
        "f16": (Q.F16, Q.F16, F.MOSTLY_F16),
        "q8_0": (Q.Q8_0, Q.Q8_0, F.MOSTLY_Q8_0),
        # low-bit types keep the embedding and the output head at q8_0 (llama.cpp's quantizer also keeps the
        # output at higher precision): both are large-vocabulary tables where 4/5 bits cost the most accuracy
        "q4_0": (Q.Q4_0, Q.Q8_0, F.MOSTLY_Q4_0),
        "q5_0": (Q.Q5_0, Q.Q8_0, F.MOSTLY_Q5_0),
    }[qtype]


class _Reader:
    """One tensor at a time (float32 numpy) from the safetensors of a server directory; a missing, malformed or
    truncated shard is refused before anything is written."""

    def __init__(self, model_dir: Path):
        try:
            self._tensors = SafetensorsDir(model_dir)
        except SafetensorsError as e:
            raise GGUFExportError(f"{e}; not an obfuscated model directory" if "no model.safetensors" in str(e)
                                  else str(e)) from None
        self.dir = model_dir
        self.weight_map = self._tensors.weight_map

    def has(self, name: str) -> bool:
        return self._tensors.has(name)

    def shape(self, name: str) -> list[int]:
        return self._tensors.shape(name)

    def get(self, name: str) -> np.ndarray:
        import torch

        try:
            t = self._tensors.get(name)
        except SafetensorsError as e:
            raise GGUFExportError(str(e)) from None
        return t.to(torch.float32).numpy()


@dataclass
class _Item:
    gguf_name: str
    hf_name: str
    shape: list[int]  # HF order: [out, in] or [n]
    qtype: Any
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def _rope_metadata(cfg: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rtype == "default":
        return theta, None
    if rtype == "linear":
        return theta, {"type": "linear", "factor": float(rope["factor"])}
    if rtype == "llama3":
        return theta, {"type": "llama3", "freqs": llama3_rope_factors(rope, theta, head_dim)}
    raise GGUFExportError(f"RoPE scaling type {rtype!r} is not supported by the GGUF export (default, linear, llama3 are)")


def llama3_rope_factors(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling (llama.cpp reads them from ``rope_freqs.weight``).

    Frequencies whose wavelength is short compared with the original context keep their value, long ones are
    divided by ``factor``, and the band in between is interpolated smoothly in 1/wavelength.
    """
    factor = float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    # scaled inv_freq = inv_freq * ((1 - smooth) / factor + smooth); llama.cpp divides by the stored value
    return (1.0 / ((1.0 - smooth) / factor + smooth)).astype(np.float32)


def _exportable() -> str:
    """The architectures whose outputs export to GGUF, for messages."""
    return "/".join(sorted({n for n, s in SPECS.items() if s.gguf_export is not None}))


def _plan(cfg: dict[str, Any], reader: _Reader, spec: ArchSpec, qtype: str) -> tuple[list[_Item], dict[str, Any]]:
    import gguf

    D = int(cfg["hidden_size"])
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or D // n_head)
    n_layer = int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    mat_t, table_t, _ = _gguf_types(qtype)
    F32 = gguf.GGMLQuantizationType.F32
    target = GGUF_ARCHS[spec.gguf_export]
    hf = spec.hf_names
    if target.qk_rows_interleaved and head_dim % 2:
        raise GGUFExportError(f"head_dim {head_dim} is odd; llama.cpp's {spec.gguf_export} needs RoPE pairs")
    items: list[_Item] = []

    def add(gname: str, hname: str, transform=None, required=True, is_table=False):
        if not reader.has(hname):
            if required:
                raise GGUFExportError(f"{reader.dir}: tensor {hname} is missing; not a complete obfuscated model")
            return
        shape = reader.shape(hname)
        qt = F32 if len(shape) == 1 else (table_t if is_table else mat_t)
        items.append(_Item(gname, hname, shape, qt, transform))

    add(GGUF_NAMES.of("embed"), hf.of("embed"), is_table=True)
    add(GGUF_NAMES.of("final_norm"), hf.of("final_norm"))
    # obfuscated models always have their own head; a plain tied checkpoint has none and llama.cpp then reuses
    # token_embd for the output
    add(GGUF_NAMES.of("head"), hf.of("head"), is_table=True, required=not cfg.get("tie_word_embeddings"))
    for i in range(n_layer):
        for role in spec.attention_roles(cfg) + spec.mlp_roles(cfg, i):  # dense GQA layers (spec.gguf_export)
            heads = n_head if role == "q" else n_kv
            perm = (lambda w, h=heads: interleave_rope_rows(w, h)) if target.qk_rows_interleaved and role in ("q", "k") \
                else None
            add(GGUF_NAMES.of(role, i), hf.of(role, i), perm)
            if role in LINEAR_ROLES:
                add(GGUF_NAMES.of(role, i, "bias"), hf.of(role, i, "bias"), perm, required=False)

    # shape checks against what llama.cpp will create
    expect = {GGUF_NAMES.of("embed"): [vocab, D], GGUF_NAMES.of("head"): [vocab, D]}
    for i in range(n_layer):
        expect[GGUF_NAMES.of("q", i)] = [n_head * head_dim, D]
        expect[GGUF_NAMES.of("k", i)] = [n_kv * head_dim, D]
        expect[GGUF_NAMES.of("v", i)] = [n_kv * head_dim, D]
        expect[GGUF_NAMES.of("o", i)] = [D, n_head * head_dim]
    for it in items:
        want = expect.get(it.gguf_name)
        if want is not None and list(it.shape) != want:
            raise GGUFExportError(f"{it.hf_name} has shape {it.shape}, expected {want} from config.json")
        if it.qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and it.shape[-1] % BLOCK:
            raise GGUFExportError(
                f"--type {qtype}: row length {it.shape[-1]} of {it.hf_name} is not a multiple of the {BLOCK}-value "
                "quantization block; export with --type f16 or f32 (or obfuscate with an h that makes d+2h a "
                f"multiple of {BLOCK})"
            )
    if not target.o_bias:
        o_biases = {GGUF_NAMES.of("o", i, "bias") for i in range(n_layer)}
        for it in items:
            if it.gguf_name in o_biases and np.any(reader.get(it.hf_name)):
                raise GGUFExportError(f"llama.cpp's {spec.gguf_export} has no attention output bias, but this model "
                                      "has a nonzero o_proj.bias; it cannot be exported to GGUF")
        items = [it for it in items if it.gguf_name not in o_biases]
    dims = dict(D=D, n_head=n_head, n_kv=n_kv, head_dim=head_dim, n_layer=n_layer, vocab=vocab)
    return items, dims


def export_gguf(model_dir: str | Path, outfile: str | Path, qtype: str = "f32", overwrite: bool = False,
                progress: bool = False, allow_foreign: bool = False) -> ExportResult:
    """Convert the obfuscated HF directory ``model_dir`` into ``outfile`` (GGUF, arch llama or qwen3).

    ``qtype``: f32, f16 (2-D tensors), q8_0, q4_0, q5_0 (2-D tensors; with q4_0/q5_0 the embedding and output
    head are q8_0). 1-D tensors (norms, biases) are always f32. A directory aloepri did not write (no
    aloepri_model.json) is refused unless ``allow_foreign``: converting a plaintext model by mistake would
    publish it.
    """
    import gguf

    t0 = time.perf_counter()
    model_dir, outfile = Path(model_dir), Path(outfile).absolute()
    if qtype in KQUANTS:
        return _export_kquant(model_dir, outfile, qtype, overwrite, progress, allow_foreign, t0)
    if qtype not in QTYPES:
        raise GGUFExportError(f"unknown GGUF type {qtype!r}; choose one of {list(ALL_TYPES)}")
    if not (model_dir / "config.json").is_file():
        raise GGUFExportError(f"{model_dir}: no config.json; expected an aloepri-obfuscated model directory")
    meta = _aloepri_meta(model_dir)
    if meta is None and not allow_foreign:
        raise GGUFExportError(f"{model_dir} was not written by aloepri (no valid aloepri_model.json); refusing to "
                              "convert it, it may be a plaintext model. Pass --allow-foreign to convert it anyway")
    if outfile.is_dir():
        raise GGUFExportError(f"--outfile {outfile} is a directory; give the path of the .gguf file to write")
    if outfile.exists() and not overwrite:
        raise FileExistsError(f"{outfile} already exists; choose another --outfile or pass --force")
    clean_stale(outfile, ".partial", "partial GGUF file")
    check_writable_destination(outfile, "GGUF file")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise GGUFExportError(f"{model_dir / 'config.json'}: not valid JSON ({e})") from None
    try:
        spec = spec_for_hf(cfg.get("architectures"))
    except UnsupportedArchitectureError as e:
        raise GGUFExportError(f"GGUF export: {e}") from e
    if spec.gguf_export is None:
        raise GGUFExportError(f"GGUF export supports {_exportable()} models; {spec.name} (MoE or MLA) is served from "
                              "the obfuscated safetensors directory (transformers/vLLM/SGLang, docs/moe-mla.md)")
    if cfg.get("quantization_config"):
        raise GGUFExportError(f"{model_dir} holds FP8 block-quantized weights (served as they are by vLLM/SGLang); "
                              "for GGUF obfuscate with --dtype float32 or bfloat16 and export that")
    if cfg.get("model_type") != spec.output_model_type:  # a source (Qwen2) rather than an output declaration
        raise GGUFExportError(f"GGUF export supports obfuscated {_exportable()} directories (declared as "
                              f"{spec.output_architecture}), not {cfg.get('architectures')}")
    arch = spec.gguf_export
    if "sliding_window" in spec.passthrough_config and cfg.get("sliding_window"):
        log.warning("sliding_window=%s is ignored: llama.cpp's %s arch attends over the whole context "
                    "(identical results up to that many tokens)", cfg["sliding_window"], arch)
    if cfg.get("mlp_bias"):
        raise GGUFExportError("mlp_bias=true is not supported by the GGUF export")

    reader = _Reader(model_dir)
    items, dims = _plan(cfg, reader, spec, qtype)
    theta, scaling = _rope_metadata(cfg, dims["head_dim"])
    eos = eos_ids_of(model_dir)
    if not eos:
        raise GGUFExportError(f"{model_dir}: no eos_token_id in generation_config.json or config.json; "
                              "llama.cpp would never stop generating")
    meta = meta or {}

    outfile.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_staging_file(outfile, ".partial")
    os.close(fd)
    written = 0
    gguf_logger = logging.getLogger("gguf.gguf_writer")
    level = gguf_logger.level
    gguf_logger.setLevel(logging.WARNING)  # the writer logs its plan at INFO
    w = None
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name("aloepri-obfuscated-model")
        w.add_file_type(_gguf_types(qtype)[2])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_vocab_size(dims["vocab"])
        w.add_context_length(int(cfg.get("max_position_embeddings") or 2048))
        w.add_embedding_length(dims["D"])
        w.add_block_count(dims["n_layer"])
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(dims["n_head"])
        w.add_head_count_kv(dims["n_kv"])
        w.add_key_length(dims["head_dim"])
        w.add_value_length(dims["head_dim"])
        w.add_rope_dimension_count(dims["head_dim"])
        w.add_rope_freq_base(theta)
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        if scaling and scaling["type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(scaling["factor"])
        if meta.get("model_fingerprint"):
            w.add_string("aloepri.model_fingerprint", str(meta["model_fingerprint"]))
            w.add_chat_template(FINGERPRINT_TEMPLATE.format(fingerprint=meta["model_fingerprint"]))
        add_gguf_tokenizer(w, dims["vocab"], eos)

        rope_freqs = scaling["freqs"] if scaling and scaling["type"] == "llama3" else None
        if rope_freqs is not None:
            w.add_tensor_info("rope_freqs.weight", list(rope_freqs.shape), np.float32, rope_freqs.nbytes)
        for it in items:
            if it.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                dt = np.float32 if it.qtype == gguf.GGMLQuantizationType.F32 else np.float16
                w.add_tensor_info(it.gguf_name, it.shape, np.dtype(dt), int(np.prod(it.shape)) * np.dtype(dt).itemsize)
            else:
                bshape = gguf.quants.quant_shape_to_byte_shape(it.shape, it.qtype)
                w.add_tensor_info(it.gguf_name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=it.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if rope_freqs is not None:
            w.write_tensor_data(rope_freqs)
            written += rope_freqs.nbytes
        from tqdm.auto import tqdm

        for it in tqdm(items, desc="gguf", unit="tensor", disable=not progress):
            a = reader.get(it.hf_name)
            if it.transform is not None:
                a = it.transform(a)
            if it.qtype == gguf.GGMLQuantizationType.F32:
                data = np.ascontiguousarray(a, dtype=np.float32)
            elif it.qtype == gguf.GGMLQuantizationType.F16:
                data = np.ascontiguousarray(a.astype(np.float16))
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), it.qtype)
            w.write_tensor_data(data)
            written += data.nbytes
            del a, data
        w.flush()
        for f in w.fout or []:
            os.fsync(f.fileno())
        w.close()
        give_ordinary_modes(tmp)  # the staging file is 0600; the model file is public
        os.replace(tmp, outfile)
    except BaseException:
        if w is not None:
            w.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        gguf_logger.setLevel(level)
    return ExportResult(outfile, arch, qtype, len(items) + (rope_freqs is not None), written, time.perf_counter() - t0)


def _llama_quantizer():
    try:
        import llama_cpp
    except ImportError:
        raise GGUFExportError("K-quant types are made by llama.cpp's quantizer: install llama-cpp-python "
                              "(pip install 'aloepri[llamacpp]'), or export q8_0/q4_0/q5_0") from None
    return llama_cpp


def _export_kquant(model_dir: Path, outfile: Path, qtype: str, overwrite: bool, progress: bool,
                   allow_foreign: bool, t0: float) -> ExportResult:
    """f32 GGUF in a staging file, requantized by llama.cpp to ``qtype``, moved into place."""
    llama_cpp = _llama_quantizer()
    if outfile.exists() and not overwrite:
        raise FileExistsError(f"{outfile} already exists; choose another --outfile or pass --force")
    clean_stale(outfile, ".partial", "partial GGUF file")
    check_writable_destination(outfile, "GGUF file")
    outfile.parent.mkdir(parents=True, exist_ok=True)
    fd, f32_tmp = make_staging_file(outfile, ".f32.partial")
    os.close(fd)
    fd, tmp = make_staging_file(outfile, ".partial")
    os.close(fd)
    try:
        f32 = export_gguf(model_dir, f32_tmp, "f32", overwrite=True, progress=progress, allow_foreign=allow_foreign)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, KQUANTS[qtype])
        params.nthread = max(1, os.cpu_count() or 1)
        rc = llama_cpp.llama_model_quantize(str(f32_tmp).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise GGUFExportError(f"llama.cpp's quantizer failed on {f32_tmp} ({qtype}, return code {rc})")
        give_ordinary_modes(tmp)
        os.replace(tmp, outfile)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        f32_tmp.unlink(missing_ok=True)
    return ExportResult(outfile, f32.arch, qtype, f32.n_tensors, outfile.stat().st_size, time.perf_counter() - t0)


def plaintext_reference_dir(src: str | Path, directory: str | Path) -> Path:
    """The plaintext source checkpoint as a float32 HF directory holding exactly the weights the obfuscation
    starts from (aloepri's reader: dequantized, q/k rows in HF order). Exported with :func:`export_gguf` it is
    the same-precision plaintext baseline for comparisons on llama.cpp (a quantized plaintext GGUF also rounds
    activations, which flips near-ties). Embeddings stay tied when the source ties them."""
    import torch
    from safetensors.torch import save_file

    from ..obfuscation.checkpoint import open_checkpoint

    directory = Path(directory)
    ck = open_checkpoint(src)
    try:
        if ck.spec.gguf_export is None:
            raise GGUFExportError(f"a plaintext GGUF reference supports {_exportable()} models, not {ck.spec.name}")
        names = ck.spec.hf_names
        sd = {names.of(r): ck.get(r).float().contiguous() for r in ("embed", "final_norm")}
        if not ck.tied_embeddings:
            sd[names.of("head")] = ck.get("head").float().contiguous()
        for i in range(ck.num_layers):
            for role in ck.attention_roles(i) + ck.mlp_roles(i):
                for part in ("weight", "bias") if role in LINEAR_ROLES else ("weight",):
                    if ck.has(role, i, part):
                        sd[names.of(role, i, part)] = ck.get(role, i, part).float().contiguous()
        cfg = {k: v for k, v in ck.config.items() if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
        cfg.update(architectures=[ck.spec.output_architecture], model_type=ck.spec.output_model_type,
                   tie_word_embeddings=ck.tied_embeddings, dtype="float32")
        if ck.spec.attention_bias_with_o:
            cfg["attention_bias"] = ck.has("q", 0, "bias")
            if cfg["attention_bias"]:
                # the declared attention_bias also declares o_proj.bias, which Qwen2 does not have: written as
                # zeros, or vLLM serves whatever its uninitialised buffer holds (measured: token 0 on every step)
                for i in range(ck.num_layers):
                    sd.setdefault(names.of("o", i, "bias"), torch.zeros(int(ck.config["hidden_size"]),
                                                                        dtype=torch.float32))
        directory.mkdir(parents=True, exist_ok=False)
        save_file(sd, str(directory / "model.safetensors"))
        # marks the directory as aloepri's own (export_gguf accepts it); it is a plaintext model, not for a server
        (directory / MODEL_META_FILE).write_text(json.dumps({"format": PLAINTEXT_REFERENCE_FORMAT, "version": 1}) + "\n")
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    finally:
        ck.close()
    return directory


def cmd_export_gguf(a: argparse.Namespace) -> int:
    res = export_gguf(a.out, a.outfile, a.type, overwrite=a.force, progress=not a.quiet, allow_foreign=a.allow_foreign)
    print(json.dumps({"outfile": str(res.outfile), "arch": res.arch, "type": res.qtype, "tensors": res.n_tensors,
                      "bytes": res.bytes_written, "seconds": round(res.seconds, 2)}, indent=2))
    return 0


def add_export_commands(subparsers) -> None:
    """Register ``aloepri export-gguf`` on the CLI's subparsers."""
    p = subparsers.add_parser("export-gguf", help="convert an obfuscated model directory to GGUF for llama.cpp")
    p.add_argument("out", help="obfuscated model directory written by `aloepri obfuscate`")
    p.add_argument("--outfile", required=True, help="GGUF file to write")
    p.add_argument("--type", choices=list(ALL_TYPES), default="f32",
                   help="tensor type of the 2-D weights (norms and biases stay f32; q4_0/q5_0 keep embedding and "
                        "output at q8_0; q4_k_m/q5_k_m/q6_k are made by llama.cpp's quantizer from an f32 export "
                        "and need llama-cpp-python)")
    p.add_argument("--force", action="store_true", help="replace an existing --outfile")
    p.add_argument("--allow-foreign", action="store_true",
                   help="convert a directory aloepri did not write (no aloepri_model.json), e.g. a plaintext model")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_export_gguf)


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser()
    add_export_commands(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args()
    sys.exit(args.func(args))
