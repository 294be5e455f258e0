"""The measured privacy-utility points shipped with the package (``measured_frontier.json``, derived by
`python -m benchmarks run audit_frontier` from the project's frontier and behavioural experiments; its provenance
is inside), and the frontier through them."""
from __future__ import annotations

import json
from importlib import resources
from typing import Any, Sequence

DATA_FILE = "measured_frontier.json"


def load_measured() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath(DATA_FILE).read_text(encoding="utf-8"))


def model_for(names: Sequence[str], measured: dict[str, Any]) -> str | None:
    """The measured model whose file name matches one of ``names`` (source paths), or None."""
    low = [str(n).lower() for n in names]
    for model, info in measured["models"].items():
        if any(m in n for m in info["match"] for n in low):
            return model
    return None


def frontier(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured frontier: the points no other point beats on both axes (at least as accurate and less
    recovered), from the most to the least accurate. Privacy is lost where it is high, so it is the *lowest*
    recovery reached at each accuracy that bounds what a setting can hope for."""
    out: list[dict[str, Any]] = []
    best = float("inf")
    for p in sorted(points, key=lambda p: (-p["top1"], p["recovery"])):
        if p["recovery"] < best:
            out.append(p)
            best = p["recovery"]
    return out
