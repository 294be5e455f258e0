"""The client's secret key file (JSON, mode 0600) and the whole key <-> model binding.

Format (docs/key-format.md): ``vocab_permutation[plain_id] = obfuscated_id``; ``model_fingerprint`` is the
SHA-256 over the obfuscated embedding and head tensors (name, dtype, shape, raw bytes), which the server
directory also publishes in ``aloepri_model.json`` (MODEL_META_FILE). This module defines the fingerprint, the
public metadata file and the mismatch message; the pipeline, the exporter and the servers import them from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .storage.safetensors_dir import INDEX_FILE, SafetensorsDir, SafetensorsError
from .storage.staging import clean_stale, dead_siblings, make_staging_file

KEY_FORMAT = "aloepri-key"
KEY_VERSION = 1
KEY_TMP_SUFFIX = ".tmp"
MODEL_META_FILE = "aloepri_model.json"  # public metadata in the server directory: no secret inside
MODEL_META_FORMAT = "aloepri-obfuscated-model"
FINGERPRINTED = ("model.embed_tokens.weight", "lm_head.weight")  # the tensors the fingerprint hashes


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
        perm = self.vocab_permutation
        if isinstance(perm, np.ndarray):
            perm = perm.tolist()
        if not isinstance(perm, (list, tuple)) or not all(_is_int(i) for i in perm):
            raise KeyFileError("vocab_permutation is not a list of integers")
        perm = np.asarray(perm, dtype=np.int64)
        n = len(perm)
        if n == 0 or not np.array_equal(np.sort(perm), np.arange(n)):
            raise KeyFileError("vocab_permutation is not a permutation of 0..n-1")
        self.seed = _seed_value(self.seed)
        for name in ("h_effective", "hidden_size"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise KeyFileError(f"{name} is not a non-negative integer")
        for name in ("model_fingerprint", "source", "architecture"):
            if not isinstance(getattr(self, name), str):
                raise KeyFileError(f"{name} is not a string")
        if not isinstance(self.params, dict) or not isinstance(self.special_tokens, dict):
            raise KeyFileError("params and special_tokens must be JSON objects")
        if self.tokenizer is not None and not isinstance(self.tokenizer, dict):
            raise KeyFileError("tokenizer must be a JSON object or null")
        self._perm = perm
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
        d["seed"] = str(self.seed)  # a 256-bit integer: a decimal string survives JSON readers with 53-bit numbers
        return json.dumps(d, separators=(",", ":"), allow_nan=False)

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
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except KeyFileError as e:
            raise KeyFileError(f"{origin}: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _seed_value(seed: Any) -> int:
    """The seed as an int: keys store it as a decimal string (older keys: a JSON number)."""
    if _is_int(seed) and seed >= 0:
        return int(seed)
    if isinstance(seed, str) and seed.isascii() and seed.isdigit():
        return int(seed)
    raise KeyFileError("seed is not a non-negative integer (or its decimal string)")


def check_key_outside(key_path: Path, model_dir: Path) -> None:
    """The key must never be written into the directory that is shipped to the server."""
    key_path, model_dir = Path(key_path).resolve(), Path(model_dir).resolve()
    if key_path == model_dir or model_dir in key_path.parents:
        raise ValueError(f"refusing to write the secret key inside the server directory {model_dir}; choose a path outside it")


def stage_key(key: KeyFile, path: str | Path) -> Path:
    """Write the key into a temporary sibling of ``path`` (mode 0600 from its creation, synced to disk) and return
    it; :func:`publish_key` moves it into place. The sibling is named after this process, so a rerun removes it
    if the process dies (storage/staging.py)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_staging_file(path, KEY_TMP_SUFFIX)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.to_json())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def publish_key(staged: Path, path: str | Path) -> None:
    os.replace(staged, path)


