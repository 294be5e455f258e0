"""The child process of the key_setup experiment, run BY PATH so that the source it measures can be another git
revision's (PYTHONPATH=<that revision>/src): it imports nothing of this repository but aloepri and its sibling
gemm_probe.py.

    PYTHONPATH=SRC python benchmarks/lib/key_child.py D THREADS WORKERS CHECKPOINT_OR_-

Prints one JSON line: the time and peak memory of each part of what an obfuscation does before its first block
(validation and outlier scan of CHECKPOINT when given; the key: INIT and P, Q's common part, kappa, the vocabulary
permutation), the sha256 of every secret (a faster key must give the same bits), and float32 GEMM probes taken in
the same process before and after."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def _status(field: str) -> float:
    from proc_status import status_kib  # this file's directory is on sys.path when run by path

    return status_kib(field) / 1024


def main(d: int, threads: int, workers: str, src: str) -> dict:
    import numpy as np
    import torch
    from gemm_probe import GemmProbe  # this file's directory is on sys.path when run by path

    from aloepri.obfuscation import keymat
    from aloepri.obfuscation.params import PRESETS
    from aloepri.obfuscation.secrets import SecretSampler
    try:
        from aloepri.obfuscation.shape import ModelShape
    except ImportError:  # an older revision's source (the side-by-side comparison): ModelShape was in secrets
        from aloepri.obfuscation.secrets import ModelShape

    torch.set_num_threads(threads)
    if workers != "-":
        keymat.key_workers = lambda: int(workers)  # the thread-count check: same code, one worker
    probe = GemmProbe()
    parts: dict[str, dict] = {}

    def part(name, fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the part's peak is its own
        rss0, t = _status("VmRSS"), time.perf_counter()
        out = fn()
        parts[name] = {"seconds": time.perf_counter() - t, "peak_rss_mib": _status("VmHWM"),
                       "peak_above_start_mib": _status("VmHWM") - rss0, "rss_after_mib": _status("VmRSS")}
        return out

    for _ in range(2):
        probe()
    load0 = os.getloadavg()[0]
    # 4 kept dimensions chosen from the weights (the presets' rule when these figures were measured): the key's
    # cost with kept dimensions, comparable with the stored results (the measured rule's count varies by model)
    params = PRESETS["default"].replace(alpha_e=0.1, alpha_h=0.05, outlier_dims=4)
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
        q = part("key: Q common", lambda: sampler.reader_Q("q", 0))
        kappa = part("key: kappa", sampler.kappa)
        perm = part("key: vocabulary permutation", sampler.vocab_permutation)
    for _ in range(2):
        probe()
    b = sampler.base
    digest = {name: hashlib.sha256(np.ascontiguousarray(m).tobytes()).hexdigest()[:16]
              for name, m in [("B", b.B), ("B_inv", b.B_inv), ("Z", b.Z), ("P", sampler._shared_P), ("Q", q),
                              ("perm", perm)]}
    digest["kappa"] = repr(kappa)
    return {"parts": parts, "sha256_16": digest, "float32_probe_gflops": probe.gflops,
            "loadavg_1min": [load0, os.getloadavg()[0]], "peak_rss_mib": _status("VmHWM"),
            "key_workers": keymat.key_workers() if hasattr(keymat, "key_workers") else 1, "outliers": list(outliers)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])))
