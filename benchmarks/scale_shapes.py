"""Obfuscation at the published widths of the paper's model families: time per block, GFLOP/s against a float32 GEMM
probed in the same process, peak RSS, and equivalence against the plaintext where memory allows.

For every family (aloepri.testing.synthetic.PUBLISHED_CONFIGS) a random-weight bf16 checkpoint with the real
hidden, feed-forward, head and vocabulary widths and few decoder layers is written under --workdir, then
obfuscated in a fresh child process (its peak RSS, VmHWM, is its own). The child probes a float32 2048^3 matmul
twice before and twice after the run (same process, same thread count): the fraction is the achieved rate of the
WHOLE obfuscation (reading, keys, noise, hashing and writing included) over the mean of those probes. FLOPs are the
method's weight products only (ObfuscationResult.flops). The machine is shared: only ratios taken in the same run
mean anything, and every entry records the load average.

Equivalence (--equivalence): the same family with a reduced vocabulary (--equiv-vocab) and, for MoE, fewer routed
experts (--equiv-experts), obfuscated losslessly (the `default` transforms with no embedding/head noise) into
float32, then plaintext and obfuscated logits compared in float32 on random ids mapped through the key's
permutation: max |logit error| over max |logit|.

    python benchmarks/scale_shapes.py --label after --families llama-3.1-8b --layers 2
    python benchmarks/scale_shapes.py --label full-8b --families llama-3.1-8b --layers 32 --no-equivalence
    python benchmarks/scale_shapes.py --label fp8 --families deepseek-v3.1 --fp8 --no-equivalence
Results: benchmarks/results/scale_shapes.json, one entry per (label, family); an existing one is kept unless --force.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "scale_shapes.json"

# routed experts kept per MoE layer in the timing run: all of them where one layer fits this machine (2 cores,
# ~64 GB disk, ~20 GB shared memory); DeepSeek-V3.1's 256 (11.3B parameters, 22.5 GB in bf16, ~160 TFLOP per
# layer) do not, so its MoE layer is timed with 16 experts and the per-expert time scaled in the projection
TIMING_EXPERTS = {"deepseek-v3.1": 16}
# DeepSeek-V3.1's first three layers are dense: four layers reach a sparse one
TIMING_LAYERS = {"deepseek-v3.1": 4}
NOISY = {"alpha_e": 0.1, "alpha_h": 0.05}  # the embedding/head noise of the noisy small-model preset, h = 0
LOSSLESS = {"alpha_e": 0.0, "alpha_h": 0.0}

# a float32 2048^3 matmul timed in the child itself (``probe()`` appends GFLOP/s to ``probes``): the rate every
# figure of the run is compared with; pasted into each child's code
GEMM_PROBE = r"""N = 2048
a, b = torch.randn(N, N), torch.randn(N, N)
c = torch.empty(N, N)
torch.matmul(a, b, out=c)
probes = []
def probe():
    t = time.perf_counter()
    torch.matmul(a, b, out=c)
    probes.append(2.0 * N**3 / (time.perf_counter() - t) / 1e9)
"""

CHILD = r"""
import json, os, sys, time, threading, torch
from pathlib import Path
import aloepri.obfuscation.pipeline as pipeline
from aloepri import obfuscate, resolve_params

src, work, overrides, threads, device = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
""" + GEMM_PROBE + r"""

def vm_hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