def write_key(key: KeyFile, path: str | Path, overwrite: bool = False) -> None:
    """Atomic write with mode 0600 from the first byte."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite a key")
    tmp = stage_key(key, path)
    try:
        publish_key(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_key(path: str | Path) -> KeyFile:
    path = Path(path)
    if path.is_dir():
        raise KeyFileError(f"the key path {path} is a directory, not a key file; give the file written by "
                           "`aloepri obfuscate --key-out`")
    if not path.is_file():
        raise FileNotFoundError(f"key file {path} not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not a key file (binary content, not JSON text); give the key written by "
                           "`aloepri obfuscate --key-out`") from None
    return KeyFile.from_json(text, origin=str(path))


def key_file_exposure(path: str | Path) -> str | None:
    """What is wrong with the key file's mode, as ssh checks its private keys: None when only its owner may access
    it, else one line saying so and how to fix it."""
    mode = Path(path).stat().st_mode & 0o777
    if not mode & 0o077:
        return None
    return (f"the key file {path} can be accessed by other users (mode {mode:04o}): anyone who reads it reads what "
            f"the model says; run: chmod 600 {path}")


def read_model_meta(model_dir: str | Path) -> dict[str, Any] | None:
    """The public aloepri_model.json of a server directory as a dict, or None (absent or unreadable)."""
    try:
        meta = json.loads((Path(model_dir) / MODEL_META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def committed_fingerprint(model_dir: Path) -> str | None:
    """The fingerprint a committed aloepri model directory publishes, or None."""
    meta = read_model_meta(model_dir)
    return meta.get("model_fingerprint") if meta is not None else None


def recover_or_clean_staged_keys(key_path: Path, model_dir: Path) -> None:
    """Before a run: a staged key left by a killed run is published if the model it belongs to was committed
    (the run died between the two renames) and ``key_path`` is free; every other dead staged key is removed."""
    committed = committed_fingerprint(model_dir)
    for tmp in dead_siblings(key_path, KEY_TMP_SUFFIX):
        try:
            staged_fp = json.loads(tmp.read_text()).get("model_fingerprint")
        except (OSError, ValueError, AttributeError):
            staged_fp = None
        if committed is not None and staged_fp == committed and not key_path.exists():
            publish_key(tmp, key_path)
            print(f"aloepri: recovered the key {key_path} of the committed model {model_dir} (an interrupted run "
                  "had not moved it into place)", file=sys.stderr)
    clean_stale(key_path, KEY_TMP_SUFFIX, "staged key")


def existing_key_problem(key_path: Path, model_dir: Path) -> str:
    """Why an existing key blocks a run and what to do (the FileExistsError message)."""
    try:
        fp = load_key(key_path).model_fingerprint
    except (OSError, ValueError):
        return f"{key_path} exists and is not a readable aloepri key; move it away or choose another --key-out"
    if committed_fingerprint(model_dir) == fp:
        return (f"{key_path} exists and belongs to the model already in {model_dir}; pass --force to replace both, "
                "or choose another output and --key-out")
    where = "is missing" if not Path(model_dir).exists() else "holds another model"
    return (f"{key_path} exists, but its model (fingerprint {fp[:16]}...) is not in {model_dir} (the output {where}): "
            "if the key is an orphan of an interrupted older run, delete it or pass --force; if it belongs to a "
            "model elsewhere, choose another --key-out")


def fingerprint_begin(hasher: "hashlib._Hash", name: str, dtype, shape) -> None:
    """The part of a tensor's fingerprint that precedes its bytes: name, dtype (torch), shape. The raw bytes follow
    in order, whole or in row blocks (the same digest either way)."""
    hasher.update(name.encode())
    hasher.update(str(dtype).encode())
    hasher.update(repr(tuple(shape)).encode())


def fingerprint_update(hasher: "hashlib._Hash", name: str, tensor) -> None:
    """Feed one tensor (torch) into the fingerprint: name, dtype, shape, raw bytes."""
    import torch

    fingerprint_begin(hasher, name, tensor.dtype, tensor.shape)
    hasher.update(tensor.contiguous().view(torch.uint8).numpy())  # buffer protocol: no copy of a big matrix


def model_fingerprint(model_dir: str | Path) -> str:
    """Recompute the fingerprint from the tensors of an obfuscated model directory."""
    model_dir = Path(model_dir)
    if not (model_dir / INDEX_FILE).is_file():
        raise KeyFileError(f"{model_dir}: not an obfuscated model directory (no {INDEX_FILE})")
    try:
        tensors = SafetensorsDir(model_dir)
        h = hashlib.sha256()
        for name in FINGERPRINTED:
            if not tensors.has(name):
                raise KeyFileError(f"{model_dir}: tensor {name} missing; not an aloepri-obfuscated model")
            fingerprint_update(h, name, tensors.get(name))
    except SafetensorsError as e:
        raise KeyFileError(str(e)) from None
    return h.hexdigest()


def mismatch_message(key_fingerprint: str, model_fingerprint: str, where: str) -> str:
    """The one message for a key used with another model; ``where`` names the model ("the model in DIR")."""
    return (f"the key does not belong to {where}: key fingerprint {key_fingerprint[:16]}..., model fingerprint "
            f"{model_fingerprint[:16]}...; use the key written when this model was obfuscated")


def check_fingerprint(key: KeyFile, model_fingerprint: str, where: str) -> None:
    """KeyMismatchError unless ``model_fingerprint`` (read from ``where``) is the key's."""
    if model_fingerprint != key.model_fingerprint:
        raise KeyMismatchError(mismatch_message(key.model_fingerprint, model_fingerprint, where))


def check_key_matches(key: KeyFile, model_dir: str | Path) -> None:
    """Refuse a key that belongs to another model (it would decode into garbage, silently). The sizes the key
    implies are checked against config.json first: cheap, and before anything loads the model."""
    check_key_shape(key, model_dir)
    check_fingerprint(key, model_fingerprint(model_dir), f"the model in {model_dir}")


def check_key_shape(key: KeyFile, model_dir: str | Path) -> None:
    """The key's vocabulary and hidden sizes must be the model's (an edited or truncated key would otherwise
    fail with an index error after the model has loaded)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: the fingerprint check reports the directory
    if not isinstance(cfg, dict):
        return
    vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
    if isinstance(vocab, int) and vocab != key.vocab_size:
        raise KeyMismatchError(f"the key's vocabulary permutation has {key.vocab_size} entries but the model in "
                               f"{model_dir} has vocab_size {vocab}; the key file is damaged or belongs to another "
                               "model")
    if isinstance(hidden, int) and key.hidden_size and hidden != key.hidden_size:
        raise KeyMismatchError(f"the key was written for hidden size {key.hidden_size} but the model in {model_dir} "
                               f"has {hidden}; use the key written when this model was obfuscated")
