"""Frequency and known-pair attacks on real models, per preset (resumable JSON).

    OMP_NUM_THREADS=1 python benchmarks/attack_frequency.py [--models smollm2,qwen] [--presets exact,noisy,paper]
        [--budget full] [--work /tmp/aloepri-attack-frequency]

For each model and preset: obfuscate (seed 11, cached in --work), then
- TFMA in the three knowledge settings (prior / observed stream sizes in the JSON; TFMA sees only ids, so the
  preset changes nothing but the key),
- known-pair ridge with k = 20, 300, 1000 oracle pairs (full-vocabulary matching of every obfuscated id),
- frequency-bootstrapped ridge (no oracle) with the distribution-aware and domain-aware priors.
Private prompts: 50 Faker PII prompts (seed 0). Results: benchmarks/results/attack_frequency.json, one entry
per model/preset/attack; entries already present are skipped, and each write merges into the file as it is, so
two runs on different presets may share it (or use --out and merge).
Needs the Debian corpora of docs/data.md. Wall time on SmolLM2 with 1 thread on a shared 2-core machine: about
1 min per TFMA, 4-9 min per ridge (full 49,152 x 49,152 matching), 12 min per bootstrapped ridge.
The committed JSON was produced by (exact and noisy, then paper in a second process):
    benchmarks/attack_frequency.py --models smollm2 --presets exact,noisy --attacks tfma,ridge
    benchmarks/attack_frequency.py --models smollm2 --presets exact,noisy --attacks freq-ridge \
        --freq-settings distribution-aware
    benchmarks/attack_frequency.py --models smollm2 --presets paper --attacks tfma,ridge --ks 20,300,1000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "attack_frequency.json"
OBF_SEED = 11


def _models():
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    return {"smollm2": smollm2_gguf, "qwen": qwen25_coder_05b_gguf}


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, entry: str, value: dict) -> None:
    """Merge one entry into the file as it is now (another run may have added entries meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    results = _load(path)
    results[entry] = value
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1, default=float))
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--presets", default="exact,noisy,paper")
    ap.add_argument("--attacks", default="tfma,ridge,freq-ridge")
    ap.add_argument("--budget", default="full", choices=["ci", "small", "full"])
    ap.add_argument("--ks", default="20,300,1000", help="known-pair counts for the ridge attack")
    ap.add_argument("--freq-settings", default="distribution-aware,domain-aware",
                    help="priors for the frequency-bootstrapped ridge")
    ap.add_argument("--work", default="/tmp/aloepri-attack-frequency")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import aloepri
    from aloepri.attacks.base import AttackTarget, Budget
    from aloepri.attacks.data import SETTINGS, private_prompts
    from aloepri.attacks.frequency import run_bootstrapped_ridge, run_known_pair_ridge, run_tfma, row_spaces

    budget = Budget.named(args.budget)
    attacks = set(args.attacks.split(","))
    out = Path(args.out)
    for model_name in args.models.split(","):
        src = _models()[model_name]()
        plain = None
        for preset in args.presets.split(","):
            work = Path(args.work) / model_name / preset
            key = work / "client.key"
            if not key.exists():
                t0 = time.perf_counter()
                aloepri.obfuscate(src, work / "server", key, aloepri.resolve_params(preset), seed=OBF_SEED,
                                  allow_weak_seed=True,
                                  progress=False)
                print(f"[{model_name}/{preset}] obfuscated in {time.perf_counter() - t0:.0f}s", flush=True)
            target = AttackTarget(src, work / "server", key)
            if plain is not None:  # share the plaintext model across presets (it is the same public model)
                target.__dict__["plain_model"], target.__dict__["tokenizer"] = plain
            data = private_prompts(target.tokenizer, n=50, seed=0)
            spaces = None

            def run(name, fn):
                entry = f"{model_name}/{preset}/{name}"
                if entry in _load(out):
                    return
                res = fn()
                d = res.to_dict()
                d["budget"]["budget_name"] = budget.name
                d["obfuscation_seed"] = OBF_SEED
                _save(out, entry, d)
                m = res.metrics
                print(f"[{entry}] ttrsr={res.ttrsr:.4f} piirsr={res.piirsr} vocab={m.get('vocab_recovery'):.4f} "
                      f"bleu4={m.get('bleu4')} {res.seconds:.0f}s", flush=True)

            def spaces_once():
                nonlocal spaces
                if spaces is None:
                    spaces = row_spaces(target)
                return spaces

            if "tfma" in attacks:
                for setting in SETTINGS:
                    run(f"tfma-{setting}", lambda s=setting: _timed(run_tfma, target, data, s, budget, 0))
            if "ridge" in attacks:
                for k in [int(x) for x in args.ks.split(",")]:
                    run(f"ridge-k{k}", lambda k=k: _timed(run_known_pair_ridge, target, data, k, budget, 0,
                                                          spaces=spaces_once()))
            if "freq-ridge" in attacks:
                for setting in args.freq_settings.split(","):
                    run(f"freq-ridge-{setting}", lambda s=setting: _timed(
                        run_bootstrapped_ridge, target, data, s, budget, 0, spaces=spaces_once()))
            plain = (target.plain_model, target.tokenizer)
    return 0


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    res = fn(*a, **kw)
    res.seconds = time.perf_counter() - t0
    return res


if __name__ == "__main__":
    sys.exit(main())