# per-block wall time for code whose result does not report it
blocks = {}
def timed(label, fn):
    def run(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            key = label(args)
            blocks[key] = blocks.get(key, 0.0) + time.perf_counter() - t
    return run
if hasattr(pipeline, "obfuscate_embedding"):  # code from before ObfuscationResult.block_seconds
    pipeline._obfuscate_layer = timed(lambda a: f"layer {a[3]}", pipeline._obfuscate_layer)
    pipeline.obfuscate_embedding = timed(lambda a: "embedding", pipeline.obfuscate_embedding)
    pipeline.obfuscate_head = timed(lambda a: "head", pipeline.obfuscate_head)

for _ in range(2):
    probe()
rss0 = vm_hwm_kib()
load0 = os.getloadavg()[0]
extra = {} if device == "-" else {"device": device}
t = time.perf_counter()
res = obfuscate(src, work / "out", work / "key.json", resolve_params("default", **overrides), seed=1,
                allow_weak_seed=True, overwrite=True, progress=True, **extra)
wall = time.perf_counter() - t
for _ in range(2):
    probe()
block_seconds = getattr(res, "block_seconds", None) or blocks
print(json.dumps({"wall_seconds": wall, "flops": res.flops, "output_bytes": res.bytes_written,
                  "hidden_size": res.hidden_size, "peak_rss_kib": vm_hwm_kib(), "rss_after_imports_kib": rss0,
                  "float32_probe_gflops": probes, "block_seconds": block_seconds,
                  "loadavg_1min": [load0, os.getloadavg()[0]], "torch_threads": torch.get_num_threads()}))
"""

EQUIV_CHILD = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from aloepri import obfuscate, resolve_params
from aloepri.keyfile import load_key

src, work, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]))
res = obfuscate(src, work / "out", work / "key.json", resolve_params("default", **overrides), seed=1,
                allow_weak_seed=True, overwrite=True, progress=False, dtype="float32")
perm = torch.tensor(load_key(work / "key.json").vocab_permutation)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, len(perm), (2, 16), generator=gen)
with torch.no_grad():
    plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref = plain(ids).logits
    del plain
    obf = AutoModelForCausalLM.from_pretrained(work / "out", dtype=torch.float32)
    got = obf(perm[ids]).logits[..., perm]
err = float((got - ref).abs().max())
scale = float(ref.abs().max())
print(json.dumps({"max_logit_error": err, "max_logit": scale, "relative_error": err / scale,
                  "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                  "positions": ids.numel()}))
"""


def run_child(code: str, args: list[str], threads: int, log: Path) -> dict:
    """Run a child; its stderr (the obfuscation's progress bar, per block) goes to ``log`` as it runs."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `aloepri obfuscate` sets
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                              env=env)
    if proc.returncode:
        raise RuntimeError(log.read_text()[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def git_revision() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src/aloepri"], capture_output=True, text=True,
                               cwd=Path(__file__).parent.parent).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except OSError:
        return "unknown"


def timing_run(family: str, layers: int, workdir: Path, threads: int, overrides: dict, device: str,
               vocab: int | None = None, source_dtype: str = "bfloat16") -> dict:
    from aloepri.testing.synthetic import synthetic_config, write_synthetic_checkpoint

    experts = TIMING_EXPERTS.get(family)
    src = workdir / (f"{family}-L{layers}" + ("" if experts is None else f"-E{experts}") +
                     ("" if vocab is None else f"-V{vocab}") + ("" if source_dtype == "bfloat16" else f"-{source_dtype}"))
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        write_synthetic_checkpoint(family, src, num_layers=layers, num_experts=experts, vocab_size=vocab,
                                   dtype=source_dtype)
        print(f"  wrote {src} in {time.perf_counter() - t:.0f} s", flush=True)
    out_dir = workdir / f"{family}-L{layers}-obf"
    try:
        r = run_child(CHILD, [str(src), str(out_dir), json.dumps(overrides), str(threads), device], threads,
                      workdir / f"{family}-L{layers}.log")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    probes = r["float32_probe_gflops"]
    r["float32_gemm_gflops"] = sum(probes) / len(probes)
    r["gflops_achieved"] = r["flops"] / r["wall_seconds"] / 1e9
    r["fraction_of_float32_gemm"] = r["gflops_achieved"] / r["float32_gemm_gflops"]
    r["peak_rss_mib"] = r["peak_rss_kib"] / 1024
    r["config"] = {k: v for k, v in synthetic_config(family, layers, vocab, experts).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
    r["num_layers"], r["num_experts"], r["vocab_size"], r["source_dtype"] = layers, experts, vocab, source_dtype
    r["source_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    return r


def equivalence_run(family: str, workdir: Path, threads: int, vocab: int, experts: int | None) -> dict:
    from aloepri.testing.synthetic import write_synthetic_checkpoint

    cfg_experts = experts if family in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3.1") else None
    layers = 1  # DeepSeek-V3.1's first layer is dense: its MLA attention is checked at full width, its MoE is not
    src = workdir / f"{family}-equiv"
    shutil.rmtree(src, ignore_errors=True)
    write_synthetic_checkpoint(family, src, num_layers=layers, vocab_size=vocab, num_experts=cfg_experts)
    try:
        r = run_child(EQUIV_CHILD, [str(src), str(workdir / f"{family}-equiv-obf"), json.dumps(LOSSLESS), str(threads)],
                      threads, workdir / f"{family}-equiv.log")
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(workdir / f"{family}-equiv-obf", ignore_errors=True)
    r.update(num_layers=layers, vocab_size=vocab, num_experts=cfg_experts)
    return r


# float32 GEMM rates for the projection. "this machine, idle": its 2-thread float32 2048^3 probe when nothing else
# runs (217-228 GFLOP/s, docs/performance.md); the others are assumptions, not measurements: a 96-core AVX-512
# server (96 cores x ~2.4 GHz x 32-64 float32 FLOP/cycle = 7-15 TFLOP/s peak; ~5 TFLOP/s sustained in a large
# sgemm) and one H100 in plain float32 (~50 TFLOP/s; TF32's 10-bit mantissa is not the precision the products
# are checked in)
PROJECTION_GEMM_GFLOPS = {"this machine, idle (2 cores)": 220.0, "96-core client": 5000.0,
                          "one GPU (H100, float32)": 50000.0}
ASSUMED_DISK_GBPS = 2.0  # one NVMe drive for reading the source and writing the output: a floor no GEMM removes
PAPER_MINUTES = {"qwen3-32b": ("R1-Distill-32B", 9.28), "qwen2.5-14b": ("R1-Distill-14B", 3.43),
                 "qwen3-30b-a3b": ("Qwen3-MoE-30B-A3B", 4.58), "deepseek-v3.1": ("DeepSeek-V3.1-Terminus", 482.38)}


def product_flops(cfg: dict, hidden: int) -> float:
    """The method's weight products for a whole model: 2 x D x every matrix that reads or writes the residual
    stream (one dimension equal to the hidden size), as ObfuscationResult.flops counts them."""
    from aloepri.testing.synthetic import tensor_shapes

    d = cfg["hidden_size"]
    return float(sum(2.0 * shape[0] * shape[1] * hidden for _, shape in tensor_shapes(cfg)
                     if len(shape) == 2 and d in shape))


PROBE_SPREAD_MAX = 2.0


def steady(timing: dict) -> bool:
    """The run's GEMM probes (two before, two after, same process) agree within PROBE_SPREAD_MAX: the load did not
    change under it so much that the fraction of their mean means nothing (a run that started on an idle machine
    and ended on a loaded one reads 270 then 25 GFLOP/s). Only such runs give the projection a measured fraction."""
    probes = timing["float32_probe_gflops"]
    return max(probes) <= PROBE_SPREAD_MAX * min(probes)


def projection(runs: list[dict], fraction: float | None = None, moe_fraction: float | None = None) -> list[dict]:
    """Full-model time per family: its products' FLOPs over the fraction of a float32 GEMM the measured run
    reached (the first of ``runs`` that measured it under a steady load; ``fraction`` for the others), at each rate of PROJECTION_GEMM_GFLOPS; and the time to read and write its bf16
    weights at ASSUMED_DISK_GBPS. Projections, not measurements."""
    from aloepri.testing.synthetic import synthetic_config, tensor_shapes

    rows = []
    for fam in synthetic_config.__globals__["FAMILIES"]:
        timings = [r["families"].get(fam, {}).get("timing") for r in runs]
        t = next((x for x in timings if x is not None and "error" not in x and steady(x)), None)
        measured = t is not None
        cfg = synthetic_config(fam)
        is_moe = "num_experts" in cfg or "n_routed_experts" in cfg
        f = t["fraction_of_float32_gemm"] if measured else (moe_fraction if is_moe else fraction)
        if f is None:
            continue
        flops = product_flops(cfg, cfg["hidden_size"])
        row = {"family": fam, "full_tflop": flops / 1e12, "fraction": f, "fraction_measured": measured,
               "disk_floor_minutes": 2 * 2 * sum(math.prod(s) for _, s in tensor_shapes(cfg)) / (ASSUMED_DISK_GBPS * 1e9) / 60}
        for name, rate in PROJECTION_GEMM_GFLOPS.items():
            row[name] = flops / (f * rate * 1e9) / 60
        if fam in PAPER_MINUTES:
            row["paper"] = PAPER_MINUTES[fam]
        rows.append(row)
    return rows


def _minutes(m: float) -> str:
    return f"{m * 60:.0f} s" if m < 1 else f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"


def save(label: str, family: str, entry: dict, header: dict) -> None:
    """Merge one family's entry into the results file as it is now (several runs may write it side by side)."""
    out = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": {}}
    run = out["runs"].setdefault(label, {**header, "families": {}})
    run.update(header)
    run["families"][family] = entry
    tmp = RESULTS.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, RESULTS)


