"""The children of the device_attack experiment's synthetic plan: a checkpoint without a tokenizer (a synthetic
real-width shape, or a tiny test model), so they drive the library, not the CLI. Each prints one JSON line.

    python -m benchmarks.lib.device_child equivalence SRC WORK DEVICE THREADS
    python -m benchmarks.lib.device_child behavioural SRC SERVER KEY DEVICE BATCH THREADS

``equivalence`` obfuscates SRC (``default`` preset, float32, seed 1) with its products on DEVICE, then compares the
plaintext and the obfuscated model's logits on DEVICE for 2 x 16 random ids mapped through the key. ``behavioural``
runs the behavioural attack (budget ci) on DEVICE with BATCH probe sequences per forward ("default": the stages'
own) against four random 12-token prompts, with a stand-in chat template (the first ids of the vocabulary).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .proc_status import status_kib

TEMPLATE = ([1, 10, 11, 12], [13, 14, 15])  # stand-in chat template: no tokenizer here


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def equivalence(src: str, work: Path, device: str) -> dict:
    import torch

    from aloepri.keyfile import load_key
    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.pipeline import obfuscate
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model

    t = time.perf_counter()
    obfuscate(src, work / "out", work / "key.json", resolve_params("default"), seed=1, allow_weak_seed=True,
              overwrite=True, progress=False, dtype="float32", device=device)
    obfuscate_seconds = time.perf_counter() - t
    perm = torch.tensor(load_key(work / "key.json").vocab_permutation, device=device)
    ids = torch.randint(0, len(perm), (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        plain = load_plain_model(src, device=device)
        t = time.perf_counter()
        ref = plain(ids).logits
        _synchronize(device)
        forward_seconds = time.perf_counter() - t
        del plain
        got = load_obfuscated_model(work / "out", device=device)(perm[ids]).logits[..., perm]
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    return {"obfuscate_seconds": obfuscate_seconds, "plain_forward_seconds": forward_seconds,
            "max_logit_error": err, "max_logit": scale, "relative_error": err / scale,
            "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), "positions": ids.numel()}


def behavioural(src: str, server: str, key: str, device: str, batch: str) -> dict:
    import numpy as np

    from aloepri.attacks.base import AttackTarget, Budget, PrivateData
    from aloepri.attacks.behavioural import run_behavioural

    target = AttackTarget(src, server, key, device=device)
    vocab = int(target.plain_model.config.vocab_size)
    rng = np.random.default_rng(0)
    ids = [rng.integers(16, vocab, size=12).tolist() for _ in range(4)]
    data = PrivateData([""] * 4, ids, [[j % 3 == 0 for j in range(12)] for _ in ids])
    budget = Budget.named("ci")
    if batch != "default":
        budget.batch = int(batch)
    t = time.perf_counter()
    result, _ = run_behavioural(target, data, budget, 0, template=TEMPLATE)
    _synchronize(device)
    return {"attack_seconds": time.perf_counter() - t, "ttrsr": result.ttrsr,
            "vocab_recovery": result.metrics.get("vocab_recovery"), "ran_on": result.budget.get("device")}


def main(argv: list[str]) -> int:
    import torch

    kind, rest = argv[0], argv[1:]
    torch.set_num_threads(int(rest[-1]))
    t = time.perf_counter()
    if kind == "equivalence":
        out = equivalence(rest[0], Path(rest[1]), rest[2])
    elif kind == "behavioural":
        out = behavioural(*rest[:5])
    else:
        raise ValueError(f"unknown child {kind!r}")
    print(json.dumps({**out, "wall_seconds": time.perf_counter() - t, "peak_rss_mib": status_kib("VmHWM") / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
