"""Attack tables for docs/security.md: the weight attacks (VMA, Gate-IA, Attn-IA, Attn-IA-sorted, NN, or any
registered attack via --attacks) on SmolLM2-135M (and Qwen2.5-Coder-0.5B with --models qwen) for the presets
exact / noisy / paper, the positive-control targets, and the paper's ablation rows.

Targets:
  default, exact, noisy, paper  aloepri.obfuscate with that preset (seed --seed)
  exact-nohp                 exact preset with head_permutation=False (beta is already 1): the weak target of
                             the paper's Attn-IA (positive control)
  permutation-only           the plaintext model with its vocabulary rows permuted, nothing else (positive
                             control of NN)
  ablation-0/1               the paper's first two ablation rows from the paper preset (report.ablation_params);
                             the third row (all mechanisms) IS the paper preset, so the tables reuse `paper`

Resumable: results/attack_tables.json is keyed by model/target/attack/budget; existing entries are skipped.
Run:  OMP_NUM_THREADS=1 nohup python benchmarks/attack_tables.py --budget small > attack_tables.log 2>&1 &
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, Budget
from aloepri.attacks.cli import private_data
from aloepri.attacks.nearest_neighbour import permutation_only_target
from aloepri.attacks.report import ABLATION_ROWS, ablation_params
from variants import parse_variant  # same directory

RESULTS = Path(__file__).parent / "results" / "attack_tables.json"
MY_ATTACKS = ["vma", "gate-ia", "attn-ia", "attn-ia-sorted", "nn"]


def model_src(name: str) -> Path:
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    return {"smollm2": smollm2_gguf, "qwen": qwen25_coder_05b_gguf}[name]()


def target_params(target: str):
    """A preset, exact-nohp, ablation-N, or a preset with overrides 'PRESET:key=value,...' (benchmarks/variants.py)."""
    if ":" in target:
        return parse_variant(target)[1]
    if target in aloepri.PRESETS:
        return aloepri.resolve_params(target)
    if target == "exact-nohp":
        return aloepri.resolve_params("exact", head_permutation=False)
    if target.startswith("ablation-"):
        return list(ablation_params(aloepri.resolve_params("paper")).values())[int(target.split("-")[1])]
    raise ValueError(f"unknown target {target}")


def build_target(src: Path, target: str, work: Path, seed: int, plain_model, params_fn=None,
                 **obfuscate_kwargs) -> AttackTarget:
    """``params_fn(target) -> ObfuscationParams`` (default ``target_params``) lets other benchmarks name targets;
    ``obfuscate_kwargs`` go to aloepri.obfuscate (e.g. noise_factors)."""
    if target == "permutation-only":
        return permutation_only_target(src, seed, plain_model)
    d = work / f"{src.stem}-{target}-s{seed}"
    if not (d / "model" / "config.json").exists():
        print(f"obfuscating {src.name} as {target}", flush=True)
        aloepri.obfuscate(src, d / "model", d / "key.json", (params_fn or target_params)(target), seed=seed,
                          allow_weak_seed=True, overwrite=True, progress=False, **obfuscate_kwargs)
    t = AttackTarget(src, d / "model", d / "key.json")
    t.plain_model = plain_model  # share the public model between targets (memory)
    return t


def render(store: dict) -> str:
    """Markdown tables of the stored results: one per (model, target, budget), and the ablation table."""
    from aloepri.attacks.base import AttackResult
    from aloepri.attacks.report import markdown_table

    groups: dict[tuple[str, str, str], list[AttackResult]] = {}
    for key, e in store.items():
        model, target, _, budget = key.split("/")
        fields = {k: e[k] for k in ("attack", "ttrsr", "piirsr", "metrics", "budget", "uses", "seconds")}
        groups.setdefault((model, target, budget), []).append(AttackResult(**fields))
    out = []
    for (model, target, budget), results in sorted(groups.items()):
        out += [f"### {model} / {target} (budget {budget})", "", markdown_table(results), ""]
    for model in sorted({k[0] for k in groups}):
        for budget in sorted({k[2] for k in groups}):
            rows = [(ABLATION_ROWS[i], groups.get((model, t, budget)))
                    for i, t in enumerate(("ablation-0", "ablation-1", "paper"))]  # row 3 = the paper preset
            if not any(r for _, r in rows):
                continue
            attacks = sorted({r.attack for _, rs in rows if rs for r in rs})
            out += [f"### Ablation, {model}, paper noise (budget {budget}): TTRSR (%)", "",
                    "| Applied mechanism | " + " | ".join(attacks) + " |", "|---|" + "---|" * len(attacks)]
            for row, rs in rows:
                by = {r.attack: r for r in rs or []}
                out.append(f"| {row} | " + " | ".join(
                    f"{100 * by[x].ttrsr:.2f}" if x in by and by[x].ttrsr is not None else "not run"
                    for x in attacks) + " |")
            out.append("")
    return "\n".join(out)


def failed_entry(name: str, err: Exception, t0: float) -> dict:
    """A result row for an attack that raised: recorded with its error, never hidden."""
    return {"attack": name, "ttrsr": None, "piirsr": None, "metrics": {"error": f"{type(err).__name__}: {err}"},
            "budget": {}, "uses": "", "seconds": time.perf_counter() - t0}


def print_entry(entry: dict) -> None:
    m = entry["metrics"]
    print(f"  TTRSR {entry['ttrsr']} PIIRSR {entry['piirsr']} vocab "
          f"{m.get('vocab_recovery', m.get('vocab_recovery_sampled'))} ({entry['seconds']:.0f} s)", flush=True)


def save_entry(key: str, entry: dict, path: Path = RESULTS) -> dict:
    """Merge one result into the JSON (re-read first: several runs may write it) and replace it atomically."""
    store = json.loads(path.read_text()) if path.exists() else {}
    store[key] = entry
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(store, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["smollm2"], choices=["smollm2", "qwen"])
    ap.add_argument("--targets", nargs="*", default=["permutation-only", "exact-nohp", "exact", "noisy", "paper",
                                                     "ablation-0", "ablation-1"])
    ap.add_argument("--attacks", nargs="*", default=MY_ATTACKS)
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aloepri-attack-tables"))
    ap.add_argument("--print", action="store_true", help="only print the Markdown tables of the stored results")
    a = ap.parse_args()
    if a.print:
        print(render(json.loads(RESULTS.read_text()) if RESULTS.exists() else {}))
        return
    torch.set_num_threads(1)
    store = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for model in a.models:
        src = model_src(model)
        plain = None
        for target in a.targets:
            todo = [n for n in a.attacks if f"{model}/{target}/{n}/{a.budget}" not in store]
            if not todo:
                continue
            if plain is None:
                from aloepri.runtime.inference import load_plain_model

                plain = load_plain_model(src)
            t = build_target(src, target, work, a.seed, plain)
            data = private_data(t.tokenizer, a.prompts, 0)
            for name in todo:
                t0 = time.time()
                res = REGISTRY[name](t, data, Budget.named(a.budget), 0)
                entry = res.to_dict()
                entry["target"] = target
                entry["model"] = src.name
                entry["params"] = (t.key.params if target != "permutation-only" else {"mechanism": "permutation-only"})
                if target.startswith("ablation-"):
                    entry["ablation_row"] = ABLATION_ROWS[int(target.split("-")[1])]
                store = save_entry(f"{model}/{target}/{name}/{a.budget}", entry)
                print(f"{model:8s} {target:16s} {name:15s} TTRSR {res.ttrsr:.4f} PIIRSR {res.piirsr} vocab "
                      f"{res.metrics.get('vocab_recovery_sampled')} ({time.time() - t0:.0f} s)", flush=True)
            del t


if __name__ == "__main__":
    main()
