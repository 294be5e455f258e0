"""MoE routing-leak attack on tiny random-weight MoE models, per architecture / preset / relabelling.

No real MoE checkpoint is available offline, so every number here is on the tiny random-weight models of
aloepri.testing.tiny (vocabulary 96, 2-3 layers, 8 experts top-2 unless the entry says otherwise), loaded float32
through the stock classes, obfuscated with seed 11. Random-weight models route mostly by token, which favours the
attack; trained models route by context more. Plus the positive control (the weak target): Qwen3-MoE with 32
experts, exact preset. Private prompts: ``prompts`` random id sequences (seed 0) of ``tokens`` ids after an
8-id known prefix (a stand-in for the public chat template). Candidate pool: the full vocabulary (96).
Each entry: token recovery (TTRSR), the fraction of private tokens whose id occurs in the known prefix (known
outright, a floor), learned-relabelling accuracy, the fraction of (token, layer) expert sets the
obfuscated model chose equal to the plaintext ones (routing agreement), wall time. Entries present are skipped.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..lib import ResultStore
from ..lib.legacy import legacy_note

CONTROL = ("qwen3_moe", {"num_experts": 32}, "exact")  # the weak target: 32 experts, exact preset


@dataclass(frozen=True)
class Settings:
    archs: tuple[str, ...] = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")
    presets: tuple[str, ...] = ("exact", "noisy")  # presets or variants (benchmarks.lib.variants)
    prompts: int = 8
    tokens: int = 16
    overrides: dict = field(default_factory=dict)  # tiny-model config overrides for ``archs``, e.g. num_experts
    control: bool = True  # also the 32-expert positive control
    obfuscation_seed: int = 11
    threads: int = 1


def _tag(arch: str, overrides: dict) -> str:
    return arch + "".join(f"-{k}{v}" for k, v in overrides.items())


def _target(arch: str, overrides: dict, preset: str, seed: int):
    from aloepri.attacks.base import AttackTarget
    from aloepri.testing.tiny import build_tiny

    from ..lib.targets import WORK, obfuscated
    from ..lib.variants import parse_variant

    src = WORK / "tiny" / _tag(arch, overrides)
    if not (src / "config.json").exists():
        build_tiny(arch, src, **overrides)
    built = obfuscated(src, parse_variant(preset)[1], seed)
    return AttackTarget(src, built.model_dir, built.key_path)


def routing_agreement(target, data) -> float:
    """Fraction of (token, layer) expert sets of the obfuscated model equal to the plaintext ones (key: truth)."""
    import torch

    from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts

    orders = expert_orders(target.key, target.obf_model.config)
    same = tot = 0
    for ids in data.plain_ids:
        p = routing_decisions(target.plain_model, torch.tensor([ids]))
        o = to_plain_experts(routing_decisions(target.obf_model, torch.tensor([target.obfuscate_ids(ids)])), orders)
        for L in p:
            same += int((p[L] == o[L]).all(-1).sum())
            tot += len(p[L])
    return same / tot


def run(s: Settings, store: ResultStore) -> None:
    import numpy as np
    import torch

    from aloepri.attacks.base import Budget, PrivateData
    from aloepri.attacks.routing_leak import run_routing_leak

    torch.set_num_threads(s.threads)
    runs = [CONTROL] if s.control else []
    runs += [(a, dict(s.overrides), p) for p in s.presets for a in s.archs]
    budget = Budget.named("full")
    for arch, overrides, preset in runs:
        keys = {oracle: f"{_tag(arch, overrides)}/{preset}/{'oracle' if oracle else 'learned'}/p{s.prompts}x{s.tokens}"
                for oracle in (True, False)}
        if all(store.has(k) for k in keys.values()):
            continue
        target = _target(arch, overrides, preset, s.obfuscation_seed)
        rng = np.random.default_rng(0)
        ids = [rng.integers(0, target.vocab_size, s.tokens).tolist() for _ in range(s.prompts)]
        data = PrivateData([""] * len(ids), ids, [[False] * len(i) for i in ids])
        agreement = routing_agreement(target, data)
        for oracle, key in keys.items():
            if store.has(key):
                continue
            t0 = time.perf_counter()
            res = run_routing_leak(target, data, budget, seed=0, oracle=oracle)
            value = {**res.to_dict(), "seconds": time.perf_counter() - t0, "routing_agreement": agreement,
                     "arch": arch, "overrides": overrides, "preset": preset, "obf_seed": s.obfuscation_seed,
                     "threads": int(os.environ.get("OMP_NUM_THREADS", s.threads))}
            store.put(key, value)
            print(f"{key}: TTRSR {res.ttrsr:.3f} relabel {res.metrics.get('relabel_accuracy', 1.0):.2f} "
                  f"agreement {agreement:.2f} passes {res.metrics['passes']} ({value['seconds']:.0f} s)", flush=True)


def report(store: ResultStore) -> str:
    """The docs/security.md table: per model, preset and data size, oracle and learned TTRSR side by side."""
    groups: dict[tuple[str, str, str], dict[str, dict]] = {}
    for key, e in store.entries().items():
        tag, preset, mode, data = key.split("/")
        groups.setdefault((tag, preset, data), {})[mode] = e
    rows = ["| model | preset | data | agreement | TTRSR oracle | TTRSR learned (relabelling correct) |",
            "|---|---|---|---|---|---|"]
    for (tag, preset, data), by in sorted(groups.items(),
                                    key=lambda kv: (int(kv[0][2][1:].split("x")[0]), kv[0][1], kv[0][0])):
        o, l = by.get("oracle"), by.get("learned")
        oracle = "-" if o is None else f"{100 * o['ttrsr']:.1f}%"
        learned = "-" if l is None else \
            f"{100 * l['ttrsr']:.1f}% ({100 * l['metrics'].get('relabel_accuracy', 1.0):.0f}%)"
        rows.append(f"| {tag} | {preset} | {data.lstrip('p').replace('x', ' x ')} | "
                    f"{(o or l)['routing_agreement']:.2f} | {oracle} | {learned} |")
    return legacy_note(store) + "\n".join(rows)


SUMMARY = "MoE routing-leak attack on tiny random-weight MoE models per architecture and preset (minutes)"
CONFIGS = {"full": Settings(),
           "experts32-noisy": Settings(archs=("qwen3_moe",), presets=("noisy",), overrides={"num_experts": 32},
                                       control=False),
           "traffic24": Settings(archs=("qwen3_moe", "deepseek_v3"), presets=("exact", "noisy"), prompts=24,
                                 control=False),
           "smoke": Settings(archs=("mixtral",), presets=("exact",), prompts=2, tokens=8, control=False)}
DOCS = ("docs/security.md",)
LEGACY_CONFIGS = ("old-presets",)
NOTES = "old-presets: rows measured on 2026-11-22 with the presets of then"
