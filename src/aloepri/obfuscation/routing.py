"""Routing decisions of MoE models: what a serving engine sees of every token's expert choice.

The expert permutation Z_router only relabels experts; the *pattern* of choices is kept exactly (the exact
variant), so routing is an observable side channel: expert choices alone can reveal tokens (the routing-leak
attack of the attack suite). These helpers expose it for the obfuscated model (server view) and, with the key,
map it back to plaintext expert numbers (ground truth for scoring).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .archs import spec_for_hf
from ..keyfile import KeyFile
from .secrets import expert_order


def router_module_names(model: Any) -> dict[int, str]:
    """{layer: qualified module name} of every router of a stock transformers MoE model.

    Found by class (``*TopKRouter``), not by checkpoint name: transformers renames modules on load (Mixtral's
    ``block_sparse_moe`` is ``mlp`` in memory since v5)."""
    spec = spec_for_hf(getattr(model.config, "architectures", None))
    if spec.moe is None:
        raise ValueError(f"{spec.name} has no routed experts")
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            layer = int(name.split("layers.")[1].split(".")[0])
            out[layer] = name
    if not out:
        raise ValueError(f"no router modules found in {type(model).__name__}; transformers may have renamed them")
    return dict(sorted(out.items()))


@torch.no_grad()
def routing_decisions(model: Any, input_ids: torch.Tensor, **forward_kwargs: Any) -> dict[int, torch.Tensor]:
    """Expert choices of every MoE layer for ``input_ids`` (batch, seq): {layer: LongTensor (batch*seq, top_k)},
    sorted per token, in the model's own expert numbering. Works for plaintext and obfuscated models alike."""
    names = router_module_names(model)
    modules = dict(model.named_modules())
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for layer, name in names.items():
        def hook(_mod, _inp, out, layer=layer):
            seen[layer] = torch.sort(out[2], dim=-1).values.cpu()  # routers return (logits, weights, indices)
        hooks.append(modules[name].register_forward_hook(hook))
    try:
        model(input_ids, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return dict(sorted(seen.items()))


def expert_orders(key: KeyFile, model_config: Any) -> dict[int, np.ndarray]:
    """Z_router of every MoE layer, from the key (client side / ground truth): obfuscated slot s holds plaintext
    expert order[s]."""
    spec = spec_for_hf(getattr(model_config, "architectures", None) or model_config.get("architectures"))
    cfg = model_config if isinstance(model_config, dict) else model_config.to_dict()
    n = spec.moe.num_experts(cfg)
    groups = int(cfg.get(spec.moe.expert_groups_key) or 1) if spec.moe.expert_groups_key else 1
    return {i: expert_order(key.seed, i, n, groups) for i in range(int(cfg["num_hidden_layers"]))
            if spec.moe.is_sparse_layer(cfg, i)}


def to_plain_experts(decisions: dict[int, torch.Tensor], orders: dict[int, np.ndarray]) -> dict[int, torch.Tensor]:
    """Obfuscated routing decisions renumbered into plaintext experts (sorted per token)."""
    return {i: torch.sort(torch.from_numpy(orders[i])[d], dim=-1).values for i, d in decisions.items()}
