"""The behavioural attacks on the provider's engine: the same obfuscated checkpoints attacked with both models in
float32 torch (the reference) and on llama.cpp at q8_0 and at a 4-bit K-quant (q4_k_m), side by side in one run.

For each preset, each engine runs the real command (``aloepri attack behavioural,behavioural-composed --budget ci
--engine E``) in a fresh child process (benchmarks.lib.command_child): wall and CPU seconds (user + system, every
thread of the process: llama.cpp's included) and peak RSS (VmHWM) of the whole command, model loading included,
with each attack's TTRSR / PIIRSR / vocabulary recovery, seconds and peak RSS from its report. The engines of one
preset run one after the other, so a ratio compares runs minutes apart on the same machine. The GGUF files are
made before the timed runs (their export seconds are stored apart: a provider has them already).

The checkpoints are the cached targets of ``llamacpp_quantized`` (the same seed and output dtype), so the figures
sit beside that experiment's fidelity rows. Entries ``PRESET/ENGINE``.

``ALOEPRI_BENCH_ONLY=PRESET[/ENGINE],...`` (environment) makes one invocation fill only those entries of the
config (a preset: its three engines; ``PRESET/ENGINE``: that one), so that a run under the shared heavy-run lock
can leave it between entries (one preset of SmolLM2 is ~10 min, one engine of the 0.5B model more). It chooses
which entries this run fills, not what they mean, so it is not a setting.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.models import model_path
from ..lib.provenance import REPO
from ..lib.variants import preset_params

ATTACKS = ("behavioural", "behavioural-composed")
ONLY_ENV = "ALOEPRI_BENCH_ONLY"


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    presets: tuple[str, ...] = ("default", "noisy", "noisy+alpha_e=0.5+alpha_h=0.1", "paper")
    engines: tuple[str, ...] = ("torch", "llamacpp-q8_0", "llamacpp-q4_k_m")
    attacks: str = ",".join(ATTACKS)
    budget: str = "ci"
    prompts: int = 10
    threads: int = 2
    seed: int = 2026
    dtype: str = "bfloat16"


def _target(s: Settings, src: Path, preset: str):
    from ..lib.targets import obfuscated

    return obfuscated(src, preset_params(preset), s.seed, dtype=s.dtype)


def _child(argv: list[str], work: Path) -> dict:
    out = work / "child.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.command_child", str(out), "--", *argv], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"aloepri {' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr[-2500:]}")
    return json.loads(out.read_text())


def _entries_now(s: Settings) -> list[tuple[str, str]]:
    """(preset, engine) of the entries this invocation may fill: all of the config's, or those ``ONLY_ENV`` names."""
    every = [(p, e) for p in s.presets for e in s.engines]
    raw = os.environ.get(ONLY_ENV, "").strip()
    if not raw:
        return every
    asked = [x.strip() for x in raw.split(",") if x.strip()]
    unknown = [x for x in asked if x not in s.presets and tuple(x.rsplit("/", 1)) not in every]
    if unknown:
        raise UsageError(f"{ONLY_ENV}: {', '.join(unknown)} is not a preset or PRESET/ENGINE of this config "
                         f"(presets {', '.join(s.presets)}; engines {', '.join(s.engines)})")
    return [(p, e) for p, e in every if p in asked or f"{p}/{e}" in asked]


def run(s: Settings, store: ResultStore) -> None:
    from aloepri.attacks.engines import TORCH, engine_files

    src = model_path(s.model)
    chosen = _entries_now(s)
    for preset in dict.fromkeys(p for p, _ in chosen):
        todo = [e for p, e in chosen if p == preset and not store.has(f"{preset}/{e}")]
        if not todo:
            continue
        t = _target(s, src, preset)
        exports = {}
        for engine in todo:  # the GGUF files first: the timed runs find them made
            if engine != TORCH:
                t0 = time.perf_counter()
                engine_files(engine, src, t.model_dir)
                exports[engine] = round(time.perf_counter() - t0, 1)
        for engine in todo:
            with tempfile.TemporaryDirectory(prefix="aloepri-attack-engines-") as work:
                w = Path(work)
                argv = ["attack", s.attacks, "--plain", str(src), "--obfuscated", str(t.model_dir), "--key",
                        str(t.key_path), "--budget", s.budget, "--prompts", str(s.prompts), "--threads",
                        str(s.threads), "--engine", engine, "--report-dir", str(w / "report"), "--quiet"]
                child = _child(argv, w)
                report = json.loads((w / "report" / "attack_report.json").read_text())
            attacks = {}
            for r in report["results"]:
                m, b = r["metrics"], r["budget"]
                attacks[r["attack"]] = {"ttrsr": r["ttrsr"], "piirsr": r["piirsr"],
                                        "vocab_recovery": m.get("vocab_recovery"),
                                        # the composed attack's behavioural stage alone (before the weights' ridge)
                                        "before_ridge": m.get("before_ridge"),
                                        "confident_fraction": m.get("confident_fraction"),
                                        "vocab_recovery_confident_only": m.get("vocab_recovery_confident_only"),
                                        "tokens_scored": m.get("tokens_scored"),
                                        "pii_tokens_scored": m.get("pii_tokens_scored"),
                                        "seconds": round(r["seconds"], 1), "peak_rss_gib": b.get("peak_rss_gib"),
                                        "engine": b.get("engine"), "error": m.get("error"),
                                        "trace": m.get("trace")}
            store.put(f"{preset}/{engine}", {
                "model": s.model, "preset": preset, "engine": engine, "params": preset_params(preset).to_dict(),
                "wall_seconds": child["seconds"], "cpu_seconds": child["cpu_seconds"],
                "load_seconds": child["load_seconds"], "peak_rss_gib": round(child["peak_rss_mib"] / 1024, 2),
                "gguf_export_seconds": exports.get(engine), "attacks": attacks,
                "command": "aloepri " + " ".join(a if not a.startswith("/") else Path(a).name for a in argv)})
            print(f"{preset}/{engine}", json.dumps({k: (v["ttrsr"], v["piirsr"]) for k, v in attacks.items()}),
                  f"wall {child['seconds']} s, cpu {child['cpu_seconds']} s, peak {child['peak_rss_mib']} MiB",
                  flush=True)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _engine_cell(e: dict, attacks: dict) -> str:
    """The engine, and the type both models were served at where it is not the one asked for (an output whose rows
    cannot be cut into 32-value blocks is served at f16)."""
    engine = e["engine"]
    served = {(a.get("engine") or {}).get("precision") for a in attacks.values() if a} - {None}
    asked = engine.partition("-")[2]
    if engine != "torch" and served and served != {asked}:
        return f"{engine} (served at {', '.join(sorted(served))})"
    return engine


