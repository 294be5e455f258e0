"""Obfuscated models for experiments, cached by what decides their bytes, in a cache of bounded size.

The cache key is the source file's identity (path, size, mtime), the parameters (every field of
ObfuscationParams), the seed, the extra ``aloepri.obfuscate`` arguments and FORMAT_VERSION: the version of the bytes
``obfuscate`` writes, bumped on purpose when a change to the obfuscation changes them (the golden-bytes test,
tests/obfuscation/test_golden_bytes.py, fails until it is). A docstring or a refactoring in aloepri/obfuscation
therefore reuses every cached target. Seeds here are reproducible and therefore insecure (``allow_weak_seed``):
experiments only.

The cache (``WORK``, ``ALOEPRI_BENCH_WORK``) holds at most ``cap_bytes()`` (``ALOEPRI_BENCH_CACHE_GB``, default
DEFAULT_CAP_GB): after each build the least recently used entries are removed until it fits, except the ones used
in the last RECENT_SECONDS (an experiment may still be reading them). ``python -m benchmarks cache`` shows and
prunes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fields import to_jsonable

WORK = Path(os.environ.get("ALOEPRI_BENCH_WORK", Path.home() / ".cache" / "aloepri" / "bench-targets"))

# The version of the bytes aloepri.obfuscate writes for a source, parameters and seed. Bump it (and record the new
# digest in tests/obfuscation/test_golden_bytes.py) when a change makes them differ: every cached target is then
# rebuilt. 2: the presets' kept dimensions measured (outlier_rms) instead of counted.
FORMAT_VERSION = 2

DEFAULT_CAP_GB = 20.0
CAP_ENV = "ALOEPRI_BENCH_CACHE_GB"
RECENT_SECONDS = 2 * 3600
GROUPS = ("gguf", "tiny")  # folders of WORK whose children are the entries (quantized GGUFs, tiny sources)
USED = ".last-used"  # an entry directory's use time (a file entry's own mtime)


@dataclass(frozen=True)
class Target:
    src: Path
    model_dir: Path
    key_path: Path
    cache_key: str


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
                "kwargs": to_jsonable({k: _array_digest(v) for k, v in sorted(obfuscate_kwargs.items())}), "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def obfuscated(src: Path, params: Any, seed: int, work: Path | None = None, **obfuscate_kwargs: Any) -> Target:
    """The obfuscated model of ``src`` under ``params`` and ``seed``: built once (atomically), then reused."""
    import aloepri

    if obfuscate_kwargs.get("dtype") is None and Path(src).is_file():
        # a GGUF source: float32, what every experiment measured before the API's default became bfloat16 there
        obfuscate_kwargs["dtype"] = "float32"
    key = cache_key(src, params, seed, **obfuscate_kwargs)
    root = Path(work or WORK) / f"{Path(src).stem}-{key}"
    if (root / "model" / "config.json").exists():
        touch(root)
    else:
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed build leaves only this, removed here
        tmp.mkdir(parents=True)
        aloepri.obfuscate(src, tmp / "model", tmp / "key.json", params, seed=seed, allow_weak_seed=True,
                          overwrite=True, progress=False, **obfuscate_kwargs)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
        touch(root)
        prune(keep=(root,), work=work)
    return Target(Path(src), root / "model", root / "key.json", key)


def plaintext_reference(src: Path, work: Path | None = None) -> Path:
    """The plaintext model as the float32 checkpoint the obfuscation starts from (export.gguf's
    plaintext_reference_dir), built once (atomically) and shared by the experiments that compare with it."""
    from aloepri.export.gguf import plaintext_reference_dir

    root = Path(work or WORK) / "gguf" / f"{Path(src).stem}-plaintext-f32"
    if (root / "config.json").exists():
        touch(root)
    else:
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed build leaves only this, removed here
        plaintext_reference_dir(src, tmp)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)
        touch(root)
        prune(keep=(root,), work=work)
    return root


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch


def touch(path: Path) -> None:
    """Record that a cached entry (a directory or a file) was used now."""
    path = Path(path)
    if path.is_dir():
        (path / USED).touch()
    elif path.exists():
        os.utime(path)


def entries(work: Path | None = None) -> list[Entry]:
    """Every cached entry, least recently used first: the children of WORK, and of its GROUPS folders."""
    root = Path(work or WORK)
    if not root.is_dir():
        return []
    paths = []
    for p in root.iterdir():
        if p.name in GROUPS and p.is_dir():
            paths += list(p.iterdir())
        else:
            paths.append(p)
    out = []
    for p in paths:
        try:
            used = (p / USED).stat().st_mtime if (p / USED).exists() else p.stat().st_mtime
            out.append(Entry(p, _size(p), used))
        except FileNotFoundError:  # removed meanwhile (another process pruning)
            continue
    return sorted(out, key=lambda e: e.last_used)


def _size(path: Path) -> int:
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def cap_bytes() -> int:
    """The cache's size cap: ALOEPRI_BENCH_CACHE_GB (a number of GB, 0: keep nothing) or DEFAULT_CAP_GB."""
    raw = os.environ.get(CAP_ENV)
    try:
        gb = float(raw) if raw is not None else DEFAULT_CAP_GB
    except ValueError:
        raise ValueError(f"{CAP_ENV} must be a number of GB, got {raw!r}") from None
    if not gb >= 0:
        raise ValueError(f"{CAP_ENV} must be a number of GB >= 0, got {raw!r}")
    return int(gb * 1e9)


def prune(cap: int | None = None, keep: tuple = (), work: Path | None = None,
          recent_seconds: float = RECENT_SECONDS) -> list[Entry]:
    """Remove least recently used entries until the cache holds at most ``cap`` bytes (default cap_bytes());
    never ``keep`` nor an entry used in the last ``recent_seconds``. Returns the removed entries."""
    cap = cap_bytes() if cap is None else cap
    now = time.time()
    found = entries(work)
    total = sum(e.bytes for e in found)
    keep = {Path(k).resolve() for k in keep}
    removed = []
    for e in found:
        if total <= cap:
            break
        if e.path.resolve() in keep or now - e.last_used < recent_seconds:
            continue
        if e.path.name.endswith(".partial") and now - e.last_used < 86400:  # maybe another process's build
            continue
        if e.path.is_dir() and not e.path.is_symlink():
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            e.path.unlink(missing_ok=True)
        total -= e.bytes
        removed.append(e)
    return removed
