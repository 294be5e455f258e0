"""Which residual dimensions the key keeps out of its mixing (``ObfuscationParams.outlier_rms``), measured on the
public model.

A few residual dimensions of most LLMs carry activations hundreds of times the others' (massive activations).
Mixed into every coordinate by the key, one of them puts its rounding error into all of them when the model is
served in bfloat16 or 8 bits (docs/accuracy.md, "Output precision for a quantized GGUF source"). The rule: run
the public model on a fixed, public calibration input and keep every dimension whose root mean square over the
residual stream (every layer's output, every position) is at least ``outlier_rms`` times the median dimension's.
Everything here is a function of the public model: the server can compute the same list, so choosing by it
reveals nothing the public model does not (docs/security.md, "Outlier dimensions").

The measurement holds the public model in bfloat16 in memory (3.6 GB for Qwen2.5-Coder-1.5B). For a model above
MEASURE_MAX_BYTES in bfloat16, or an FP8 release (which transformers does not run on the CPU), the kept dimensions
are the ``FALLBACK_COUNT`` largest feed-forward output rows of the public weights instead
(``massive_activation_dims``, the rule before this one), and ``kept_dims_rule`` says so. Which rule applies
depends on the model alone, never on the machine, so a seed gives the same model everywhere; a model within the
limit that does not fit in the available memory is refused with the way out (``outlier_dims``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# The calibration input: CALIBRATION_SEQUENCES sequences of CALIBRATION_LENGTH ids, each the source's BOS (when it
# has one) and then ids drawn uniformly from the vocabulary with a fixed public seed. Massive activations sit at
# the first position (and stay in the same dimensions whatever the text), which dominates the measurement.
CALIBRATION_SEQUENCES = 4
CALIBRATION_LENGTH = 64
CALIBRATION_SEED = 20261128
FALLBACK_COUNT = 4  # the weight-chosen count of the rule before this one (presets' outlier_dims=4)
MEASURE_MAX_BYTES = 16 << 30  # bfloat16 parameters (an 8B model); above: the weights' FALLBACK_COUNT


@dataclass(frozen=True)
class KeptDims:
    dims: tuple  # sorted residual dimensions kept out of the mixing
    rule: str  # how they were chosen, for the log and the tests: "measured" or "weights (<why>)"
    rms_over_median: tuple = ()  # the kept dimensions' measured RMS over the median (measured rule only)


def calibration_ids(vocab_size: int, bos_token_id: int | None) -> torch.Tensor:
    """(CALIBRATION_SEQUENCES, CALIBRATION_LENGTH) int64 ids: public and fixed for a vocabulary size and BOS."""
    rng = np.random.Generator(np.random.PCG64(CALIBRATION_SEED))
    ids = rng.integers(0, vocab_size, size=(CALIBRATION_SEQUENCES, CALIBRATION_LENGTH), dtype=np.int64)
    if bos_token_id is not None and 0 <= int(bos_token_id) < vocab_size:
        ids[:, 0] = int(bos_token_id)
    return torch.from_numpy(ids)


def residual_rms(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-dimension root mean square (float64) of a transformers causal LM's residual stream on ``ids`` (n, L):
    every decoder layer's output, every position."""
    total, count = None, 0
    with torch.no_grad():
        for row in ids:
            out = model(input_ids=row[None], output_hidden_states=True)
            for h in out.hidden_states[1:]:
                sq = h[0].to(torch.float64).square().sum(dim=0)
                total = sq if total is None else total + sq
                count += h.shape[1]
    return (total / count).sqrt()


def dims_above(rms: torch.Tensor, threshold: float, limit: int) -> tuple:
    """The dimensions whose RMS is at least ``threshold`` times the median dimension's, at most ``limit`` of them
    (the largest), sorted by index."""
    median = float(rms.median())
    order = torch.argsort(rms, descending=True)
    picked = [int(i) for i in order[:limit] if float(rms[i]) >= threshold * median]
    return tuple(sorted(picked))


def measurement_bytes(source) -> int:
    """What the measurement holds: the public model's parameters in bfloat16."""
    return 2 * sum(math.prod(source.tensor_shape(n)) for n in source.tensor_names())


def kept_dims(source, threshold: float, limit: int, available: int | None, fallback) -> KeptDims:
    """The kept dimensions of ``source`` under ``outlier_rms=threshold`` (see the module doc). ``fallback()``
    gives the weight-chosen FALLBACK_COUNT dimensions; ``available``: the memory available, None if unknown."""
    from .plain_model import plain_model

    if source.fp8 is not None:
        return KeptDims(fallback(), "weights (an FP8 source is not run on the CPU)")
    need = measurement_bytes(source)
    if need > MEASURE_MAX_BYTES:
        return KeptDims(fallback(), f"weights (the model is {need / 2**30:.1f} GiB in bfloat16, above the "
                                    f"{MEASURE_MAX_BYTES / 2**30:.0f} GiB measured)")
    if available is not None and need > available:
        raise ValueError(f"choosing the kept residual dimensions (outlier_rms) runs the public model in bfloat16: "
                         f"{need / 2**30:.1f} GiB, but {available / 2**30:.1f} GiB are available; free memory, or "
                         f"choose them from the weights instead (--outlier-dims {FALLBACK_COUNT})")
    cfg = source.config
    model = _quietly(plain_model, source.path, torch.bfloat16)  # no loading bar of transformers' in the run's log
    try:
        rms = residual_rms(model, calibration_ids(int(cfg["vocab_size"]), cfg.get("bos_token_id")))
    finally:
        del model
    dims = dims_above(rms, threshold, limit)
    median = float(rms.median())
    return KeptDims(dims, "measured", tuple(round(float(rms[i]) / median, 1) for i in dims))


def _quietly(fn, *args):
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        return fn(*args)
    finally:
        if was:
            logging.enable_progress_bar()
