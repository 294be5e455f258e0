"""Streaming checkpoint readers (sharded safetensors, GGUF) and an atomic sharded safetensors writer.

Readers hand out one tensor at a time by role, so the pipeline holds about one decoder layer in memory.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .archs import (
    GGUF_GLOBAL_ROLES,
    GGUF_LAYER_PREFIX,
    GGUF_LAYER_ROLES,
    HF_GLOBAL_ROLES,
    HF_LAYER_PREFIX,
    LINEAR_ROLES,
    ArchSpec,
    spec_for_gguf,
    spec_for_hf,
)


class CheckpointError(ValueError):
    """A source checkpoint is missing, truncated, corrupt or incomplete."""


def _tensor_name(roles: dict, global_roles: dict, prefix: str, role: str, layer: int | None, part: str,
                 expert: int | None = None) -> str:
    if layer is None:
        return global_roles[role]
    if role not in roles:
        raise CheckpointError(f"tensor role {role!r} does not exist in this checkpoint format")
    base = prefix.format(i=layer) + roles[role].format(e=expert)
    return f"{base}.{part}" if role in LINEAR_ROLES else base


class SourceCheckpoint:
    """Common interface: ``config`` (HF-style dict), ``spec``, ``get(role, layer, part)`` -> float64 tensor."""

    config: dict[str, Any]
    spec: ArchSpec
    path: Path

    def name_of(self, role: str, layer: int | None = None, part: str = "weight", expert: int | None = None) -> str:
        raise NotImplementedError

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

    def attention_roles(self, layer: int) -> list[str]:
        if self.spec.attention == "mla":
            q = ["q_a", "q_a_norm", "q_b"] if self.config.get("q_lora_rank") else ["q"]
            return ["attn_norm", *q, "kv_a", "kv_a_norm", "kv_b", "o"]
        return ["attn_norm", "q", "k", "v", "o"] + (["q_norm", "k_norm"] if self.spec.qk_norm else [])

    def is_moe_layer(self, layer: int) -> bool:
        return self.spec.moe is not None and self.spec.moe.is_sparse_layer(self.config, layer)

    def mlp_roles(self, layer: int) -> list[tuple]:
        """Roles of the feed-forward block of ``layer``; for MoE layers as (role, expert) pairs."""
        if not self.is_moe_layer(layer):
            return ["ffn_norm", "gate", "up", "down"]
        moe = self.spec.moe
        roles = ["ffn_norm", "router"]
        roles += ["shared_gate", "shared_up", "shared_down"] if moe.shared_expert else []
        roles += ["shared_expert_gate"] if moe.shared_expert_gate else []
        return roles + [(r, e) for e in range(self.num_experts) for r in ("expert_gate", "expert_up", "expert_down")]

    @property
    def num_experts(self) -> int:
        return self.spec.moe.num_experts(self.config) if self.spec.moe else 0

    def close(self) -> None:
        pass


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _SafetensorsShard:
    """Reads single tensors of a safetensors file with plain reads (no mmap: the resident set stays bounded
    by what we hold, not by the pages of the whole file we have touched)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if header_len <= 0 or header_len > 100 * 2**20:
                    raise ValueError(f"implausible header length {header_len}")
                header = json.loads(f.read(header_len))
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors header ({e}); the file is corrupt or truncated") from e
        header.pop("__metadata__", None)
        self.entries = header
        self.data_start = 8 + header_len
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        actual = path.stat().st_size - self.data_start
        if actual < end:
            raise CheckpointError(f"{path}: truncated ({actual} data bytes, header promises {end}); re-download it")

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        dtype = _ST_DTYPES.get(e["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {e['dtype']}; expected one of {sorted(_ST_DTYPES)}")
        start, stop = e["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + start)
            buf = bytearray(stop - start)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{self.path}: short read for {name}; the file is truncated")
        return torch.frombuffer(buf, dtype=dtype).reshape(e["shape"])


class SafetensorsCheckpoint(SourceCheckpoint):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: no config.json; expected a Hugging Face checkpoint directory or a .gguf file")
        try:
            self.config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
        self.spec = spec_for_hf(self.config.get("architectures"))
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: malformed index ({e})") from e
        elif (self.path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
        shard_names = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._shards: dict[str, _SafetensorsShard] = {}
        for shard in shard_names:
            shard_path = self.path / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: shard listed in the index is missing")
            self._shards[shard] = _SafetensorsShard(shard_path)
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._shards["model.safetensors"].entries}
        else:
            for name, shard in weight_map.items():
                if name not in self._shards[shard].entries:
                    raise CheckpointError(f"{self.path / shard}: index says it holds {name!r} but it does not")
        self._weight_map = weight_map

    def name_of(self, role, layer=None, part="weight", expert=None):
        return _tensor_name(self.spec.hf_role_names(), HF_GLOBAL_ROLES, HF_LAYER_PREFIX, role, layer, part, expert)

    def tensor_names(self):
        return set(self._weight_map)

    def get(self, role, layer=None, part="weight", dtype=torch.float64, expert=None):
        name = self.name_of(role, layer, part, expert)
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint index")
        t = self._shards[shard].get(name)
        return t if dtype is None else t.to(dtype)

    def tokenizer_kwargs(self):
        has_tok = any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        return {"pretrained_model_name_or_path": str(self.path)} if has_tok else None


def _unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter: it stores each head's rows as adjacent RoPE pairs; HF uses (i, i+d/2)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint(SourceCheckpoint):
    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{self.path}: not a GGUF file (bad magic)")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot parse GGUF ({e}); the file is corrupt or truncated") from e
        arch = bytes(self._reader.fields["general.architecture"].parts[-1]).decode()
        self.spec = spec_for_gguf(arch)
        self._tensors = {t.name: t for t in self._reader.tensors}
        for t in self._reader.tensors:
            if t.data.nbytes < t.n_bytes:
                raise CheckpointError(f"{self.path}: tensor {t.name} is truncated; re-download the file")
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)
        cfg = dict(parsed["config"])
        cfg["architectures"] = [self.spec.hf_architectures[0]]
        cfg["model_type"] = self.spec.name
        cfg.setdefault("tie_word_embeddings", "output.weight" not in self._tensors)
        if self.spec.name == "qwen2" and "blk.0.attn_q.bias" in self._tensors:
            cfg["attention_bias"] = True
        self.config = cfg
        self.chat_template = parsed.get("tokenizer_config", {}).get("chat_template")

    def name_of(self, role, layer=None, part="weight", expert=None):
        return _tensor_name(GGUF_LAYER_ROLES, GGUF_GLOBAL_ROLES, GGUF_LAYER_PREFIX, role, layer, part)

    def tensor_names(self):
        return set(self._tensors)

    def get(self, role, layer=None, part="weight", dtype=torch.float64, expert=None):
        import gguf

        name = self.name_of(role, layer, part)
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the GGUF file")
        w = gguf.dequantize(t.data, t.tensor_type)
        if self.spec.gguf_qk_rows_interleaved and role in ("q", "k"):
            heads = self.config["num_attention_heads"] if role == "q" else self.config["num_key_value_heads"]
            w = _unpermute_llama_qk(w, heads)
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

    def tokenizer_kwargs(self):
        return {"pretrained_model_name_or_path": str(self.path.parent), "gguf_file": self.path.name}


