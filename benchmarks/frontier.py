"""Privacy-utility frontier: accuracy and attacks on the same obfuscated model, one parameter swept at a time.

Every point is one obfuscation of the model (seed 1) measured for fidelity (built-in chat prompts, top-1 agreement
and KL against the plaintext model) and attacked by the attack suite (private Faker-PII prompts, full-vocabulary
candidate pools, the budget given). Resumable and parallel-safe: results go to
benchmarks/results/frontier_<model>.json through aloepri.tuning.ResultStore; start a second process with the same
arguments to use the second core. The plot (PNG) puts top-1 agreement on x and the highest TTRSR over the attacks
on y, one series per swept parameter, like the paper's privacy-utility figure.

Usage: python benchmarks/frontier.py [--model smollm2|qwen-coder] [--budget small] [--sweeps alpha_e alpha_h lam]
       python benchmarks/frontier.py --plot-only
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from aloepri.obfuscation.params import resolve_params
from aloepri.tuning import DEFAULT_ATTACKS, Evaluator, ResultStore, sweep

RESULTS = Path(__file__).parent / "results"
SWEEPS = {  # series -> overrides of the `default` preset, one dict per point; the series label names the x value
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
    ax.set_xlabel("top-1 agreement with the plaintext model (utility)")
    ax.set_ylabel("highest TTRSR over the attacks (privacy loss)")
    ax.set_title(f"privacy-utility frontier, {store_path.stem.replace('frontier_', '')}")
    ax.axhline(0.05, color="grey", lw=0.8, ls="--")
    ax.legend(title="swept parameter", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def table(store_path: Path) -> str:
    """Markdown table of the finished points: one row per setting, TTRSR per attack."""
    data = [e for e in json.loads(store_path.read_text()).values() if e.get("status") == "done"]
    attacks = sorted({a for e in data for a in e["attacks"]})
    rows = ["| series | setting | top-1 | KL | " + " | ".join(f"{a} TTRSR" for a in attacks) + " | max |",
            "|---|---|---|---|" + "---|" * (len(attacks) + 1)]
    for e in sorted(data, key=lambda e: (e["label"], str(e["params"].get(SERIES_X.get(e["label"], e["label"]))))):
        p = e["params"]
        x = SERIES_X.get(e["label"], e["label"])
        cells = [f"{e['attacks'][a]['ttrsr']:.3f}" if a in e["attacks"] and e["attacks"][a]["ttrsr"] is not None
                 else "-" for a in attacks]
        rows.append(f"| {e['label']} | {x}={p[x]} | {e['fidelity']['top1_agreement']:.3f} | "
                    f"{e['fidelity']['mean_kl']:.4f} | " + " | ".join(cells) + f" | {e['max_ttrsr']:.3f} |")
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
        base = resolve_params("default")
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
