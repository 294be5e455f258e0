"""The child process of the experiment obfuscation_perf: obfuscates one model with the pipeline's phases timed and
float64/float32 matmul roofline probes interleaved, and prints one JSON line. A fresh process, so its peak RSS
(VmHWM) is the obfuscation's own.

    python -m benchmarks.lib.perf_child MODEL_OR_PATH WORKDIR PRESET THREADS PROBE_EVERY
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    import aloepri.obfuscation.blocks as blocks
    import aloepri.obfuscation.checkpoint as checkpoint
    import aloepri.obfuscation.pipeline as pipeline
    from aloepri import obfuscate, resolve_params
    from aloepri.models import BUNDLED_MODELS, resolve_model
    from aloepri.obfuscation.secrets import SecretSampler

    threads, probe_every = int(argv[3]), int(argv[4])
    torch.set_num_threads(threads)
    src = resolve_model(argv[0]) if argv[0] in BUNDLED_MODELS else Path(argv[0])

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
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    res = obfuscate(src, Path(argv[1]) / "m", Path(argv[1]) / "k.json", resolve_params(argv[2]), seed=1,
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
                          torch.float32, resolve_params(argv[2]))),
                      "loadavg_1min": [load_before, os.getloadavg()[0]],
                      "torch_threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
