"""The one reader of a (sharded) safetensors directory: ``model.safetensors`` or ``model.safetensors.index.json``
plus the shards it lists. Used by the checkpoint reader (obfuscation), the GGUF exporter and the key check.

Shards are read with plain reads, one tensor at a time (no mmap: the resident set stays bounded by what the
caller holds, not by the pages of the whole file it has touched). Every shard's header is read and its size
checked when the directory is opened, so a truncated file is refused before anything is written.
torch is imported only when a tensor is read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# block-quantized FP8 weights: meaningful only with their scale tensor, so handed out only on request
_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn"}


class SafetensorsError(ValueError):
    """The directory or one of its shards is missing, malformed or truncated (the message says which)."""


def read_weight_map(model_dir: Path) -> dict[str, str] | None:
    """``{tensor name: shard file}`` from the index, None for a single ``model.safetensors``."""
    index = Path(model_dir) / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index}: malformed index ({e})") from None
        if not isinstance(weight_map, dict):
            raise SafetensorsError(f"{index}: malformed index (weight_map is not an object)")
        return weight_map
    if (Path(model_dir) / SINGLE_FILE).is_file():
        return None
    raise SafetensorsError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


class SafetensorsShard:
    """Single tensors of one safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if header_len <= 0 or header_len > 100 * 2**20:
                    raise ValueError(f"implausible header length {header_len}")
                header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: cannot read safetensors header ({e}); the file is corrupt or truncated") from e
        header.pop("__metadata__", None)
        self.entries: dict[str, Any] = header
        self.data_start = 8 + header_len
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        actual = path.stat().st_size - self.data_start
        if actual < end:
            raise SafetensorsError(f"{path}: truncated ({actual} data bytes, header promises {end}); re-download it")

    def get(self, name: str, fp8: bool = False):
        import torch

        e = self.entries[name]
        dtype_name = _DTYPE_NAMES.get(e["dtype"]) or (_FP8_NAMES.get(e["dtype"]) if fp8 else None)
        if dtype_name is None:
            raise SafetensorsError(f"{self.path}: tensor {name} has dtype {e['dtype']}; expected one of "
                                   f"{sorted(_DTYPE_NAMES)}")
        start, stop = e["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + start)
            buf = bytearray(stop - start)
            if f.readinto(buf) != len(buf):
                raise SafetensorsError(f"{self.path}: short read for {name}; the file is truncated")
        return torch.frombuffer(buf, dtype=getattr(torch, dtype_name)).reshape(e["shape"])


class SafetensorsDir:
    """Every tensor of a safetensors directory by name; shards opened and checked up front."""

    def __init__(self, model_dir: str | Path):
        self.path = Path(model_dir)
        weight_map = read_weight_map(self.path)
        self._shards: dict[str, SafetensorsShard] = {}
        for shard in sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]:
            if not (self.path / shard).is_file():
                raise SafetensorsError(f"{self.path / shard}: shard listed in the index is missing")
            self._shards[shard] = SafetensorsShard(self.path / shard)
        if weight_map is None:
            weight_map = {k: SINGLE_FILE for k in self._shards[SINGLE_FILE].entries}
        for name, shard in weight_map.items():
            if name not in self._shards[shard].entries:
                raise SafetensorsError(f"{self.path / shard}: the index says it holds {name!r} but it does not")
        self.weight_map: dict[str, str] = weight_map

    def names(self) -> set[str]:
        return set(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> list[int]:
        return list(self._shards[self.weight_map[name]].entries[name]["shape"])

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F8_E4M3", ...)."""
        return str(self._shards[self.weight_map[name]].entries[name]["dtype"])

    def get(self, name: str, fp8: bool = False):
        """The stored tensor (torch, stored dtype); KeyError for a name the directory does not hold. FP8 tensors
        only with ``fp8=True``: their values mean nothing without the block scales the caller applies."""
        return self._shards[self.weight_map[name]].get(name, fp8)
