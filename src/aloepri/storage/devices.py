"""Which torch device a command computes on: the one place a ``--device`` text is read and checked.

Every command with ``--device`` (verify, eval, attack, obfuscate) calls ``resolve_device`` once, before loading
anything, so a typo or an absent accelerator is one clear line (exit 2 in the CLI), never a traceback half-way
through a run. torch is imported only inside the functions: this module sits in the lowest layer.
"""
from __future__ import annotations

import argparse
from typing import Any

DEFAULT_DEVICE = "cpu"
DEVICE_HELP = ("torch device to compute on: cpu (default), cuda, cuda:N or mps; models and tensors are placed "
               "there, results come back to the CPU")


class DeviceError(ValueError):
    """An invalid or unavailable device (a ValueError, so every command reports it as a user error)."""


def _available(kind: str, torch: Any) -> tuple[bool, int]:
    """(is the backend usable here, how many devices it has)."""
    if kind == "cuda":
        ok = torch.cuda.is_available()
        return ok, torch.cuda.device_count() if ok else 0
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return bool(mps is not None and mps.is_available()), 1
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        ok = bool(xpu is not None and xpu.is_available())
        return ok, xpu.device_count() if ok else 0
    return False, 0


def resolve_device(text: Any = None):
    """``text`` ('cpu', 'cuda', 'cuda:1', 'mps', a ``torch.device`` or None = cpu) -> a ``torch.device`` that
    exists on this machine, with an index for cuda/xpu. Raises ``DeviceError`` with one actionable line."""
    import torch

    if text is None:
        text = DEFAULT_DEVICE
    if isinstance(text, torch.device):
        dev = text
    else:
        spec = str(text).strip()
        try:
            dev = torch.device(spec)
        except (RuntimeError, ValueError):
            raise DeviceError(f"unknown device {spec!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type not in ("cuda", "mps", "xpu"):
        raise DeviceError(f"device {str(dev)!r} cannot run a model; use cpu, cuda, cuda:N or mps")
    ok, count = _available(dev.type, torch)
    if not ok:
        raise DeviceError(f"device {str(dev)!r} is not available on this machine (torch {torch.__version__} "
                          f"sees no {dev.type.upper()} device); use --device cpu, or a machine and a torch build with "
                          f"{dev.type} support")
    if dev.type in ("cuda", "xpu"):
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise DeviceError(f"device {str(dev)!r} does not exist: this machine has {count} {dev.type} "
                              f"device(s), {dev.type}:0 to {dev.type}:{count - 1}")
        return torch.device(dev.type, index)
    return dev


def describe_device(device: Any) -> str:
    """The device in words for result files: 'cpu' or e.g. 'cuda:0 (NVIDIA H100 80GB HBM3)'."""
    import torch

    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def model_device(model: Any):
    """The device a model's weights are on (cpu for a model without parameters)."""
    import torch

    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device`` with the shared default and help; the command passes ``args.device`` to ``resolve_device``."""
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)


__all__ = ["DEFAULT_DEVICE", "DEVICE_HELP", "DeviceError", "add_device_option", "describe_device",
           "model_device", "resolve_device"]
