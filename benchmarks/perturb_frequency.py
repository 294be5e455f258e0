"""What the client's online token perturbation (aloepri.runtime.perturb) does to the frequency attacks: TFMA and
SDA in the distribution-aware setting (the attacker's prior is held-out text from the client's own
distribution, the strongest of the paper's three), on SmolLM2-135M's 49,152-token vocabulary.

The client perturbs every token of its traffic (private corpus stream + Faker PII prompts) with the exponential
mechanism at eps_tok before the key maps it; the attacks see the permuted perturbed ids and are scored against
the client's REAL tokens. The frequency attacks read ids only, so the target is the permutation-only model (every
preset applies one vocabulary permutation). Resumable per (attack, eps_tok).

    OMP_NUM_THREADS=1 python benchmarks/perturb_frequency.py [--budget ci]   # results/perturb_frequency.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from aloepri.attacks.base import Budget
from aloepri.attacks.data import private_prompts
from aloepri.attacks.decipher import sda_setting_attack
from aloepri.attacks.frequency import run_tfma
from aloepri.attacks.nearest_neighbour import permutation_only_target
from aloepri.runtime.perturb import TokenPerturbation
from aloepri.models import smollm2_gguf

OUT = Path(__file__).parent / "results" / "perturb_frequency.json"
EPS_TOK = [math.inf, 100.0, 60.0, 40.0]
SETTING = "distribution-aware"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="ci", choices=["ci", "small", "full"])
    ap.add_argument("--attacks", nargs="*", default=["tfma", "sda"])
    ap.add_argument("--prompts", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    target = permutation_only_target(smollm2_gguf(), seed=1)
    data = private_prompts(target.tokenizer, a.prompts, seed=0)
    special = list(target.tokenizer.all_special_ids)
    budget = Budget.named(a.budget)
    for attack in a.attacks:
        for eps in EPS_TOK:
            key = f"smollm2/{attack}-{SETTING}/eps_tok={eps:g}/{a.budget}"
            if key in results:
                continue
            perturb = None
            if math.isfinite(eps):
                pert = TokenPerturbation.from_plain_model(target.plain_model, eps, seed=7, exclude_ids=special)
                perturb = pert.apply_stream
            t0 = time.perf_counter()
            if attack == "tfma":
                res = run_tfma(target, data, SETTING, budget, 0, perturb=perturb)
            else:
                res = sda_setting_attack(target, data, SETTING, budget, 0, perturb=perturb)
            entry = res.to_dict()
            entry.update(eps_tok=eps if math.isfinite(eps) else None, seconds=time.perf_counter() - t0,
                         victim=f"{a.prompts} Faker PII prompts, seed 0", model="SmolLM2-135M-Instruct",
                         target="permutation-only (ids only: the same for every preset)")
            results = json.loads(OUT.read_text()) if OUT.exists() else {}
            results[key] = entry
            tmp = OUT.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1, default=str))
            tmp.replace(OUT)
            print(f"{key}: TTRSR {res.ttrsr:.4f} PIIRSR {res.piirsr} perturbed "
                  f"{res.budget.get('perturbed_token_fraction')} ({entry['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
