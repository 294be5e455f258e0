"""The measured privacy-utility points that `aloepri audit` draws its frontier from, derived from the frontier and
behavioural benchmarks' results (nothing is recomputed) into the package data file
src/aloepri/audit/measured_frontier.json.

One point per measured obfuscation setting: its top-1 agreement with the plaintext model (built-in chat prompts)
and the highest TTRSR over the attacks measured on that very output, with the attacks named. Sources:
- results/frontier_<model>.json (benchmarks/frontier.py): weight attacks (VMA, Gate-IA, NN) and TFMA per setting;
- results/attack_behavioural.json (benchmarks/attack_behavioural.py): the behavioural attacks, each on its own
  obfuscated output with that output's top-1 agreement; a frontier point with the same parameters also counts
  them (frontier.matched_behavioural).

Run: python benchmarks/audit_frontier.py   (rerun after either benchmark adds points)
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from frontier import BEHAVIOURAL, RESULTS, behavioural_points, matched_behavioural  # same directory

OUT = Path(__file__).resolve().parents[1] / "src" / "aloepri" / "audit" / "measured_frontier.json"
MODELS = {  # frontier name -> lower-case substrings of the source file name that identify the model
    "smollm2": {"title": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "match": ["smollm2-135m"]},
    "qwen-coder": {"title": "Qwen2.5-Coder-0.5B-Instruct (GGUF)", "match": ["qwen2.5-coder-0.5b"]},
}
SHOWN_PARAMS = ("alpha_e", "alpha_h", "lam", "h", "beta", "noise_shape", "outlier_dims")


def _setting(params: dict) -> str:
    return ", ".join(f"{k}={params[k]}" for k in SHOWN_PARAMS if k in params)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def model_points(model: str) -> list[dict]:
    store_path = RESULTS / f"frontier_{model}.json"
    entries = [e for e in json.loads(store_path.read_text()).values() if e.get("status") == "done"]
    beh = behavioural_points(model)
    points = []
    for e in entries:
        attacks = {a: r["ttrsr"] for a, r in e["attacks"].items() if r.get("ttrsr") is not None}
        b = matched_behavioural(e, beh)
        if b:
            attacks.update(b["attacks"])
        if not attacks:
            continue
        worst = max(attacks, key=attacks.get)
        points.append({"source": store_path.name, "series": e["label"], "setting": _setting(e["params"]),
                       "top1": round(e["fidelity"]["top1_agreement"], 4), "recovery": round(attacks[worst], 4),
                       "attack": worst, "attacks": {a: round(t, 4) for a, t in sorted(attacks.items())},
                       "budget": e["budget"]})
    for p in beh:  # the behavioural targets, each at its own output's accuracy
        worst = max(p["attacks"], key=p["attacks"].get)
        points.append({"source": BEHAVIOURAL.name, "series": "behavioural attacks", "setting": _setting(p["params"]),
                       "top1": round(p["top1"], 4), "recovery": round(p["attacks"][worst], 4), "attack": worst,
                       "attacks": {a: round(t, 4) for a, t in sorted(p["attacks"].items())},
                       "budget": ",".join(sorted(set(p["budgets"].values())))})
    return sorted(points, key=lambda p: (-p["top1"], p["recovery"]))


def main() -> None:
    sources = [RESULTS / f"frontier_{m}.json" for m in MODELS] + [BEHAVIOURAL]
    data = {
        "provenance": {
            "derived_by": "benchmarks/audit_frontier.py",
            "derived": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "from": {f"benchmarks/results/{p.name}": _sha(p) for p in sources},
            "x": "top-1 agreement with the plaintext model on the built-in chat prompts",
            "y": "highest TTRSR (private prompt tokens recovered) over the attacks measured on that output",
            "attacker": "the provider: holds the obfuscated weights and the public model (weight, behavioural "
                        "attacks) and sees the id stream (TFMA)",
        },
        "models": {m: {**info, "points": model_points(m)} for m, info in MODELS.items()},
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{m} {len(v['points'])} points" for m, v in data["models"].items()))


if __name__ == "__main__":
    main()