def main() -> None:
    from aloepri.testing.synthetic import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True,
                    help="name of this code state or run (--project: several, comma-separated, first wins)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (DeepSeek-V3.1: at least 4, to reach MoE)")
    ap.add_argument("--noise", choices=("noisy", "lossless"), default="noisy",
                    help="embedding/head noise of the timing run: alpha_e 0.1 / alpha_h 0.05 (noisy) or none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="-", help="obfuscation device (code without --device: '-')")
    ap.add_argument("--workdir", default="/tmp/aloepri-scale", help="where checkpoints are written (and removed)")
    ap.add_argument("--keep-sources", action="store_true", help="keep the synthetic checkpoints for a later run")
    ap.add_argument("--no-equivalence", dest="equivalence", action="store_false")
    ap.add_argument("--vocab", type=int, default=None,
                    help="reduced vocabulary for the timing run (per-layer timing of the wide families)")
    ap.add_argument("--fp8", action="store_true",
                    help="timing source in the FP8 release format (block-quantized float8_e4m3fn, as DeepSeek-V3.1 "
                         "ships); the output is then FP8 too, the default for an FP8 source")
    ap.add_argument("--equiv-vocab", type=int, default=4096)
    ap.add_argument("--equiv-experts", type=int, default=16)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--project", action="store_true", help="only print the full-model projection of --label's runs")
    ap.add_argument("--fraction", type=float, default=None,
                    help="with --project: the fraction of the GEMM rate to assume where no run measured one")
    ap.add_argument("--moe-fraction", type=float, default=None,
                    help="with --project: the same for mixture-of-experts families (default: --fraction)")
    a = ap.parse_args()
    if a.project:
        out = json.loads(RESULTS.read_text())
        fraction = a.fraction if a.fraction else None
        rows = projection([out["runs"][label] for label in a.label.split(",") if label in out["runs"]], fraction,
                          a.moe_fraction or fraction)
        out["projection"] = {"label": a.label, "rows": rows, "gemm_gflops": PROJECTION_GEMM_GFLOPS,
                             "disk_gbps": ASSUMED_DISK_GBPS}
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        print("| family | product TFLOP | fraction of GEMM | " + " | ".join(PROJECTION_GEMM_GFLOPS) +
              " | disk floor | the paper |")
        print("|---" * (5 + len(PROJECTION_GEMM_GFLOPS)) + "|")
        for r in rows:
            paper = f"{r['paper'][0]}: {r['paper'][1]:.0f} min" if "paper" in r else ""
            frac = f"{r['fraction']:.2f}" + ("" if r["fraction_measured"] else " (assumed)")
            print(f"| {r['family']} | {r['full_tflop']:.0f} | {frac} | " +
                  " | ".join(_minutes(r[k]) for k in PROJECTION_GEMM_GFLOPS) +
                  f" | {_minutes(r['disk_floor_minutes'])} | {paper} |")
        return
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": {}}
    header = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
              "code": git_revision()}
    run = out["runs"].get(a.label, {"families": {}})
    overrides = NOISY if a.noise == "noisy" else LOSSLESS
    for fam in a.families:
        entry = run["families"].get(fam, {})
        layers = max(a.layers, TIMING_LAYERS.get(fam, 0))
        if "timing" not in entry or a.force:
            try:
                entry["timing"] = timing_run(fam, layers, workdir, a.threads, overrides, a.device, a.vocab,
                                             "fp8" if a.fp8 else "bfloat16")
                entry["timing"]["noise"] = overrides
                entry["timing"]["code"] = header["code"]  # the run's header holds the latest run's revision
            except (RuntimeError, OSError) as e:
                entry["timing"] = {"error": str(e)[-1500:]}
            save(a.label, fam, entry, header)
            t = entry["timing"]
            if "error" in t:
                print(f"{a.label}/{fam}: FAILED {t['error'][-400:]}", flush=True)
            else:
                blocks = ", ".join(f"{k} {v:.1f}s" for k, v in t["block_seconds"].items())
                print(f"{a.label}/{fam}: {layers} layers, {t['wall_seconds']:.1f} s, {t['flops'] / 1e12:.2f} TFLOP -> "
                      f"{t['gflops_achieved']:.0f} GFLOP/s = {t['fraction_of_float32_gemm']:.2f} of the float32 GEMM "
                      f"{t['float32_gemm_gflops']:.0f} GFLOP/s (same process); peak RSS {t['peak_rss_mib']:.0f} MiB; "
                      f"load {t['loadavg_1min'][0]:.1f}/{t['loadavg_1min'][1]:.1f}\n  {blocks}", flush=True)
        if not a.keep_sources:
            for p in workdir.glob(f"{fam}-L*"):
                shutil.rmtree(p, ignore_errors=True)
        if a.equivalence and ("equivalence" not in entry or a.force):
            try:
                entry["equivalence"] = equivalence_run(fam, workdir, a.threads, a.equiv_vocab, a.equiv_experts)
            except (RuntimeError, OSError) as e:
                entry["equivalence"] = {"error": str(e)[-1500:]}
            save(a.label, fam, entry, header)
            e = entry["equivalence"]
            print(f"{a.label}/{fam} equivalence: " + (f"FAILED {e['error'][-400:]}" if "error" in e else
                  f"max logit error {e['max_logit_error']:.2e} of max |logit| {e['max_logit']:.2f} "
                  f"(relative {e['relative_error']:.1e}), top-1 {e['top1_agreement']:.3f}"), flush=True)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
