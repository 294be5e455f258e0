"""Obfuscation wall time and achieved GFLOP/s against this machine's float64 matmul roofline, measured in the same
process, with the same thread count and dtype, interleaved with the obfuscation; peak RSS; time per phase.

FLOPs counted: only the weight products of the method, 2 * rows * d * D for every reader (W Q^T) and writer (P^T W)
product, including the embedding and the head (ObfuscationResult.flops). Not counted: key generation (QR,
inverses, the per-reader Q), the per-head dh x dh maps, noise, dequantization, hashing, writing -- those are
overhead the ratio has to absorb, so the fraction is of the WHOLE obfuscation wall time.

The output is float32 (the GGUF sources' default), so a noisy preset (`noisy`) runs its products in float32 and
the exact ones (`default`, `exact`) in float64 (pipeline.product_dtype; error budget: benchmarks/product_precision.py).
The fraction is reported against the float64 roofline and, for honesty, against the float32 matmul rate probed before and after the run.

Roofline: a float64 (2048 x 2048) @ (2048 x 2048) torch matmul with the same torch thread count, run in the child
process before the obfuscation, after it, before the embedding and the head and between decoder layers (every
``--probe-every`` layers; the probes' time is taken out of the obfuscation's wall time). The machine is shared, so the probes sample the same load the
obfuscation sees; the fraction uses their mean rate.

Each model is obfuscated in a fresh subprocess so its peak RSS is its own. Results are resumable: one entry per
(label, model) in benchmarks/results/obfuscation_perf.json; an existing entry is kept unless --force.
Usage: python benchmarks/obfuscation_perf.py --label after [--models smollm2 qwen-coder] [--preset noisy]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "obfuscation_perf.json"

CHILD = r"""
import json, os, sys, threading, time, torch
from pathlib import Path
import aloepri.obfuscation.pipeline as pipeline
import aloepri.obfuscation.blocks as blocks
import aloepri.obfuscation.checkpoint as checkpoint
from aloepri.obfuscation.secrets import SecretSampler
from aloepri import obfuscate, resolve_params
from aloepri.models import smollm2_gguf, qwen25_coder_05b_gguf

threads, probe_every = int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
src = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}.get(sys.argv[1], lambda: Path(sys.argv[1]))()

N = 2048
_a, _b = torch.randn(N, N, dtype=torch.float64), torch.randn(N, N, dtype=torch.float64)
_c = torch.empty(N, N, dtype=torch.float64)
torch.matmul(_a, _b, out=_c)  # warm-up
probes = []  # (seconds, GFLOP/s)
_a32, _b32, _c32 = _a.float(), _b.float(), _c.float()
probes32 = []  # float32 rate, before and after only: the products run in float32 for float32 outputs

def probe32():
    torch.matmul(_a32, _b32, out=_c32)
    t = time.perf_counter()
    torch.matmul(_a32, _b32, out=_c32)
    probes32.append(2.0 * N**3 / (time.perf_counter() - t) / 1e9)

def probe(reps=1):
    t = time.perf_counter()
    for _ in range(reps):
        torch.matmul(_a, _b, out=_c)
    dt = time.perf_counter() - t
    probes.append((dt, 2.0 * N**3 * reps / dt / 1e9))
    return dt

# --- exclusive per-phase timers: time goes to the innermost wrapped call ---
phase = {}
background = {}  # time in calls made by the obfuscation's worker threads (overlapped: not part of the wall split)
stack = []
def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        if threading.current_thread() is not threading.main_thread():
            try:
                return fn(*a, **k)
            finally:
                background[name] = background.get(name, 0.0) + time.perf_counter() - t
        if stack:  # pause the enclosing phase
            outer, t_outer = stack[-1]
            phase[outer] = phase.get(outer, 0.0) + t - t_outer
        stack.append([name, t])
        try:
            return fn(*a, **k)
        finally:
            t2 = time.perf_counter()
            _, t_in = stack.pop()
            phase[name] = phase.get(name, 0.0) + t2 - t_in
            if stack:
                stack[-1][1] = t2
    return wrapper

pipeline.open_checkpoint = timed("parse_source", pipeline.open_checkpoint)
for cls in (checkpoint.GGUFCheckpoint, checkpoint.SafetensorsCheckpoint):
    cls.get = timed("read_dequantize", cls.get)
    cls.validate = timed("parse_source", cls.validate)
for m in ("__init__", "writer_P", "reader_Q", "attention", "ffn", "mla", "kappa", "vocab_permutation", "expert_order"):
    setattr(SecretSampler, m, timed("key_generation", getattr(SecretSampler, m)))
pipeline.fingerprint_update = timed("hash", pipeline.fingerprint_update)
checkpoint.ShardedWriter.add = timed("write", checkpoint.ShardedWriter.add)
checkpoint.ShardedWriter.finish = timed("write", checkpoint.ShardedWriter.finish)
probe_seconds = [0.0]

