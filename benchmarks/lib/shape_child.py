"""The child processes of the scale_shapes experiment (each in a fresh process: its peak RSS, VmHWM, is its own).

    python -m benchmarks.lib.shape_child timing SRC WORK OVERRIDES_JSON THREADS DEVICE
    python -m benchmarks.lib.shape_child equivalence SRC WORK OVERRIDES_JSON THREADS

Each prints one JSON line: ``timing`` obfuscates SRC with the ``default`` preset and OVERRIDES (seed 1) between two
float32 GEMM probes before and two after, in the same process; ``equivalence`` obfuscates into float32 and compares
stock transformers' logits of plaintext and obfuscated model on 2 x 16 random ids mapped through the key."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .proc_status import status_kib


def timing(src: str, work: Path, overrides: dict, threads: int, device: str) -> dict:
    import torch

    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.pipeline import obfuscate

    from .gemm_probe import GemmProbe

    torch.set_num_threads(threads)
    probe = GemmProbe()
    for _ in range(2):
        probe()
    rss0 = status_kib("VmHWM")
    load0 = os.getloadavg()[0]
    extra = {} if device == "-" else {"device": device}
    t = time.perf_counter()
    res = obfuscate(src, work / "out", work / "key.json", resolve_params("default", **overrides), seed=1,
                    allow_weak_seed=True, overwrite=True, progress=True, **extra)
    wall = time.perf_counter() - t
    for _ in range(2):
        probe()
    return {"wall_seconds": wall, "flops": res.flops, "output_bytes": res.bytes_written,
            "hidden_size": res.hidden_size, "peak_rss_kib": status_kib("VmHWM"), "rss_after_imports_kib": rss0,
            "float32_probe_gflops": probe.gflops, "block_seconds": res.block_seconds,
            "loadavg_1min": [load0, os.getloadavg()[0]], "torch_threads": torch.get_num_threads()}


def equivalence(src: str, work: Path, overrides: dict, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from aloepri.keyfile import load_key
    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.pipeline import obfuscate

    torch.set_num_threads(threads)
    obfuscate(src, work / "out", work / "key.json", resolve_params("default", **overrides), seed=1,
              allow_weak_seed=True, overwrite=True, progress=False, dtype="float32")
    perm = torch.tensor(load_key(work / "key.json").vocab_permutation)
    ids = torch.randint(0, len(perm), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        ref = plain(ids).logits
        del plain
        obf = AutoModelForCausalLM.from_pretrained(work / "out", dtype=torch.float32)
        got = obf(perm[ids]).logits[..., perm]
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    return {"max_logit_error": err, "max_logit": scale, "relative_error": err / scale,
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), "positions": ids.numel()}


if __name__ == "__main__":
    kind, src, work, overrides, threads = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]), \
        int(sys.argv[5])
    out = timing(src, work, overrides, threads, sys.argv[6]) if kind == "timing" else \
        equivalence(src, work, overrides, threads)
    print(json.dumps(out))
