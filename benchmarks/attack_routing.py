"""MoE routing-leak attack on tiny random-weight MoE models, per architecture / preset / relabelling (resumable JSON).

    OMP_NUM_THREADS=1 python benchmarks/attack_routing.py [--archs qwen2_moe,qwen3_moe,mixtral,deepseek_v3]
        [--presets exact,noisy] [--prompts 8] [--tokens 16] [--overrides JSON] [--no-control]
        [--work /tmp/aloepri-attack-routing]

No real MoE checkpoint is available offline, so every number here is on the tiny random-weight models of
src/aloepri/testing/tiny.py (vocabulary 96, 2-3 layers, 8 experts top-2 unless the entry says otherwise), loaded float32
through the stock classes, obfuscated with seed 11. Random-weight models route mostly by token, which favours the
attack; trained models route by context more. Plus the positive control (the weak target): Qwen3-MoE with 32
experts, exact preset. Private prompts: ``--prompts`` random id sequences (seed 0) of ``--tokens`` ids after an
8-id known prefix (a stand-in for the public chat template). Candidate pool: the full vocabulary (96).
Further runs: `--archs qwen3_moe --presets noisy --overrides '{"num_experts": 32}' --no-control` (the weak
target under noise) and `--archs qwen3_moe --presets exact --prompts 24 --no-control` (more traffic).
Each entry: token recovery (TTRSR), the fraction of private tokens whose id occurs in the known prefix (known
outright, a floor), learned-relabelling accuracy, the fraction of (token, layer) expert sets the
obfuscated model chose equal to the plaintext ones (routing agreement), wall time. Entries present are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results" / "attack_routing.json"
OBF_SEED = 11
CONTROL = ("qwen3_moe", {"num_experts": 32}, "exact")


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, entry: str, value: dict) -> None:
    """Merge one entry into the file as it is now (another run may have added entries meanwhile)."""
    data = _load(path)
    data[entry] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _target(arch: str, overrides: dict, preset: str, work: Path):
    import aloepri
    from aloepri.attacks.base import AttackTarget
    from aloepri.testing.tiny import build_tiny

    tag = arch + "".join(f"-{k}{v}" for k, v in overrides.items())
    d = work / tag
    if not (d / "src" / "config.json").exists():
        build_tiny(arch, d / "src", **overrides)
    out, key = d / f"obf-{preset}", d / f"{preset}.key"
    if not (out / "config.json").exists():
        aloepri.obfuscate(d / "src", out, key, aloepri.resolve_params(preset), seed=OBF_SEED,
                          allow_weak_seed=True, progress=False)
    return tag, AttackTarget(d / "src", out, key)


def routing_agreement(target, data) -> float:
    """Fraction of (token, layer) expert sets of the obfuscated model equal to the plaintext ones (key: truth)."""
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen2_moe,qwen3_moe,mixtral,deepseek_v3")
    ap.add_argument("--presets", default="exact,noisy")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--overrides", default="{}", help='config overrides for --archs, JSON, e.g. {"num_experts": 32}')
    ap.add_argument("--no-control", action="store_true", help="skip the 32-expert positive control")
    ap.add_argument("--work", default="/tmp/aloepri-attack-routing")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from aloepri.attacks.base import Budget, PrivateData
    from aloepri.attacks.routing_leak import run_routing_leak

    work, results = Path(args.work), Path(args.results)
    work.mkdir(parents=True, exist_ok=True)
    runs = [] if args.no_control else [(CONTROL[0], CONTROL[1], CONTROL[2])]
    runs += [(a, json.loads(args.overrides), p) for p in args.presets.split(",") for a in args.archs.split(",")]
    budget = Budget.named("full")
    for arch, overrides, preset in runs:
        tag, target = _target(arch, overrides, preset, work)
        rng = np.random.default_rng(0)
        ids = [rng.integers(0, target.vocab_size, args.tokens).tolist() for _ in range(args.prompts)]
        data = PrivateData([""] * len(ids), ids, [[False] * len(i) for i in ids])
        agreement = None
        for oracle in (True, False):
            entry = f"{tag}/{preset}/{'oracle' if oracle else 'learned'}/p{args.prompts}x{args.tokens}"
            if entry in _load(results):
                print("skip", entry)
                continue
            if agreement is None:
                agreement = routing_agreement(target, data)
            t0 = time.perf_counter()
            res = run_routing_leak(target, data, budget, seed=0, oracle=oracle)
            value = {**res.to_dict(), "seconds": time.perf_counter() - t0, "routing_agreement": agreement,
                     "arch": arch, "overrides": overrides, "preset": preset, "obf_seed": OBF_SEED,
                     "threads": int(os.environ.get("OMP_NUM_THREADS", "1"))}
            _save(results, entry, value)
            print(f"{entry}: TTRSR {res.ttrsr:.3f} relabel {res.metrics.get('relabel_accuracy', 1.0):.2f} "
                  f"agreement {agreement:.2f} passes {res.metrics['passes']} ({value['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
