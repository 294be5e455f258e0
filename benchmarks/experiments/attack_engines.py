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
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.provenance import REPO
from ..lib.variants import preset_params

ATTACKS = ("behavioural", "behavioural-composed")


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


def run(s: Settings, store: ResultStore) -> None:
    from aloepri.attacks.engines import TORCH, engine_files

    src = model_path(s.model)
    for preset in s.presets:
        todo = [e for e in s.engines if not store.has(f"{preset}/{e}")]
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


def report(store: ResultStore) -> str:
    entries = store.entries()
    settings = store.load()["settings"]
    if not entries:
        return "(nothing measured yet)"
    names = settings["attacks"].split(",")
    head = " | ".join(f"{n} TTRSR / PIIRSR (%)" for n in names)
    out = [f"| model | preset | engine | {head} | wall | CPU | peak RSS |",
           "|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    notes = []
    by_preset: dict[str, dict[str, dict]] = {}
    for e in entries.values():
        by_preset.setdefault(e["preset"], {})[e["engine"]] = e
    for preset, rows in by_preset.items():
        ref = rows.get("torch")
        for engine, e in rows.items():
            cells = []
            for n in names:
                a = e["attacks"].get(n)
                cells.append("-" if a is None else f"{_pct(a['ttrsr'])} / {_pct(a['piirsr'])}")
                r = ref and ref["attacks"].get(n)
                if a and r and engine != "torch" and r["ttrsr"] >= 0.99 and a["ttrsr"] < r["ttrsr"] - 0.01:
                    notes.append(f"{preset}, {n}: {engine} reads {_pct(a['ttrsr'])}% against float32's "
                                 f"{_pct(r['ttrsr'])}%")
            out.append(f"| {e['model']} | {preset} | {engine} | " + " | ".join(cells) +
                       f" | {e['wall_seconds']:.0f} s | {e['cpu_seconds']:.0f} s | {e['peak_rss_gib']:.2f} GiB |")
    if notes:
        out += ["", "More than 1 point below float32 where float32 reads 99% or more: " + "; ".join(notes) + "."]
    return "\n".join(out)


SUMMARY = ("the behavioural attacks with both models on float32 torch, llama.cpp q8_0 and llama.cpp q4_k_m, side by "
           "side on the same checkpoints: prompt/PII recovery, wall, CPU, peak RSS")
CONFIGS = {
    # the composed attack alone (the one that reads every preset at float32, `paper` included): on a shared 2-core
    # machine the two attacks on 4 presets x 3 engines would take hours
    "smollm2": Settings(attacks="behavioural-composed"),
    # `paper` alone (where only the composed attack reads the prompts in float32), q8_0 against float32
    "smollm2-paper": Settings(presets=("paper",), engines=("torch", "llamacpp-q8_0"), attacks="behavioural-composed"),
    "qwen-coder": Settings(model="qwen-coder"),
    "qwen-coder-1.5b": Settings(model="qwen-coder-1.5b"),
    # a check that the path runs: one preset, the behavioural attack alone, two prompts
    "smoke": Settings(presets=("default",), attacks="behavioural", prompts=2),
}
DEFAULT_CONFIG = "smollm2"
DOCS = ("docs/performance.md", "docs/security.md")
NOTES = "needs llama-cpp-python; SmolLM2 about 30-60 min on 2 cores (4 presets x 3 engines)"
