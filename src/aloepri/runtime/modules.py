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


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer by role. Absent roles are None (MLA has no q_proj; a MoE layer has no dense gate)."""

    block: Module  # the decoder layer itself (its output is the residual stream after it)

    @property
    def attn_norm(self) -> Module:
        return self.block.input_layernorm

    @property
    def attention(self) -> Module:
        return self.block.self_attn

    @property
    def ffn_norm(self) -> Module:
        return self.block.post_attention_layernorm

    @property
    def mlp(self) -> Module:
        return self.block.mlp

    def _attn(self, name: str) -> Module | None:
        return getattr(self.attention, name, None)

    @property
    def q(self) -> Module | None:
        return self._attn("q_proj")

    @property
    def k(self) -> Module | None:
        return self._attn("k_proj")

    @property
    def v(self) -> Module | None:
        return self._attn("v_proj")

    @property
    def o(self) -> Module | None:
        return self._attn("o_proj")

    @property
    def q_norm(self) -> Module | None:  # Qwen3: per-head RMSNorm on q and k before RoPE
        return self._attn("q_norm")

    @property
    def k_norm(self) -> Module | None:
        return self._attn("k_norm")

    @property
    def gate(self) -> Module | None:  # dense feed-forward only (a MoE layer's experts are not one gate)
        return getattr(self.mlp, "gate_proj", None)

    @property
    def up(self) -> Module | None:
        return getattr(self.mlp, "up_proj", None)

    @property
    def down(self) -> Module | None:
        return getattr(self.mlp, "down_proj", None)

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