def probed_before(fn):  # a roofline probe before each vocabulary matrix too: the load changes within a run
    def run(*a, **k):
        probe_seconds[0] += probe()
        return fn(*a, **k)
    return run

pipeline.obfuscate_embedding = probed_before(timed("vocab_products_noise", pipeline.obfuscate_embedding))
pipeline.obfuscate_head = probed_before(timed("vocab_products_noise", pipeline.obfuscate_head))
for f in ("obfuscate_attention", "mlp_reader", "mlp_writer", "obfuscate_mla", "obfuscate_router", "pad_attention_heads",
          "transform_reader_input"):
    setattr(blocks, f, timed("layer_products", getattr(blocks, f)))

layer_fn = pipeline._obfuscate_layer
def layer_with_probe(source, writer, secrets, i, *rest):
    if probe_every and i % probe_every == probe_every - 1:
        probe_seconds[0] += probe()
    return layer_fn(source, writer, secrets, i, *rest)
pipeline._obfuscate_layer = layer_with_probe

def vm_hwm_kib():
    # VmHWM belongs to this process image (reset by exec); ru_maxrss would inherit the parent's high-water mark
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

for _ in range(2):
    probe()
    probe32()
rss_before = vm_hwm_kib()
load_before = os.getloadavg()[0]
import resource
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
res = obfuscate(src, Path(sys.argv[2]) / "m", Path(sys.argv[2]) / "k.json", resolve_params(sys.argv[3]), seed=1,
                allow_weak_seed=True, overwrite=True, progress=False)
wall = time.perf_counter() - t - probe_seconds[0]
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = {"user_seconds": cpu1.ru_utime - cpu0.ru_utime, "sys_seconds": cpu1.ru_stime - cpu0.ru_stime,
       "minor_faults": cpu1.ru_minflt - cpu0.ru_minflt, "probe_wall_seconds": probe_seconds[0]}
for _ in range(2):
    probe()
    probe32()
phase["layer_products"] = phase.get("layer_products", 0.0)  # probes ran inside no phase
phase["other"] = wall - sum(phase.values())
rates = [r for _, r in probes]
print(json.dumps({"src": src.name, "src_bytes": src.stat().st_size, "wall_seconds": wall, "flops": res.flops,
                  "output_bytes": res.bytes_written, "hidden_size": res.hidden_size, "h": res.h,
                  "rss_before_kib": rss_before, "peak_rss_kib": vm_hwm_kib(), "phase_seconds": phase,
                  "background_seconds": background, "cpu": cpu,
                  "roofline_probe_gflops": rates, "float32_probe_gflops": probes32,
                  # code from before product_dtype existed ran every product in float64
                  "product_dtype": str(getattr(pipeline, "product_dtype", lambda *_: torch.float64)(
                      torch.float32, resolve_params(sys.argv[3]))),
                  "loadavg_1min": [load_before, os.getloadavg()[0]],
                  "torch_threads": torch.get_num_threads()}))
