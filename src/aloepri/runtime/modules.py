"""The modules of a loaded Hugging Face decoder-only causal LM, by role.

One place knows where transformers keeps each part (``model.model.embed_tokens``, ``layers[i].self_attn.q_proj``,
...); attacks, baselines and sensitivity read the model through it. The role names are those of
``aloepri.obfuscation.archs`` (embed, head, final_norm; per layer attn_norm, q, k, v, o, q_norm, k_norm,
ffn_norm, gate, up, down, router). A model without the decoder-only layout is refused here, with its class name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Module = torch.nn.Module


def _part(parent: str, name: str) -> property:
    """The role held as attribute ``name`` of the layer's ``parent`` module; None where the layer has none."""
    return property(lambda self: getattr(getattr(self, parent), name, None))


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer by role. Absent roles are None (MLA has no q_proj; a MoE layer has no dense gate)."""

    block: Module  # the decoder layer itself (its output is the residual stream after it)

    attn_norm = _part("block", "input_layernorm")
    attention = _part("block", "self_attn")
    ffn_norm = _part("block", "post_attention_layernorm")
    mlp = _part("block", "mlp")
    q = _part("attention", "q_proj")
    k = _part("attention", "k_proj")
    v = _part("attention", "v_proj")
    o = _part("attention", "o_proj")
    q_norm = _part("attention", "q_norm")  # Qwen3: per-head RMSNorm on q and k before RoPE
    k_norm = _part("attention", "k_norm")
    gate = _part("mlp", "gate_proj")  # dense feed-forward only (a MoE layer's experts are not one gate)
    up = _part("mlp", "up_proj")
    down = _part("mlp", "down_proj")

    @property
    def router(self) -> Module | None:
        """The MoE router (a linear map to expert logits), None for a dense layer."""
        router = getattr(self.mlp, "gate", None)
        return router if router is not None and hasattr(router, "weight") else None


class ModelModules:
    """A causal LM by role. ``layers`` is read from the model at each access: ``probe.first_layers`` swaps it."""

    def __init__(self, model: Any):
        decoder = getattr(model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "embed_tokens"):
            raise TypeError(f"{type(model).__name__}: expected a decoder-only causal LM with "
                            ".model.layers/.model.embed_tokens")
        self.model = model
        self.decoder = decoder  # the stack without the head: embedding, layers, final norm, rotary tables

    @property
    def embed(self) -> Module:
        return self.decoder.embed_tokens

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.decoder.layers

    @property
    def final_norm(self) -> Module:
        return self.decoder.norm

    @property
    def head(self) -> Module:
        return self.model.get_output_embeddings()

    @property
    def rotary(self) -> Module:
        return self.decoder.rotary_emb

    def __len__(self) -> int:
        return len(self.decoder.layers)

    def layer(self, i: int) -> LayerModules:
        return LayerModules(self.decoder.layers[i])

    def state_module(self, layer: int) -> Module:
        """The module whose output is the residual stream after ``layer`` decoder layers (0: the embedding)."""
        if not 0 <= layer <= len(self):
            raise ValueError(f"layer {layer} out of range: the model has {len(self)} decoder layers")
        return self.embed if layer == 0 else self.layers[layer - 1]

