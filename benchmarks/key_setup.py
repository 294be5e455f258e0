"""Time and peak memory of what an obfuscation does before its first block, split into its parts, at full widths.

The parts (plan_obfuscation): validating the source, the outlier scan (every layer's down projection read for its
row energies), and the key: Algorithm 1's INIT (two Haar QRs and B's inverse at width d), the shared P = s B Z,
Q's common part Z^T B^-1 / s (drawn before the first reader), kappa and the vocabulary permutation. The key is
drawn at the `default` preset (h = 0, 4 outlier dimensions kept) as `aloepri obfuscate` draws it: numpy float64
inside keymat.single_threaded_blas().

Each code state runs in a fresh child (its own VmHWM; /proc/self/clear_refs resets it per part, so a part's peak
is its own), with a float32 2048^3 GEMM probed in the same child before and after, on the same thread count. With
--before REV the key is also drawn by the code of git revision REV (exported to a temporary directory), in the
same run, side by side, and the sha256 of every secret of both is compared: a faster key must give the same bits.
--threads-check draws the new code's key once more with one worker thread: the same bits again.

    python benchmarks/key_setup.py --label key-parallel --widths 4096 5120 7168 8192 --before HEAD~1
Results: benchmarks/results/key_setup.json, one entry per (label, width); an existing one is kept unless --force.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale_shapes import GEMM_PROBE  # noqa: E402  (benchmarks/ is the script's directory)

RESULTS = Path(__file__).parent / "results" / "key_setup.json"
REPO = Path(__file__).resolve().parent.parent
# one family per width, for the checkpoint parts (1 decoder layer, a 4096-token vocabulary)
FAMILY_OF_WIDTH = {4096: "llama-3.1-8b", 5120: "qwen2.5-14b", 7168: "deepseek-v3.1", 8192: "llama-3.1-70b"}

CHILD = r"""
import hashlib, json, os, sys, time
t_import = time.perf_counter()
import numpy as np, torch
from aloepri.obfuscation import keymat
from aloepri.obfuscation.params import PRESETS
from aloepri.obfuscation.secrets import ModelShape, SecretSampler

d, threads, workers, src = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(threads)
if workers != "-":
    keymat.key_workers = lambda: int(workers)  # the thread-count check: same code, one worker
""" + GEMM_PROBE + r"""

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

