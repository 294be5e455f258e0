"""A cached forward (serve-local, the behavioural attack, HumanEval) gives the full forward's logits and warns
nothing: transformers 5.2x renamed past_key_values to cache and warns on the old name at every step."""
from __future__ import annotations

import warnings

import torch

from aloepri.runtime.inference import forward_cached, load_plain_model


def test_cached_steps_equal_one_full_forward_without_a_warning(tiny_dir):
    model = load_plain_model(tiny_dir("llama"))
    ids = torch.tensor([[3, 17, 42, 8, 60]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (or any other) fails the test
        out, cache = forward_cached(model, ids[:, :3])
        for i in (3, 4):
            out, cache = forward_cached(model, ids[:, i:i + 1], cache)
    with torch.no_grad():
        full = model(ids).logits[0, -1]
    torch.testing.assert_close(out.logits[0, -1], full, rtol=1e-5, atol=1e-5)
