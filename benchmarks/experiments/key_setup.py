"""Time and peak memory of what an obfuscation does before its first block, split into its parts, at full widths.

The parts (plan_obfuscation): validating the source, the outlier scan (every layer's down projection read for its
row energies), and the key: Algorithm 1's INIT (two Haar QRs and B's inverse at width d), the shared P = s B Z,
Q's common part Z^T B^-1 / s (drawn before the first reader), kappa and the vocabulary permutation. The key is
drawn at the `default` preset (h = 0, 4 outlier dimensions kept) as `aloepri obfuscate` draws it: numpy float64
inside keymat.single_threaded_blas().

Each code state runs in a fresh child (benchmarks/lib/key_child.py, run by path: its own VmHWM, reset per part),
with a float32 2048^3 GEMM probed in the same child before and after, on the same thread count. With ``before``
set to a git revision, the key is also drawn by that revision's code (exported to a temporary directory), in the
same run, side by side, and the sha256 of every secret of both is compared: a faster key must give the same bits.
``threads_check`` draws the current code's key once more with one worker thread: the same bits again.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore

FAMILY_OF_WIDTH = {4096: "llama-3.1-8b", 5120: "qwen2.5-14b", 7168: "deepseek-v3.1", 8192: "llama-3.1-70b"}


@dataclass(frozen=True)
class Settings:
    widths: tuple[int, ...] = (4096, 5120, 7168, 8192)
    before: str | None = "bf08f2d"  # git revision whose key code runs side by side (None: the current code only)
    threads: int = 2
    threads_check: bool = True
    checkpoint: bool = True  # also validate and outlier-scan a 1-layer synthetic checkpoint of the width's family


CONFIGS = {"widths": Settings(), "key-only": Settings(widths=(8192, 7168), threads_check=False, checkpoint=False)}
SUMMARY = ("before the first block at full widths: validation, outlier scan and the key's parts, time and peak "
           "memory, side by side with an older revision, same bits checked (minutes per width)")
DOCS = ("docs/performance.md",)


def _run_child(pythonpath, d: int, threads: int, workers: str, src: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    import time

    from ..lib import key_child

    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, key_child.__file__, str(d), str(threads), workers, src],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["child_wall_seconds"] = time.perf_counter() - t
    r["float32_gemm_gflops"] = sum(r["float32_probe_gflops"]) / len(r["float32_probe_gflops"])
    r["key_seconds"] = sum(p["seconds"] for k, p in r["parts"].items() if k.startswith("key"))
    return r


def run(s: Settings, store: ResultStore) -> None:
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from aloepri.testing.synthetic import write_synthetic_checkpoint

    from ..lib.provenance import REPO

    with tempfile.TemporaryDirectory(prefix="aloepri-key-setup-") as tmp:
        before_src = None
        if s.before:
            archive = subprocess.run(["git", "archive", s.before, "src"], cwd=REPO, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            before_src = Path(tmp) / "src"
        for d in s.widths:
            if store.has(str(d)):
                continue
            entry, src = {"before_revision": s.before}, "-"
            try:
                if s.checkpoint:
                    src = Path(tmp) / f"{FAMILY_OF_WIDTH[d]}-L1"
                    write_synthetic_checkpoint(FAMILY_OF_WIDTH[d], src, num_layers=1, vocab_size=4096)
                    entry["family"] = FAMILY_OF_WIDTH[d]
                if before_src is not None:
                    entry["before"] = _run_child(before_src, d, s.threads, "-", "-")
                entry["after"] = _run_child(REPO / "src", d, s.threads, "-", str(src))
                if s.threads_check:
                    entry["after_one_worker"] = _run_child(REPO / "src", d, s.threads, "1", "-")
            finally:
                if src != "-":
                    shutil.rmtree(src, ignore_errors=True)
            digests = [entry[k]["sha256_16"] for k in ("before", "after", "after_one_worker") if k in entry]
            entry["same_secrets"] = all(x == digests[0] for x in digests)
            if "before" in entry:
                entry["key_speedup"] = entry["before"]["key_seconds"] / entry["after"]["key_seconds"]
            store.put(str(d), entry)
            print(f"d={d}: " + _line(entry), flush=True)


def _line(e: dict) -> str:
    parts = []
    for k in ("before", "after", "after_one_worker"):
        if k in e:
            r = e[k]
            parts.append(f"{k} key {r['key_seconds']:.1f} s, peak {r['peak_rss_mib']:.0f} MiB, probes "
                         f"{r['float32_gemm_gflops']:.0f} GFLOP/s, load {r['loadavg_1min'][0]:.1f}")
    speed = f"; key {e['key_speedup']:.2f}x faster" if "key_speedup" in e else ""
    return "; ".join(parts) + f"; same secrets: {e['same_secrets']}{speed}"


def report(store: ResultStore) -> str:
    return "\n".join(f"- d = {k}: {_line(e)}" for k, e in store.entries().items()
                     if k.isdigit() and isinstance(e, dict)) or "(nothing stored)"
