"""The client's secret key file (JSON, mode 0600) and its binding to one obfuscated model.

Format (docs/key-format.md): ``vocab_permutation[plain_id] = obfuscated_id``; ``model_fingerprint`` is the
SHA-256 over the obfuscated embedding and head tensors (name, dtype, shape, raw bytes), which the server
directory also publishes in ``aloepri_model.json``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KEY_FORMAT = "aloepri-key"
KEY_VERSION = 1


class KeyFileError(ValueError):
    """A key file is malformed, or does not belong to the model it is used with."""


class KeyMismatchError(KeyFileError):
    """The key was written for a different obfuscated model."""


@dataclass
class KeyFile:
    vocab_permutation: list[int]
    model_fingerprint: str
    params: dict[str, Any]
    seed: int
    h_effective: int
    hidden_size: int
    source: str
    architecture: str
    special_tokens: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] | None = None
    chat_template: str | None = None
    format: str = KEY_FORMAT
    version: int = KEY_VERSION

    def __post_init__(self) -> None:
        perm = np.asarray(self.vocab_permutation)
        n = len(perm)
        if n == 0 or perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(n)):
            raise KeyFileError("key file: vocab_permutation is not a permutation of 0..n-1")
        self._perm = perm.astype(np.int64)
        self._inv = np.argsort(self._perm)

    @property
    def vocab_size(self) -> int:
        return len(self._perm)

    def encode_ids(self, plain_ids) -> list[int]:
        """Plain token ids -> the ids the server sees."""
        return self._perm[np.asarray(plain_ids, dtype=np.int64)].tolist()

    def decode_ids(self, obf_ids) -> list[int]:
        """Ids produced by the server -> plain token ids."""
        return self._inv[np.asarray(obf_ids, dtype=np.int64)].tolist()

    @property
    def permutation(self) -> np.ndarray:
        return self._perm

    @property
    def inverse_permutation(self) -> np.ndarray:
        return self._inv

    def obfuscated_eos_ids(self) -> list[int]:
        eos = self.special_tokens.get("eos_token_id")
        if eos is None:
            return []
        return self.encode_ids(eos if isinstance(eos, list) else [eos])

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, origin: str = "key") -> "KeyFile":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeyFileError(f"{origin}: not a JSON key file ({e})") from e
        if not isinstance(d, dict) or d.get("format") != KEY_FORMAT:
            raise KeyFileError(f"{origin}: not an aloepri key file (format field is {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("version") != KEY_VERSION:
            raise KeyFileError(f"{origin}: key version {d.get('version')} is not supported (this aloepri reads {KEY_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise KeyFileError(f"{origin}: key file lacks {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})


def check_key_outside(key_path: Path, model_dir: Path) -> None:
    """The key must never be written into the directory that is shipped to the server."""
    key_path, model_dir = Path(key_path).resolve(), Path(model_dir).resolve()
    if key_path == model_dir or model_dir in key_path.parents:
        raise ValueError(f"refusing to write the secret key inside the server directory {model_dir}; choose a path outside it")


def write_key(key: KeyFile, path: str | Path, overwrite: bool = False) -> None:
    """Atomic write with mode 0600 from the first byte (the temp file is created 0600 by mkstemp)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite a key")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.to_json())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_key(path: str | Path) -> KeyFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"key file {path} not found")
    return KeyFile.from_json(path.read_text(), origin=str(path))


def model_fingerprint(model_dir: str | Path) -> str:
    """Recompute the fingerprint from the tensors of an obfuscated model directory."""
    from safetensors import safe_open

    from .pipeline import FINGERPRINTED, fingerprint_update

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        raise KeyFileError(f"{model_dir}: not an obfuscated model directory (no model.safetensors.index.json)")
    weight_map = json.loads(index.read_text())["weight_map"]
    h = hashlib.sha256()
    for name in FINGERPRINTED:
        if name not in weight_map:
            raise KeyFileError(f"{model_dir}: tensor {name} missing; not an aloepri-obfuscated model")
        with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
            fingerprint_update(h, name, f.get_tensor(name))
    return h.hexdigest()


def check_key_matches(key: KeyFile, model_dir: str | Path) -> None:
    """Refuse a key that belongs to another model (it would decode into garbage, silently)."""
    actual = model_fingerprint(model_dir)
    if actual != key.model_fingerprint:
        raise KeyMismatchError(
            f"key does not belong to the model in {model_dir}: key fingerprint {key.model_fingerprint[:16]}..., "
            f"model fingerprint {actual[:16]}...; use the key written when this model was obfuscated"
        )
