"""Privacy-utility frontier: accuracy and attacks on the same obfuscated model, one parameter swept at a time.

Every point is one obfuscation of the model (seed 1) measured for fidelity (built-in chat prompts, top-1 agreement
and KL against the plaintext model) and attacked by the attack suite (private Faker-PII prompts, full-vocabulary
candidate pools, the budget given). Resumable and parallel-safe: results go to
benchmarks/results/frontier_<model>.json through aloepri.eval.tuning.ResultStore; start a second process with the same
arguments to use the second core. The plot (PNG) puts top-1 agreement on x and the highest TTRSR over the attacks
on y, one series per swept parameter, like the paper's privacy-utility figure.

The behavioural attacks (benchmarks/attack_behavioural.py, seed 1234, 50 prompts) are added to the plot and the
table from results/attack_behavioural.json without recomputing anything: one series per behavioural attack at its own
top-1 agreement (measured on the very output it attacked), and "worst of all attacks" for the frontier points whose
parameters equal a behavioural target's (max of the weight attacks' TTRSR there and the behavioural TTRSRs).

Usage: python benchmarks/frontier.py [--model smollm2|qwen-coder] [--budget small] [--sweeps alpha_e alpha_h lam]
       python benchmarks/frontier.py --plot-only [--list]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from aloepri.obfuscation.params import resolve_params
from aloepri.eval.tuning import DEFAULT_ATTACKS, Evaluator, ResultStore, sweep

RESULTS = Path(__file__).parent / "results"
SWEEPS = {  # series -> overrides of the `noisy` preset, one dict per point; the series label names the x value
    "alpha_e": [{"alpha_e": v} for v in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)],
    "alpha_h": [{"alpha_h": v} for v in (0.0, 0.02, 0.05, 0.1, 0.2)],
    "lam": [{"lam": v} for v in (0.0, 0.1, 0.3)],
    "h": [{"h": v} for v in (32, 128, 256)],
    "beta": [{"beta": v} for v in (1, 8, 32)],
    "shared_c": [{"shared_c": v} for v in (True, False)],
    # embedding and head noise together: VMA matches through down x head as well as through the embedding, so the
    # permutation is only as hidden as the *smaller* of the two noises
    "alpha_e=alpha_h": [{"alpha_e": v, "alpha_h": v} for v in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)],
    # beyond the paper: the same noise energy shaped per column or per row (docs/accuracy.md)
    "noise_shape=column": [{"noise_shape": "column", "alpha_e": v, "alpha_h": v} for v in (0.1, 0.2, 0.3)],
    "noise_shape=row": [{"noise_shape": "row", "alpha_e": v, "alpha_h": v} for v in (0.1, 0.2, 0.3)],
}
SERIES_X = {"noise_shape=column": "alpha_e", "noise_shape=row": "alpha_e", "alpha_e=alpha_h": "alpha_e"}


def model_path(name: str) -> Path:
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    return {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[name]()


BEHAVIOURAL = RESULTS / "attack_behavioural.json"
BEHAVIOURAL_MODEL = {"smollm2": "smollm2", "qwen-coder": "qwen"}  # frontier name -> attack_behavioural.py name
BEHAVIOURAL_ATTACKS = ("behavioural", "behavioural-composed")


def behavioural_points(model: str, path: Path = BEHAVIOURAL) -> list[dict]:
    """One dict per obfuscated target of attack_behavioural.json for this frontier model: target name, its
    parameters, top-1 agreement of that same output, and TTRSR per behavioural attack (largest budget stored)."""
    if not path.exists():
        return []
    store = json.loads(path.read_text())
    name = BEHAVIOURAL_MODEL[model]
    points: dict[str, dict] = {}
    for key, e in store.items():
        m, target, attack, budget = key.split("/")
        if m != name or attack not in BEHAVIOURAL_ATTACKS or e.get("ttrsr") is None or not e.get("target_params"):
            continue
        fid = store.get(f"{m}/{target}/fidelity/-")
        if fid is None:
            continue
        pt = points.setdefault(target, {"target": target, "params": e["target_params"],
                                        "top1": fid["top1_agreement"], "attacks": {}, "budgets": {}})
        order = ("ci", "small-reduced", "small", "full")
        if attack not in pt["attacks"] or order.index(budget) > order.index(pt["budgets"][attack]):
            pt["attacks"][attack], pt["budgets"][attack] = e["ttrsr"], budget
    return sorted(points.values(), key=lambda p: -p["top1"])


def matched_behavioural(entry: dict, points: list[dict]) -> dict | None:
    """The behavioural point whose obfuscation parameters equal this frontier entry's (seeds differ: 1 vs 1234)."""
    return next((p for p in points if p["params"] == entry["params"]), None)


