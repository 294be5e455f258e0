"""Obfuscated models for experiments, cached by a hash of everything that decides their bytes.

The cache key is the source file's identity (path, size, mtime), the parameters (every field of
ObfuscationParams), the seed, the extra ``aloepri.obfuscate`` arguments and a digest of the obfuscation code
itself, so a changed preset, seed or transform never reuses a stale model. Seeds here are reproducible and
therefore insecure (``allow_weak_seed``): experiments only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fields import to_jsonable

WORK = Path(os.environ.get("ALOEPRI_BENCH_WORK", Path.home() / ".cache" / "aloepri" / "bench-targets"))


@dataclass(frozen=True)
class Target:
    src: Path
    model_dir: Path
    key_path: Path
    cache_key: str


def _code_digest() -> str:
    import aloepri.obfuscation as pkg

    h = hashlib.sha256()
    root = Path(pkg.__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _array_digest(value: Any) -> Any:
    """Arrays and tensors (noise_factors) by their bytes, not by an abbreviated repr; other values as they are."""
    if isinstance(value, (tuple, list)):
        return [_array_digest(v) for v in value]
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if hasattr(value, "tobytes") and hasattr(value, "shape"):
        import numpy as np

        a = np.ascontiguousarray(value)
        return {"sha256": hashlib.sha256(a.tobytes()).hexdigest(), "shape": list(a.shape), "dtype": str(a.dtype)}
    return value


def cache_key(src: Path, params: Any, seed: int, **obfuscate_kwargs: Any) -> str:
    st = Path(src).stat()
    identity = {"src": str(Path(src).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "params": to_jsonable(params), "seed": seed,
                "kwargs": to_jsonable({k: _array_digest(v) for k, v in sorted(obfuscate_kwargs.items())}), "code": _code_digest()}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def obfuscated(src: Path, params: Any, seed: int, work: Path | None = None, **obfuscate_kwargs: Any) -> Target:
    """The obfuscated model of ``src`` under ``params`` and ``seed``: built once (atomically), then reused."""
    import aloepri

    key = cache_key(src, params, seed, **obfuscate_kwargs)
    root = Path(work or WORK) / f"{Path(src).stem}-{key}"
    if not (root / "model" / "config.json").exists():
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed build leaves only this, removed here
        tmp.mkdir(parents=True)
        aloepri.obfuscate(src, tmp / "model", tmp / "key.json", params, seed=seed, allow_weak_seed=True,
                          overwrite=True, progress=False, **obfuscate_kwargs)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    return Target(Path(src), root / "model", root / "key.json", key)


def plaintext_reference(src: Path, work: Path | None = None) -> Path:
    """The plaintext model as the float32 checkpoint the obfuscation starts from (export.gguf's
    plaintext_reference_dir), built once (atomically) and shared by the experiments that compare with it."""
    from aloepri.export.gguf import plaintext_reference_dir

    root = Path(work or WORK) / "gguf" / f"{Path(src).stem}-plaintext-f32"
    if not (root / "config.json").exists():
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed build leaves only this, removed here
        plaintext_reference_dir(src, tmp)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
    return root
