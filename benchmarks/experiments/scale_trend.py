"""The paper's question across the three real scales: does a larger model tolerate more noise at the same accuracy,
and does that move the weight attack below 50% or 5%?

Reads the llamacpp_quantized results of the three real models (one harness: llama.cpp, q8_0 against plaintext q8_0,
the same presets, seed, prompts, HumanEval subset and attack budget) and, per preset, fits each quantity against
log10(parameters) by least squares: top-1 disagreement with the plaintext model (1 - top-1), the HumanEval pass@1
change (models that solve no problem in plaintext left out), and the attack's TTRSR. The fit is extrapolated to 8B and 14B with a 90% prediction interval
(Student t, n - 2 degrees of freedom); with three sizes that is one degree of freedom, so the interval is wide and
the extrapolation is an extrapolation, not a measurement; the figure clips lines and intervals to the
quantity's range and draws no extrapolation from two sizes. run() computes the points and fits from the stored
results (nothing is re-measured); report() draws the figure beside the results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..lib import ResultStore, UsageError

# parameters (embedding included) of the real models the llamacpp_quantized configs run
PARAMETERS = {"smollm2": 134.5e6, "qwen-coder": 494.0e6, "qwen-coder-1.5b": 1.54e9}
EXTRAPOLATE = {"8B": 8.0e9, "14B": 14.7e9}


@dataclass(frozen=True)
class Settings:
    configs: tuple[str, ...] = ("smollm2", "qwen-coder", "qwen-coder-1.5b")  # of llamacpp_quantized
    presets: tuple[str, ...] = ("noisy", "paper")
    qtype: str = "q8_0"
    attack: str = "vma"


def point(entries: dict, preset: str, qtype: str, attack: str) -> dict | None:
    """One model's figures for one preset, from its llamacpp_quantized entries; None if any is missing."""
    fid = entries.get(f"fidelity/{preset}:{qtype}")
    att = entries.get(f"attacks/{preset}")
    plain = {k.split("/", 2)[2]: e for k, e in entries.items() if k.startswith(f"humaneval/plaintext:{qtype}/")}
    obf = {k.split("/", 2)[2]: e for k, e in entries.items() if k.startswith(f"humaneval/{preset}:{qtype}/")}
    common = sorted(set(plain) & set(obf))
    if not (fid and att and attack in att["attacks"]):
        return None
    point = {"top1": fid["top1"], "kl": fid["kl"], "ttrsr": att["attacks"][attack]["ttrsr"],
             "served_type": fid["type"], "humaneval_problems": len(common)}
    if common:  # HumanEval is optional: a model may not have reached it
        point.update(humaneval_plain=sum(bool(plain[t]["passed"]) for t in common) / len(common),
                     humaneval_obfuscated=sum(bool(obf[t]["passed"]) for t in common) / len(common))
    return point


