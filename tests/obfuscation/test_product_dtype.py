"""Which dtype the weight products run in (pipeline.product_dtype; measured in experiments product_rounding and
product_precision)."""
from __future__ import annotations

import torch

from aloepri.obfuscation.params import resolve_params
from aloepri.obfuscation.pipeline import product_dtype


def test_float64_only_for_float64_outputs_and_noiseless_float32_ones():
    exact, noisy = resolve_params("exact"), resolve_params("exact", alpha_e=0.1, alpha_h=0.05)
    assert exact.is_exact and not noisy.is_exact
    assert product_dtype(torch.float64, noisy) == torch.float64
    assert product_dtype(torch.float32, exact) == torch.float64
    assert product_dtype(torch.float32, noisy) == torch.float32
    for sixteen_bit in (torch.bfloat16, torch.float16):  # their rounding dwarfs a float32 product's error
        assert product_dtype(sixteen_bit, exact) == torch.float32
        assert product_dtype(sixteen_bit, noisy) == torch.float32
