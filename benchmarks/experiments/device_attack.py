"""Wall time of `aloepri attack` (behavioural + VMA + isa_anchor) per device, and of the behavioural attack per probe
batch, measured side by side in one run.

Each configuration is the real command (`python -m aloepri.cli attack ... --device D --batch N`) in its own process,
timed from start to exit (model loading included), with the per-attack seconds, TTRSR and vocabulary recovery read
back from its report, so a change of result across batches or devices shows beside the change of speed. The
configurations of one run are interleaved (device by device, batch by batch, in the order given), so a ratio
compares runs minutes apart on the same machine; compare ratios, not absolute seconds, across machines.

VMA and isa_anchor do not depend on the probe batch: they run once per device; `behavioural` runs once per batch.
Batch "default" is each stage's own batch (16 sequences per output-profile forward, all generation prompts at once,
128 for the input-side re-ranking); batch 1 is the unbatched path. Rows keyed ``device/batch/attacks``.

The ``synthetic`` plan (configs ``synthetic-cuda`` and ``synthetic-cpu``) needs no model download and no network, for a
GPU machine that gets a copy of the working tree: it writes a random-weight checkpoint of a published shape at its
real width (``model`` = ``synthetic:FAMILY``, aloepri.testing.synthetic; depth and vocabulary reduced) on the spot,
then per device (benchmarks.lib.device_child): obfuscates it with the products on that device and checks
equivalence there (plaintext against obfuscated logits; row ``device/equivalence``), and runs the behavioural
attack (budget ci, random prompts, a stand-in chat template: the checkpoint has no tokenizer) per probe batch (rows
``device/batch/behavioural``). The same obfuscated model (built on the CPU) is attacked on every device.
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
from ..lib.provenance import REPO

WEIGHT_ATTACKS = "vma,isa_anchor"  # batch-independent


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"  # a bundled model's name, or a Hugging Face Llama/Qwen2 directory or GGUF file
    preset: str = "exact"  # obfuscation preset of the attacked model (seed 1234)
    devices: tuple[str, ...] = ("cpu",)
    batches: tuple[str, ...] = ("1", "default", "64")  # behavioural probe batches ("default" = the stages' own)
    budget: str = "ci"
    prompts: int = 10
    threads: int = 2
    plan: str = "cli"  # "cli": `aloepri attack` on a model with a tokenizer; "synthetic": see the module doc
    synthetic_layers: int = 2
    synthetic_vocab: int = 16384


def source(model: str) -> Path:
    from ..lib.models import model_path

    path = Path(model)
    return path if path.exists() else model_path(model)


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
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((report_dir / "attack_report.json").read_text())
    vocab_keys = ("vocab_recovery", "vocab_recovery_sampled", "vocab_recovery_from_mapped_embedding")
    attacks = {r["attack"]: {"seconds": round(r["seconds"], 2), "ttrsr": r["ttrsr"], "piirsr": r["piirsr"],
                             "vocab_recovery": next((r["metrics"][k] for k in vocab_keys if k in r["metrics"]), None),
                             "tokens_scored": r["metrics"].get("tokens_scored"),
                             "error": r["metrics"].get("error"), "ran_on": r["budget"].get("device"),
                             "peak_rss_gib": r["budget"].get("peak_rss_gib"),
                             "obfuscated_weights": r["budget"].get("obfuscated_weights")}
               for r in report["results"]}
    return {"command": " ".join(cmd[2:]), "device": device, "batch": batch, "wall_seconds": round(wall, 2),
            "attacks": attacks, "device_name": report["context"].get("device")}


def run(s: Settings, store: ResultStore) -> None:
    if s.plan == "synthetic":
        return run_synthetic(s, store)
    import aloepri
    from aloepri.storage.devices import describe_device

    from ..lib.targets import obfuscated

    src = source(s.model)
    names = {d: describe_device(d) for d in s.devices}  # refuses an absent device before any work
    t0 = time.perf_counter()
    built = obfuscated(src, aloepri.resolve_params(s.preset), 1234)
    print(f"obfuscated {src.name} ({s.preset}) in {time.perf_counter() - t0:.0f} s -> {built.model_dir}", flush=True)
    with tempfile.TemporaryDirectory(prefix="aloepri-device-bench-") as work:
        for dev in s.devices:
            plan = [(WEIGHT_ATTACKS, "default")] + [("behavioural", b) for b in s.batches]
            for i, (attacks, batch) in enumerate(plan):
                key = f"{dev}/{batch}/{attacks}"
                if store.has(key):
                    continue
                row = attack_once(src, built.model_dir, built.key_path, attacks, dev, batch, s.budget, s.prompts,
                                  s.threads, Path(work) / f"report-{dev.replace(':', '_')}-{i}")
                store.put(key, {**row, "model": src.name, "preset": s.preset, "device_description": names[dev]})
                print(json.dumps({k: row[k] for k in ("device", "batch", "wall_seconds", "attacks")}), flush=True)


def device_child(args: list[str], threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.device_child", *args, str(threads)],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"device_child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_synthetic(s: Settings, store: ResultStore) -> None:
    import aloepri
    from aloepri.storage.devices import describe_device
    from aloepri.testing.synthetic import write_synthetic_checkpoint

    from ..lib.targets import obfuscated

    names = {d: describe_device(d) for d in s.devices}  # refuses an absent device before any work
    with tempfile.TemporaryDirectory(prefix="aloepri-device-synthetic-") as work:
        if s.model.startswith("synthetic:"):
            src = write_synthetic_checkpoint(s.model.split(":", 1)[1], Path(work) / "src",
                                             num_layers=s.synthetic_layers, vocab_size=s.synthetic_vocab)
        else:
            src = source(s.model)
        built = obfuscated(src, aloepri.resolve_params(s.preset), 1234, work=Path(work) / "targets")
        for dev in s.devices:
            key = f"{dev}/equivalence"
            if not store.has(key):
                row = device_child(["equivalence", str(src), str(Path(work) / f"eq-{dev.replace(':', '_')}"), dev],
                                   s.threads)
                store.put(key, {**row, "device": dev, "model": s.model, "device_description": names[dev]})
                print(key, json.dumps(row), flush=True)
            for batch in s.batches:
                key = f"{dev}/{batch}/behavioural"
                if store.has(key):
                    continue
                row = device_child(["behavioural", str(src), str(built.model_dir), str(built.key_path), dev, batch],
                                   s.threads)
                store.put(key, {**row, "device": dev, "batch": batch, "model": s.model, "preset": s.preset,
                                "device_description": names[dev]})
                print(key, json.dumps(row), flush=True)


def rows_of(store: ResultStore) -> list[dict]:
    return [e for e in store.entries().values() if "attacks" in e]


def synthetic_report(entries: dict) -> str:
    lines = ["| device | row | seconds | result |", "|---|---|---|---|"]
    cpu_attack = {e["batch"]: e["attack_seconds"] for k, e in entries.items() if k.startswith("cpu/") and "batch" in e}
    for key, e in entries.items():
        if key.endswith("/equivalence"):
            lines.append(f"| {e['device']} | obfuscate + equivalence | obfuscate {e['obfuscate_seconds']:.1f} | "
                         f"top-1 {e['top1_agreement']:.4f}, relative logit error {e['relative_error']:.1e} |")
        else:
            speed = cpu_attack.get(e["batch"])
            vs_cpu = f", {speed / e['attack_seconds']:.2f}x the CPU's speed" if speed and e["device"] != "cpu" else ""
            lines.append(f"| {e['device']} | behavioural, batch {e['batch']} | {e['attack_seconds']:.1f} | TTRSR "
                         f"{e['ttrsr']:.2f}, vocabulary recovery {e['vocab_recovery']:.4f}{vs_cpu} |")
    return "\n".join(lines)


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


def report(store: ResultStore) -> str:
    entries = store.entries()
    if entries and all("attacks" not in e for e in entries.values()):
        return synthetic_report(entries)
    rows = rows_of(store)
    lines = ["| device | batch | attack | attack seconds | TTRSR | vocabulary recovery | process wall seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, a in r["attacks"].items():
            voc = "-" if a["vocab_recovery"] is None else f"{a['vocab_recovery']:.6g}"
            ttrsr = f"error: {a['error']}" if a.get("error") else f"{a['ttrsr']:.2f}"
            lines.append(f"| {r['device']} | {r['batch']} | {name} | {a['seconds']:.0f} | {ttrsr} | {voc} | "
                         f"{r['wall_seconds']:.0f} |")
    summary = summarise(rows)
    if summary:
        lines += ["", "```json", json.dumps(summary, indent=2), "```"]
    return "\n".join(lines)


SUMMARY = ("wall time of `aloepri attack` per device and behavioural probe batch, side by side in one run "
           "(~1 h on 2 CPU cores for SmolLM2)")
CONFIGS = {
    # docs/performance.md: 2 shared CPU cores, no GPU
    "smollm2-cpu": Settings(),
    # the same on a GPU machine, CPU beside it (for a model of a few B parameters: --set model=DIR --save-as ...)
    "smollm2-cuda": Settings(devices=("cpu", "cuda"), batches=("1", "default", "128"), threads=16),
    # for a GPU machine with no download and no network: Llama-3.1-8B's width (d 4096, ff 14336), 2 layers, 16k vocabulary
    "synthetic-cuda": Settings(model="synthetic:llama-3.1-8b", preset="default", devices=("cuda", "cpu"),
                               batches=("default", "128"), threads=16, plan="synthetic"),
    # the same with Llama-3.1's full vocabulary and 4 layers (measured on one H100)
    "synthetic-cuda-vocab128k": Settings(model="synthetic:llama-3.1-8b", preset="default", devices=("cuda", "cpu"),
                                         batches=("default", "128"), threads=16, plan="synthetic",
                                         synthetic_layers=4, synthetic_vocab=128256),
    "synthetic-cpu": Settings(model="synthetic:llama-3.1-8b", preset="default", batches=("default",),
                              plan="synthetic"),
}
DEFAULT_CONFIG = "smollm2-cpu"
DOCS = ("docs/performance.md",)
NOTES = "each configuration is its own `aloepri attack` process; no config takes under a few minutes"
