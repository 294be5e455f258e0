"""ISA / IMA / SDA on SmolLM2-135M-Instruct for the presets exact / noisy / paper (+ the unprotected model as
the positive control). Entries ``model/target/attack/budget``; a pair already stored is skipped.

Every entry records the budget the attack actually used (steps, data sizes, model size, candidate pool), what it
used, and its wall time. Obfuscated models are cached by parameters (benchmarks.lib.targets), seed 4242.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.legacy import legacy_note
from ..lib.models import model_path

ATTACKS = ("ima_oracle", "ima", "sda", "isa_hidden", "isa_attention")


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    budget: str = "small"  # aloepri.attacks.base.Budget.named: ci, small, full
    prompts: int = 20  # victim PII prompts (Faker, seed 7)
    isa_len: int = 24  # positions per prompt inverted by ISA
    isa_prompts: int = 3  # prompts inverted by ISA (it costs minutes each)
    attacks: tuple[str, ...] = ATTACKS
    targets: tuple[str, ...] = ("unprotected", "exact", "noisy", "paper")  # "unprotected" or a preset / variant
    obfuscation_seed: int = 4242
    threads: int = 1


def _plans(s: Settings) -> list[tuple[str, str]]:
    """(target, attack) in the order that runs the cheap attacks first."""
    plans = [(t, a) for t in s.targets for a in ("ima_oracle", "ima")
             if not (t == "unprotected" and a == "ima_oracle")]  # identical to `ima` on the unprotected model
    plans += [("noisy", "sda")]  # SDA sees ids only: identical for every preset (same permutation mechanism)
    plans += [(t, "isa_hidden") for t in s.targets] + [(t, "isa_attention") for t in s.targets]
    return [(t, a) for t, a in plans if a in s.attacks]


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import AttackTarget, Budget, unprotected_target
    from aloepri.attacks.data import private_prompts
    from aloepri.attacks.decipher import sda_attack
    from aloepri.attacks.ima import run_ima
    from aloepri.attacks.isa import ISAConfig, isa_attention_attack, isa_hidden_attack

    from ..lib.targets import obfuscated
    from ..lib.variants import parse_variant

    unknown = set(s.attacks) - set(ATTACKS)
    if unknown:
        raise ValueError(f"unknown attacks {sorted(unknown)}: {', '.join(ATTACKS)}")
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    budget = Budget.named(s.budget)
    isa_cfg = ISAConfig.for_budget(budget, max_prompts=s.isa_prompts, max_len=s.isa_len)
    for tname, attack in _plans(s):
        key = f"{s.model}/{tname}/{attack}/{s.budget}"
        if store.has(key):
            continue
        if tname == "unprotected":
            target = unprotected_target(src)
        else:
            built = obfuscated(src, parse_variant(tname)[1], s.obfuscation_seed)
            target = AttackTarget(src, built.model_dir, built.key_path)
        data = private_prompts(target.tokenizer, n=s.prompts, seed=7)
        t0 = time.perf_counter()
        if attack in ("ima_oracle", "ima"):
            res = run_ima(target, data, budget, 0, oracle=attack == "ima_oracle")
        elif attack == "sda":
            res = sda_attack(target, data, budget, 0)
        elif attack == "isa_hidden":
            res = isa_hidden_attack(target, data, budget, 0, cfg=isa_cfg)
        else:
            res = isa_attention_attack(target, data, budget, 0, cfg=isa_cfg)
        res.seconds = time.perf_counter() - t0
        entry = res.to_dict()
        entry.update(target=tname, model=src.name, victim=f"{s.prompts} Faker PII prompts, seed 7",
                     params=None if tname == "unprotected" else parse_variant(tname)[1].to_dict())
        store.put(key, entry)
        print(f"{key}: ttrsr={res.ttrsr} piirsr={res.piirsr} ({res.seconds:.0f}s)", flush=True)


def _budget_details(b: dict) -> str:
    keep = ("layer", "attention_layers", "steps", "train_tokens", "proposal", "match", "prompts", "max_len",
            "episodes", "prior_tokens", "model", "candidate_pool")
    return "; ".join(f"{k} {v}" for k, v in b.items() if k in keep)


def report(store: ResultStore) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    rows = ["| target | attack | budget | TTRSR % | PIIRSR % | BLEU-4 | CosSim | tokens scored | wall s | "
            "budget details |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {a: i for i, a in enumerate(("ima", "ima_oracle", "isa_attention", "isa_hidden", "sda"))}
    for key, e in sorted(store.entries().items(), key=lambda kv: (order.get(kv[1]["attack"], 9), kv[0])):
        _, target, attack, budget = key.split("/")
        label = attack if not attack.endswith("-relaxed") else f"{e['attack']} (relaxed proposal, superseded)"
        m = e["metrics"]
        rows.append(f"| {target} | {label} | {budget} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                    f"{m.get('bleu4', 0):.1f} | {m.get('cossim', 0):.2f} | {m.get('tokens_scored', '-')} | "
                    f"{e['seconds']:.0f} | {_budget_details(e['budget'])} |")
    return legacy_note(store) + "\n".join(rows)


SUMMARY = "ISA / IMA / SDA on SmolLM2 per preset and the unprotected control (tens of minutes per row)"
CONFIGS = {"small": Settings(), "ci": Settings(budget="ci"), "full": Settings(budget="full"),
           "smoke": Settings(budget="ci", prompts=2, isa_prompts=1, isa_len=8, attacks=("isa_hidden",),
                             targets=("unprotected",))}
DOCS = ("docs/security.md",)
LEGACY_CONFIGS = ("old-presets",)
NOTES = "old-presets: rows measured on 2026-11-23 with the presets of then"
