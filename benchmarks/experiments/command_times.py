"""Wall time of each long command as the README gives it, on SmolLM2-135M-Instruct obfuscated with ``default``,
with a phase profile: loading (models and tokenizers) against the rest (the command's compute), the slowest steps
(attacks, settings), peak RSS and the machine's load average before and after.

Each command runs in a fresh child process (benchmarks.lib.command_child: the real ``aloepri`` CLI in process,
its loaders timed, its CPU time taken: with one torch thread that is about the wall time on an idle core). Targets, on 2 idle cores: verify < 1 min, eval fidelity < 3 min, attack all
--budget ci and audit --budget ci < 5 min, tune with its default budget < 15 min. The machine here is shared; the
load average says how far from idle a figure is.
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

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.provenance import REPO

TARGET_SECONDS = {"verify": 60, "eval_fidelity": 180, "attack_all_ci": 300, "audit_ci": 300, "tune": 900}


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    commands: tuple[str, ...] = ("attack_all_ci", "verify", "eval_fidelity", "audit_ci", "tune")
    preset: str = "default"
    seed: int = 20261127
    threads: int = 1


def command_line(name: str, model: str, server: Path, key: Path, work: Path, threads: int) -> list[str]:
    """The README's command for ``name`` (without a progress bar), writing into ``work``."""
    t = ["--threads", str(threads)]
    return {
        "verify": ["verify", model, str(server), "--key", str(key), "--quiet", *t],
        "eval_fidelity": ["eval", "fidelity", model, str(server), "--key", str(key), "--quiet", *t],
        "attack_all_ci": ["attack", "all", "--plain", model, "--obfuscated", str(server), "--key", str(key),
                          "--budget", "ci", "--report-dir", str(work / "attack"), "--quiet", *t],
        "audit_ci": ["audit", model, "--obfuscated", str(server), "--key", str(key), "--budget", "ci",
                     "--out", str(work / "audit"), "--quiet", *t],
        "tune": ["tune", model, "--min-top1", "0.9", "--out", str(work / "preset.json"), "--quiet", *t],
    }[name]


def slowest_steps(name: str, work: Path, n: int = 4) -> list[list]:
    """[[step, seconds], ...] of the slowest attacks (attack, audit) or settings (tune) the command recorded."""
    steps: list[tuple[str, float]] = []
    if name == "attack_all_ci" and (work / "attack" / "attack_report.json").exists():
        rep = json.loads((work / "attack" / "attack_report.json").read_text())
        steps = [(r["attack"], r["seconds"]) for r in rep["results"]]
    elif name == "audit_ci" and (work / "audit" / "report.json").exists():
        rep = json.loads((work / "audit" / "report.json").read_text())
        steps = [(a["name"], a.get("seconds") or 0.0) for a in rep["attacks"] if a["status"] != "skipped"]
        steps.append(("fidelity", rep["fidelity"].get("seconds") or 0.0))
    elif name == "tune" and (work / "preset.results.json").exists():
        res = json.loads((work / "preset.results.json").read_text())
        steps = [(json.dumps({k: e["params"][k] for k in ("alpha_e", "alpha_h")}), e["seconds"])
                 for e in res.values() if e.get("status") == "done"]
    return [[s, round(sec, 1)] for s, sec in sorted(steps, key=lambda x: -x[1])[:n]]


def run(s: Settings, store: ResultStore) -> None:
    import aloepri

    from ..lib.targets import obfuscated

    src = model_path(s.model)
    target = obfuscated(src, aloepri.resolve_params(s.preset), s.seed)
    for name in s.commands:
        if store.has(name):
            continue
        with tempfile.TemporaryDirectory(prefix=f"command-times-{name}-") as tmp:
            work = Path(tmp)
            argv = command_line(name, s.model, target.model_dir, target.key_path, work, s.threads)
            load_before = [round(x, 2) for x in os.getloadavg()]
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.command_child", str(work / "child.json"),
                                   "--", *argv], cwd=REPO, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            child = json.loads((work / "child.json").read_text())
            entry = {"command": "aloepri " + " ".join(Path(a).name if a.startswith("/") else a for a in argv),
                     "seconds": round(wall, 1), "command_seconds": child["seconds"],
                     "cpu_seconds": child["cpu_seconds"],
                     "load_seconds": child["load_seconds"],
                     "compute_seconds": round(child["seconds"] - child["load_seconds"], 1),
                     "loads": child["loads"], "slowest_steps": slowest_steps(name, work),
                     "peak_rss_mib": child["peak_rss_mib"], "target_seconds": TARGET_SECONDS[name],
                     "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
                     "threads": s.threads, "preset": s.preset}
        store.put(name, entry)
        print(f"{name}: {entry['seconds']} s (load {entry['load_seconds']} s), load average "
              f"{load_before[0]} -> {entry['load_average_after'][0]}", flush=True)


def _clock(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def report(store: ResultStore) -> str:
    rows = ["| command | wall | CPU time | loading | compute | slowest steps | peak RSS | load avg before / after | "
            "target |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in store.entries().items():
        steps = ", ".join(f"{step} {_clock(sec)}" for step, sec in e["slowest_steps"]) or "-"
        met = "met" if e["seconds"] <= e["target_seconds"] else "missed"
        cpu = _clock(e["cpu_seconds"]) if "cpu_seconds" in e else "-"
        rows.append(f"| `{e['command']}` | {_clock(e['seconds'])} | {cpu} | {_clock(e['load_seconds'])} | "
                    f"{_clock(e['compute_seconds'])} | {steps} | {e['peak_rss_mib']} MiB | "
                    f"{e['load_average_before'][0]} / {e['load_average_after'][0]} | "
                    f"< {_clock(e['target_seconds'])}: {met} |")
    return "\n".join(rows)


SUMMARY = ("wall time of verify, eval fidelity, audit/attack --budget ci and tune on SmolLM2 (default preset), "
           "split into loading and compute, with the slowest steps and the load average")
CONFIGS = {"smollm2": Settings(),
           # the first run (run as `smollm2` at commit 11cec2a, before the child took CPU time; stopped during
           # attack all): verify, eval fidelity, audit
           "wall-only": Settings(commands=("verify", "eval_fidelity", "audit_ci", "attack_all_ci", "tune")),
           "quick": Settings(commands=("verify", "eval_fidelity")),
           "smoke": Settings(commands=("verify",))}
DOCS = ("docs/audit.md",)
NOTES = ("a shared machine's load inflates every figure (the load average is recorded); tune skips the attacks "
         "that cannot change its choice, so its time depends on how many settings the accuracy budget admits")
