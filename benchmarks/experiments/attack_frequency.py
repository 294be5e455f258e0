"""Frequency and known-pair attacks on real models, per preset.

For each model and preset: obfuscate (seed 11, cached by parameters: benchmarks.lib.targets), then
- TFMA in the three knowledge settings (prior / observed stream sizes in each entry; TFMA sees only ids, so the
  preset changes nothing but the key),
- known-pair ridge with k = 20, 300, 1000 oracle pairs (full-vocabulary matching of every obfuscated id),
- frequency-bootstrapped ridge (no oracle) with the distribution-aware and domain-aware priors.
Private prompts: 50 Faker PII prompts (seed 0). Entries ``model/preset/attack``; entries present are skipped.
Needs the Debian corpora of docs/data.md. Wall time on SmolLM2 with 1 thread on a shared 2-core machine: about
1 min per TFMA, 4-9 min per ridge (full 49,152 x 49,152 matching), 12 min per bootstrapped ridge.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.legacy import legacy_note
from ..lib.models import model_path

SETTINGS_ORDER = ("zero-knowledge", "domain-aware", "distribution-aware")


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("smollm2",)
    presets: tuple[str, ...] = ("exact", "noisy", "paper")  # presets or variants (benchmarks.lib.variants)
    attacks: tuple[str, ...] = ("tfma", "ridge", "freq-ridge")
    budget: str = "full"  # aloepri.attacks.base.Budget.named: ci, small, full
    ks: tuple[int, ...] = (20, 300, 1000)  # known-pair counts for the ridge attack
    freq_settings: tuple[str, ...] = ("distribution-aware", "domain-aware")  # priors of the bootstrapped ridge
    prompts: int = 50
    obfuscation_seed: int = 11
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import AttackTarget, Budget
    from aloepri.attacks.data import SETTINGS, private_prompts
    from aloepri.attacks.frequency import row_spaces, run_bootstrapped_ridge, run_known_pair_ridge, run_tfma

    from ..lib.targets import obfuscated
    from ..lib.variants import parse_variant

    unknown = set(s.attacks) - {"tfma", "ridge", "freq-ridge"}
    if unknown:
        raise ValueError(f"unknown attacks {sorted(unknown)}: tfma, ridge, freq-ridge")
    torch.set_num_threads(s.threads)
    budget = Budget.named(s.budget)
    names = ([f"tfma-{x}" for x in SETTINGS] if "tfma" in s.attacks else []) \
        + ([f"ridge-k{k}" for k in s.ks] if "ridge" in s.attacks else []) \
        + ([f"freq-ridge-{x}" for x in s.freq_settings] if "freq-ridge" in s.attacks else [])
    for model in s.models:
        src = model_path(model)
        plain = None
        for preset in s.presets:
            label, params = parse_variant(preset)
            todo = [n for n in names if not store.has(f"{model}/{label}/{n}")]
            if not todo:
                continue
            built = obfuscated(src, params, s.obfuscation_seed)
            target = AttackTarget(src, built.model_dir, built.key_path)
            if plain is not None:  # share the plaintext model across presets (it is the same public model)
                target.__dict__["plain_model"], target.__dict__["tokenizer"] = plain
            data = private_prompts(target.tokenizer, n=s.prompts, seed=0)
            spaces = None
            for name in todo:
                t0 = time.perf_counter()
                if name.startswith("tfma-"):
                    res = run_tfma(target, data, name[len("tfma-"):], budget, 0)
                else:
                    if spaces is None:
                        spaces = row_spaces(target)
                    if name.startswith("ridge-k"):
                        res = run_known_pair_ridge(target, data, int(name[len("ridge-k"):]), budget, 0, spaces=spaces)
                    else:
                        res = run_bootstrapped_ridge(target, data, name[len("freq-ridge-"):], budget, 0,
                                                     spaces=spaces)
                res.seconds = time.perf_counter() - t0
                entry = res.to_dict()
                entry["budget"]["budget_name"] = budget.name
                entry.update(obfuscation_seed=s.obfuscation_seed, params=params.to_dict())
                key = f"{model}/{label}/{name}"
                store.put(key, entry)
                m = res.metrics
                print(f"[{key}] ttrsr={res.ttrsr:.4f} piirsr={res.piirsr} vocab={m.get('vocab_recovery'):.4f} "
                      f"bleu4={m.get('bleu4')} {res.seconds:.0f}s", flush=True)
            plain = (target.plain_model, target.tokenizer)


def report(store: ResultStore) -> str:
    """The docs/security.md tables (%): TFMA per setting, known-pair ridge, frequency-bootstrapped ridge."""
    pct = lambda x, n=1: "-" if x is None else f"{100 * x:.{n}f}"  # noqa: E731
    rows = {tuple(k.split("/")): e for k, e in store.entries().items()}
    out = [legacy_note(store) + "TFMA (ids only: the same for every preset under one obfuscation seed)", "",
           "| model | preset | setting | prompt TTRSR | PIIRSR | BLEU-4 | stream top-1 / top-10 / top-100 | "
           "top-1 on 10 / 100 most frequent types | prompt top-10 / top-100 |", "| --- " * 9 + "|"]
    for (model, preset, name), e in rows.items():
        if not name.startswith("tfma-"):
            continue
        m = e["metrics"]
        out.append(f"| {model} | {preset} | {name[5:]} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                   f"{m['bleu4']:.2f} | {pct(m['stream_top1'])} / {pct(m['stream_top10'])} / "
                   f"{pct(m['stream_top100'])} | {pct(m['top10_types_top1'])} / {pct(m['top100_types_top1'])} | "
                   f"{pct(m['prompt_top10'])} / {pct(m['prompt_top100'])} |")
    out += ["", "Known-pair ridge", "", "| model | preset | k | prompt TTRSR | PIIRSR | vocab (unknown ids only) | "
            "spaces chosen | seconds |", "| --- " * 8 + "|"]
    for (model, preset, name), e in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2][7:].zfill(6))):
        if not name.startswith("ridge-k"):
            continue
        m, b = e["metrics"], e["budget"]
        out.append(f"| {model} | {preset} | {name[7:]} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                   f"{pct(m['vocab_recovery'], 2)} ({pct(m.get('vocab_recovery_unknown_only'), 2)}) | "
                   f"{'+'.join(b.get('row_spaces', ['embed', 'head']))} | {e['seconds']:.0f} |")
    out += ["", "Frequency-bootstrapped ridge", "", "| model | preset | prior | prompt TTRSR | PIIRSR | vocab | "
            "seed pairs correct | CV-consistent pairs kept |", "| --- " * 8 + "|"]
    for (model, preset, name), e in rows.items():
        if not name.startswith("freq-ridge-"):
            continue
        stages = {t["stage"]: t for t in e["metrics"].get("trace", [])}
        seed, kept = stages.get("tfma seed pairs", {}), stages.get("cv-consistent seed pairs", {})
        out.append(f"| {model} | {preset} | {name[11:]} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                   f"{pct(e['metrics']['vocab_recovery'], 2)} | {pct(seed.get('pairs_correct'))}% of "
                   f"{seed.get('pairs', '-')} | {kept.get('pairs', '-')} ({pct(kept.get('pairs_correct'), 0)}% "
                   f"correct) |")
    return "\n".join(out)


SUMMARY = "TFMA, known-pair ridge and frequency-bootstrapped ridge per preset on SmolLM2 (hours at full budget)"
CONFIGS = {"full": Settings(),
           "smoke": Settings(presets=("exact",), attacks=("tfma",), budget="ci", prompts=10)}
DOCS = ("docs/security.md",)
LEGACY_CONFIGS = ("old-presets",)
NOTES = "needs the Debian corpora of docs/data.md; old-presets: rows measured with the presets of 2026-11-22"
