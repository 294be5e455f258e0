"""Privacy-utility frontier: accuracy and attacks on the same obfuscated model, one parameter swept at a time.

Every point is one obfuscation of the model (seed 1) measured for fidelity (built-in chat prompts, top-1 agreement
and KL against the plaintext model) and attacked by the attack suite (private Faker-PII prompts, full-vocabulary
candidate pools, the budget given); points are keyed by aloepri.eval.tuning.setting_key (model file, parameters, seed,
attacks, budget, prompt counts). The plot puts top-1 agreement on x and the highest TTRSR over the attacks on y, one
series per swept parameter, like the paper's privacy-utility figure.

The behavioural attacks (experiment attack_behavioural, seed 1234, 50 prompts) are added to the plot and the table
from its stored results (every config) without recomputing anything: one series per behavioural attack at its own
top-1 agreement (measured on the very output it attacked), and "worst of all attacks" for the frontier points whose
parameters equal a behavioural target's (max of the weight attacks' TTRSR there and the behavioural TTRSRs).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path

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
BEHAVIOURAL_ATTACKS = ("behavioural", "behavioural-composed")


def behavioural_points(model: str) -> list[dict]:
    """One dict per obfuscated target of attack_behavioural for this model: target name, its parameters, top-1
    agreement of that same output, and TTRSR per behavioural attack (largest budget stored)."""
    from ..lib.stored import merged_entries

    store = merged_entries("attack_behavioural")
    points: dict[str, dict] = {}
    for key, e in store.items():
        m, target, attack, budget = key.split("/")
        if m != model or attack not in BEHAVIOURAL_ATTACKS or e.get("ttrsr") is None or not e.get("target_params"):
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


def plot(data: list[dict], model: str, png) -> None:
    from ..lib.plots import figure

    with figure(png, (7, 5)) as ax:
        for label in sorted({e["label"] for e in data}):
            pts = sorted((e["fidelity"]["top1_agreement"], e["max_ttrsr"], e["params"][SERIES_X.get(label, label)]) for e in data
                         if e["label"] == label and e["max_ttrsr"] is not None)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            for x, y, v in pts:
                ax.annotate(str(v), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        beh = behavioural_points(model)
        for attack, marker in zip(BEHAVIOURAL_ATTACKS, ("s", "^")):
            # a reduced-budget row (attack_behavioural's reduced configs) is marked in its label
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
        ax.set_title(f"privacy-utility frontier, {model}")
        ax.axhline(0.05, color="grey", lw=0.8, ls="--")
        ax.legend(title="swept parameter / attack", fontsize=7)
        ax.grid(alpha=0.3)


def table(data: list[dict], model: str) -> str:
    """Markdown table of the finished points: one row per setting, TTRSR per attack."""
    attacks = sorted({a for e in data for a in e["attacks"]})
    beh = behavioural_points(model)
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


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    budget: str = "ci"
    sweeps: tuple[str, ...] = tuple(SWEEPS)
    attacks: tuple[str, ...] = ("vma", "gate-ia", "nn", "tfma")
    values: tuple[float, ...] = ()  # only the points whose swept value is one of these, in this order; () = all
    prompts: int = 20  # built-in chat prompts for the fidelity
    private_prompts: int = 30  # Faker PII prompts attacked
    seed: int = 1  # obfuscation seed of every point
    threads: int = 1


def points(s: Settings) -> list[tuple[str, dict]]:
    """(series label, overrides of `noisy`) for every point of the settings, in run order."""
    unknown = [n for n in s.sweeps if n not in SWEEPS]
    if unknown:
        raise ValueError(f"unknown sweeps {unknown}; sweeps: {', '.join(SWEEPS)}")
    out = []
    for name in s.sweeps:
        pts = SWEEPS[name]
        if s.values:
            x = SERIES_X.get(name, name)
            pts = [o for v in s.values for o in pts if o.get(x) == v]
        out += [(name, o) for o in pts]
    return out


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.obfuscation.params import resolve_params
    from aloepri.eval.tuning import Evaluator, params_summary, setting_key

    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    ev = None
    base = resolve_params("noisy")
    extra = {"attacks": sorted(s.attacks), "budget": s.budget, "fidelity_prompts": s.prompts,
             "private_prompts": s.private_prompts}
    for label, overrides in points(s):
        params = base.replace(**overrides)
        key = setting_key(src.name, params, s.seed, extra)
        if store.has(key):
            continue
        if ev is None:
            ev = Evaluator(src, s.attacks, s.budget, s.prompts, 0, s.private_prompts)
        entry = {"label": label, "model": src.name, **ev.evaluate(params, s.seed), "status": "done"}
        store.put(key, entry)
        f = entry["fidelity"]
        print(f"[{label}] top-1 {f['top1_agreement']:.3f} KL {f['mean_kl']:.4f} max TTRSR {entry['max_ttrsr']} "
              f"({entry['seconds']:.0f} s) {params_summary(params)}", flush=True)


MODEL_FILES = {"smollm2": "smollm2-135m", "qwen-coder": "qwen2.5-coder-0.5b"}  # name -> part of its file's name


def model_of(entries: list[dict]) -> str:
    """The bundled model name of a frontier's points (from the model file name they record)."""
    files = {e["model"].lower() for e in entries}
    names = {n for n, part in MODEL_FILES.items() for f in files if part in f}
    if len(names) != 1:
        raise ValueError(f"frontier points of {sorted(files)}: expected one bundled model")
    return names.pop()


def done_points(store: ResultStore) -> list[dict]:
    # "status" is from the rows written by aloepri.eval.tuning.ResultStore (a run in progress was stored as "running")
    return [e for e in store.entries().values() if e.get("status", "done") == "done"]


def report(store: ResultStore) -> str:
    data = done_points(store)
    if not data:
        return "(no finished points)"
    model = model_of(data)
    plot(data, model, store.figure_path(".png"))
    return table(data, model)


SUMMARY = ("privacy-utility frontier: accuracy and attacks on the same obfuscation, one parameter swept at a "
           "time (minutes per point on SmolLM2, more on Qwen)")
CONFIGS = {
    # docs/accuracy.md "Privacy-utility frontier (SmolLM2-135M)"
    "smollm2-ci": Settings(sweeps=("alpha_e", "alpha_e=alpha_h", "noise_shape=column", "noise_shape=row",
                                   "alpha_h")),
    # docs/accuracy.md "Privacy-utility frontier (Qwen2.5-Coder-0.5B-Instruct)"
    "qwen-coder-ci": Settings(model="qwen-coder", attacks=("gate-ia", "nn"), sweeps=("alpha_e=alpha_h",),
                              values=(0.1, 0.2, 0.3, 0.5, 0.7, 1.0)),
    # a check that the path runs: one point (no noise), NN only, 5 + 5 prompts
    "smoke": Settings(sweeps=("alpha_e",), values=(0.0,), attacks=("nn",), prompts=5, private_prompts=5),
}
DEFAULT_CONFIG = "smollm2-ci"
DOCS = ("docs/accuracy.md", "docs/security.md")
NOTES = ("CPU; report also reads every stored config of attack_behavioural; audit_frontier derives the audit's "
         "package data from both. The kept results swept the noisy preset of then (lam 0.1, h 128, beta 8)")
