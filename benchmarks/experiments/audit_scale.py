"""What the audit costs against model size, per attacker engine: `aloepri audit` on each real model and the 8B
shape, torch (both models in process, float32) beside llama.cpp q8_0 (both models as a provider serves them).

Reads the stored runs of ``audit_smollm2`` (nothing is re-measured here): each point is one whole command, its
wall and CPU seconds (every thread) and peak RSS (the highest of the child's count and each step's), model loading
included, with the verdict it reached. A point that was run in process (the older torch 1.5B run, before the
command ran in a child) has the report's wall seconds and its steps' highest peak RSS, and no CPU figure. A config with no stored run is listed as not measured, never drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore, UsageError

# parameters (embeddings included), from each model's config
PARAMETERS = {"smollm2": 134.5e6, "qwen-coder": 494.0e6, "qwen-coder-1.5b": 1.54e9, "llama-3.1-8b": 8.03e9}


@dataclass(frozen=True)
class Settings:
    configs: tuple[str, ...] = ("smollm2-small-torch", "smollm2-small-llamacpp", "qwen-coder-small-torch",
                                "qwen-coder-small-llamacpp", "qwen-coder-1.5b-small",
                                "qwen-coder-1.5b-small-llamacpp-fewer-reads",
                                "synthetic-8b-llamacpp")


def point(config: str, settings, entries: dict) -> dict | None:
    """One stored audit as a point: size, engine, budget, wall / CPU / peak RSS, the verdict; None if not run."""
    rep = entries.get("report")
    if rep is None:
        return None
    from .audit_smollm2 import peak_rss_gib

    proc = entries.get("process")
    engine = (rep.get("engine") or {}).get("name") or "torch"
    return {"config": config, "model": settings.model, "parameters": PARAMETERS[settings.model],
            "synthetic": bool(settings.synthetic), "engine": engine, "budget": rep["budget"],
            "in_process": proc is None,
            "wall_seconds": proc["wall_seconds"] if proc else rep["time"]["seconds"],
            "cpu_seconds": proc["cpu_seconds"] if proc else None,
            "peak_rss_gib": peak_rss_gib(rep, proc),
            "load_average": [proc["load_average_before"][0], proc["load_average_after"][0]]
            if proc and "load_average_before" in proc else None,
            "worst_prompt_token_recovery": rep["worst_prompt_token_recovery"], "worst_attack": rep["worst_attack"]}


def run(s: Settings, store: ResultStore) -> None:
    from ..lib.registry import get_experiment

    source = get_experiment("audit_smollm2")
    points, missing = [], []
    for config in s.configs:
        p = point(config, source.config(config), source.store(config).entries())
        (points.append(p) if p else missing.append(config))
    if not points:
        raise UsageError("audit_scale: no audit stored yet; run `python -m benchmarks run audit_smollm2 --config "
                         f"NAME` for {', '.join(s.configs)}")
    store.put("points", {"points": points, "not_measured": missing})


def report(store: ResultStore) -> str:
    e = store.get("points")
    if e is None:
        return "(nothing stored)"
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = ["| model | parameters | engine | budget | wall | CPU | peak RSS | load average before / after | "
             "verdict (worst prompt-token recovery) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(e["points"], key=lambda p: (p["parameters"], p["engine"])):
        name = p["model"] + (" (shape, random weights)" if p["synthetic"] else "")
        cpu = "-" if p["cpu_seconds"] is None else f"{p['cpu_seconds'] / 60:.1f} min"
        lines.append(f"| {name} | {p['parameters'] / 1e9:.2f}B | {p['engine']}{' (in process)' if p['in_process'] else ''}"
                     f" | {p['budget']} | {p['wall_seconds'] / 60:.1f} min | {cpu} | {p['peak_rss_gib']:.1f} GiB | "
                     f"{'not recorded' if not p.get('load_average') else ' / '.join(map(str, p['load_average']))} | "
                     f"{pct(p['worst_prompt_token_recovery'])} ({p['worst_attack']}) |")
    if e["not_measured"]:
        lines += ["", "Not measured yet: " + ", ".join(f"`{c}`" for c in e["not_measured"]) + "."]
    draw(e["points"], store.figure_path())
    return "\n".join(lines)


def draw(points: list[dict], png) -> None:
    from matplotlib.ticker import FixedLocator, NullFormatter

    from ..lib.plots import figure

    budgets = {p["budget"] for p in points}
    with figure(png, (9, 3.6)) as ax:
        fig = ax.figure
        fig.clear()
        axes = fig.subplots(1, 2)
        for ax, (key, label, scale) in zip(axes, (("peak_rss_gib", "peak RSS (GiB)", 1.0),
                                                   ("wall_seconds", "wall time (min)", 1 / 60))):
            for engine in sorted({p["engine"] for p in points}):
                pts = sorted((p for p in points if p["engine"] == engine), key=lambda p: p["parameters"])
                ax.plot([p["parameters"] for p in pts], [p[key] * scale for p in pts], "o-", label=engine)
                for p in pts:
                    # the budget is named only where the points mix budgets
                    note = ", ".join(([p["budget"]] if len(budgets) > 1 else [])
                                     + (["shape, random weights"] if p["synthetic"] else []))
                    if note:
                        ax.annotate(note, (p["parameters"], p[key] * scale), fontsize=6, xytext=(-4, -10),
                                    textcoords="offset points", ha="right")
            ax.set_xscale("log")
            ticks = [1e8, 3e8, 1e9, 3e9, 1e10]
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.set_xticklabels([f"{t / 1e9:g}B" for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("parameters")
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)


SUMMARY = "the audit's memory and time against model size, torch beside llama.cpp q8_0"
CONFIGS = {"small": Settings(),
           # `ci`, the budget the guide gives a large model: each real model on both engines and the 8B shape
           "ci": Settings(configs=tuple(f"{m}-ci-{e}" for m in ("smollm2", "qwen-coder", "qwen-coder-1.5b")
                                        for e in ("torch", "llamacpp")) + ("synthetic-8b-llamacpp",))}
DOCS = ("docs/performance.md", "docs/audit.md")
NOTES = "reads audit_smollm2's stored runs; computes no model"
