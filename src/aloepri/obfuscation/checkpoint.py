"""Streaming checkpoint readers (sharded safetensors, GGUF) and an atomic sharded safetensors writer.

Readers hand out one tensor at a time by role, so the pipeline holds about one decoder layer in memory.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..storage.safetensors_dir import INDEX_FILE, SafetensorsDir, SafetensorsError
from ..storage.safetensors_stream import StreamedFile
from ..storage.sources import pretrained_kwargs
from ..storage.staging import clean_stale, give_ordinary_modes, make_staging_dir, staging_prefix
from .archs import GGUF_ARCHS, GGUF_NAMES, ArchSpec, TensorNames, UnknownRoleError, fp8_weight_pattern, role_shapes, \
    spec_for_gguf, spec_for_hf
from .fp8 import (BlockFp8, Fp8FormatError, check_scale, dequantize_blockwise, parse_quantization_config,
                  quantize_blockwise, scale_name)
from .transforms import deinterleave_rope_rows


class CheckpointError(ValueError):
    """A source checkpoint is missing, truncated, corrupt or incomplete."""


class SourceCheckpoint:
    """Common interface: ``config`` (HF-style dict), ``spec``, ``get(role, layer, part)`` -> float64 tensor."""

    config: dict[str, Any]
    spec: ArchSpec
    path: Path
    fp8: BlockFp8 | None = None  # the block format of an FP8 source (its linear weights are read dequantized)
    names: TensorNames  # the naming scheme of the stored tensors

    def name_of(self, role: str, layer: int | None = None, part: str = "weight", expert: int | None = None) -> str:
        try:
            return self.names.of(role, layer, part, expert)
        except UnknownRoleError:
            raise CheckpointError(f"tensor role {role!r} does not exist in this checkpoint format") from None

    def has(self, role: str, layer: int | None = None, part: str = "weight", expert: int | None = None) -> bool:
        return self.name_of(role, layer, part, expert) in self.tensor_names()

    def tensor_names(self) -> set[str]:
        raise NotImplementedError

    def get(self, role: str, layer: int | None = None, part: str = "weight",
            dtype: torch.dtype | None = torch.float64, expert: int | None = None) -> torch.Tensor:
        """One tensor by role, converted to ``dtype`` (None keeps the stored precision: for the big vocabulary
        matrices, which are converted to float64 chunk by chunk instead)."""
        raise NotImplementedError

    def tokenizer_kwargs(self) -> dict[str, Any] | None:
        """Arguments for AutoTokenizer.from_pretrained, or None when the checkpoint carries no tokenizer."""
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def tied_embeddings(self) -> bool:
        return not self.has("head")

    def validate(self) -> None:
        """Fail before writing anything if a tensor the obfuscation needs is absent."""
        required = [("embed", None, "weight", None), ("final_norm", None, "weight", None)]
        for i in range(self.num_layers):
            for role in self.attention_roles(i) + self.mlp_roles(i):
                role, expert = role if isinstance(role, tuple) else (role, None)
                required.append((role, i, "weight", expert))
        names = self.tensor_names()
        missing = [self.name_of(*r) for r in required if self.name_of(*r) not in names]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(
                f"{self.path}: checkpoint is incomplete, missing tensor(s) {missing[:5]}{more}; "
                "re-download or re-convert the checkpoint"
            )
        self._validate_shapes()
        self._validate_quantized([self.name_of(*r) for r in required])

    def _validate_quantized(self, names: list[str]) -> None:
        """Quantized tensors among ``names`` must come with what dequantizes them (checked before any work)."""

    def tensor_shape(self, name: str) -> list[int]:
        """Shape of a stored tensor in Hugging Face order ([out, in]), without reading its data."""
        raise NotImplementedError

    def _validate_shapes(self) -> None:
        """config.json and the weights must agree before any arithmetic (a mismatch would surface as a matmul
        error deep inside the obfuscation)."""
        try:
            shapes = role_shapes(self.spec, self.config)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: config lacks a usable {e} entry") from None
        checked = [("embed", None), ("final_norm", None)] + ([] if self.tied_embeddings else [("head", None)])
        for i in range(self.num_layers):
            checked += [("attn_norm", i), ("ffn_norm", i)]
            if self.spec.attention != "mla":
                checked += [(r, i) for r in ("q", "k", "v", "o")]
            if not self.is_moe_layer(i):
                checked += [(r, i) for r in ("gate", "up", "down")]
        expect = {(role, layer): list(shapes[role]) for role, layer in checked}
        for (role, layer), want in expect.items():
            name = self.name_of(role, layer)
            got = list(self.tensor_shape(name))
            if got != want:
                raise CheckpointError(
                    f"{self.path}: tensor {name} has shape {got} but config.json implies {want}; the config does "
                    "not describe these weights (use the config.json that came with them)"
                )

    def attention_roles(self, layer: int) -> list[str]:
        return self.spec.attention_roles(self.config)

    def is_moe_layer(self, layer: int) -> bool:
        return self.spec.is_moe_layer(self.config, layer)

    def mlp_roles(self, layer: int) -> list[tuple]:
        """Roles of the feed-forward block of ``layer``; for MoE layers as (role, expert) pairs."""
        return self.spec.mlp_roles(self.config, layer)

    @property
    def num_experts(self) -> int:
        return self.spec.moe.num_experts(self.config) if self.spec.moe else 0

    def close(self) -> None:
        pass


class SafetensorsCheckpoint(SourceCheckpoint):
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()  # absolute: the key records it for the client's tokenizer
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; expected a Hugging Face checkpoint directory or a .gguf file")
        try:
            self.config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
        self.spec = spec_for_hf(self.config.get("architectures"))
        self.names = self.spec.hf_names
        try:
            self.fp8 = parse_quantization_config(self.config)  # None: unquantized
        except Fp8FormatError as e:
            raise CheckpointError(f"{cfg_path}: {e}") from None
        try:
            self._tensors = SafetensorsDir(self.path)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None

    def tensor_names(self):
        return self._tensors.names()

    def get(self, role, layer=None, part="weight", dtype=torch.float64, expert=None):
        name = self.name_of(role, layer, part, expert)
        if not self._tensors.has(name):
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint index")
        try:
            if self._is_fp8(name):  # dequantized in float32 (the releases' arithmetic); None keeps float32
                self._validate_quantized([name])
                t = dequantize_blockwise(self._tensors.get(name, fp8=True), self._tensors.get(scale_name(name)),
                                         self.fp8.block)
            else:
                t = self._tensors.get(name)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        return t if dtype is None else t.to(dtype)

    def _is_fp8(self, name: str) -> bool:
        return self._tensors.dtype(name).startswith("F8_")

    def _validate_quantized(self, names):
        for name in names:
            if not self._tensors.has(name) or not self._is_fp8(name):
                continue
            if self.fp8 is None:
                raise CheckpointError(f"{self.path}: tensor {name} is stored as {self._tensors.dtype(name)} but "
                                      "config.json has no quantization_config saying how to dequantize it")
            if self._tensors.dtype(name) != "F8_E4M3":
                raise CheckpointError(f"{self.path}: tensor {name} is stored as {self._tensors.dtype(name)}; "
                                      "the FP8 format declared in config.json is e4m3 (F8_E4M3)")
            if not name.endswith(".weight") or len(self._tensors.shape(name)) != 2:
                raise CheckpointError(f"{self.path}: tensor {name} is FP8, but only 2-D linear weights are "
                                      "block-quantized")
            scale = scale_name(name)
            if not self._tensors.has(scale):
                raise CheckpointError(f"{self.path}: FP8 tensor {name} has no {scale}; the checkpoint is "
                                      "incomplete (re-download it)")
            try:
                check_scale(self.fp8, name, self._tensors.shape(name), self._tensors.shape(scale))
            except Fp8FormatError as e:
                raise CheckpointError(f"{self.path}: {e}") from None

    def tensor_shape(self, name):
        return self._tensors.shape(name)

    def tokenizer_kwargs(self):
        has_tok = any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        return {"pretrained_model_name_or_path": str(self.path)} if has_tok else None



def _fast_gguf_reader(path: str):
    """gguf.GGUFReader whose metadata parsing slices a plain ndarray view of the file mapping instead of the
    np.memmap itself: every memmap slice runs Python-level __array_finalize__, and a tokenizer of 150k strings
    makes ~1M of them (7-25 s for Qwen2.5's GGUF). Same fields, same tensors, same bytes."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset: offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            """Arrays of strings or scalars (the tokenizer's 150k tokens and merges) in one loop, the same parts
            as the stock element-by-element recursion; anything else goes to the stock parser."""
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(gguf.GGUFValueType(itype)) if itype in gguf.GGUFValueType._value2member_map_ else None
            if n == 0 or (itype != gguf.GGUFValueType.STRING and nptype is None):
                return super()._get_field_parts(orig_offs, raw_type)
            parts, idxs = [raw_itype, alen], []
            if itype == gguf.GGUFValueType.STRING:
                plain, view, from_bytes = self._plain, memoryview(self._plain), int.from_bytes
                for _ in range(n):
                    length = from_bytes(view[offs: offs + 8], "little")
                    parts.append(plain[offs: offs + 8].view(np.uint64))
                    parts.append(plain[offs + 8: offs + 8 + length])
                    idxs.append(len(parts) - 1)
                    offs += 8 + length
            else:
                values = self._get(offs, nptype, n)
                parts.extend(values[k: k + 1] for k in range(n))
                idxs = list(range(2, 2 + n))
                offs += int(values.nbytes)
            return offs - orig_offs, parts, idxs, [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(itype)]

    return _Reader(path)


# Array fields longer than this (the tokenizer's tokens, merges, scores, token types) are not configuration:
# transformers' config parse would turn each element into a Python value (Qwen2.5: 455k of them, ~1 s).
_CONFIG_ARRAY_MAX = 4096


class _ConfigFieldsOnly:
    """The reader as transformers' config parse should see it: every field but the long arrays; the rest of the
    reader (tensors, data) unchanged."""

    def __init__(self, reader):
        self._reader = reader
        self.fields = {name: f for name, f in reader.fields.items() if len(f.data) <= _CONFIG_ARRAY_MAX}

    def __getattr__(self, name):
        return getattr(self._reader, name)


@contextlib.contextmanager
def _reusing_reader(reader):
    """transformers' load_gguf_checkpoint opens its own gguf.GGUFReader(path); give it the one already parsed,
    without the long arrays (_ConfigFieldsOnly)."""
    import gguf

    stock = gguf.GGUFReader
    gguf.GGUFReader = lambda *args, **kwargs: _ConfigFieldsOnly(reader)
    # its warning that vocab_size cannot come from the (hidden) tokens: the caller takes it from them itself
    log = logging.getLogger("transformers.modeling_gguf_pytorch_utils")
    level = log.level
    if "tokenizer.ggml.tokens" in reader.fields:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        gguf.GGUFReader = stock
        log.setLevel(level)


def _dequantize(t) -> np.ndarray:
    """gguf.dequantize, by larger row groups on a plain view: the stock routine calls its block decoder on groups
    of 16 rows of the memmap, whose per-call overhead dominates (Q8_0 embedding: 3.3 s -> 0.6 s). The block
    decoders are elementwise, so the result is bit-identical."""
    import gguf
    from gguf.quants import _type_traits

    quant = _type_traits.get(t.tensor_type)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or quant is None:
        return gguf.dequantize(t.data, t.tensor_type)
    quant.init_grid()
    decode = _q5_0_rows if t.tensor_type == gguf.GGMLQuantizationType.Q5_0 else quant.dequantize_rows
    raw = np.asarray(t.data).view(np.ndarray).view(np.uint8)
    raw = raw.reshape(-1, raw.shape[-1])
    out = np.empty((raw.shape[0], raw.shape[1] // quant.type_size * quant.block_size), dtype=np.float32)
    step = max(1, (1 << 19) // raw.shape[1])  # ~0.5 MB of blocks per call: temporaries stay in cache

    def rows(start: int) -> None:
        out[start: start + step] = decode(raw[start: start + step])

    # numpy releases the GIL inside the decoders' array operations, so row groups decode in parallel on torch's
    # thread count (the same cores the products use; nothing else runs meanwhile)
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        list(pool.map(rows, range(0, raw.shape[0], step)))
    return out.reshape(*t.data.shape[:-1], out.shape[-1])


def _q5_0_rows(rows: np.ndarray) -> np.ndarray:
    """Q5_0 rows (uint8) -> float32, bit-identical to gguf's decoder (the same single float32 multiply d * (q - 16))
    but with the 32 high bits unpacked by np.unpackbits instead of 32 uint32 shifts per block: 4x faster on
    Qwen2.5's Q5_0 weights. Block: float16 d, 4 bytes of high bits (bit j = element j), 16 bytes of nibbles
    (low nibbles: elements 0-15, high nibbles: 16-31)."""
    blocks = rows.reshape(-1, 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")
    nibbles = blocks[:, 6:]
    low = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=1)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(16)
    return (d * q.astype(np.float32)).reshape(rows.shape[0], -1)


class GGUFCheckpoint(SourceCheckpoint):
    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path).resolve()  # absolute: the key records it for the client's tokenizer
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{self.path}: not a GGUF file (bad magic)")
        try:
            self._reader = _fast_gguf_reader(str(self.path))
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot parse GGUF ({e}); the file is corrupt or truncated") from e
        arch = bytes(self._reader.fields["general.architecture"].parts[-1]).decode()
        self.spec = spec_for_gguf(arch)
        self.names = GGUF_NAMES
        self._gguf_arch = GGUF_ARCHS[arch]
        self._tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            if t.data.nbytes < t.n_bytes:
                raise CheckpointError(f"{self.path}: tensor {t.name} is truncated; re-download the file")
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        # transformers would parse the whole file (tokenizer arrays included) a second time: hand it our reader
        with _reusing_reader(self._reader):
            parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)
        cfg = dict(parsed["config"])
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if "vocab_size" not in cfg and tokens is not None:  # what transformers derives from the hidden array
            cfg["vocab_size"] = len(tokens.data)
        cfg["architectures"] = [self.spec.hf_architectures[0]]
        cfg["model_type"] = self.spec.name
        cfg.setdefault("tie_word_embeddings", not self.has("head"))
        if self.has("q", 0, "bias"):  # transformers' GGUF config does not say so (Qwen2's q/k/v biases)
            cfg["attention_bias"] = True
        self.config = cfg
        self.chat_template = parsed.get("tokenizer_config", {}).get("chat_template")

    def tensor_names(self):
        return set(self._tensors)

    @property
    def below_float32(self) -> bool:
        """Whether a tensor is stored in less than float32: block-quantized (Q4_K, Q8_0, ...), F16 or BF16."""
        import gguf

        return any(t.tensor_type != gguf.GGMLQuantizationType.F32 for t in self._tensors.values())

    def get(self, role, layer=None, part="weight", dtype=torch.float64, expert=None):
        name = self.name_of(role, layer, part)
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the GGUF file")
        w = _dequantize(t)
        if self._gguf_arch.qk_rows_interleaved and role in ("q", "k"):
            heads = self.config["num_attention_heads"] if role == "q" else self.config["num_key_value_heads"]
            w = deinterleave_rope_rows(w, heads)
        w = np.ascontiguousarray(w)  # dequantized GGUF tensors are float32
        if not w.flags.writeable:  # unquantized tensors come back as views of the file mapping: own a copy
            w = w.copy()
        out = torch.from_numpy(w)
        out = out if dtype is None else out.to(dtype)
        self._release_pages(t)
        return out

    def _release_pages(self, t) -> None:
        """Drop the file pages of a tensor we are done with from our resident set (the file is memory-mapped;
        without this, RSS grows to the whole file size even though we stream)."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = (int(t.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        length = int(t.data_offset) + int(t.n_bytes) - start
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):
            pass

    def tensor_shape(self, name):
        return [int(n) for n in reversed(self._tensors[name].shape)]  # GGUF lists dimensions innermost first

    def tokenizer_kwargs(self):
        return pretrained_kwargs(self.path)


