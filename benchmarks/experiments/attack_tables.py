"""The weight attacks of docs/security.md (VMA, Gate-IA, Attn-IA, Attn-IA-sorted, NN, or any registered attack) on
the bundled models, per target (benchmarks.lib.attack_targets: presets, positive controls, the paper's ablation
rows, preset variants). Rows keyed ``model/target/attack/budget``; 1 CPU thread."""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.attack_targets import print_entry, render, run_attack, target_record
from ..lib.models import model_path

WEIGHT_ATTACKS = ("vma", "gate-ia", "attn-ia", "attn-ia-sorted", "nn")


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("smollm2",)
    targets: tuple[str, ...] = ("permutation-only", "exact-nohp", "exact", "noisy", "paper", "ablation-0",
                                "ablation-1")
    attacks: tuple[str, ...] = WEIGHT_ATTACKS
    budget: str = "ci"  # ci | small | full (aloepri.attacks.base.Budget)
    prompts: int = 50  # Faker PII prompts of the victim (seed 0)
    seed: int = 1234  # obfuscation seed
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import Budget
    from aloepri.attacks.cli import private_data
    from aloepri.runtime.inference import load_plain_model

    from ..lib.attack_targets import build_target

    torch.set_num_threads(s.threads)
    for model in s.models:
        src = model_path(model)
        plain = None
        for target in s.targets:
            todo = [a for a in s.attacks if not store.has(f"{model}/{target}/{a}/{s.budget}")]
            if not todo:
                continue
            if plain is None:
                plain = load_plain_model(src)
            t = build_target(src, target, s.seed, plain)
            data = private_data(t.tokenizer, s.prompts, 0)
            for name in todo:
                key = f"{model}/{target}/{name}/{s.budget}"
                entry = run_attack(name, t, data, Budget.named(s.budget))
                store.put(key, {**entry, "target": target, "params": target_record(target)})
                print_entry(key, entry)
            del t


def report(store: ResultStore) -> str:
    return render(store.entries())


SUMMARY = ("weight attacks (VMA, Gate-IA, Attn-IA, NN ...) per target and model: docs/security.md's tables "
           "(minutes per attack on SmolLM2, up to 20 min on Qwen)")
CONFIGS = {
    # docs/security.md "Summary ... SmolLM2-135M, budget ci", the detailed tables and the ablation table
    "smollm2-ci": Settings(),
    # the same on Qwen2.5-Coder-0.5B (VMA only on the noisy targets: 19 min per run)
    "qwen-coder-ci": Settings(models=("qwen-coder",), targets=("permutation-only", "exact", "noisy", "paper",
                                                               "ablation-0", "ablation-1")),
    # known-pair ridge on Qwen (docs/security.md, the leaked-pairs paragraph)
    "qwen-coder-ridge": Settings(models=("qwen-coder",), targets=("noisy", "paper"),
                                 attacks=("ridge-k20", "ridge-k300")),
    # VMA at budget small on the paper preset (docs/defences.md quotes its wall time)
    "paper-vma-small": Settings(targets=("paper",), attacks=("vma",), budget="small"),
    # the frequency attacks over the client's whole traffic (docs/security.md, SDA in the paper's settings)
    "traffic-ci": Settings(targets=("noisy",), attacks=("tfma", "sda-zero-knowledge", "sda-domain-aware",
                                                          "sda-distribution-aware")),
    # lambda and the block permutation against the weight attacks (docs/expansion.md)
    "lam-beta-ci": Settings(targets=("noisy:lam=0.1", "default:lam=0.0,beta=1"),
                            attacks=("gate-ia", "attn-ia", "attn-ia-sorted")),
    # a check that the whole path runs (NN on the positive control, 5 prompts: about a minute)
    "smoke": Settings(targets=("permutation-only",), attacks=("nn",), prompts=5),
}
DEFAULT_CONFIG = "smollm2-ci"
DOCS = ("docs/security.md", "docs/defences.md", "docs/expansion.md")
NOTES = ("CPU; 1 thread; the obfuscated targets are cached by parameter hash (benchmarks.lib.targets). The kept "
         "results name targets as the presets were then ('default' was noisy-like then); every row records its "
         "parameters")
