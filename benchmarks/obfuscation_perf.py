"""Obfuscation wall time, achieved GFLOP/s against a plain float64 matmul on this machine, and peak RSS.

Each model is obfuscated in a fresh subprocess so its peak RSS is its own. The matmul reference runs in the
same invocation, so the ratio is measured side by side. Results: benchmarks/results/obfuscation_perf.json
Usage: python benchmarks/obfuscation_perf.py [--models smollm2 qwen-coder] [--preset default]
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, resource, torch
from pathlib import Path
from aloepri import obfuscate, resolve_params
from aloepri.models import smollm2_gguf, qwen25_coder_05b_gguf
torch.set_num_threads(int(sys.argv[4]))
src = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}.get(sys.argv[1], lambda: Path(sys.argv[1]))()
def vm_hwm_kib():
    # VmHWM belongs to this process image (reset by exec); ru_maxrss would inherit the parent's high-water mark
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
rss_before = vm_hwm_kib()
t = time.perf_counter()
res = obfuscate(src, Path(sys.argv[2]) / "m", Path(sys.argv[2]) / "k.json", resolve_params(sys.argv[3]), seed=1,
                allow_weak_seed=True,
                overwrite=True, progress=False)
wall = time.perf_counter() - t
print(json.dumps({"src": src.name, "src_bytes": src.stat().st_size, "wall_seconds": wall, "flops": res.flops,
                  "output_bytes": res.bytes_written, "hidden_size": res.hidden_size, "h": res.h,
                  "rss_before_kib": rss_before, "peak_rss_kib": vm_hwm_kib()}))
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


def matmul_gflops(threads: int, n: int = 2048, reps: int = 3) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=torch.float64)
    b = torch.randn(n, n, dtype=torch.float64)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2.0 * n**3 * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["smollm2", "qwen-coder", "synthetic-deep"])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    out = {"machine": platform.processor() or platform.machine(), "threads": a.threads, "preset": a.preset, "models": {}}
    out["matmul_float64_gflops_before"] = matmul_gflops(a.threads)
    for m in a.models:
        with tempfile.TemporaryDirectory() as work:
            src = str(synthetic_checkpoint(Path(work) / "src")) if m == "synthetic-deep" else m
            proc = subprocess.run([sys.executable, "-c", CHILD, src, work, a.preset, str(a.threads)],
                                  capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["gflops_achieved"] = r["flops"] / r["wall_seconds"] / 1e9
        r["peak_rss_mib"] = r["peak_rss_kib"] / 1024
        r["baseline_rss_mib"] = r["rss_before_kib"] / 1024
        r["output_mib"] = r["output_bytes"] / 2**20
        out["models"][m] = r
        print(f"{m}: {r['wall_seconds']:.1f}s, {r['gflops_achieved']:.2f} GFLOP/s of transform math, peak RSS "
              f"{r['peak_rss_mib']:.0f} MiB (imports alone {r['baseline_rss_mib']:.0f} MiB) for a "
              f"{r['output_mib']:.0f} MiB output", flush=True)
    out["matmul_float64_gflops_after"] = matmul_gflops(a.threads)
    ref = (out["matmul_float64_gflops_before"] + out["matmul_float64_gflops_after"]) / 2
    for r in out["models"].values():
        r["fraction_of_matmul_peak"] = r["gflops_achieved"] / ref
    print(f"reference float64 matmul: {ref:.1f} GFLOP/s")
    path = Path(__file__).parent / "results" / "obfuscation_perf.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
