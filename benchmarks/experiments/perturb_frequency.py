"""What the client's online token perturbation (aloepri.runtime.perturb) does to the frequency attacks: TFMA and
SDA in the distribution-aware setting (the attacker's prior is held-out text from the client's own
distribution, the strongest of the paper's three), on SmolLM2-135M's 49,152-token vocabulary.

The client perturbs every token of its traffic (private corpus stream + Faker PII prompts) with the exponential
mechanism at eps_tok before the key maps it; the attacks see the permuted perturbed ids and are scored against
the client's REAL tokens. The frequency attacks read ids only, so the target is the permutation-only model (every
preset applies one vocabulary permutation). Resumable per (attack, eps_tok).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    budget: str = "ci"  # aloepri.attacks.base.Budget.named: ci, small, full
    attacks: tuple[str, ...] = ("tfma", "sda")
    eps_tok: tuple[float, ...] = (math.inf, 100.0, 60.0, 40.0)  # inf: no perturbation
    setting: str = "distribution-aware"
    prompts: int = 30  # Faker PII prompts, seed 0
    permutation_seed: int = 1
    perturbation_seed: int = 7
    threads: int = 1


def _key(attack: str, setting: str, eps: float) -> str:
    return f"{attack}-{setting}/eps_tok={eps:g}"


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import Budget
    from aloepri.attacks.data import private_prompts
    from aloepri.attacks.decipher import sda_setting_attack
    from aloepri.attacks.frequency import run_tfma
    from aloepri.attacks.nearest_neighbour import permutation_only_target
    from aloepri.runtime.perturb import TokenPerturbation

    todo = [(a, eps) for a in s.attacks for eps in s.eps_tok if not store.has(_key(a, s.setting, eps))]
    if not todo:
        return
    torch.set_num_threads(s.threads)
    target = permutation_only_target(model_path(s.model), seed=s.permutation_seed)
    data = private_prompts(target.tokenizer, s.prompts, seed=0)
    special = list(target.tokenizer.all_special_ids)
    budget = Budget.named(s.budget)
    for attack, eps in todo:
        perturb = None
        if math.isfinite(eps):
            pert = TokenPerturbation.from_plain_model(target.plain_model, eps, seed=s.perturbation_seed,
                                                      exclude_ids=special)
            perturb = pert.apply_stream
        t0 = time.perf_counter()
        if attack == "tfma":
            res = run_tfma(target, data, s.setting, budget, 0, perturb=perturb)
        elif attack == "sda":
            res = sda_setting_attack(target, data, s.setting, budget, 0, perturb=perturb)
        else:
            raise ValueError(f"unknown attack {attack!r}: tfma or sda")
        entry = res.to_dict()
        entry.update(eps_tok=eps if math.isfinite(eps) else None, seconds=time.perf_counter() - t0,
                     victim=f"{s.prompts} Faker PII prompts, seed 0", model=model_path(s.model).name,
                     target="permutation-only (ids only: the same for every preset)")
        key = _key(attack, s.setting, eps)
        store.put(key, entry)
        print(f"{key}: TTRSR {res.ttrsr:.4f} PIIRSR {res.piirsr} perturbed "
              f"{res.budget.get('perturbed_token_fraction')} ({entry['seconds']:.0f}s)", flush=True)


def report(store: ResultStore) -> str:
    """The docs/accuracy.md table: per eps_tok, TFMA and SDA side by side (%)."""
    by_eps: dict[float, dict[str, dict]] = {}
    for e in store.entries().values():
        eps = math.inf if e["eps_tok"] is None else e["eps_tok"]
        by_eps.setdefault(eps, {})[e["attack"].split("-", 1)[0]] = e
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = ["| eps_tok | tokens perturbed | TFMA TTRSR | TFMA PIIRSR | SDA TTRSR | SDA PIIRSR | "
            "private-stream recovery TFMA / SDA |", "|---|---|---|---|---|---|---|"]
    for eps in sorted(by_eps, reverse=True):
        t, d = by_eps[eps].get("tfma", {}), by_eps[eps].get("sda", {})
        any_ = t or d
        perturbed = any_.get("budget", {}).get("perturbed_token_fraction") if math.isfinite(eps) else 0.0
        # SDA reports it as private_stream_recovery, TFMA as stream_top1_tokenwise (the same quantity)
        stream = lambda e: pct(e.get("metrics", {}).get("private_stream_recovery",  # noqa: E731
                                                        e.get("metrics", {}).get("stream_top1_tokenwise")))
        rows.append(f"| {'inf (none)' if math.isinf(eps) else f'{eps:g}'} | {pct(perturbed)} | "
                    f"{pct(t.get('ttrsr'))} | {pct(t.get('piirsr'))} | {pct(d.get('ttrsr'))} | "
                    f"{pct(d.get('piirsr'))} | {stream(t)} / {stream(d)} |")
    return "\n".join(rows)


SUMMARY = "token perturbation vs TFMA and SDA (distribution-aware) on SmolLM2's vocabulary (minutes per row)"
CONFIGS = {"ci": Settings(), "small": Settings(budget="small"),
           "smoke": Settings(attacks=("tfma",), eps_tok=(math.inf, 40.0), prompts=5)}
DOCS = ("docs/accuracy.md", "docs/security.md")
NOTES = "needs the Debian corpora of docs/data.md"
