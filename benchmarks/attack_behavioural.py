"""Behavioural attacks (aloepri.attacks.behavioural) on real models: TTRSR / PIIRSR / vocabulary recovery
for permutation-only, exact, noisy, paper and points of the alpha_e = alpha_h frontier, plus the composed
pipeline (VMA -> behavioural -> ridge).

Resumable: results/attack_behavioural.json is keyed model/target/attack/budget; existing entries are skipped.
Run:  OMP_NUM_THREADS=2 nohup nice -n 10 python benchmarks/attack_behavioural.py --budget small > beh.log 2>&1 &
      python benchmarks/attack_behavioural.py --print        (Markdown table of the stored results, and the plot
                                                              results/attack_behavioural.png)
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import aloepri
import attack_tables  # same directory: shared target building and resumable JSON writing
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, Budget
from aloepri.attacks.behavioural import run_behavioural, run_composed
from aloepri.attacks.cli import private_data

RESULTS = Path(__file__).parent / "results" / "attack_behavioural.json"
ATTACKS = ["behavioural", "behavioural-composed"]
# not a registered attack: `behavioural` with no chat-template pairs (anchors = the published special ids only),
# to measure how much the template bootstrap matters
NO_TEMPLATE = "behavioural-specials-only"
# --reduced: one output-profile round (the `small` budget's first, 96 x 16 contexts) and no input-side re-ranking,
# for runs that would not finish otherwise (Qwen's 151,936-token vocabulary on a loaded 2-core machine); stored
# under the budget key "<budget>-reduced" so it never mixes with full-budget rows
REDUCED = {"round_seqs": (96,), "rerank_ids": 0}


def target_params(target: str):
    """'alpha-X' (the noisy preset with alpha_e = alpha_h = X), or any target attack_tables names (a preset,
    or a preset with overrides 'PRESET:key=value,...', e.g. noisy:lam=0.1)."""
    if target.startswith("alpha-"):
        a = float(target.split("-", 1)[1])
        return aloepri.resolve_params("noisy", alpha_e=a, alpha_h=a)
    return attack_tables.target_params(target)


def build_target(src: Path, target: str, work: Path, seed: int, plain_model) -> AttackTarget:
    return attack_tables.build_target(src, target, work, seed, plain_model, params_fn=target_params)


def save_entry(key: str, entry: dict) -> dict:
    return attack_tables.save_entry(key, entry, RESULTS)


def render(store: dict) -> str:
    lines = ["| Model | Target | top-1 agreement | Attack | TTRSR (%) | PIIRSR (%) | Vocab. recovery (%) | "
             "Confident ids (%) | Wall time (s) | Threads | Budget |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fidelity = {k.rsplit("/", 2)[0]: v for k, v in store.items() if "/fidelity/" in k}
    for key in sorted(store):
        e = store[key]
        model, target, attack, budget = key.split("/")
        if attack == "fidelity":
            continue
        m = e["metrics"]
        top1 = fidelity.get(f"{model}/{target}", {}).get("top1_agreement")
        top1 = "1 (plaintext logits)" if target == "permutation-only" else ("-" if top1 is None else f"{top1:.3f}")
        if "error" in m:
            lines.append(f"| {model} | {target} | {top1} | {attack} | error: {m['error'][:80]} | | | | | | {budget} |")
            continue
        pct = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
        lines.append(f"| {model} | {target} | {top1} | {attack} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                     f"{pct(m.get('vocab_recovery'))} | {pct(m.get('confident_fraction'))} | "
                     f"{'-' if e.get('seconds') is None else format(e['seconds'], '.0f')} | "
                     f"{e['budget'].get('threads', '-')} | {budget} |")
    return "\n".join(lines)


def plot(store: dict, path: Path) -> None:
    """Top-1 agreement (x) against TTRSR (y) of each attack, one point per obfuscated target (SmolLM2 / Qwen),
    next to the weight attacks' frontier of docs/accuracy.md when that JSON is present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for model in sorted({k.split("/")[0] for k in store}):
        for attack in sorted({k.split("/")[2] for k in store if k.startswith(model + "/")} - {"fidelity"}):
            pts = []
            for key, e in store.items():
                m, target, a, _ = key.split("/")
                fid = store.get(f"{m}/{target}/fidelity/-")
                if m == model and a == attack and fid and e.get("ttrsr") is not None:
                    pts.append((fid["top1_agreement"], e["ttrsr"], target))
            pts.sort()
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{model} {attack}")
                for x, y, t in pts:
                    ax.annotate(t, (x, y), fontsize=7)
    ax.set_xlabel("top-1 agreement with the plaintext model")
    ax.set_ylabel("TTRSR (prompt tokens recovered)")
    ax.set_title("Behavioural attacks: accuracy vs. leakage (same obfuscated output)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["smollm2"], choices=["smollm2", "qwen"])
    ap.add_argument("--targets", nargs="*", default=["permutation-only", "exact", "noisy", "paper"])
    ap.add_argument("--attacks", nargs="*", default=ATTACKS, choices=ATTACKS + [NO_TEMPLATE])
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "aloepri-behavioural"))
    ap.add_argument("--reduced", action="store_true", help=f"reduced budget {REDUCED} (key '<budget>-reduced')")
    ap.add_argument("--print", action="store_true", help="only print the Markdown table of the stored results")
    a = ap.parse_args()
    if a.print:
        store = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        print(render(store))
        plot(store, RESULTS.with_suffix(".png"))
        return
    torch.set_num_threads(a.threads)
    store = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    budget = Budget.named(a.budget)
    budget.threads = a.threads
    config = dict(REDUCED) if a.reduced else None
    bkey = f"{a.budget}-reduced" if a.reduced else a.budget
    for model in a.models:
        src = attack_tables.model_src(model)
        plain = None
        for target in a.targets:
            todo = [n for n in a.attacks if f"{model}/{target}/{n}/{bkey}" not in store]
            fkey = f"{model}/{target}/fidelity/-"
            need_fidelity = target != "permutation-only" and fkey not in store
            if not todo and not need_fidelity:
                continue
            if plain is None:
                from aloepri.runtime.inference import load_plain_model

                plain = load_plain_model(src)
            t = build_target(src, target, work, a.seed, plain)
            data = private_data(t.tokenizer, a.prompts, 0)
            if need_fidelity:
                # accuracy of the very output attacked (built-in chat prompts, as the tuner measures it)
                from aloepri.eval.fidelity import builtin_prompt_ids, compare

                ids = builtin_prompt_ids(t.tokenizer, plain.config.vocab_size, 20)
                store = save_entry(fkey, compare(plain, t.obf_model, t.key, ids, greedy_tokens=0).to_dict())
                print(f"  fidelity {store[fkey]}", flush=True)
            for name in todo:
                t0 = time.perf_counter()
                print(f"{model}/{target}/{name}/{bkey} ...", flush=True)
                try:
                    if name == NO_TEMPLATE:  # ablation of the bootstrap: published special ids only
                        res = run_behavioural(t, data, budget, 0, template=([], []), config=config)[0]
                    elif config is None:
                        res = REGISTRY[name](t, data, budget, 0)
                    elif name == "behavioural":
                        res = run_behavioural(t, data, budget, 0, config=config)[0]
                    else:
                        res = run_composed(t, data, budget, 0, config=config)
                    res.attack = name
                    res.seconds = time.perf_counter() - t0  # the direct calls above bypass the registry's clock
                    entry = res.to_dict()
                except Exception as err:  # noqa: BLE001 - recorded, not hidden
                    entry = attack_tables.failed_entry(name, err, t0)
                entry["target_params"] = None if target == "permutation-only" else target_params(target).to_dict()
                if config is not None:
                    entry["budget"]["reduced"] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
                store = save_entry(f"{model}/{target}/{name}/{bkey}", entry)
                attack_tables.print_entry(entry)
            del t
    print(render(store))


if __name__ == "__main__":
    main()
