"""aloepri: privacy-preserving LLM inference by covariant obfuscation (the AloePri method).

The public API is loaded on first use (PEP 562), so ``import aloepri.serving.client`` in a process that only maps
token ids does not load torch. See docs/architecture.md for the package layout.
"""
from __future__ import annotations

import importlib

# public name -> module that defines it (relative to this package)
_PUBLIC = {
    "UnsupportedArchitectureError": ".obfuscation.archs", "supported_architectures": ".obfuscation.archs",
    "CheckpointError": ".obfuscation.checkpoint",
    "KeyFile": ".keyfile", "KeyFileError": ".keyfile", "KeyMismatchError": ".keyfile",
    "check_key_matches": ".keyfile", "load_key": ".keyfile",
    "PRESETS": ".obfuscation.params", "ObfuscationParams": ".obfuscation.params",
    "resolve_params": ".obfuscation.params",
    "ObfuscationResult": ".obfuscation.pipeline", "obfuscate": ".obfuscation.pipeline",
    "serving_dtype": ".obfuscation.pipeline",
    "PrivateModel": ".runtime.inference",
    "Client": ".serving.client", "AsyncClient": ".serving.client",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'aloepri' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
