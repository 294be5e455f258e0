"""`aloepri audit` on a real model obfuscated with the lossless setting (the exact transforms, h = 0, the four
massive-activation dimensions kept out of the key's mixing: no noise; the `default` preset), recorded as one entry
``report`` (the audit's report.json, with local paths reduced to file names): SmolLM2-135M-Instruct at `ci`
(config ``ci``) and Qwen2.5-Coder-1.5B-Instruct at `small`, the audit's default budget for a user (config
``qwen-coder-1.5b-small``). The report holds each step's peak RSS.

The done-criterion of the audit: on this setting it must report >= 90% of prompt tokens recovered (the behavioural
attack and weight matching read the prompts there), and < 90% only where its attacks truly fail. ``existing``
(a report directory written by `aloepri audit` on that setting) records an audit already run instead.

With ``engine`` set, the audit is the real command (``aloepri audit ... --engine E``) in a fresh child process
(benchmarks.lib.command_child), and the entry ``process`` holds its wall and CPU seconds (every thread) and peak
RSS (VmHWM), model loading included: the figures a user's run would show.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore


@dataclass(frozen=True)
class Settings:
    budget: str = "ci"
    threads: int = 1
    existing: str = ""  # a report directory of `aloepri audit` to record instead of running one
    model: str = "smollm2"
    # 0: obfuscate afresh with a random seed, as a user would; else the benchmarks' cached checkpoint of this seed
    # and output dtype (benchmarks.lib.targets: the 1.5B model takes 10 min to obfuscate)
    seed: int = 0
    dtype: str = ""
    engine: str = ""  # "": run_audit in this process (torch); else `aloepri audit --engine ENGINE` in a child
    all_attacks: bool = False
    device: str = "cpu"  # the child's --device (cuda: the torch engine on the GPU)
    # a random-weight checkpoint of a published shape instead of a bundled model (aloepri.testing.synthetic:
    # FAMILY, its depth and vocabulary; 0 = as published), written once into the benchmarks' cache
    synthetic: str = ""
    synthetic_layers: int = 0
    synthetic_vocab: int = 0
    # an attack run after the audit on the same output and engine (`aloepri attack NAME`), the positive control
    # where the audit's verdict comes from another attack (Gate-IA reads an `exact` output before the models run)
    control: str = ""


def shorten_paths(report: dict) -> dict:
    """Local paths -> their last component (the record is read on other machines)."""
    out = json.loads(json.dumps(report))
    for k, v in out["inputs"].items():
        out["inputs"][k] = Path(v).name
    out["parameters"]["source"] = Path(out["parameters"]["source"]).name
    if out.get("command"):
        out["command"] = " ".join(Path(w).name if w.startswith("/") else w for w in out["command"].split())
    return out


def run(s: Settings, store: ResultStore) -> None:
    if store.has("report"):
        return
    if s.existing:
        report = json.loads((Path(s.existing) / "report.json").read_text())
    else:
        import aloepri
        from aloepri.audit import run_audit

        from ..lib.models import model_path

        src = synthetic_source(s) if s.synthetic else model_path(s.model)
        params = aloepri.resolve_params("exact", h=0, outlier_dims=4)
        output = {"dtype": s.dtype} if s.dtype else {}
        with tempfile.TemporaryDirectory(prefix="audit-") as work:
            w = Path(work)
            if s.seed:
                from ..lib.targets import obfuscated

                t = obfuscated(src, params, s.seed, **output)
                server, key = t.model_dir, t.key_path
            else:
                server, key = w / "server", w / "client.key"
                aloepri.obfuscate(src, server, key, params, progress=False, **output)
            if s.engine:
                process, report = _audit_child(s, src, server, key, w)
                store.put("process", process)
                if s.control:
                    store.put("report", shorten_paths(report))  # kept whatever the control does
                    try:
                        store.put("control", _control_child(s, src, server, key, w))
                    except RuntimeError as e:
                        store.put("control", {"attack": s.control, "failed": str(e)[-600:]})
            else:
                report = run_audit(src, server, key, s.budget, w / "report", threads=s.threads, progress=False,
                                   log=print,
                                   command=f"aloepri audit {src.name} --obfuscated server --key client.key "
                                           f"--budget {s.budget} --out report --threads {s.threads}").data
    params = report["parameters"]["params"]
    if not (params["h"] == 0 and params["alpha_e"] == 0 and params["alpha_h"] == 0 and params["outlier_dims"] == 4):
        raise ValueError(f"not the lossless setting: {params}")
    store.put("report", shorten_paths(report))
    print(f"worst {report['worst_prompt_token_recovery']} ({report['worst_attack']}), {report['time']['seconds']} s")


def synthetic_source(s: Settings) -> Path:
    """The random-weight checkpoint of ``s.synthetic`` (written shard by shard on first use, then reused)."""
    import shutil

    from aloepri.testing.synthetic import write_synthetic_checkpoint

    from ..lib.targets import WORK

    out = Path(WORK) / f"synthetic-{s.synthetic}-{s.synthetic_layers or 'all'}-{s.synthetic_vocab or 'full'}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_checkpoint(s.synthetic, tmp, num_layers=s.synthetic_layers or None,
                                   vocab_size=s.synthetic_vocab or None)
        tmp.rename(out)
    return out


def _run_child(argv: list[str], out: Path, what: str, echo: bool = False) -> dict:
    """One ``aloepri`` command in a fresh child (benchmarks.lib.command_child): its wall and CPU seconds, loading,
    peak RSS, the load average around it and the command with local paths shortened."""
    import subprocess
    import sys

    from ..lib.provenance import REPO

    load_before = [round(x, 2) for x in os.getloadavg()]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.command_child", str(out), "--", *argv], cwd=REPO,
                          capture_output=True, text=True)
    if echo:
        print(proc.stdout[-2000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"aloepri {what} failed ({proc.returncode}): {proc.stderr[-2500:]}")
    child = json.loads(out.read_text())
    return {"wall_seconds": child["seconds"], "cpu_seconds": child["cpu_seconds"],
            "load_seconds": child["load_seconds"], "peak_rss_gib": round(child["peak_rss_mib"] / 1024, 2),
            "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "command": "aloepri " + " ".join(Path(a).name if a.startswith("/") else a for a in argv)}


def _audit_child(s: Settings, src: Path, server: Path, key: Path, work: Path) -> tuple[dict, dict]:
    argv = ["audit", str(src), "--obfuscated", str(server), "--key", str(key), "--budget", s.budget, "--out",
            str(work / "report"), "--threads", str(s.threads), "--engine", s.engine, "--quiet"] + \
        (["--all-attacks"] if s.all_attacks else []) + (["--device", s.device] if s.device != "cpu" else [])
    process = _run_child(argv, work / "child.json", "audit", echo=True)
    return process, json.loads((work / "report" / "report.json").read_text())


def _control_child(s: Settings, src: Path, server: Path, key: Path, work: Path) -> dict:
    """``aloepri attack CONTROL`` on the audited output, on the same engine, in a child: its recovery and cost."""
    argv = ["attack", s.control, "--plain", str(src), "--obfuscated", str(server), "--key", str(key), "--budget",
            s.budget, "--threads", str(s.threads), "--engine", s.engine, "--report-dir", str(work / "control"),
            "--quiet"] + (["--device", s.device] if s.device != "cpu" else [])
    process = _run_child(argv, work / "control.json", f"attack {s.control}")
    (res,) = json.loads((work / "control" / "attack_report.json").read_text())["results"]
    out = {"attack": res["attack"], "ttrsr": res["ttrsr"], "piirsr": res["piirsr"],
           "vocab_recovery": res.get("metrics", {}).get("vocab_recovery"), **process}
    if res["ttrsr"] is None:  # ran and gave no figure: say why (the attack's own words)
        out["no_figure"] = str(res.get("reason") or res.get("error") or res.get("status") or "no figure returned")
    return out


def peak_rss_gib(report: dict, process: dict | None) -> float:
    """The whole command's peak RSS: the highest of the child's count and every step's own (runs before the child
    read the count before each step's restart of it stored only the last step's)."""
    steps = [(a.get("attack_budget") or {}).get("peak_rss_gib") for a in report["attacks"]] + \
        [report.get("fidelity", {}).get("peak_rss_gib")]
    return max([x for x in steps if x] + ([process["peak_rss_gib"]] if process else []))


def report(store: ResultStore) -> str:
    r = store.get("report")
    if r is None:
        return "(no audit stored)"
    proc = store.get("process")
    engine = r.get("engine") or {"name": "torch", "why": "(before --engine: both models in process, float32)"}
    lines = [r["verdict"]["headline"], "",
             f"budget {r['budget']}, complete {r['complete']}, {r['time']['seconds']:.0f} s; command: `{r['command']}`",
             f"engine {engine['name']}: {engine['why']}" + (
                 f"; the whole command: {proc['wall_seconds'] / 60:.1f} min wall, {proc['cpu_seconds'] / 60:.1f} min "
                 f"CPU, peak RSS {peak_rss_gib(r, proc):.2f} GiB" if proc else ""),
             "", "| attack | observer | status | TTRSR (%) | PIIRSR (%) | seconds | peak RSS (GiB) |",
             "|---|---|---|---|---|---|---|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    ctl = store.get("control")
    if ctl and ctl.get("failed"):
        lines.insert(3, f"positive control `{ctl['attack']}` did not run: {ctl['failed'].strip().splitlines()[-1]}")
    elif ctl and ctl.get("ttrsr") is None:
        why = ctl.get("no_figure", "no reason recorded")
        lines.insert(3, f"positive control: `{ctl['command']}` gave no figure ({why}): the positive control "
                        "failed")
    elif ctl:
        lines.insert(3, f"positive control: `{ctl['command']}` read {100 * ctl['ttrsr']:.1f}% of the prompt tokens "
                        f"({ctl['wall_seconds'] / 60:.1f} min wall, {ctl['cpu_seconds'] / 60:.1f} min CPU, peak RSS "
                        f"{ctl['peak_rss_gib']:.2f} GiB)")
    fid = r.get("fidelity", {})
    if fid.get("status") == "ran":
        where = f", {fid['engine']}, {fid.get('models_held', 'both models held')}" if fid.get("engine") else ""
        lines.append(f"| (fidelity: top-1 {fid['top1_agreement']:.4f}{where}) | - | ran | - | - | {fid.get('seconds', '-')} | "
                     f"{fid.get('peak_rss_gib') or '-'} |")
    for a in r["attacks"]:
        why = f" ({a['why']})" if a["status"] == "skipped" and a.get("why") else ""
        lines.append(f"| {a['name']} | {a['observer']} | {a['status']}{why} | {pct(a.get('ttrsr'))} | "
                     f"{pct(a.get('piirsr'))} | {a.get('seconds') or '-'} | "
                     f"{(a.get('attack_budget') or {}).get('peak_rss_gib') or '-'} |")
    return "\n".join(lines)


SUMMARY = ("`aloepri audit` on a real model obfuscated losslessly (SmolLM2 at ci, ~20 min; the 1.5B model at small): "
           "it must report the prompts as read")
CONFIGS = {"ci": Settings(),
           # the 1.5B model (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M) at the default budget, on the bfloat16 output
           # `aloepri obfuscate` writes from it (the cached `default` checkpoint of llamacpp_quantized)
           "qwen-coder-1.5b-small": Settings(budget="small", threads=2, model="qwen-coder-1.5b", seed=2026,
                                             dtype="bfloat16"),
           # the same checkpoint, the same command, with the attacker on llama.cpp q8_0: the fidelity step and the
           # attacks that run the models on the engine, one model at a time
           "qwen-coder-1.5b-small-llamacpp": Settings(budget="small", threads=2, model="qwen-coder-1.5b", seed=2026,
                                                      dtype="bfloat16", engine="llamacpp-q8_0"),
           # the same, run again with nothing else on the machine (the load average is recorded)
           "qwen-coder-1.5b-small-llamacpp-idle": Settings(budget="small", threads=2, model="qwen-coder-1.5b",
                                                           seed=2026, dtype="bfloat16", engine="llamacpp-q8_0"),
           # the same with the fidelity step's greedy continuations decoded together (a code path since dropped: the
           # batch's numerics broke near-ties, greedy match 0.65 against 0.80 one prompt at a time) and the log
           # reader's model reading 6,000 candidates at small (12,000 before)
           "qwen-coder-1.5b-small-llamacpp-batched-greedy": Settings(budget="small", threads=2, model="qwen-coder-1.5b",
                                                                     seed=2026, dtype="bfloat16",
                                                                     engine="llamacpp-q8_0"),
           # the same with greedy decoding one prompt at a time again and the 6,000 model reads
           "qwen-coder-1.5b-small-llamacpp-fewer-reads": Settings(budget="small", threads=2, model="qwen-coder-1.5b",
                                                                  seed=2026, dtype="bfloat16", engine="llamacpp-q8_0"),
           # memory and time against size (docs/performance.md): the same command at `small` on each real model's
           # cached bfloat16 `default` output, torch (both models in process, float32) beside llama.cpp q8_0
           **{f"{m}-small-{tag}": Settings(budget="small", threads=2, model=m, seed=2026, dtype="bfloat16", engine=e)
              for m in ("smollm2", "qwen-coder") for tag, e in (("torch", "torch"), ("llamacpp", "llamacpp-q8_0"))},
           # the same at `ci`, the budget the guide gives a large model, beside the 8B shape at ci
           **{f"{m}-ci-{tag}": Settings(budget="ci", threads=2, model=m, seed=2026, dtype="bfloat16", engine=e)
              for m in ("smollm2", "qwen-coder", "qwen-coder-1.5b")
              for tag, e in (("torch", "torch"), ("llamacpp", "llamacpp-q8_0"))},
           # SmolLM2 at ci with every attack (none skipped as not needed), the command in a child: its CPU time
           "ci-all-attacks": Settings(threads=1, seed=2026, engine="torch", all_attacks=True),
           "ci-all-attacks-llamacpp": Settings(threads=1, seed=2026, engine="llamacpp-q8_0", all_attacks=True),
           # the prepared GPU command (docs/performance.md): a Llama-3.1-8B-shaped checkpoint (random weights, full
           # width and vocabulary, 8 of its 32 layers: what a device call's 10 minutes fit), audited at ci with the
           # torch engine on the GPU; and the same path at 2 layers and a 16k vocabulary on the CPU, how it is tested here
           "synthetic-8b-cuda": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b", synthetic_layers=8,
                                         seed=2026, engine="torch", device="cuda", threads=8),
           # the 8B shape on this machine: all 32 layers, the full vocabulary, llama.cpp q8_0, at ci
           "synthetic-8b-llamacpp": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b", seed=2026,
                                             engine="llamacpp-q8_0", threads=2, control="behavioural"),
           # the same width and vocabulary with 4 of the 32 layers: what fits a few hours of a 2-core machine
           "synthetic-8b-4layers-llamacpp": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b", synthetic_layers=4,
                                                     seed=2026, engine="llamacpp-q8_0", threads=2,
                                                     control="behavioural"),
           # the path end to end at 2 layers and a 16k vocabulary, with the behavioural attack as positive control
           "synthetic-8b-2layers-llamacpp": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b", synthetic_layers=2,
                                                     synthetic_vocab=16384, seed=2026, engine="llamacpp-q8_0",
                                                     threads=2, control="behavioural"),
           # the same after the weight attacks read their tensors streamed from the checkpoints (VMA loaded both
           # models in float32 before)
           "synthetic-8b-2layers-llamacpp-vma-streamed": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b",
                                                                  synthetic_layers=2, synthetic_vocab=16384, seed=2026,
                                                                  engine="llamacpp-q8_0", threads=2,
                                                                  control="behavioural"),
           "synthetic-8b-2layers-cpu": Settings(model="llama-3.1-8b", synthetic="llama-3.1-8b", synthetic_layers=2,
                                                synthetic_vocab=16384, seed=2026, engine="torch", threads=2)}
DOCS = ("docs/audit.md", "docs/performance.md")
NOTES = "CPU; obfuscates with a fresh random seed each run, as a user would"