"""


def synthetic_checkpoint(directory: Path, layers: int = 40, d: int = 1024, f: int = 4096, vocab: int = 4096) -> Path:
    """A deep, narrow-vocabulary Llama checkpoint (bf16, one shard per layer), written layer by layer. Its
    embedding and head are tiny, so peak RSS while obfuscating it shows the per-layer bound on its own."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory.mkdir(parents=True)
    heads, kv, dh = 16, 4, 64
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=dh, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(directory)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)  # noqa: E731
    weight_map = {}
    shards = [("model-embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, d),
                                           "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)})]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append((f"model-layer{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(heads * dh, d), p + "self_attn.k_proj.weight": rnd(kv * dh, d),
            p + "self_attn.v_proj.weight": rnd(kv * dh, d), p + "self_attn.o_proj.weight": rnd(d, heads * dh),
            p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
            p + "mlp.down_proj.weight": rnd(d, f)}))
    for fname, tensors in shards:
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def cpu_model() -> str:
    """The CPU's model name: the roofline, and so the fraction, differ between machines of the same kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def git_revision() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src/aloepri/obfuscation"], capture_output=True,
                               text=True, cwd=Path(__file__).parent.parent).stdout.strip()
        return head + ("+uncommitted obfuscation changes" if dirty else "")
    except OSError:
        return "unknown"


def run_model(model: str, preset: str, threads: int, probe_every: int, omp_wait_policy: str = "PASSIVE") -> dict:
    with tempfile.TemporaryDirectory() as work:
        if model == "synthetic-deep":  # memory follows one layer, not the model
            model = str(synthetic_checkpoint(Path(work) / "src"))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS=str(threads))
        env.pop("OMP_WAIT_POLICY", None)
        if omp_wait_policy:  # what `aloepri obfuscate` sets (cli.main); "" = libgomp's default (spinning)
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        proc = subprocess.run([sys.executable, "-c", CHILD, model, work, preset, str(threads), str(probe_every)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{model}: obfuscation failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    # the two probes before and the two after the run see the machine without the obfuscation's own worker
    # threads (shard writer, hashing, noise), which slow the probes between layers by up to 2x: the stricter roofline
    idle = r["roofline_probe_gflops"][:2] + r["roofline_probe_gflops"][-2:]
    r["idle_roofline_gflops"] = sum(idle) / len(idle)
    rates = sorted(r["roofline_probe_gflops"])
    r["roofline_gflops"] = sum(rates) / len(rates)
    r["roofline_gflops_min_max"] = [rates[0], rates[-1]]
    r["gflops_achieved"] = r["flops"] / r["wall_seconds"] / 1e9
    r["fraction_of_roofline"] = r["gflops_achieved"] / r["roofline_gflops"]
    r["fraction_of_idle_roofline"] = r["gflops_achieved"] / r["idle_roofline_gflops"]
    if r.get("float32_probe_gflops"):
        r["float32_roofline_gflops"] = sum(r["float32_probe_gflops"]) / len(r["float32_probe_gflops"])
        r["fraction_of_float32_roofline"] = r["gflops_achieved"] / r["float32_roofline_gflops"]
    r["matmul_seconds_at_roofline"] = r["flops"] / (r["roofline_gflops"] * 1e9)
    r["omp_wait_policy"] = omp_wait_policy or "default"
    # share of the machine's cores the run kept busy: CPU time minus the probes' (their wall time x threads)
    busy = r["cpu"]["user_seconds"] + r["cpu"]["sys_seconds"] - r["cpu"]["probe_wall_seconds"] * threads
    r["cpu_utilisation"] = busy / (r["wall_seconds"] * threads)
    r["peak_rss_mib"] = r["peak_rss_kib"] / 1024
    r["baseline_rss_mib"] = r["rss_before_kib"] / 1024
    r["output_mib"] = r["output_bytes"] / 2**20
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="name of this code state, e.g. before / after")
    ap.add_argument("--models", nargs="*", default=["smollm2", "qwen-coder"],
                    help="smollm2, qwen-coder, synthetic-deep (40 layers, 4k vocabulary) or a checkpoint path")
    ap.add_argument("--preset", default="noisy")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-every", type=int, default=4, help="roofline probe every N decoder layers (0: none)")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY of the child: PASSIVE is what `aloepri obfuscate` sets; '' = libgomp's default")
    ap.add_argument("--force", action="store_true", help="re-run entries already in the results file")
    a = ap.parse_args()
    out = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if "runs" not in out:  # the earlier single-run format: keep it under its own label
        out = {"runs": {"initial (before per-phase timing)": out}} if out else {"runs": {}}
    run = out["runs"].setdefault(a.label, {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                           "cpu_model": cpu_model(), "threads": a.threads, "preset": a.preset,
                                           "models": {}})
    run["code"] = git_revision()
    for m in a.models:
        if m in run["models"] and not a.force:
            print(f"{a.label}/{m}: already measured (use --force to re-run)")
            continue
        r = run_model(m, a.preset, a.threads, a.probe_every, a.omp_wait_policy)
        run["models"][m] = r
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
        ph = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(r["phase_seconds"].items(), key=lambda kv: -kv[1]))
        bg = ", ".join(f"{k} {v:.1f}s" for k, v in r.get("background_seconds", {}).items())
        print(f"{a.label}/{m}: {r['wall_seconds']:.1f} s wall, {r['flops'] / 1e9:.0f} GFLOP -> "
              f"{r['gflops_achieved']:.1f} GFLOP/s = {r['fraction_of_roofline']:.2f} of the float64 matmul roofline "
              f"{r['roofline_gflops']:.1f} GFLOP/s (same process, {a.threads} threads, probes "
              f"{r['roofline_gflops_min_max'][0]:.1f}-{r['roofline_gflops_min_max'][1]:.1f}), "
              f"{r['fraction_of_idle_roofline']:.2f} of the idle probes' {r['idle_roofline_gflops']:.1f}; "
              f"{r['fraction_of_float32_roofline']:.2f} of the float32 rate {r['float32_roofline_gflops']:.1f} "
              f"(products in {r['product_dtype']}); peak RSS "
              f"{r['peak_rss_mib']:.0f} MiB (imports {r['baseline_rss_mib']:.0f} MiB), output {r['output_mib']:.0f} MiB;"
              f" load {r['loadavg_1min'][0]:.1f}/{r['loadavg_1min'][1]:.1f}; CPU user {r['cpu']['user_seconds']:.1f} s +"
              f" sys {r['cpu']['sys_seconds']:.1f} s (less the probes') = {r['cpu_utilisation']:.2f} of {a.threads} cores x wall\n  phases: {ph}"
              f"; overlapped on a worker thread: {bg or 'none'}", flush=True)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
