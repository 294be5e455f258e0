"""Where a result came from: the command, the code (commit and whether it was modified), the library versions,
the machine and its load, and the time."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_PACKAGES = ("aloepri", "torch", "transformers", "numpy", "safetensors", "gguf", "llama_cpp_python", "vllm")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    info = {"host": platform.node(), "system": platform.platform(), "cpu": _cpu_model(), "cores": os.cpu_count()}
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    gpus = _gpus()
    if gpus:
        info["gpu"] = gpus
    return info


def _gpus() -> list[str]:
    """The GPUs' names, without importing torch (a run's record is written before its experiment imports it):
    from torch when it is already loaded, else from the NVIDIA driver's /proc entries."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a machine description must not fail a run
        pass
    names = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    return names


def provenance(argv: list[str] | None = None, settings: dict | None = None) -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "argv": list(sys.argv if argv is None else argv),
        "commit": _git("rev-parse", "HEAD"),
        "modified": None if status is None else bool(status),
        "versions": _versions(),
        "machine": machine(),
        "started": now(),
        "settings": settings,
    }