VALUES = {"top1_disagreement": lambda p: 1 - p["top1"],
          "humaneval_change": lambda p: p["humaneval_obfuscated"] - p["humaneval_plain"],
          "ttrsr": lambda p: p["ttrsr"]}


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares y = a + b x, and the 90% prediction interval at the extrapolation points."""
    from scipy import stats

    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    out = {"intercept": a, "slope_per_decade": b, "n": n}
    if n > 2:
        s = math.sqrt(sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / (n - 2))
        t = float(stats.t.ppf(0.95, n - 2))
        for name, p in EXTRAPOLATE.items():
            x = math.log10(p)
            half = t * s * math.sqrt(1 + 1 / n + (x - mx) ** 2 / sxx)
            out[name] = {"fit": a + b * x, "low": a + b * x - half, "high": a + b * x + half}
    return out


def run(s: Settings, store: ResultStore) -> None:
    from ..lib.registry import get_experiment

    source = get_experiment("llamacpp_quantized")
    for preset in s.presets:
        pts = {}
        for config in s.configs:
            p = point(source.store(config).entries(), preset, s.qtype, s.attack)
            if p is not None:
                pts[config] = {**p, "parameters": PARAMETERS[source.config(config).model]}
        if len(pts) < 2:
            raise UsageError(f"scale_trend: {preset} has results for {sorted(pts) or 'no model'}; run "
                             "`python -m benchmarks run llamacpp_quantized --config NAME` for the others first")
        xs = [math.log10(p["parameters"]) for p in pts.values()]
        fits = {"top1_disagreement": fit(xs, [1 - p["top1"] for p in pts.values()]),
                "ttrsr": fit(xs, [p["ttrsr"] for p in pts.values()])}
        # a model that solves nothing in plaintext says nothing about the loss (SmolLM2-135M)
        he = [p for p in pts.values() if p.get("humaneval_plain")]
        if len(he) >= 2:
            fits["humaneval_change"] = fit([math.log10(p["parameters"]) for p in he],
                                           [p["humaneval_obfuscated"] - p["humaneval_plain"] for p in he])
        store.put(preset, {"points": pts, "fits": fits})


def _interval(f: dict, name: str) -> str:
    e = f.get(name)
    return "-" if e is None else f"{e['fit']:.2f} [{e['low']:.2f}, {e['high']:.2f}]"


def report(store: ResultStore) -> str:
    entries = store.entries()
    lines = ["| preset | model | parameters | served as | top-1 | KL | HumanEval pass@1, plaintext / obfuscated | "
             "attack TTRSR |", "|---|---|---|---|---|---|---|---|"]
    for preset, e in entries.items():
        for config, p in e["points"].items():
            he = (f"{p['humaneval_plain']:.2f} / {p['humaneval_obfuscated']:.2f} ({p['humaneval_problems']} problems)"
                  if "humaneval_plain" in p else "not measured")
            lines.append(f"| {preset} | {config} | {p['parameters'] / 1e9:.2f}B | {p['served_type']} | {p['top1']:.3f} | "
                         f"{p['kl']:.3f} | {he} | {p['ttrsr']:.3f} |")
    lines += ["", "| preset | quantity | slope per 10x parameters | 8B (90% prediction interval) | 14B |",
              "|---|---|---|---|---|"]
    for preset, e in entries.items():
        for q, f in e["fits"].items():
            lines.append(f"| {preset} | {q} | {f['slope_per_decade']:+.3f} | {_interval(f, '8B')} | "
                         f"{_interval(f, '14B')} |")
    if entries:
        draw(entries, store.figure_path())
    return "\n".join(lines)


def draw(entries: dict, png) -> None:
    from ..lib.plots import figure

    with figure(png, (10, 4)) as ax:
        fig = ax.figure
        fig.clear()
        axes = fig.subplots(1, 3)
        for ax, (q, label) in zip(axes, (("top1_disagreement", "1 - top-1 agreement"),
                                          ("humaneval_change", "HumanEval pass@1 change"),
                                          ("ttrsr", "attack TTRSR"))):
            for preset, e in entries.items():
                if q not in e["fits"]:
                    continue
                pts = sorted((p for p in e["points"].values() if q != "humaneval_change" or p.get("humaneval_plain")),
                             key=lambda p: p["parameters"])
                xs = [p["parameters"] for p in pts]
                ys = [VALUES[q](p) for p in pts]
                (h,) = ax.plot(xs, ys, "o", label=f"{preset} (measured)")
                f = e["fits"][q]
                # the line only where it has an interval (three sizes or more), and inside the quantity's range
                grid = [min(xs), *EXTRAPOLATE.values()] if f["n"] > 2 else [min(xs), max(xs)]
                lo, hi = (-1.0, 1.0) if q == "humaneval_change" else (0.0, 1.0)
                ax.plot(grid, [min(hi, max(lo, f["intercept"] + f["slope_per_decade"] * math.log10(x))) for x in grid],
                        "--", color=h.get_color(), lw=1, label=f"{preset} fit" + (", extrapolated" if f["n"] > 2 else ""))
                for name in (n for n in EXTRAPOLATE if n in f):
                    v = f[name]
                    mid = min(hi, max(lo, v["fit"]))
                    ax.errorbar([EXTRAPOLATE[name]], [mid], yerr=[[mid - max(lo, v["low"])], [min(hi, v["high"]) - mid]],
                                color=h.get_color(), capsize=3, alpha=0.6)
            if q == "ttrsr":
                ax.axhline(0.5, color="grey", lw=0.8, ls=":")
                ax.axhline(0.05, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_xlim(8e7, 2.5e10)
            ax.minorticks_off()
            ax.set_xlabel("parameters")
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)


SUMMARY = "accuracy loss and attack recovery against model size (three real models, fit and extrapolation)"
CONFIGS = {"vma": Settings()}
DOCS = ("docs/accuracy.md",)
NOTES = "reads llamacpp_quantized's smollm2, qwen-coder and qwen-coder-1.5b results; computes no model"
