"""The public plaintext model as a stock transformers model, built from aloepri's own checkpoint reader: the
weights the obfuscation starts from, one tensor at a time into an uninitialised model (no second copy). Used by
the pipeline to measure the public model's residual stream (residual.py) and by the runtime (runtime.inference)."""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..storage.sources import pretrained_kwargs


def plain_model(src: str | Path, dtype: torch.dtype = torch.float32):
    """The public plaintext model, from a checkpoint directory or a .gguf file (on the CPU, in eval mode).

    A .gguf file is dequantized one tensor at a time into the model (``gguf_model``): transformers' own GGUF
    loading holds every dequantized tensor and the model at once, twice the model's size at its peak."""
    from transformers import AutoModelForCausalLM

    if Path(src).is_file():
        return gguf_model(src, dtype).eval()
    return AutoModelForCausalLM.from_pretrained(**pretrained_kwargs(src), dtype=dtype).eval()


def gguf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model of a .gguf file with the weights transformers' GGUF loading gives (the same config, the same
    dequantization and q/k row order: aloepri's reader, which the obfuscation starts from), built without a
    second copy: the model is allocated uninitialised, then each tensor is dequantized into its place."""
    from .checkpoint import open_checkpoint

    def tensors(wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        ck = open_checkpoint(path)
        try:
            names = ck.spec.hf_names
            for role, layer, part in _gguf_tensor_roles(ck):
                yield names.of(role, layer, part), ck.get(role, layer, part, dtype=torch.float32)
            if ck.tied_embeddings and names.of("head") in wanted:  # a config that unties what the file ties
                yield names.of("head"), ck.get("embed", dtype=torch.float32)
        finally:
            ck.close()

    return uninitialised_model_filled(source_config(path), dtype, tensors, path)


def source_config(src: str | Path):
    """The transformers config of a checkpoint directory or a .gguf file. A .gguf's is parsed once per process and
    file (its path, size and modification time; each call gets its own copy): transformers reads every metadata
    field of the file for it, the whole vocabulary included (3 CPU-s for SmolLM2's), and one ``aloepri attack
    all`` asked for it three times (``AttackTarget.plain_config``, the model's loading, IMA's own obfuscation)."""
    from transformers import AutoConfig

    p = Path(src)
    if not p.is_file():
        return AutoConfig.from_pretrained(**pretrained_kwargs(p))
    st = p.stat()
    return copy.deepcopy(_gguf_config(str(p), st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=4)
def _gguf_config(path: str, size: int, mtime_ns: int):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(**pretrained_kwargs(path))


class TensorMismatchError(ValueError):
    """The stored tensors are not the parameters of the model the config describes."""


def uninitialised_model_filled(config, dtype: torch.dtype, tensors: Callable[[set[str]], Iterator],
                                source: str | Path):
    """The model ``config`` describes, allocated without initialising it, each parameter then copied (and
    converted to ``dtype``) from ``tensors(parameter names)``, which yields (name, tensor) one at a time: the peak
    is the model and one stored tensor. Every parameter must be filled, and only those."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = dict(model.named_parameters())  # a tied head is the embedding, listed once
    filled = set()
    for name, tensor in tensors(set(params)):
        if name not in params:  # e.g. q/k/v biases in a file whose llama config declares none
            raise TensorMismatchError(f"{source} holds {name}, which the {type(model).__name__} its config "
                                      "describes does not have")
        params[name].data.copy_(tensor)
        filled.add(name)
        del tensor
    if filled != set(params):
        raise TensorMismatchError(f"{source} leaves {sorted(set(params) - filled)[:5]} of the "
                                  f"{type(model).__name__} unset")
    return model


def _gguf_tensor_roles(ck) -> list[tuple[str, int | None, str]]:
    roles = [("embed", None, "weight"), ("final_norm", None, "weight")]
    if not ck.tied_embeddings:
        roles.append(("head", None, "weight"))
    for i in range(ck.num_layers):
        for role in ck.attention_roles(i) + ck.mlp_roles(i):
            roles += [(role, i, part) for part in ("weight", "bias") if ck.has(role, i, part)]
    return roles
