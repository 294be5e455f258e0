"""Reading a model's internals: forward hooks, residual streams, truncated forwards, first-layer queries and keys.

What the attacks (ISA, IMA, routing leak), the DP-Forward baseline and the sensitivity statistics observe of a
forward pass, in one place. Modules are found by role (``runtime.modules.ModelModules``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator

import torch

from .modules import ModelModules


def module_output(out: Any) -> torch.Tensor:
    """The hidden states of a module's output (decoder layers return a tuple in some transformers versions)."""
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def forward_hooks(modules: Iterable[tuple[Hashable, torch.nn.Module]],
                  on_output: Callable[[Hashable, Any], Any]) -> Iterator[None]:
    """Within the block, ``on_output(name, output)`` runs after every forward of each (name, module); a value it
    returns other than None replaces the module's output. The hooks are removed on exit, also on an error."""
    handles = []
    try:
        for name, module in modules:
            handles.append(module.register_forward_hook(lambda _m, _i, out, name=name: on_output(name, out)))
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def first_layers(model, n_layers: int, eager: bool = False):
    """Run only the first ``n_layers`` decoder layers (the state at a shallow layer does not need the rest);
    ``eager`` switches to eager attention, the only one that returns the probabilities. Yields the decoder."""
    mods = ModelModules(model)
    full = mods.layers
    if not 0 <= n_layers <= len(full):
        raise ValueError(f"layer {n_layers} out of range: the model has {len(full)} decoder layers")
    old_impl = model.config._attn_implementation
    mods.decoder.layers = torch.nn.ModuleList(list(full)[:n_layers])
    if eager and old_impl != "eager":
        model.set_attn_implementation("eager")
    try:
        yield mods.decoder
    finally:
        mods.decoder.layers = full
        if eager and old_impl != "eager":
            model.set_attn_implementation(old_impl)


def layer_states(model, layer: int, input_ids: torch.Tensor | None = None,
                 inputs_embeds: torch.Tensor | None = None, attentions: bool = False):
    """Residual stream after ``layer`` decoder layers (0 = embedding output), batch-first; with ``attentions``
    also the attention probabilities of those layers, each (batch, heads, n, n)."""
    mods = ModelModules(model)
    if inputs_embeds is None:
        inputs_embeds = mods.embed(input_ids)
    if layer == 0 and not attentions:
        return inputs_embeds
    captured: dict[str, torch.Tensor] = {}
    with first_layers(model, layer, eager=attentions) as decoder:
        watched = [("h", decoder.layers[layer - 1])] if layer > 0 else []
        with forward_hooks(watched, lambda _name, out: captured.__setitem__("h", module_output(out))):
            out = decoder(inputs_embeds=inputs_embeds, use_cache=False, output_attentions=attentions)
    h = captured.get("h", inputs_embeds)
    return (h, list(out.attentions)) if attentions else h


@torch.no_grad()
def batched_states(model, layer: int, ids: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """``layer_states`` of many sequences (rows of ``ids``), ``batch`` at a time, float32."""
    return torch.cat([layer_states(model, layer, input_ids=ids[i:i + batch]).float()
                      for i in range(0, len(ids), batch)])


@torch.no_grad()
def single_token_states(model, layer: int, batch: int = 4096) -> torch.Tensor:
    """(vocab, d) state of every token alone after ``layer`` layers (at layer 0: the embedding table)."""
    emb = ModelModules(model).embed.weight
    if layer == 0:
        return emb.detach().float()
    ids = torch.arange(emb.shape[0], device=emb.device).unsqueeze(1)
    return batched_states(model, layer, ids, batch)[:, 0]


def residual_streams(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Residual stream at every layer boundary (embedding output .. last decoder layer's output, before the final
    norm), each (b, n, D) float64. Read with our own hooks, not ``output_hidden_states``: transformers 5 installs its
    output recorders once, on the layers present at the first call that asks for outputs, so after a truncated eager
    run (``layer_states(..., attentions=True)``, the attention ISA) ``hidden_states`` held the embedding and one
    layer only, and a state map fitted afterwards failed (map error 0.97)."""
    mods = ModelModules(model)
    states: list[torch.Tensor] = []
    watched = enumerate((mods.embed, *mods.layers))  # they run in this order
    with forward_hooks(watched, lambda _i, out: states.append(module_output(out).double())), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return states


# --- first-layer queries and keys of every token ----------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclass
class FirstLayerQK:
    """Every vocabulary token's first-layer query and key (before RoPE) and the RoPE tables of n positions.

    The first decoder layer's attention depends only on the tokens (its input is the embedding), so the score of
    any candidate token at any position is a dot product of two rows of these tables: every one of the vocabulary's
    tokens can be scored exactly at every position without a forward pass."""

    q: torch.Tensor  # (vocab, heads, head_dim)
    k: torch.Tensor  # (vocab, kv_heads, head_dim)
    cos: torch.Tensor  # (n, head_dim)
    sin: torch.Tensor
    scaling: float

    @classmethod
    def of(cls, model, n: int, batch: int = 4096) -> "FirstLayerQK":
        mods = ModelModules(model)
        layer = mods.layer(0)
        if layer.q is None or layer.k is None or not hasattr(layer.attention, "scaling"):
            raise TypeError(f"{type(layer.attention).__name__}: the exhaustive attention proposal needs q_proj/k_proj "
                            "attention (use proposal='relaxed')")
        cfg = model.config
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        emb = mods.embed.weight.detach()
        qs, ks = [], []
        with torch.no_grad():
            for i in range(0, emb.shape[0], batch):
                x = layer.attn_norm(emb[i:i + batch].unsqueeze(0))[0]
                q = layer.q(x).view(x.shape[0], heads, -1)
                k = layer.k(x).view(x.shape[0], kv_heads, -1)
                if layer.q_norm is not None:  # Qwen3: per-head norms before RoPE
                    q, k = layer.q_norm(q), layer.k_norm(k)
                qs.append(q.float())
                ks.append(k.float())
            cos, sin = mods.rotary(emb[:1].unsqueeze(0).float(), torch.arange(n).unsqueeze(0))
        return cls(torch.cat(qs), torch.cat(ks), cos[0].float(), sin[0].float(), float(layer.attention.scaling))

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        return x * self.cos[pos] + _rotate_half(x) * self.sin[pos]

    def unrope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """The transpose of ``rope`` at ``pos``: <rope(q, pos), v> = <q, unrope(v, pos)>."""
        return x * self.cos[pos] - _rotate_half(x * self.sin[pos])

    def group(self) -> torch.Tensor:
        heads, kv_heads = self.q.shape[1], self.k.shape[1]
        return torch.arange(heads) // (heads // kv_heads)
