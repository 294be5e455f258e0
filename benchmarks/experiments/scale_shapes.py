"""Obfuscation at the published widths of the paper's model families: time per block, GFLOP/s against a float32 GEMM
probed in the same process, peak RSS, and equivalence against the plaintext where memory allows.

For every family (aloepri.testing.synthetic.PUBLISHED_CONFIGS) a random-weight bf16 checkpoint with the real
hidden, feed-forward, head and vocabulary widths and few decoder layers is written in a temporary directory, then
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

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.provenance import REPO

# routed experts kept per MoE layer in the timing run: all of them where one layer fits this machine (2 cores,
# ~64 GB disk, ~20 GB shared memory); DeepSeek-V3.1's 256 (11.3B parameters, 22.5 GB in bf16, ~160 TFLOP per
# layer) do not, so its MoE layer is timed with 16 experts and the per-expert time scaled in the projection
TIMING_EXPERTS = {"deepseek-v3.1": 16}
# DeepSeek-V3.1's first three layers are dense: four layers reach a sparse one
TIMING_LAYERS = {"deepseek-v3.1": 4}
NOISY = {"alpha_e": 0.1, "alpha_h": 0.05}  # the embedding/head noise of the noisy small-model preset, h = 0
LOSSLESS = {"alpha_e": 0.0, "alpha_h": 0.0}


@dataclass(frozen=True)
class Settings:
    families: tuple[str, ...] = ()  # () = every family of aloepri.testing.synthetic
    layers: int = 1  # decoder layers of the timing run (DeepSeek-V3.1: at least 4, to reach MoE)
    noise: str = "noisy"  # embedding/head noise of the timing run: "noisy" (alpha 0.1 / 0.05) or "lossless"
    threads: int = 2
    device: str = "-"  # obfuscation device ("-": the default)
    vocab: int | None = None  # reduced vocabulary for the timing run (per-layer timing of the wide families)
    fp8: bool = False  # timing source (and so output) in the FP8 release format, as DeepSeek-V3.1 ships
    equivalence: bool = True
    equiv_vocab: int = 4096
    equiv_experts: int = 16
    # projection only (no timing): the full models from these configs' stored runs (first steady run wins)
    project_from: tuple[str, ...] = ()
    fraction: float | None = None  # assumed fraction of the GEMM rate where no steady run measured one
    moe_fraction: float | None = None


CONFIGS = {
    "llama-3.1-8b": Settings(families=("llama-3.1-8b",), layers=2),
    "families": Settings(),
    "full-8b": Settings(families=("llama-3.1-8b",), layers=32, equivalence=False),
    "wide": Settings(families=("llama-3.1-70b", "qwen3-235b-a22b"), equivalence=False),
    "wide-layers": Settings(families=("deepseek-v3.1",), fp8=True, vocab=4096, equivalence=False),
    "projection": Settings(project_from=("after", "wide"), fraction=0.72, moe_fraction=0.44),
}
DEFAULT_CONFIG = "llama-3.1-8b"
LEGACY_CONFIGS = ("before", "after", "after-layers")
SUMMARY = ("obfuscation at the published widths of the paper's families: GFLOP/s against a same-process GEMM, "
           "peak RSS, equivalence; and the projection to the full models (tens of minutes to hours per family)")
DOCS = ("docs/performance.md",)
NOTES = "writes synthetic checkpoints of several GB to the temp directory (70B: ~12 GB) and removes them"


def _run_child(kind: str, args: list[str], threads: int, log: Path) -> dict:
    """A fresh child (benchmarks.lib.shape_child); its stderr (the progress bar, per block) goes to ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `aloepri obfuscate` sets
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.shape_child", kind, *args], stdout=subprocess.PIPE,
                              stderr=err, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(log.read_text()[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timing_run(family: str, layers: int, workdir: Path, threads: int, overrides: dict, device: str,
               vocab: int | None = None, source_dtype: str = "bfloat16") -> dict:
    from aloepri.testing.synthetic import synthetic_config, write_synthetic_checkpoint

    experts = TIMING_EXPERTS.get(family)
    src = workdir / f"{family}-source"
    shutil.rmtree(src, ignore_errors=True)
    t = time.perf_counter()
    write_synthetic_checkpoint(family, src, num_layers=layers, num_experts=experts, vocab_size=vocab,
                               dtype=source_dtype)
    print(f"  wrote {src} in {time.perf_counter() - t:.0f} s", flush=True)
    out_dir = workdir / f"{family}-obf"
    try:
        r = _run_child("timing", [str(src), str(out_dir), json.dumps(overrides), str(threads), device], threads,
                       workdir / f"{family}.log")
        r["source_bytes"] = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    probes = r["float32_probe_gflops"]
    r["float32_gemm_gflops"] = sum(probes) / len(probes)
    r["gflops_achieved"] = r["flops"] / r["wall_seconds"] / 1e9
    r["fraction_of_float32_gemm"] = r["gflops_achieved"] / r["float32_gemm_gflops"]
    r["peak_rss_mib"] = r["peak_rss_kib"] / 1024
    r["config"] = {k: v for k, v in synthetic_config(family, layers, vocab, experts).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
    r["num_layers"], r["num_experts"], r["vocab_size"], r["source_dtype"] = layers, experts, vocab, source_dtype
    return r


def equivalence_run(family: str, workdir: Path, threads: int, vocab: int, experts: int | None) -> dict:
    from aloepri.testing.synthetic import write_synthetic_checkpoint

    cfg_experts = experts if family in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3.1") else None
    layers = 1  # DeepSeek-V3.1's first layer is dense: its MLA attention is checked at full width, its MoE is not
    src = workdir / f"{family}-equiv"
    shutil.rmtree(src, ignore_errors=True)
    write_synthetic_checkpoint(family, src, num_layers=layers, vocab_size=vocab, num_experts=cfg_experts)
    try:
        r = _run_child("equivalence", [str(src), str(workdir / f"{family}-equiv-obf"), json.dumps(LOSSLESS),
                                        str(threads)], threads, workdir / f"{family}-equiv.log")
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


def projection(runs: list[dict[str, dict]], fraction: float | None = None, moe_fraction: float | None = None) -> list[dict]:
    """Full-model time per family: its products' FLOPs over the fraction of a float32 GEMM the measured run
    reached (the first of ``runs`` -- each {family: entry} -- that measured it under a steady load; ``fraction``
    for the others), at each rate of PROJECTION_GEMM_GFLOPS; and the time to read and write its bf16 weights at
    ASSUMED_DISK_GBPS. Projections, not measurements."""
    from aloepri.testing.synthetic import FAMILIES, synthetic_config, tensor_shapes

    rows = []
    for fam in FAMILIES:
        timings = [r.get(fam, {}).get("timing") for r in runs]
        t = next((x for x in timings if x is not None and "error" not in x and steady(x)), None)
        measured = t is not None
        cfg = synthetic_config(fam)
        is_moe = "num_experts" in cfg or "n_routed_experts" in cfg
        f = t["fraction_of_float32_gemm"] if measured else (moe_fraction if is_moe else fraction)
        if f is None:
            continue
        flops = product_flops(cfg, cfg["hidden_size"])
        row = {"family": fam, "full_tflop": flops / 1e12, "fraction": f, "fraction_measured": measured,
               "disk_floor_minutes": 2 * 2 * sum(math.prod(s) for _, s in tensor_shapes(cfg))
               / (ASSUMED_DISK_GBPS * 1e9) / 60}
        for name, rate in PROJECTION_GEMM_GFLOPS.items():
            row[name] = flops / (f * rate * 1e9) / 60
        if fam in PAPER_MINUTES:
            row["paper"] = PAPER_MINUTES[fam]
        rows.append(row)
    return rows


def _minutes(m: float) -> str:
    return f"{m * 60:.0f} s" if m < 1 else f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"


def run(s: Settings, store: ResultStore) -> None:
    import tempfile

    from aloepri.testing.synthetic import FAMILIES

    from ..lib.registry import get_experiment

    if s.project_from:
        exp = get_experiment("scale_shapes")
        runs = [exp.store(c).entries() for c in s.project_from if exp.store(c).path.exists()]
        store.put("projection", {"from": list(s.project_from), "gemm_gflops": PROJECTION_GEMM_GFLOPS,
                                 "disk_gbps": ASSUMED_DISK_GBPS,
                                 "rows": projection(runs, s.fraction, s.moe_fraction or s.fraction)})
        return
    overrides = NOISY if s.noise == "noisy" else LOSSLESS
    with tempfile.TemporaryDirectory(prefix="aloepri-scale-") as tmp:
        workdir = Path(tmp)
        for fam in s.families or FAMILIES:
            entry = dict(store.get(fam) or {})
            layers = max(s.layers, TIMING_LAYERS.get(fam, 0))
            if "timing" not in entry:
                try:
                    entry["timing"] = timing_run(fam, layers, workdir, s.threads, overrides, s.device, s.vocab,
                                                 "fp8" if s.fp8 else "bfloat16")
                    entry["timing"]["noise"] = overrides
                except (RuntimeError, OSError) as e:
                    entry["timing"] = {"error": str(e)[-1500:]}
                store.put(fam, entry)
                print(f"{fam}: {_timing_line(entry['timing'])}", flush=True)
            if s.equivalence and "equivalence" not in entry:
                try:
                    entry["equivalence"] = equivalence_run(fam, workdir, s.threads, s.equiv_vocab, s.equiv_experts)
                except (RuntimeError, OSError) as e:
                    entry["equivalence"] = {"error": str(e)[-1500:]}
                store.put(fam, entry)


def _timing_line(t: dict) -> str:
    if "error" in t:
        return f"FAILED {t['error'][-400:]}"
    probes = t["float32_probe_gflops"]
    return (f"{t['num_layers']} layers, {t['wall_seconds']:.0f} s, {t['flops'] / 1e12:.2f} TFLOP -> "
            f"{t['gflops_achieved']:.0f} GFLOP/s = {t['fraction_of_float32_gemm']:.2f} of the float32 GEMM probed in "
            f"the same process ({min(probes):.0f}-{max(probes):.0f} GFLOP/s{'' if steady(t) else ', not steady'}); "
            f"peak RSS {t['peak_rss_mib']:.0f} MiB; load {t['loadavg_1min'][0]:.1f} -> {t['loadavg_1min'][1]:.1f}")


def report(store: ResultStore) -> str:
    out = []
    for key, e in store.entries().items():
        if key == "projection":
            out += ["| family | product TFLOP | fraction of GEMM | " + " | ".join(e["gemm_gflops"]) +
                    " | disk floor | the paper |", "|---" * (5 + len(e["gemm_gflops"])) + "|"]
            for r in e["rows"]:
                paper = f"{r['paper'][0]}: {r['paper'][1]:.0f} min" if "paper" in r else ""
                frac = f"{r['fraction']:.2f}" + ("" if r["fraction_measured"] else " (assumed)")
                out.append(f"| {r['family']} | {r['full_tflop']:.0f} | {frac} | " +
                           " | ".join(_minutes(r[k]) for k in e["gemm_gflops"]) +
                           f" | {_minutes(r['disk_floor_minutes'])} | {paper} |")
            continue
        if not isinstance(e, dict) or "timing" not in e and "equivalence" not in e:
            continue
        line = f"- {key}: " + (_timing_line(e["timing"]) if "timing" in e else "no timing")
        q = e.get("equivalence")
        if q:
            line += ("; equivalence FAILED" if "error" in q else
                     f"; equivalence: max logit error {q['max_logit_error']:.2e} of {q['max_logit']:.2f} "
                     f"(relative {q['relative_error']:.1e}), top-1 {q['top1_agreement']:.3f}")
        out.append(line)
    return "\n".join(out) or "(nothing stored)"