def open_checkpoint(path: str | Path) -> SourceCheckpoint:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_file():
        return GGUFCheckpoint(p)
    return SafetensorsCheckpoint(p)


class ShardedWriter:
    """Writes tensors into size-bounded safetensors shards plus model.safetensors.index.json.

    Tensors are buffered only until the shard is full; a full shard is written by a background thread while the
    next one fills (safetensors releases the GIL while writing), so memory stays bounded by two shards and the
    disk works while the products run. A write error is raised by the next add/finish.
    """

    def __init__(self, directory: Path, max_shard_bytes: int = 256 << 20):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shard_files: list[str] = []
        self._weight_map: dict[str, int] = {}
        self.total_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._buffer:
            raise ValueError(f"tensor {name} written twice")
        t = tensor.contiguous()
        nbytes = t.numel() * t.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes
        if self._buffer_bytes >= self.max_shard_bytes:  # e.g. an embedding larger than a shard: write it now
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buffer:
            return
        self._wait()  # at most one shard in flight
        idx = len(self._shard_files)
        fname = f"model-{idx + 1:05d}.safetensors"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending = self._pool.submit(save_file, self._buffer, str(self.directory / fname),
                                          metadata={"format": "pt"})
        for k in self._buffer:
            self._weight_map[k] = idx
        self._shard_files.append(fname)
        self._buffer = {}
        self._buffer_bytes = 0

    def add_stream(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, blocks: Iterator[torch.Tensor],
                   observe: Callable[[torch.Tensor], None] | None = None) -> None:
        """A tensor that arrives in row blocks (blocks.StreamedTensor) goes into a shard of its own, written as the
        blocks come: it is never whole in memory. ``observe`` sees every block, in order (the fingerprint)."""
        if name in self._weight_map or name in self._buffer:
            raise ValueError(f"tensor {name} written twice")
        self._flush()  # the shards keep the order the tensors came in
        self._wait()
        fname = f"model-{len(self._shard_files) + 1:05d}.safetensors"
        dtype_name = str(dtype).replace("torch.", "")
        self._shard_files.append(fname)  # listed before it is written: a failure leaves it to the staging cleanup
        f = StreamedFile(self.directory / fname, [(name, dtype_name, shape)])
        try:
            for block in blocks:
                if block.dtype != dtype:
                    raise ValueError(f"{name}: a block of dtype {block.dtype}, declared {dtype}")
                block = block.contiguous()
                if observe is not None:
                    observe(block)
                f.write(name, block)
            f.close()
        except BaseException:
            f.abort()
            raise
        self._weight_map[name] = len(self._shard_files) - 1
        self.total_bytes += f.total_bytes

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises the writer thread's error (e.g. disk full) here

    def abandon(self) -> None:
        """After a failure elsewhere: let an in-flight write end (its error no longer matters) before the
        staging directory is removed."""
        try:
            self._wait()
        except Exception:
            pass
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def finish(self) -> None:
        self._flush()
        try:
            self._wait()
        finally:
            self._shutdown()
        n = len(self._shard_files)
        final_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for old, new in zip(self._shard_files, final_names):
            os.replace(self.directory / old, self.directory / new)
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: final_names[v] for k, v in sorted(self._weight_map.items())},
        }
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class BlockFp8Writer:
    """A ShardedWriter that stores the linear weights of the FP8 roles (archs.FP8_ROLES) block-quantized, each
    with its ``weight_scale_inv``, and every other tensor in ``dtype`` (bfloat16: embedding, head, norms, routers,
    biases stay unquantized, as in the FP8 releases)."""

    def __init__(self, inner: ShardedWriter, fmt: BlockFp8, spec: ArchSpec, dtype: torch.dtype = torch.bfloat16):
        self.inner, self.fmt, self.dtype = inner, fmt, dtype
        self._quantized = fp8_weight_pattern(spec)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._quantized.fullmatch(name):
            q, scale = quantize_blockwise(tensor, self.fmt.block)
            self.inner.add(name, q)
            self.inner.add(scale_name(name), scale)
        else:
            self.inner.add(name, tensor.to(self.dtype))

    def add_stream(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, blocks: Iterator[torch.Tensor],
                   observe: Callable[[torch.Tensor], None] | None = None) -> None:
        """The row-block streams are the embedding and the head, which the FP8 releases keep unquantized."""
        if self._quantized.fullmatch(name):
            raise ValueError(f"{name} arrives in row blocks but is an FP8 role; it cannot be block-quantized so")
        if dtype != self.dtype:
            raise ValueError(f"{name} streams as {dtype}; the FP8 output keeps unquantized tensors in {self.dtype}")
        self.inner.add_stream(name, shape, dtype, blocks, observe)

    @property
    def total_bytes(self) -> int:
        return self.inner.total_bytes

    def finish(self) -> None:
        self.inner.finish()

    def abandon(self) -> None:
        self.inner.abandon()


class AtomicOutputDir:
    """A temporary sibling directory that replaces ``target`` only on success; removed on failure.

    The sibling is named after its owner process (see storage/staging.py), so a rerun removes the one a killed run left
    and keeps the one of a run still in progress."""

    def __init__(self, target: str | Path, overwrite: bool = False):
        self.target = Path(target).resolve()
        self.overwrite = overwrite
        if self.target.exists() and not overwrite:
            raise FileExistsError(f"{self.target} already exists; choose a new output path or pass --force")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = make_staging_dir(self.target)

    def commit(self) -> None:
        give_ordinary_modes(self.tmp)  # a public checkpoint: 0755/0644 under umask 022, not the staging 0700/0600
        if self.target.exists():
            trash = Path(tempfile.mkdtemp(prefix=staging_prefix(self.target), suffix=".old", dir=self.target.parent))
            os.replace(self.target, trash / "old")
            os.replace(self.tmp, self.target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.target)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def clean_stale_outputs(target: str | Path) -> None:
    """Remove what an interrupted run for ``target`` left (staging directories, replaced old copies)."""
    target = Path(target).resolve()
    clean_stale(target, ".partial", "partial output")
    clean_stale(target, ".old", "replaced output")
