"""Private inference in process: plaintext in, plaintext out; the model only ever sees permuted ids."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ..keyfile import KeyFile, check_key_matches, load_key
from ..obfuscation.plain_model import (  # noqa: F401  (gguf_model, TensorMismatchError: public names here too)
    TensorMismatchError, gguf_model, plain_model, uninitialised_model_filled)
from ..storage.devices import resolve_device
from .tokenizer import load_hf_tokenizer, load_tokenizer  # noqa: F401  (load_tokenizer: the public name)


def load_plain_model(src: str | Path, dtype: torch.dtype = torch.float32, device=None):
    """The public plaintext model, from a checkpoint directory or a .gguf file, on ``device`` (default cpu)
    (obfuscation.plain_model.plain_model: a .gguf file is dequantized one tensor at a time into the model)."""
    return plain_model(src, dtype).to(resolve_device(device)).eval()


def forward_cached(model, input_ids: torch.Tensor, cache: Any = None) -> tuple[Any, Any]:
    """One forward pass that continues ``cache`` (None: starts one); returns (output, the cache to continue from).
    transformers 5.2x renamed the argument past_key_values to cache and warns (FutureWarning) on the old name on
    every call; older releases know only past_key_values. The name is read from the model's own signature."""
    name = _cache_argument(type(model))
    out = model(input_ids=input_ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out, getattr(out, name)


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def load_obfuscated_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device=None,
                          hold_stored: bool = False):
    """The server's artifact as a stock transformers model, on ``device`` (default cpu).

    Stored in another dtype (a bfloat16 checkpoint computed in float32), it is converted shard by shard into an
    uninitialised model: transformers' loading holds the converted model and every mapped shard at once (10.6 GB
    for a 1.5B model's 6.8 GB). A checkpoint whose tensors transformers renames on loading (fused MoE experts)
    is left to transformers.

    ``hold_stored``: a checkpoint stored in a narrower float (bfloat16, float16) keeps its linear and embedding
    weights as stored and computes in ``dtype`` (``precision.compute_in``): the same numbers at the stored size."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .precision import NARROW_FLOATS, compute_in

    config = AutoConfig.from_pretrained(str(model_dir))
    stored = str(getattr(config, "dtype", None) or "").replace("torch.", "")
    stored_dtype = getattr(torch, stored, None) if stored else None
    quantized = getattr(config, "quantization_config", None) is not None
    hold = hold_stored and not quantized and stored_dtype in NARROW_FLOATS and stored_dtype != dtype
    load_as = stored_dtype if hold else dtype
    if stored in ("", str(load_as).replace("torch.", "")) or quantized:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=load_as)
    else:
        try:
            model = uninitialised_model_filled(config, load_as, lambda wanted: _safetensors_tensors(model_dir),
                                                model_dir)
        except TensorMismatchError:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=load_as)
        else:
            if (Path(model_dir) / "generation_config.json").is_file():
                model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    if hold:
        compute_in(model, dtype)
    return model.to(resolve_device(device)).eval()


def _safetensors_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint, one at a time; each shard is unmapped before the next opens."""
    from safetensors import safe_open

    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass
class PrivateReply:
    text: str | None
    plain_prompt_ids: list[int]
    server_prompt_ids: list[int]  # what the server received
    server_reply_ids: list[int]  # what the server produced
    plain_reply_ids: list[int]


class PrivateModel:
    """Client and (local) server in one process, for trying the method and for evaluation.

    The obfuscated model is a stock transformers model; only ``key`` knows how its ids map to text. It runs on
    ``device`` (default cpu); ids go in and come out as Python lists.
    """

    def __init__(self, key: KeyFile | str | Path, model_dir: str | Path, tokenizer: Any = None,
                 dtype: torch.dtype = torch.float32, verify_fingerprint: bool = True, device=None):
        self.device = resolve_device(device)
        self.key = key if isinstance(key, KeyFile) else load_key(key)
        if verify_fingerprint:
            check_key_matches(self.key, model_dir)
        self.tokenizer = load_tokenizer(self.key, tokenizer)
        self.model = load_obfuscated_model(model_dir, dtype, self.device)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("no tokenizer: the source checkpoint has none; pass tokenizer=... or use generate_ids")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    @torch.no_grad()
    def generate_ids(self, plain_ids: Sequence[int], max_new_tokens: int = 64, **gen_kwargs: Any) -> PrivateReply:
        server_in = self.key.encode_ids(list(plain_ids))
        eos = self.key.obfuscated_eos_ids()
        gen_kwargs.setdefault("do_sample", False)
        out = self.model.generate(
            torch.tensor([server_in], device=self.device),
            attention_mask=torch.ones(1, len(server_in), dtype=torch.long, device=self.device),
            max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=(eos or [0])[0], **gen_kwargs,
        )
        server_out = out[0, len(server_in):].tolist()
        plain_out = self.key.decode_ids(server_out)
        return PrivateReply(None, list(plain_ids), server_in, server_out, plain_out)

    def chat(self, messages: Sequence[dict[str, str]] | str, max_new_tokens: int = 64, **gen_kwargs: Any) -> PrivateReply:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        reply = self.generate_ids(self.encode_chat(messages), max_new_tokens, **gen_kwargs)
        reply.text = self.tokenizer.decode(reply.plain_reply_ids, skip_special_tokens=True)
        return reply

    def as_server_sees(self, server_ids: Sequence[int]) -> str:
        """The server's ids read with the public tokenizer: what an observer without the key gets."""
        return self.tokenizer.decode(list(server_ids)) if self.tokenizer is not None else repr(list(server_ids))
