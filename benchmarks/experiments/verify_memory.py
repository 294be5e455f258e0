"""Peak memory of `aloepri verify` and `aloepri eval fidelity`: one model in memory at a time against both side by
side (what verify did before), with the numbers of the two checked equal, and the figure this implies for 8B and 14B
models.

The model is obfuscated (``preset``, output ``dtype``) in a child process into a temporary directory; each mode then
runs in a fresh child (benchmarks.lib.verify_child) whose peak RSS (VmHWM) is its own:
- ``verify``: `aloepri verify` as shipped: the plaintext model's logits and greedy continuations are taken, it is
  freed, the obfuscated model loads; a .gguf plaintext model is dequantized tensor by tensor into the model;
- ``both``: the plaintext and the obfuscated model loaded side by side, then ``compare`` (the earlier verify; the
  plaintext model now comes through the same tensor-by-tensor GGUF loader, so this is its floor);
- ``eval-fidelity`` / ``eval-fidelity-both``: the same for `aloepri eval fidelity` (prompts, then a corpus of
  ``prompts`` texts of 64 tokens; the one-at-a-time path keeps the plaintext logits in a temporary directory).

Both models are computed in float32, whatever the output's dtype (verify loads the checkpoint as float32), so the
peak of the one-at-a-time path is about one float32 model plus the largest dequantized tensor. The 8B / 14B figures
are an extrapolation, linear in the parameter count, from the largest model measured: (peak - RSS after imports) per
parameter, times 8.03e9 (Llama-3-8B) or 14.8e9 (Qwen2.5-14B), plus the import RSS.

A ``max_rss_gib`` watchdog kills a child whose RSS passes it (recorded as such): the machine is shared.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.provenance import REPO

EXTRAPOLATE = {"8B (Llama-3-8B, 8.03e9 parameters)": 8.03e9, "14B (Qwen2.5-14B, 14.8e9 parameters)": 14.8e9}


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    preset: str = "default"
    dtype: str = "float32"  # the obfuscated checkpoint's dtype (verify computes in float32 either way)
    modes: tuple[str, ...] = ("verify", "both", "eval-fidelity", "eval-fidelity-both")
    prompts: int = 4
    greedy_tokens: int = 8
    threads: int = 2
    max_rss_gib: float = 12.0  # watchdog: a child above this is killed


def parameter_count(path: Path) -> int:
    """Parameters the source file stores (a tied head counted once)."""
    from aloepri.obfuscation.checkpoint import open_checkpoint

    ck = open_checkpoint(path)
    try:
        return sum(math.prod(ck.tensor_shape(n)) for n in ck.tensor_names())
    finally:
        ck.close()


def run_child(argv: list[str], max_rss_gib: float, threads: int) -> dict:
    """One child with an RSS watchdog: its last stdout line as JSON, or {"killed_above_gib": ...}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env, cwd=REPO)
        killed = False
        while proc.poll() is None:
            if _rss_gib(proc.pid) > max_rss_gib:
                proc.send_signal(signal.SIGKILL)
                killed = True
            time.sleep(0.5)
        if killed:
            return {"killed_above_gib": max_rss_gib}
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{argv[2:4]} failed ({proc.returncode}):\n{err.read()[-3000:]}")
        return json.loads(out.read().strip().splitlines()[-1])


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run(s: Settings, store: ResultStore) -> None:
    todo = [m for m in s.modes if not store.has(f"{s.model}|{s.dtype}|{m}")]
    if not todo:
        print("all modes measured")
        return
    src = model_path(s.model)
    params = parameter_count(src)
    with tempfile.TemporaryDirectory(prefix="verify-memory-") as work:
        server, key = Path(work) / "server", Path(work) / "client.key"
        t = time.perf_counter()
        obf = subprocess.run([sys.executable, "-m", "aloepri.cli", "obfuscate", str(src), str(server), "--key-out",
                              str(key), "--preset", s.preset, "--dtype", s.dtype, "--quiet"],
                             capture_output=True, text=True, cwd=REPO)
        if obf.returncode:
            raise RuntimeError(f"obfuscation failed:\n{obf.stderr[-3000:]}")
        print(f"obfuscated {s.model} ({s.preset}, {s.dtype}) in {time.perf_counter() - t:.0f} s", flush=True)
        output_bytes = sum(f.stat().st_size for f in server.iterdir())
        for mode in todo:
            r = run_child([sys.executable, "-m", "benchmarks.lib.verify_child", mode, str(src), str(server), str(key),
                           str(s.prompts), str(s.greedy_tokens), str(s.threads)], s.max_rss_gib, s.threads)
            store.put(f"{s.model}|{s.dtype}|{mode}", {"model": s.model, "preset": s.preset, "dtype": s.dtype,
                                                      "parameters": params, "output_bytes": output_bytes,
                                                      "prompts": s.prompts, "greedy_tokens": s.greedy_tokens,
                                                      "threads": s.threads, **r})
            peak = f"{r['peak_rss_mib'] / 1024:.2f} GiB" if "peak_rss_mib" in r else f"killed above {s.max_rss_gib} GiB"
            print(f"{s.model} {mode}: peak RSS {peak}, {r.get('seconds', 0):.0f} s", flush=True)


