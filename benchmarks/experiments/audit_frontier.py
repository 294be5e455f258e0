"""The measured privacy-utility points that `aloepri audit` draws its frontier from, derived from the frontier and
attack_behavioural experiments' stored results (nothing is recomputed) into the package data file
src/aloepri/audit/measured_frontier.json (and, per model, into this experiment's results).

One point per measured obfuscation setting: its top-1 agreement with the plaintext model (built-in chat prompts)
and the highest TTRSR over the attacks measured on that very output, with the attacks named. Sources:
- frontier (every stored config): weight attacks (VMA, Gate-IA, NN) and TFMA per setting;
- attack_behavioural (every stored config): the behavioural attacks, each on its own obfuscated output with that
  output's top-1 agreement; a frontier point with the same parameters also counts them (frontier.matched_behavioural).
Rerun after either experiment adds points.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.provenance import REPO
from ..lib.stored import stored_results

OUT = REPO / "src" / "aloepri" / "audit" / "measured_frontier.json"
DERIVED_BY = "python -m benchmarks run audit_frontier"
MODELS = {  # bundled name -> title, and the lower-case substrings of the source file name that identify the model
    "smollm2": {"title": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "match": ["smollm2-135m"]},
    "qwen-coder": {"title": "Qwen2.5-Coder-0.5B-Instruct (GGUF)", "match": ["qwen2.5-coder-0.5b"]},
}
SHOWN_PARAMS = ("alpha_e", "alpha_h", "lam", "h", "beta", "noise_shape", "outlier_dims")


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = tuple(MODELS)


def _setting(params: dict) -> str:
    return ", ".join(f"{k}={params[k]}" for k in SHOWN_PARAMS if k in params)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def model_points(model: str) -> list[dict]:
    from .frontier import behavioural_points, done_points, matched_behavioural, model_of

    beh = behavioural_points(model)
    points = []
    for store in stored_results("frontier"):
        entries = done_points(store)
        if not entries or model_of(entries) != model:
            continue
        source = f"frontier/{store.config}.json"
        for e in entries:
            attacks = {a: r["ttrsr"] for a, r in e["attacks"].items() if r.get("ttrsr") is not None}
            b = matched_behavioural(e, beh)
            if b:
                attacks.update(b["attacks"])
            if not attacks:
                continue
            worst = max(attacks, key=attacks.get)
            points.append({"source": source, "series": e["label"], "setting": _setting(e["params"]),
                           "top1": round(e["fidelity"]["top1_agreement"], 4), "recovery": round(attacks[worst], 4),
                           "attack": worst, "attacks": {a: round(t, 4) for a, t in sorted(attacks.items())},
                           "budget": e["budget"]})
    for p in beh:  # the behavioural targets, each at its own output's accuracy
        worst = max(p["attacks"], key=p["attacks"].get)
        points.append({"source": "attack_behavioural", "series": "behavioural attacks",
                       "setting": _setting(p["params"]), "top1": round(p["top1"], 4),
                       "recovery": round(p["attacks"][worst], 4), "attack": worst,
                       "attacks": {a: round(t, 4) for a, t in sorted(p["attacks"].items())},
                       "budget": ",".join(sorted(set(p["budgets"].values())))})
    return sorted(points, key=lambda p: (-p["top1"], p["recovery"]))


def run(s: Settings, store: ResultStore) -> None:
    unknown = [m for m in s.models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; models: {', '.join(MODELS)}")
    sources = [st.path for exp in ("frontier", "attack_behavioural") for st in stored_results(exp)]
    data = {
        "provenance": {
            "derived_by": DERIVED_BY,
            "derived": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "from": {p.relative_to(REPO).as_posix(): _sha(p) for p in sources},
            "x": "top-1 agreement with the plaintext model on the built-in chat prompts",
            "y": "highest TTRSR (private prompt tokens recovered) over the attacks measured on that output",
            "attacker": "the provider: holds the obfuscated weights and the public model (weight, behavioural "
                        "attacks) and sees the id stream (TFMA)",
        },
        "models": {m: {**MODELS[m], "points": model_points(m)} for m in s.models},
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    for m, v in data["models"].items():
        store.put(m, {"points": v["points"], "from": data["provenance"]["from"], "package_data": str(OUT.name)})
    print(f"wrote {OUT}: " + ", ".join(f"{m} {len(v['points'])} points" for m, v in data["models"].items()))


def report(store: ResultStore) -> str:
    lines = ["| model | source | series | setting | top-1 | recovery | worst attack |", "|---|---|---|---|---|---|---|"]
    for model, e in store.entries().items():
        for p in e["points"]:
            lines.append(f"| {model} | {p['source']} | {p['series']} | {p['setting']} | {p['top1']:.3f} | "
                         f"{p['recovery']:.3f} | {p['attack']} |")
    return "\n".join(lines)


SUMMARY = ("the measured privacy-utility points `aloepri audit` ships (package data), derived from the frontier "
           "and attack_behavioural results (seconds; nothing recomputed)")
CONFIGS = {"bundled": Settings()}
DOCS = ("docs/audit.md",)
NOTES = "writes src/aloepri/audit/measured_frontier.json"
