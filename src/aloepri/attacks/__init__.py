"""Attack suite: every attack of the AloePri paper plus our own, as reusable parts.

Importing the package fills ``REGISTRY`` (name -> ``fn(target, data, budget, seed) -> AttackResult``). The weight
attacks (VMA, Gate-IA, Attn-IA, NN) are always available; the others are loaded when their module exists, and a
missing optional dependency is reported in ``UNAVAILABLE`` instead of breaking the whole suite.
"""
from __future__ import annotations

import importlib

from .base import REGISTRY, AttackResult, AttackTarget, Budget, PrivateData, register  # noqa: F401
from . import invariant, nearest_neighbour, vma  # noqa: F401  (registration side effects)

__all__ = ["REGISTRY", "UNAVAILABLE", "AttackResult", "AttackTarget", "Budget", "PrivateData", "register",
           "invariant", "nearest_neighbour", "vma"]

UNAVAILABLE: dict[str, str] = {}  # module -> why it could not be loaded

for _name in ("frequency", "isa", "ima", "decipher", "routing_leak", "behavioural", "stream_decipher",
              "log_reader"):
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _err:
        if _err.name == f"{__name__}.{_name}":
            continue  # module not written (yet): its attacks are simply absent
        UNAVAILABLE[_name] = (f"aloepri.attacks.{_name} needs the missing package {_err.name!r}; "
                              f"install it (pip install {_err.name}) to enable its attacks")
