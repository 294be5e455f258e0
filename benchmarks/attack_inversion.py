"""ISA / IMA / SDA on SmolLM2-135M-Instruct for the presets exact / noisy / paper (+ the unprotected model as
the positive control), resumable: results go to benchmarks/results/attack_inversion.json and a (target, attack)
pair already there is skipped.

    OMP_NUM_THREADS=1 python benchmarks/attack_inversion.py [--budget small] [--prompts 20] [--only ima,sda]

Every entry records the budget the attack actually used (steps, data sizes, model size, candidate pool), what it
used, and its wall time. Obfuscated models are written once per preset under --work (seed 4242).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import aloepri
from aloepri.attacks.base import AttackTarget, Budget, unprotected_target
from aloepri.attacks.data import private_prompts
from aloepri.attacks.decipher import sda_attack
from aloepri.attacks.ima import run_ima
from aloepri.attacks.isa import ISAConfig, isa_attention_attack, isa_hidden_attack
from aloepri.models import smollm2_gguf

RESULTS = Path(__file__).parent / "results" / "attack_inversion.json"
PRESETS = ("exact", "noisy", "paper")


def _target(name: str, src: Path, work: Path) -> AttackTarget:
    if name == "unprotected":
        return unprotected_target(src)
    out, key = work / f"smol-{name}", work / f"smol-{name}.key"
    if not key.exists():
        aloepri.obfuscate(src, out, key, aloepri.resolve_params(name), seed=4242, allow_weak_seed=True, progress=False)
    return AttackTarget(src, out, key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=20, help="victim PII prompts (Faker, seed 7)")
    ap.add_argument("--isa-len", type=int, default=24, help="positions per prompt inverted by ISA")
    ap.add_argument("--isa-prompts", type=int, default=3, help="prompts inverted by ISA (it costs minutes each)")
    ap.add_argument("--only", default="", help="comma list of attacks to run (default all)")
    ap.add_argument("--targets", default="unprotected,exact,noisy,paper")
    ap.add_argument("--work", default="/tmp/aloepri-attack-inversion")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    src = smollm2_gguf()
    budget = Budget.named(args.budget)
    only = set(filter(None, args.only.split(",")))
    isa_cfg = ISAConfig.for_budget(budget, max_prompts=args.isa_prompts, max_len=args.isa_len)

    plans = []
    for t in args.targets.split(","):
        plans += [(t, "ima_oracle"), (t, "ima")]
    plans += [("noisy", "sda")]  # SDA sees ids only: identical for every preset (same permutation mechanism)
    for t in args.targets.split(","):
        plans += [(t, "isa_hidden")]
    for t in args.targets.split(","):
        plans += [(t, "isa_attention")]

    for tname, attack in plans:
        key = f"smollm2/{tname}/{attack}/{args.budget}"
        if key in results or (only and attack not in only):
            continue
        if tname == "unprotected" and attack == "ima_oracle":
            continue  # identical to `ima` on the unprotected model
        target = _target(tname, src, work)
        data = private_prompts(target.tokenizer, n=args.prompts, seed=7)
        t0 = time.perf_counter()
        if attack == "ima_oracle":
            res = run_ima(target, data, budget, 0, oracle=True)
        elif attack == "ima":
            res = run_ima(target, data, budget, 0, oracle=False)
        elif attack == "sda":
            res = sda_attack(target, data, budget, 0)
        elif attack == "isa_hidden":
            res = isa_hidden_attack(target, data, budget, 0, cfg=isa_cfg)
        else:
            res = isa_attention_attack(target, data, budget, 0, cfg=isa_cfg)
        res.seconds = time.perf_counter() - t0
        entry = res.to_dict()
        entry.update(target=tname, model="SmolLM2-135M-Instruct", victim=f"{args.prompts} Faker PII prompts, seed 7",
                     time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        # re-read before writing: two runs (e.g. --only ima / --only isa_hidden) may share the file
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        results[key] = entry
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(RESULTS)
        print(f"{key}: ttrsr={res.ttrsr} piirsr={res.piirsr} ({res.seconds:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
