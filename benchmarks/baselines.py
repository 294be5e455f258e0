"""The paper's Table 1 baselines (SANTEXT, RANTEXT, DP-Forward) in aloepri's own harness, beside aloepri.

Stages (resumable, parallel-safe: every finished point is merged into benchmarks/results/baselines.json under a
file lock):
  privacy    for every grid point: TTRSR/PIIRSR on the 50 Faker-PII prompts (direct observation for SANTEXT /
             RANTEXT; NN + IMA for DP-Forward) and fidelity (top-1 agreement / KL of the next-token distribution
             vs the clean model on the 20 built-in chat prompts, the numbers the frontier reports for aloepri).
  humaneval  pass@1 on the fixed 20-problem CI subset (aloepri.eval.humaneval: prompt, greedy, sandbox) for the
             points given with --points (Qwen2.5-Coder-0.5B; DP-Forward through a forward hook on the prefill).
  report     Markdown table + plot (top-1 agreement vs worst-attack TTRSR) with aloepri's presets and frontier,
             read from attack_tables.json, fidelity_smollm2.json and frontier_*.json (never retyped).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/baselines.py --model smollm2 --stage privacy
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/baselines.py --model qwen-coder --stage humaneval \
        --points santext@6,dp-forward-paper@5
    python benchmarks/baselines.py --stage report
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "baselines.json"
SEED = 20261123  # mechanism noise: fixed so the benchmark is reproducible
# The committed attack_tables.json, fidelity_*.json, eval_fidelity.json and humaneval*.json hold the noisy
# preset's rows under the label "default" (the name that setting had when they were measured).
STORED_AS = {"noisy": "default"}
DATA_SEED = 0  # the same Faker PII prompts as `aloepri attack` (default --seed 0)
PROMPTS = 50
# eps grids: the paper's value first (SANTEXT 3, RANTEXT 30, DP-Forward 5), then values where the mechanism
# starts to keep tokens on these small models' embedding scales (docs/baselines.md explains why eps does not
# transfer between models).
GRID = {
    "santext": [3, 5, 6, 7, 8, 12],
    "rantext": [30, 10, 20, 40, 60],
    "dp-forward": [5, 500, 5000, 50000],
    "dp-forward-paper": [5, 1, 20],
}


def model_path(name: str) -> Path:
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    return {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[name]()


@contextlib.contextmanager
def locked_results():
    """Read-modify-write of baselines.json under an exclusive lock (several processes share it)."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(OUT.read_text()) if OUT.is_file() else {}
        yield data
        tmp = OUT.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, OUT)


def read_results() -> dict:
    return json.loads(OUT.read_text()) if OUT.is_file() else {}


def point_key(method: str, eps: float) -> str:
    return f"{method}@{eps:g}"


def parse_points(spec: str) -> list[tuple[str, float]]:
    out = []
    for item in spec.split(","):
        method, _, eps = item.partition("@")
        out.append((method, float(eps)))
    return out


def load(model_name: str):
    from transformers import AutoTokenizer

    from aloepri.runtime.inference import load_plain_model

    src = model_path(model_name)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    return src, tok, load_plain_model(src)