def open_checkpoint(path: str | Path) -> SourceCheckpoint:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_file():
        return GGUFCheckpoint(p)
    return SafetensorsCheckpoint(p)


class ShardedWriter:
    """Writes tensors into size-bounded safetensors shards plus model.safetensors.index.json.

    Tensors are buffered only until the shard is full, so memory stays bounded by ``max_shard_bytes``.
    """

    def __init__(self, directory: Path, max_shard_bytes: int = 256 << 20):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shard_files: list[str] = []
        self._weight_map: dict[str, int] = {}
        self.total_bytes = 0

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
        idx = len(self._shard_files)
        fname = f"model-{idx + 1:05d}.safetensors"
        save_file(self._buffer, str(self.directory / fname), metadata={"format": "pt"})
        for k in self._buffer:
            self._weight_map[k] = idx
        self._shard_files.append(fname)
        self._buffer = {}
        self._buffer_bytes = 0

    def finish(self) -> None:
        self._flush()
        n = len(self._shard_files)
        final_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for old, new in zip(self._shard_files, final_names):
            os.replace(self.directory / old, self.directory / new)
        index = {
            "metadata": {"total_size": self.total_bytes},
            "weight_map": {k: final_names[v] for k, v in sorted(self._weight_map.items())},
        }
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class AtomicOutputDir:
    """A temporary sibling directory that replaces ``target`` only on success; removed on failure."""

    def __init__(self, target: str | Path, overwrite: bool = False):
        self.target = Path(target).resolve()
        self.overwrite = overwrite
        if self.target.exists() and not overwrite:
            raise FileExistsError(f"{self.target} already exists; choose a new output path or pass --force")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".partial", dir=self.target.parent))

    def commit(self) -> None:
        if self.target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=".old", dir=self.target.parent))
            os.replace(self.target, trash / "old")
            os.replace(self.tmp, self.target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.target)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
