"""Weights held in the precision they are stored in, computed in a wider one.

A bfloat16 checkpoint computed in float32 needs its weights in float32 only while a layer runs: converting
bfloat16 to float32 is exact, so a linear layer that converts its weight when it is called computes the same
products, in the same order, as one whose weight was converted at load time, while the model stays at its stored
size (half of float32 for bfloat16). The cost is one conversion per weight per forward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# stored precisions held as they are: converting them to a wider float is exact
NARROW_FLOATS = (torch.bfloat16, torch.float16)


class StoredPrecisionLinear(nn.Linear):
    """An ``nn.Linear`` whose weight stays in its stored precision; its input and weight are converted to
    ``compute_dtype`` when it is called."""

    compute_dtype: torch.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = self.compute_dtype
        return F.linear(x.to(cd), self.weight.to(cd), None if self.bias is None else self.bias.to(cd))


class StoredPrecisionEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose table stays in its stored precision; the rows it looks up come out in
    ``compute_dtype``."""

    compute_dtype: torch.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.compute_dtype)


_HELD = {nn.Linear: StoredPrecisionLinear, nn.Embedding: StoredPrecisionEmbedding}


def compute_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` (loaded in a narrow float, in place) computing in ``dtype``: its linear and embedding weights stay
    as stored and are converted when used; every other parameter and floating buffer (norm weights, rotary
    frequencies: small, and used in element-wise products whose rounding would differ) is converted now. Only
    modules whose class is exactly ``nn.Linear`` / ``nn.Embedding`` are held: a subclass may compute differently,
    so its weights are converted like the rest."""
    for module in model.modules():
        held = _HELD.get(type(module))
        if held is not None:
            module.__class__ = held
            module.compute_dtype = dtype
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(module, name, b.to(dtype))
    if hasattr(model, "config"):
        model.config.dtype = dtype  # what the model computes in (the weights' storage is stated above)
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (a tied weight once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
