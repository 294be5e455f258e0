"""Every stored result of an experiment, across its configs: for experiments that read another's results (the
frontier draws the behavioural attacks' points, the audit's package data is derived from both)."""
from __future__ import annotations

from .registry import get_experiment
from .store import ResultStore


def stored_results(experiment: str) -> list[ResultStore]:
    """The stores of ``experiment`` that exist, in config order (kept results last)."""
    exp = get_experiment(experiment)
    stores = [exp.store(c) for c in (*exp.config_names, *exp.legacy_configs)]
    return [s for s in stores if s.path.exists()]


def merged_entries(experiment: str) -> dict[str, dict]:
    """The entries of every stored config of ``experiment`` in one dict (a key stored twice: the later config's)."""
    merged: dict[str, dict] = {}
    for store in stored_results(experiment):
        merged.update(store.entries())
    return merged