def _below(a: dict, r: dict) -> list[str]:
    """Where the engine reads more than 1 point less than float32 and float32 reads 99% or more."""
    out = []
    for key, label in (("ttrsr", "prompt"), ("piirsr", "PII")):
        if a.get(key) is not None and r.get(key) is not None and r[key] >= 0.99 and a[key] < r[key] - 0.01:
            out.append(f"{label} {_pct(a[key])}% against {_pct(r[key])}%")
    return out


def report(store: ResultStore) -> str:
    entries = store.entries()
    settings = store.load()["settings"]
    if not entries:
        return "(nothing measured yet)"
    names = settings["attacks"].split(",")
    stage = "behavioural-composed" in names  # its behavioural stage alone, before the weights' ridge
    head = " | ".join(f"{n} TTRSR / PIIRSR (%)" for n in names)
    out = [f"| model | preset | engine | {head} |" + (" behavioural stage alone: TTRSR / vocabulary (%) |" if stage
                                                     else "") + " wall | CPU | peak RSS |",
           "|---|---|---|" + "---|" * (len(names) + stage) + "---|---|---|"]
    notes, compared = [], 0
    by_preset: dict[str, dict[str, dict]] = {}
    for e in entries.values():
        by_preset.setdefault(e["preset"], {})[e["engine"]] = e
    for preset, rows in by_preset.items():
        ref = rows.get("torch")
        for engine in [x for x in settings["engines"] if x in rows] + [x for x in rows if x not in settings["engines"]]:
            e = rows[engine]
            cells = []
            for n in names:
                a = e["attacks"].get(n)
                cells.append("-" if a is None else f"{_pct(a['ttrsr'])} / {_pct(a['piirsr'])}")
                r = ref and ref["attacks"].get(n)
                if a and r and engine != "torch":
                    compared += 1
                    notes += [f"{preset}, {n}, {engine}: {x}" for x in _below(a, r)]
            if stage:
                b = (e["attacks"].get("behavioural-composed") or {}).get("before_ridge")
                cells.append("-" if not b else f"{_pct(b.get('ttrsr'))} / {_pct(b.get('vocab_recovery'))}")
            out.append(f"| {e['model']} | {preset} | {_engine_cell(e, e['attacks'])} | " + " | ".join(cells) +
                       f" | {e['wall_seconds']:.0f} s | {e['cpu_seconds']:.0f} s | {e['peak_rss_gib']:.2f} GiB |")
    if notes:
        out += ["", "More than 1 point below float32 where float32 reads 99% or more: " + "; ".join(notes) + "."]
    elif compared:
        out += ["", "Every engine reads within 1 point of float32 wherever float32 reads 99% or more (prompt and PII "
                    "tokens)."]
    return "\n".join(out)


SUMMARY = ("the behavioural attacks with both models on float32 torch, llama.cpp q8_0 and llama.cpp q4_k_m, side by "
           "side on the same checkpoints: prompt/PII recovery, wall, CPU, peak RSS")
CONFIGS = {
    # the composed attack alone (at budget ci it reads default, noisy and alpha 0.5 in float32; `paper` only at a
    # larger VMA sample, budget small): ~10 min a preset on 2 cores, ALOEPRI_BENCH_ONLY=PRESET one at a time
    "smollm2": Settings(attacks="behavioural-composed"),
    # `paper` alone (where only the composed attack reads the prompts in float32), q8_0 against float32
    "smollm2-paper": Settings(presets=("paper",), engines=("torch", "llamacpp-q8_0"), attacks="behavioural-composed"),
    # the composed attack alone, as for SmolLM2 (ALOEPRI_BENCH_PRESETS=default,paper fills those rows first)
    "qwen-coder": Settings(model="qwen-coder", attacks="behavioural-composed"),
    "qwen-coder-1.5b": Settings(model="qwen-coder-1.5b"),
    # a check that the path runs: one preset, the behavioural attack alone, two prompts
    "smoke": Settings(presets=("default",), attacks="behavioural", prompts=2),
}
DEFAULT_CONFIG = "smollm2"
DOCS = ("docs/performance.md", "docs/security.md")
NOTES = ("needs llama-cpp-python; SmolLM2 ~5-10 min a preset (3 engines) on 2 cores; ALOEPRI_BENCH_ONLY=PRESET[/ENGINE] "
         "fills chosen entries per invocation")