parts = {}
def part(name, fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss0, t = status("VmRSS"), time.perf_counter()
    out = fn()
    parts[name] = {"seconds": time.perf_counter() - t, "peak_rss_mib": status("VmHWM"),
                   "peak_above_start_mib": status("VmHWM") - rss0, "rss_after_mib": status("VmRSS")}
    return out

for _ in range(2):
    probe()
load0 = os.getloadavg()[0]
params = PRESETS["default"].replace(alpha_e=0.1, alpha_h=0.05)
outliers = tuple(range(3, 3 + params.outlier_dims))
if src != "-":
    from aloepri.obfuscation.checkpoint import open_checkpoint
    from aloepri.obfuscation.pipeline import massive_activation_dims, model_shape
    source = open_checkpoint(src)
    part("validate", source.validate)
    shape = model_shape(source.config, source.spec)
    scanned = part("outlier scan", lambda: massive_activation_dims(source, shape.num_layers, params.outlier_dims))
    parts["outlier scan"].update(layers=shape.num_layers, found=list(scanned))  # the key keeps 3..6: comparable
shape = ModelShape(d=d, vocab_size=128256, num_layers=1, num_heads=64, num_kv_heads=8, head_dim=128,
                   intermediate_size=4 * d, rope_base=1e6, qk_norm=False)
with keymat.single_threaded_blas():
    sampler = part("key: INIT and P", lambda: SecretSampler(1, params, shape, outliers))
    Q = part("key: Q common", lambda: sampler.reader_Q("q", 0))
    kappa = part("key: kappa", sampler.kappa)
    perm = part("key: vocabulary permutation", sampler.vocab_permutation)
for _ in range(2):
    probe()
b = sampler.base
digest = {name: hashlib.sha256(np.ascontiguousarray(m).tobytes()).hexdigest()[:16]
          for name, m in [("B", b.B), ("B_inv", b.B_inv), ("Z", b.Z), ("P", sampler._shared_P), ("Q", Q),
                          ("perm", perm)]}
digest["kappa"] = repr(kappa)
print(json.dumps({"parts": parts, "sha256_16": digest, "float32_probe_gflops": probes,
                  "loadavg_1min": [load0, os.getloadavg()[0]], "peak_rss_mib": status("VmHWM"),
                  "key_workers": keymat.key_workers() if hasattr(keymat, "key_workers") else 1,
                  "outliers": list(outliers)}))
"""


def run_child(pythonpath: Path, d: int, threads: int, workers: str, src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d), str(threads), workers, src], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["child_wall_seconds"] = time.perf_counter() - t
    r["float32_gemm_gflops"] = sum(r["float32_probe_gflops"]) / len(r["float32_probe_gflops"])
    r["key_seconds"] = sum(p["seconds"] for k, p in r["parts"].items() if k.startswith("key"))
    return r


def export_revision(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def summary(name: str, r: dict) -> str:
    parts = ", ".join(f"{k} {p['seconds']:.1f} s (+{p['peak_above_start_mib']:.0f} MiB)" for k, p in r["parts"].items())
    return (f"  {name}: key {r['key_seconds']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, probes "
            f"{r['float32_gemm_gflops']:.0f} GFLOP/s, load {r['loadavg_1min'][0]:.1f}/{r['loadavg_1min'][1]:.1f}\n"
            f"    {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--widths", type=int, nargs="+", default=sorted(FAMILY_OF_WIDTH))
    ap.add_argument("--before", default=None, help="git revision whose key code runs side by side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--threads-check", action="store_true", help="also draw the new key with one worker thread")
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                    help="key parts only (no synthetic checkpoint, no validation or outlier scan)")
    ap.add_argument("--workdir", default="/tmp/aloepri-key-setup")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    from aloepri.testing.synthetic import write_synthetic_checkpoint

    out = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": {}}
    run = out["runs"].setdefault(a.label, {})
    after_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
    run.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), threads=a.threads)
    workdir = Path(a.workdir)
    with tempfile.TemporaryDirectory() as tmp:
        before_src = export_revision(a.before, Path(tmp)) if a.before else None
        for d in a.widths:
            if str(d) in run and not a.force:
                continue
            entry, src = {"before_revision": a.before, "after_revision": after_rev}, "-"
            try:
                if a.checkpoint:
                    src = workdir / f"{FAMILY_OF_WIDTH[d]}-L1"
                    shutil.rmtree(src, ignore_errors=True)
                    write_synthetic_checkpoint(FAMILY_OF_WIDTH[d], src, num_layers=1, vocab_size=4096)
                    entry["family"] = FAMILY_OF_WIDTH[d]
                if before_src is not None:
                    entry["before"] = run_child(before_src, d, a.threads, "-", "-")
                    print(f"d={d}\n" + summary("before", entry["before"]), flush=True)
                entry["after"] = run_child(REPO / "src", d, a.threads, "-", str(src))
                print(f"d={d}\n" + summary("after", entry["after"]), flush=True)
                if a.threads_check:
                    entry["after_one_worker"] = run_child(REPO / "src", d, a.threads, "1", "-")
                    print(summary("after, one worker", entry["after_one_worker"]), flush=True)
            finally:
                if src != "-":
                    shutil.rmtree(src, ignore_errors=True)
            digests = [entry[k]["sha256_16"] for k in ("before", "after", "after_one_worker") if k in entry]
            entry["same_secrets"] = all(x == digests[0] for x in digests)
            if "before" in entry:
                entry["key_speedup"] = entry["before"]["key_seconds"] / entry["after"]["key_seconds"]
            print(f"  same secrets in every run: {entry['same_secrets']}" +
                  (f"; key {entry['key_speedup']:.2f}x faster" if "key_speedup" in entry else ""), flush=True)
            run[str(d)] = entry
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
