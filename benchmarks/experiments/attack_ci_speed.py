"""Per-attack time and result of ``aloepri attack NAME --budget ci`` on SmolLM2, the code of a baseline commit
against the current code, side by side in one run: for each attack the two run one after the other, each in a
fresh child process (benchmarks.lib.command_child, the real CLI), so both see the same load. The baseline's
``src/`` is taken from git (``git archive``) and put first on the child's PYTHONPATH.

Entries ``ATTACK/before`` and ``ATTACK/after``: the attack's own seconds (from its report, models already loaded),
the child's wall and CPU seconds, TTRSR / PIIRSR / vocabulary recovery, the budget the attack recorded and the
load average. ``suite/after``: ``attack all --budget ci`` with the current code, every attack's seconds.

``commands`` (configs ``commands-attack``, ``commands-audit``): the two whole commands the CPU target is set on,
``aloepri attack all --budget ci`` and ``aloepri audit --budget ci --all-attacks``, each with the baseline code and
the current code (``COMMAND/before``, ``COMMAND/after``), one after the other: the child's wall seconds, CPU
seconds (user + system, every thread) and peak RSS, and per attack its seconds, its CPU seconds (recorded by the
current code only), TTRSR and PIIRSR from the command's own report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.provenance import REPO


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    preset: str = "default"
    attacks: tuple[str, ...] = ("isa_attention",)
    baseline: str = "6ee5b8978960cbae36ba0f8f9c4d9d6ea2bdd087"  # the code before the ci speed-ups
    versions: tuple[str, ...] = ("before", "after")
    suite: bool = False  # also `attack all --budget ci` with the current code
    seed: int = 20261127
    prompts: int = 50
    threads: int = 1
    commands: tuple[str, ...] = ()  # whole commands timed before / after: "attack_all", "audit_all"
    current: str | None = None  # the "after" code from this commit (git archive), not the working tree's src/


def _baseline_src(commit: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", commit, "src"], cwd=REPO, stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return into / "src"


def _child(argv: list[str], src: Path, work: Path) -> tuple[dict, float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(src)}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.command_child", str(work / "child.json"), "--",
                           *argv], cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads((work / "child.json").read_text()), wall


def _result(r: dict) -> dict:
    m = r.get("metrics") or {}
    return {"seconds": round(r["seconds"], 1), "ttrsr": r.get("ttrsr"), "piirsr": r.get("piirsr"),
            "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float, str)) or v is None},
            "budget": r.get("budget"), "error": r.get("error")}


def _command_argv(command: str, s: Settings, model_dir: Path, key: Path, work: Path) -> list[str]:
    common = ["--key", str(key), "--budget", "ci", "--quiet", "--threads", str(s.threads)]
    if command == "attack_all":
        return ["attack", "all", "--plain", s.model, "--obfuscated", str(model_dir), *common, "--prompts",
                str(s.prompts), "--report-dir", str(work / "report")]
    if command == "audit_all":  # the audit's own prompt count at ci
        return ["audit", s.model, "--obfuscated", str(model_dir), *common, "--all-attacks", "--out",
                str(work / "report")]
    raise ValueError(f"unknown command {command!r}")


def _command_attacks(command: str, work: Path) -> dict[str, dict]:
    """Per attack: seconds, CPU seconds (None where the code did not record them), TTRSR, PIIRSR, status."""
    if command == "attack_all":
        rows = json.loads((work / "report" / "attack_report.json").read_text())["results"]
        return {r["attack"]: {"seconds": round(r["seconds"], 1), "cpu_seconds": r["budget"].get("cpu_seconds"),
                              "ttrsr": r.get("ttrsr"), "piirsr": r.get("piirsr"),
                              "error": (r.get("metrics") or {}).get("error")} for r in rows}
    rep = json.loads((work / "report" / "report.json").read_text())
    attacks = rep["attacks"]
    rows = attacks.values() if isinstance(attacks, dict) else attacks
    out = {r["name"]: {"seconds": r.get("seconds"), "cpu_seconds": (r.get("attack_budget") or {}).get("cpu_seconds"),
                       "ttrsr": r.get("ttrsr"), "piirsr": r.get("piirsr"), "status": r.get("status"),
                       "error": r.get("error")} for r in rows}
    fid = rep.get("fidelity") or {}
    if isinstance(fid, dict) and fid.get("seconds") is not None:
        out["(fidelity)"] = {"seconds": fid.get("seconds"), "cpu_seconds": None, "ttrsr": None, "piirsr": None}
    return out


def _run_commands(s: Settings, store: ResultStore, target, srcs: dict[str, Path], tmp: str) -> None:
    for command in s.commands:
        for version in s.versions:
            key = f"{command}/{version}"
            if store.has(key):
                continue
            with tempfile.TemporaryDirectory(prefix="run-", dir=tmp) as w:
                work = Path(w)
                argv = _command_argv(command, s, target.model_dir, target.key_path, work)
                load_before = [round(x, 2) for x in os.getloadavg()]
                child, wall = _child(argv, srcs[version], work)
                attacks = _command_attacks(command, work)
            entry = {"command": "aloepri " + " ".join(Path(a).name if a.startswith("/") else a for a in argv),
                     "code": s.baseline if version == "before" else (s.current or "current"),
                     "wall_seconds": round(wall, 1),
                     "cpu_seconds": child["cpu_seconds"], "peak_rss_mib": child["peak_rss_mib"],
                     "load_seconds": child["load_seconds"], "attacks": attacks,
                     "load_average_before": load_before,
                     "load_average_after": [round(x, 2) for x in os.getloadavg()], "preset": s.preset}
            store.put(key, entry)
            print(f"{key}: CPU {entry['cpu_seconds']} s, wall {entry['wall_seconds']} s, peak RSS "
                  f"{entry['peak_rss_mib']} MiB, load average {load_before[0]} -> {entry['load_average_after'][0]}",
                  flush=True)


def run(s: Settings, store: ResultStore) -> None:
    import aloepri

    from ..lib.targets import obfuscated

    target = obfuscated(model_path(s.model), aloepri.resolve_params(s.preset), s.seed)
    with tempfile.TemporaryDirectory(prefix="attack-ci-speed-") as tmp:
        srcs = {"before": _baseline_src(s.baseline, Path(tmp) / "before"),
                "after": _baseline_src(s.current, Path(tmp) / "after") if s.current else REPO / "src"}
        if s.commands:
            _run_commands(s, store, target, srcs, tmp)
            return
        jobs = [(a, v) for a in s.attacks for v in s.versions] + ([("all", "after")] if s.suite else [])
        for attack, version in jobs:
            key = f"{'suite' if attack == 'all' else attack}/{version}"
            if store.has(key):
                continue
            with tempfile.TemporaryDirectory(prefix="run-", dir=tmp) as w:
                work = Path(w)
                argv = ["attack", attack, "--plain", s.model, "--obfuscated", str(target.model_dir), "--key",
                        str(target.key_path), "--budget", "ci", "--prompts", str(s.prompts), "--report-dir",
                        str(work / "attack"), "--quiet", "--threads", str(s.threads)]
                load_before = [round(x, 2) for x in os.getloadavg()]
                child, wall = _child(argv, srcs[version], work)
                report = json.loads((work / "attack" / "attack_report.json").read_text())
            entry = {"command": "aloepri " + " ".join(Path(a).name if a.startswith("/") else a for a in argv),
                     "code": s.baseline if version == "before" else "current", "wall_seconds": round(wall, 1),
                     "cpu_seconds": child["cpu_seconds"], "load_seconds": child["load_seconds"],
                     "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
                     "preset": s.preset}
            if attack == "all":
                entry["attacks"] = {r["attack"]: _result(r) for r in report["results"]}
                entry["attack_seconds"] = round(sum(r["seconds"] for r in report["results"]), 1)
            else:
                entry.update(_result(report["results"][0]))
            store.put(key, entry)
            print(f"{key}: wall {entry['wall_seconds']} s, load average {load_before[0]} -> "
                  f"{entry['load_average_after'][0]}", flush=True)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _commands_report(e: dict) -> str:
    rows = []
    for command in ("attack_all", "audit_all"):
        b, a = e.get(f"{command}/before"), e.get(f"{command}/after")
        if a is None and b is None:
            continue
        shown = a or b  # one version alone: its attacks, the other's column empty
        rows += [f"`{shown['command']}`", "",
                 "| code | CPU s | wall s | peak RSS MiB | load avg (before run) |", "|---|---|---|---|---|"]
        rows += [f"| {v} ({x['code'][:7]}) | {x['cpu_seconds']:.0f} | {x['wall_seconds']:.0f} | {x['peak_rss_mib']} | "
                 f"{x['load_average_before'][0]} |" for v, x in (("before", b), ("after", a)) if x is not None]
        rows += ["", "| attack | s before / after | CPU s after | TTRSR % before / after | PIIRSR % before / after |",
                 "|---|---|---|---|---|"]
        for name, shown_r in sorted(shown["attacks"].items(), key=lambda kv: -(kv[1].get("seconds") or 0)):
            r = (a or {}).get("attacks", {}).get(name, {})
            p = (b or {}).get("attacks", {}).get(name, {})
            if r.get("seconds") is None and p.get("seconds") is None:
                continue  # planned but not run at this budget (the audit lists it as skipped)
            cpu = "-" if r.get("cpu_seconds") is None else f"{r['cpu_seconds']:.0f}"
            dash = lambda v: "-" if v is None else v  # noqa: E731
            rows.append(f"| {name} | {dash(p.get('seconds'))} / {dash(r.get('seconds'))} | {cpu} | "
                        f"{_pct(p.get('ttrsr'))} / {_pct(r.get('ttrsr'))} | {_pct(p.get('piirsr'))} / "
                        f"{_pct(r.get('piirsr'))} |")
        rows.append("")
    return "\n".join(rows).strip()


def report(store: ResultStore) -> str:
    e = store.entries()
    if any(k.startswith(("attack_all/", "audit_all/")) for k in e):
        return _commands_report(e)
    rows = ["| attack | before s | after s | after / before | child CPU s before / after | TTRSR % before / after | "
            "PIIRSR % before / after | load avg (before run, after run) |", "|---|---|---|---|---|---|---|---|"]
    for key in sorted(k for k in e if k.endswith("/before")):
        name = key.split("/")[0]
        b, a = e[key], e.get(f"{name}/after")
        if a is None:
            continue
        rows.append(f"| {name} | {b['seconds']:.0f} | {a['seconds']:.0f} | {a['seconds'] / b['seconds']:.2f} | "
                    f"{b['cpu_seconds']:.0f} / {a['cpu_seconds']:.0f} | {_pct(b['ttrsr'])} / {_pct(a['ttrsr'])} | {_pct(b['piirsr'])} / {_pct(a['piirsr'])} | "
                    f"{b['load_average_before'][0]}, {a['load_average_before'][0]} |")
    if len(rows) == 2:  # no attack timed before and after
        rows = []
    if "suite/after" in e:
        s = e["suite/after"]
        rows += [f"`attack all --budget ci`, current code: wall {s['wall_seconds'] / 60:.1f} min, CPU "
                 f"{s['cpu_seconds'] / 60:.1f} min, loading {s['load_seconds']:.0f} s, attacks {s['attack_seconds']:.0f} s, "
                 f"load average {s['load_average_before'][0]} -> {s['load_average_after'][0]}", "",
                 "| attack | seconds | TTRSR % | PIIRSR % |", "|---|---|---|---|"]
        for name, r in sorted(s["attacks"].items(), key=lambda kv: -kv[1]["seconds"]):
            rows.append(f"| {name} | {r['seconds']:.0f} | {_pct(r['ttrsr'])} | {_pct(r['piirsr'])} |")
    return "\n".join(rows).strip()


SUMMARY = ("per-attack seconds and TTRSR of `attack NAME --budget ci` on SmolLM2, baseline code against the current "
           "code side by side in one run, and the whole `attack all --budget ci`")
CONFIGS = {"isa_attention": Settings(),
           "anchor-ridge": Settings(attacks=("isa_anchor", "ridge-k1000", "freq-ridge")),
           "suite": Settings(attacks=(), suite=True),
           # the code before the shared per-target results, the KV-cached ISA beam and the ci samples
           "commands-attack": Settings(attacks=(), commands=("attack_all",),
                                       baseline="54306966aa61aa222f2ff90bac0414006a01149d"),
           # the current code's run alone (the baseline's is in commands-attack), for a run started beside it
           "commands-attack-current": Settings(attacks=(), commands=("attack_all",), versions=("after",),
                                               baseline="54306966aa61aa222f2ff90bac0414006a01149d"),
           # the shared tokenization (corpora.encode_text) and VMA's numpy sort against the code before them
           "commands-attack-shared": Settings(attacks=(), commands=("attack_all",),
                                              baseline="8f8232af743748bee134f1505383ad2883ce6b1f",
                                              current="8f7ed45c7fce31967ad78b45e31667b1d29704ca"),
           # the same with the .gguf config parsed once (plain_model.source_config) too: its run alone, the baseline's
           # is in commands-attack-shared
           "commands-attack-shared-after": Settings(attacks=(), commands=("attack_all",), versions=("after",),
                                                    baseline="8f8232af743748bee134f1505383ad2883ce6b1f",
                                                    current="de27246278d12c1b32c9aa6b66f6e169fab0c7d1"),
           "commands-audit": Settings(attacks=(), commands=("audit_all",),
                                      baseline="54306966aa61aa222f2ff90bac0414006a01149d"),
           "smoke": Settings(attacks=("gate-ia",))}
DOCS = ("README.md", "docs/performance.md")
NOTES = "a shared 2-core machine: the load average is recorded; before and after run back to back per attack"