def plot(store_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [e for e in json.loads(store_path.read_text()).values() if e.get("status") == "done"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for label in sorted({e["label"] for e in data}):
        pts = sorted((e["fidelity"]["top1_agreement"], e["max_ttrsr"], e["params"][SERIES_X.get(label, label)]) for e in data
                     if e["label"] == label and e["max_ttrsr"] is not None)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        for x, y, v in pts:
            ax.annotate(str(v), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    model = store_path.stem.replace("frontier_", "")
    beh = behavioural_points(model)
    for attack, marker in zip(BEHAVIOURAL_ATTACKS, ("s", "^")):
        # a reduced-budget row (attack_behavioural.py --reduced) is marked in its label
        pts = sorted((p["top1"], p["attacks"][attack],
                      p["target"] + (" (reduced)" if p["budgets"][attack].endswith("reduced") else ""))
                     for p in beh if attack in p["attacks"])
        if not pts:
            continue
        # the line joins the noise settings (alpha-X, noisy, exact); `paper` (another lam/alpha mix) is a lone marker
        line = [p for p in pts if not p[2].startswith("paper")]
        (h,) = ax.plot([p[0] for p in line], [p[1] for p in line], marker + "--", lw=1.2,
                       label=f"{attack} (own output, seed 1234)")
        lone = [p for p in pts if p[2].startswith("paper")]
        ax.plot([p[0] for p in lone], [p[1] for p in lone], marker, color=h.get_color())
        for x, y, t in pts:
            ax.annotate(t, (x, y), fontsize=6, xytext=(3, -9), textcoords="offset points")
    worst = sorted((e["fidelity"]["top1_agreement"], max([e["max_ttrsr"], *b["attacks"].values()]), b["target"])
                   for e in data if e["max_ttrsr"] is not None and (b := matched_behavioural(e, beh)))
    if worst:
        ax.plot([p[0] for p in worst], [p[1] for p in worst], "kD:", lw=1.5, ms=5,
                label="worst of weight + behavioural attacks (same params)")
    ax.set_xlabel("top-1 agreement with the plaintext model (utility)")
    ax.set_ylabel("TTRSR (privacy loss): highest over the weight attacks,\nor of the named attack")
    ax.set_title(f"privacy-utility frontier, {store_path.stem.replace('frontier_', '')}")
    ax.axhline(0.05, color="grey", lw=0.8, ls="--")
    ax.legend(title="swept parameter / attack", fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def table(store_path: Path) -> str:
    """Markdown table of the finished points: one row per setting, TTRSR per attack."""
    data = [e for e in json.loads(store_path.read_text()).values() if e.get("status") == "done"]
    attacks = sorted({a for e in data for a in e["attacks"]})
    beh = behavioural_points(store_path.stem.replace("frontier_", ""))
    extra = list(BEHAVIOURAL_ATTACKS) if beh else []
    rows = ["| series | setting | top-1 | KL | " + " | ".join(f"{a} TTRSR" for a in attacks + extra) + " | max |"
            + (" max incl. behavioural |" if beh else ""),
            "|---|---|---|---|" + "---|" * (len(attacks) + len(extra) + 1 + bool(beh))]
    for e in sorted(data, key=lambda e: (e["label"], str(e["params"].get(SERIES_X.get(e["label"], e["label"]))))):
        p = e["params"]
        x = SERIES_X.get(e["label"], e["label"])
        cells = [f"{e['attacks'][a]['ttrsr']:.3f}" if a in e["attacks"] and e["attacks"][a]["ttrsr"] is not None
                 else "-" for a in attacks]
        b = matched_behavioural(e, beh)
        b_ttrsr = [b["attacks"].get(a) if b else None for a in extra]
        cells += ["-" if t is None else f"{t:.3f}" for t in b_ttrsr]
        worst = "" if not beh else (" -" if b is None else f" {max([e['max_ttrsr'], *b['attacks'].values()]):.3f}") + " |"
        rows.append(f"| {e['label']} | {x}={p[x]} | {e['fidelity']['top1_agreement']:.3f} | "
                    f"{e['fidelity']['mean_kl']:.4f} | " + " | ".join(cells) + f" | {e['max_ttrsr']:.3f} |" + worst)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"])
    ap.add_argument("--sweeps", nargs="*", default=list(SWEEPS))
    ap.add_argument("--attacks", nargs="*", default=list(DEFAULT_ATTACKS))
    ap.add_argument("--list", action="store_true", help="print the finished points as a table")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--private-prompts", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--values", nargs="*", type=float, default=None,
                    help="only the points whose swept value is one of these, in this order (e.g. 0.5 1.0 0.3)")
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    store_path = RESULTS / f"frontier_{a.model}.json"
    if not a.plot_only:
        torch.set_num_threads(a.threads)
        ev = Evaluator(model_path(a.model), a.attacks, a.budget, a.prompts, 0, a.private_prompts)
        store = ResultStore(store_path)
        base = resolve_params("noisy")
        for name in a.sweeps:
            points = SWEEPS[name]
            if a.values is not None:
                x = SERIES_X.get(name, name)
                points = [o for v in a.values for o in points if o.get(x) == v]
            sweep(ev, [base.replace(**o) for o in points], store, seed=1, label=name)
    plot(store_path, RESULTS / f"frontier_{a.model}.png")
    if a.list:
        print(table(store_path))


if __name__ == "__main__":
    main()
