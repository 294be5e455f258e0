"""The paper's RmDP epsilon (aloepri.eval.privacy) for the bundled models, per preset and eps_1."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("smollm2", "qwen-coder")
    presets: tuple[str, ...] = ("exact", "noisy", "paper")
    eps1: tuple[float, ...] = (math.inf, 1.0, 10.0)
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    import aloepri
    from aloepri.eval.privacy import budget_from_matrices, load_vocab_matrices

    torch.set_num_threads(s.threads)
    for model in s.models:
        matrices = None
        for preset in s.presets:
            p = aloepri.resolve_params(preset)
            for eps1 in s.eps1:
                key = f"{model}|{preset}|{eps1}"
                if store.has(key):
                    continue
                if matrices is None:
                    matrices = load_vocab_matrices(model_path(model))
                b = budget_from_matrices(*matrices, p.alpha_e, p.alpha_h, eps1)
                store.put(key, {"model": model, "preset": preset, **b.to_dict()})
                print(key, f"eps={b.eps:.6g}", flush=True)


def report(store: ResultStore) -> str:
    rows = ["| model | preset | eps_1 | lambda_e (max, min) | sigma_e | sigma_h | eps_e | eps_h | eps |",
            "|---|---|---|---|---|---|---|---|---|"]
    for key, e in store.entries().items():
        model, preset, eps1 = key.split("|")
        le = e["lambda_e"]
        rows.append(f"| {model} | {preset} | {eps1} | {le[0]:.1f}, {le[1]:.1f} | {e['sigma_e']:.4g} | "
                    f"{e['sigma_h']:.4g} | {e['eps_e']} | {e['eps_h']} | {e['eps']} |")
    return "\n".join(rows)


SUMMARY = "the paper's RmDP epsilon for the bundled models, per preset and eps_1 (seconds)"
CONFIGS = {"full": Settings(), "smollm2": Settings(models=("smollm2",))}
DOCS = ("docs/accuracy.md",)