def stage_privacy(model_name: str, points: list[tuple[str, float]], budget: str) -> None:
    from aloepri.attacks.data import private_prompts
    from aloepri.baselines.harness import fidelity, make_method, privacy, user_content_prompts

    src, tok, model = load(model_name)
    data = private_prompts(tok, PROMPTS, DATA_SEED)
    prompts = user_content_prompts(tok)
    for method, eps in points:
        key = point_key(method, eps)
        if read_results().get(model_name, {}).get(key, {}).get("privacy"):
            continue
        t0 = time.perf_counter()
        mech = make_method(method, model, eps)
        priv = privacy(mech, model, tok, data, SEED, budget)
        fid = fidelity(mech, model, prompts, SEED)
        with locked_results() as res:
            entry = res.setdefault(model_name, {}).setdefault(key, {})
            entry.update(method=method, eps=eps, mechanism=mech.describe(), privacy=priv, fidelity=fid,
                         model=src.name, prompts=PROMPTS, data_seed=DATA_SEED, seed=SEED, ima_budget=budget,
                         seconds=time.perf_counter() - t0)
        print(f"{model_name} {key}: worst TTRSR {priv['worst_ttrsr']:.4f} top-1 {fid['top1_agreement']:.4f} "
              f"KL {fid['mean_kl']:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)


def stage_humaneval(model_name: str, points: list[tuple[str, float]], max_new_tokens: int) -> None:
    from aloepri.baselines.harness import BaselineRunner, make_method
    from aloepri.eval.humaneval import evaluate, select_problems

    src, tok, model = load(model_name)
    problems = select_problems("ci")
    for method, eps in points:
        key = point_key(method, eps)
        done = read_results().get(model_name, {}).get(key, {}).get("humaneval", {})
        if done and done.get("max_new_tokens") != max_new_tokens:
            sys.exit(f"{key} HumanEval ran with max_new_tokens={done['max_new_tokens']}; keep it or remove the entry")
        runner = BaselineRunner(key, model, tok, make_method(method, model, eps), SEED)
        runner.calls = len(done.get("results", {}))

        def save(tid: str, r: dict, key=key, method=method, eps=eps) -> None:
            with locked_results() as res:
                entry = res.setdefault(model_name, {}).setdefault(key, {"method": method, "eps": eps})
                he = entry.setdefault("humaneval", {"subset": "ci", "max_new_tokens": max_new_tokens,
                                                   "results": {}})
                he["results"][tid] = r
            print(f"{key} {tid} {r['status']} {r['new_tokens']} tok {r['gen_seconds']:.0f}s", flush=True)

        summary = evaluate(runner, problems, max_new_tokens, done=done.get("results", {}), on_result=save)
        with locked_results() as res:
            res[model_name][key]["humaneval"].update(summary)
            res[model_name][key]["humaneval"]["mechanism"] = runner.method.describe()
        print(f"== {key}: {summary}", flush=True)


# --- report ------------------------------------------------------------------------------------------------------


def aloepri_points(model_name: str) -> tuple[list[dict], list[dict]]:
    """(presets, frontier) of aloepri from the existing result files: top-1 agreement and worst TTRSR."""
    tables = json.loads((RESULTS / "attack_tables.json").read_text())
    short = {"smollm2": "smollm2", "qwen-coder": "qwen"}[model_name]
    presets = []
    if model_name == "smollm2":  # 20 built-in prompts, the same prompts as the baselines and the frontier
        fid = json.loads((RESULTS / "fidelity_smollm2.json").read_text())["runs"]
    else:  # Qwen presets were measured on the first 10 built-in prompts (benchmarks/eval_fidelity.py)
        ev = json.loads((RESULTS / "eval_fidelity.json").read_text()) if (RESULTS / "eval_fidelity.json").is_file() else {}
        fid = {k.split("|")[1]: v["prompts"] for k, v in ev.items() if k.startswith("qwen-coder")}
    he = {}
    for f in ("humaneval.json", "humaneval_default.json", "humaneval_paper.json"):
        p = RESULTS / f
        if p.is_file():
            he.update(json.loads(p.read_text()).get("runs", {}))
    from aloepri.eval.humaneval import CI_SUBSET

    for preset in ("exact", "noisy", "paper"):
        stored = STORED_AS.get(preset, preset)
        # every attack at every budget it was run with ("vma/small" is stronger than "vma/ci")
        rows = {"/".join(k.split("/")[2:]): v for k, v in tables.items() if k.startswith(f"{short}/{stored}/")}
        # known-pair attacks (ridge-k*: the attacker holds plaintext/obfuscated pairs) are outside the threat model
        # the baselines are attacked under; they are reported beside, not folded into "worst"
        known_pair = {a: v["ttrsr"] for a, v in rows.items() if a.startswith("ridge")}
        rows = {a: v for a, v in rows.items() if a not in known_pair}
        if not rows:
            continue
        worst = max(rows, key=lambda a: rows[a]["ttrsr"] or 0.0)
        run = he.get(stored, {}).get("results", {}) if model_name == "qwen-coder" else {}  # HumanEval ran on Qwen
        ci = [t for t in CI_SUBSET if t in run]
        presets.append({"label": f"aloepri {preset}", "worst_ttrsr": rows[worst]["ttrsr"], "worst_attack": worst,
                        "worst_piirsr": rows[worst]["piirsr"],
                        "attacks": sorted(rows), "top1": fid.get(stored, {}).get("top1_agreement"),
                        "mean_kl": fid.get(stored, {}).get("mean_kl"),
                        "pass@1": (sum(run[t]["passed"] for t in ci) / len(ci)) if len(ci) == len(CI_SUBSET) else None,
                        "humaneval_max_new_tokens": he.get(stored, {}).get("max_new_tokens"),
                        "known_pair": known_pair})
    frontier = []
    fp = RESULTS / f"frontier_{model_name}.json"
    if fp.is_file():
        for e in json.loads(fp.read_text()).values():
            if e.get("status") == "done" and e.get("max_ttrsr") is not None:
                frontier.append({"top1": e["fidelity"]["top1_agreement"], "worst_ttrsr": e["max_ttrsr"],
                                 "label": e["label"]})
    return presets, frontier


def plaintext_pass(model_name: str) -> float | None:
    from aloepri.eval.humaneval import CI_SUBSET

    p = RESULTS / "humaneval.json"
    if model_name != "qwen-coder" or not p.is_file():
        return None
    run = json.loads(p.read_text())["runs"].get("plaintext", {}).get("results", {})
    return sum(run[t]["passed"] for t in CI_SUBSET) / len(CI_SUBSET) if all(t in run for t in CI_SUBSET) else None


def _fmt(v, nd=3):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def report(png: Path | None) -> str:
    res = read_results()
    lines = []
    for model_name in ("smollm2", "qwen-coder"):
        pts = res.get(model_name, {})
        presets, frontier = aloepri_points(model_name)
        if not pts and not presets:
            continue
        lines += [f"### {model_name}", "",
                  "| method | eps | worst attack | worst TTRSR | PIIRSR (worst attack) | top-1 agreement (all positions) "
                  "| top-1 from the first perturbed position | mean KL | tokens changed | HumanEval pass@1 (CI 20) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        pp = plaintext_pass(model_name)
        if pp is not None:
            lines.append(f"| plaintext | - | - | - | - | 1.000 | 1.000 | 0.000 | 0 | {pp:.2f} |")
        for p in presets:
            pairs = "".join(f"; {a}: {v:.3f}" for a, v in sorted(p["known_pair"].items()))
            cap = f" (cap {p['humaneval_max_new_tokens']})" if p["pass@1"] is not None else ""
            lines.append(f"| {p['label']} | - | {p['worst_attack']} (of {len(p['attacks'])}{pairs}) | "
                         f"{p['worst_ttrsr']:.3f} | {_fmt(p['worst_piirsr'])} | {_fmt(p['top1'])} | {_fmt(p['top1'])} | "
                         f"{_fmt(p['mean_kl'])} | - | "
                         f"{_fmt(p['pass@1'], 2)}{cap} |")
        for key, e in sorted(pts.items(), key=lambda kv: (kv[1]["method"], kv[1]["eps"])):
            priv, fid = e.get("privacy"), e.get("fidelity", {})
            he = e.get("humaneval", {})
            he_s = (f"{he['pass@1']:.2f} ({he['passed']}/{he['problems']}, cap {he['max_new_tokens']})"
                    if "pass@1" in he else (f"running {len(he.get('results', {}))}/20" if he else "-"))
            if priv:
                attacks = {k: v for k, v in priv.items() if isinstance(v, dict)}
                worst = max(attacks, key=lambda a: attacks[a]["ttrsr"])
                lines.append(f"| {e['method']} | {e['eps']:g} | {worst} | {priv['worst_ttrsr']:.3f} | "
                             f"{_fmt(attacks[worst]['piirsr'])} | {fid['top1_agreement']:.3f} | "
                             f"{fid['top1_agreement_from_first_change']:.3f} | {fid['mean_kl']:.3f} | "
                             f"{_fmt(fid.get('token_change_rate'))} | {he_s} |")
            else:
                lines.append(f"| {e['method']} | {e['eps']:g} | - | - | - | - | - | - | - | {he_s} |")
        lines.append("")
    if png is not None:
        plot(res, png)
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in ("smollm2", "qwen-coder") if res.get(m)]
    he_pts = {k: e for k, e in res.get("qwen-coder", {}).items() if "pass@1" in e.get("humaneval", {}) and e.get("privacy")}
    fig, axes = plt.subplots(1, len(models) + bool(he_pts), figsize=(6.5 * (len(models) + bool(he_pts)), 5),
                             squeeze=False)
    colors = {"santext": "tab:orange", "rantext": "tab:green", "dp-forward": "tab:red", "dp-forward-paper": "tab:purple"}
    for ax, model_name in zip(axes[0], models):
        presets, frontier = aloepri_points(model_name)
        if frontier:
            ax.scatter([f["top1"] for f in frontier], [f["worst_ttrsr"] for f in frontier], s=14, c="lightgray",
                       label="aloepri frontier (one-parameter sweeps)")
        for i, p in enumerate(presets):
            if p["top1"] is not None:
                ax.scatter([p["top1"]], [p["worst_ttrsr"]], marker="*", s=160, c="tab:blue")
                ax.annotate(p["label"], (p["top1"], p["worst_ttrsr"]), fontsize=8, xytext=(-60, -14 - 11 * i),
                            textcoords="offset points")
        for method, color in colors.items():
            # positions before the first perturbed token agree for free (public template prefix); aloepri's
            # obfuscation touches every position, so the comparable number is the agreement from there on
            pts = sorted((e["fidelity"]["top1_agreement_from_first_change"], e["privacy"]["worst_ttrsr"], e["eps"])
                         for e in res[model_name].values() if e["method"] == method and e.get("privacy"))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", c=color, label=method)
            for x, y, eps in pts:
                ax.annotate(f"{eps:g}", (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points", color=color)
        ax.set_xlabel("top-1 agreement with the plaintext model (built-in prompts;\n"
                      "baselines: from the first perturbed position on)")
        ax.set_ylabel("worst-attack TTRSR (50 PII prompts)")
        ax.set_title(f"{model_name}: accuracy vs privacy (eps annotated)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if he_pts:
        ax = axes[0][-1]
        presets, _ = aloepri_points("qwen-coder")
        for i, p in enumerate(presets):
            if p["pass@1"] is not None:
                ax.scatter([p["pass@1"]], [p["worst_ttrsr"]], marker="*", s=160, c="tab:blue")
                ax.annotate(p["label"], (p["pass@1"], p["worst_ttrsr"]), fontsize=8, xytext=(-60, -14 - 11 * i),
                            textcoords="offset points")
        pp = plaintext_pass("qwen-coder")
        if pp is not None:
            ax.axvline(pp, ls="--", c="gray", lw=1, label=f"plaintext pass@1 {pp:.2f}")
        for key, e in he_pts.items():
            c = colors.get(e["method"], "black")
            ax.scatter([e["humaneval"]["pass@1"]], [e["privacy"]["worst_ttrsr"]], c=c, label=key)
        ax.set_xlabel("HumanEval pass@1 (CI subset, 20 problems, greedy)")
        ax.set_ylabel("worst-attack TTRSR (50 PII prompts)")
        ax.set_title("qwen-coder: task accuracy vs privacy")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--stage", default="privacy", choices=["privacy", "humaneval", "report"])
    ap.add_argument("--points", default=None, help="comma list METHOD@EPS (default: the whole grid)")
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"], help="IMA budget (DP-Forward)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="HumanEval generation cap (plaintext CI-subset passes all stop within 99 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    points = parse_points(a.points) if a.points else [(m, float(e)) for m, es in GRID.items() for e in es]
    if a.stage == "privacy":
        stage_privacy(a.model, points, a.budget)
    elif a.stage == "humaneval":
        if not a.points:
            sys.exit("--stage humaneval needs --points (each point costs tens of minutes on CPU)")
        stage_humaneval(a.model, points, a.max_new_tokens)
    print(report(RESULTS / "baselines.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