def per_parameter_bytes(e: dict) -> float:
    return (e["peak_rss_mib"] - e["imports_rss_mib"]) * 2**20 / e["parameters"]


def report(store: ResultStore) -> str:
    entries = store.entries()
    rows = ["| model | parameters | output dtype | mode | peak RSS | above imports, bytes per parameter | time | "
            "top-1 | mean KL | greedy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, e in entries.items():
        model, dtype, mode = key.split("|")
        if "peak_rss_mib" not in e:
            rows.append(f"| {model} | {e['parameters'] / 1e9:.2f}B | {dtype} | {mode} | killed above "
                        f"{e['killed_above_gib']} GiB | | | | | |")
            continue
        fid = e["result"] if "top1_agreement" in e["result"] else e["result"]["prompts"]
        rows.append(f"| {model} | {e['parameters'] / 1e9:.2f}B | {dtype} | {mode} | {e['peak_rss_mib'] / 1024:.2f} GiB "
                    f"| {per_parameter_bytes(e):.2f} | {e['seconds']:.0f} s | {fid['top1_agreement']:.4f} | "
                    f"{fid['mean_kl']:.2e} | {fid['greedy_match_rate']:.2f} |")
    out = ["\n".join(rows)]
    same = _same_numbers(entries)
    if same:
        out.append("Numbers equal between one-at-a-time and side-by-side: " + "; ".join(same) + ".")
    out.append(_extrapolation(entries))
    return "\n\n".join(x for x in out if x)


def _same_numbers(entries: dict) -> list[str]:
    lines = []
    for key, e in entries.items():
        model, dtype, mode = key.split("|")
        other = entries.get(f"{model}|{dtype}|{mode}-both" if mode.startswith("eval") else f"{model}|{dtype}|both")
        if mode in ("verify", "eval-fidelity") and other and "result" in e and "result" in other:
            lines.append(f"{model} {dtype} {mode}: {'yes' if e['result'] == other['result'] else 'NO'}")
    return lines


def _extrapolation(entries: dict) -> str:
    lines = []
    for mode in ("verify", "both"):
        measured = [e for k, e in entries.items() if k.endswith(f"|{mode}") and "peak_rss_mib" in e]
        if not measured:
            continue
        e = max(measured, key=lambda x: x["parameters"])
        b = per_parameter_bytes(e)
        est = ", ".join(f"{name}: {(e['imports_rss_mib'] * 2**20 + b * n) / 2**30:.0f} GiB"
                        for name, n in EXTRAPOLATE.items())
        lines.append(f"- `{mode}`, extrapolated from {e['model']} ({e['parameters'] / 1e9:.2f}B parameters, "
                     f"{b:.2f} bytes per parameter above the imports): {est}.")
    if not lines:
        return ""
    return ("Extrapolation (linear in the parameter count, float32 compute; not measured):\n" + "\n".join(lines))


SUMMARY = "peak RSS of verify / eval fidelity, one model at a time against both side by side; 8B/14B extrapolated"
CONFIGS = {
    "smollm2": Settings(),
    # only the one-at-a-time modes: side by side would need about 14 GiB (13.9 GB measured for verify before it held one model at a time)
    "qwen-coder-1.5b": Settings(model="qwen-coder-1.5b", dtype="bfloat16", modes=("verify",), max_rss_gib=10.0),
}
DOCS = ("docs/performance.md",)
NOTES = ("smollm2: about 5 minutes on a quiet 2-core machine; qwen-coder-1.5b: about 2 minutes to obfuscate (3.5 GB "
         "of bfloat16 in a temporary directory) and a verify whose peak is about 8.5 GiB")
