"""Fidelity of an obfuscated model against its plaintext original, on the same prompts."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..keyfile import KeyFile
from ..storage.devices import model_device, resolve_device

# Built-in prompts for `aloepri verify` and the preset benchmark: varied tasks, short enough for CPU.
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "List three prime numbers greater than 20.",
    "My name is Alice Johnson and I live at 42 Elm Street, Springfield. Summarise this sentence.",
    "What is 17 multiplied by 23?",
    "Give me a haiku about the ocean.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Write a short email asking my manager for a day off on Friday.",
    "Define the word 'ephemeral' and use it in a sentence.",
    "What are the health benefits of drinking water?",
    "Name the planets of the solar system in order.",
    "Suggest a name for a bakery that sells only bread.",
    "Explain what a hash table is to a ten-year-old.",
    "My phone number is 555-0142 and my account id is 88321. Remind me of both.",
    "Who wrote 'Pride and Prejudice'?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Write a SQL query that counts the rows of a table named users.",
]


@dataclass
class Fidelity:
    top1_agreement: float  # fraction of positions where the argmax token agrees
    mean_kl: float  # mean KL(plain || obfuscated) over positions, nats
    max_logit_error: float  # max |logit_plain - logit_obf| (obfuscated logits mapped back)
    greedy_match_rate: float  # fraction of prompts whose greedy continuation is identical
    positions: int
    prompts: int
    greedy_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def place_models(device, *models) -> "torch.device":
    """Move ``models`` (in place, as ``nn.Module.to`` does) to ``device``; None: where the first model already is.
    Returns the device the comparison runs on."""
    dev = model_device(models[0]) if device is None else resolve_device(device)
    for m in models:
        m.to(dev)
    return dev


@torch.no_grad()
def compare(plain_model, obf_model, key: KeyFile | None, prompts_ids: Sequence[Sequence[int]],
            greedy_tokens: int = 24, device=None) -> Fidelity:
    """``obf_model`` against ``plain_model`` on the same plaintext prompts. ``key=None``: the second model takes
    plaintext ids too (a plaintext model in another dtype or engine, e.g. the float32 floor of a float64 one).

    ``device`` ('cpu', 'cuda', ...): both models are moved there (in place) and run there; None keeps them where
    they are. The metrics are taken in float64 on that device (element-wise work on one prompt's logits, cheap
    even where float64 matrix products are slow) and returned as Python numbers."""
    dev = place_models(device, plain_model, obf_model)
    encode = key.encode_ids if key is not None else list
    decode = key.decode_ids if key is not None else list
    perm = torch.from_numpy(key.permutation).to(dev) if key is not None else None
    agree = 0
    kl_sum = torch.zeros((), dtype=torch.float64, device=dev)
    max_err = torch.zeros((), dtype=torch.float64, device=dev)
    n_pos = 0
    greedy_same = 0
    eos_plain = (key.special_tokens.get("eos_token_id") if key is not None
                 else plain_model.generation_config.eos_token_id)
    eos_plain = [eos_plain] if isinstance(eos_plain, int) else eos_plain
    for ids in prompts_ids:
        x = torch.tensor([list(ids)], device=dev)
        xo = torch.tensor([encode(list(ids))], device=dev)
        lp = plain_model(x).logits[0].double()
        lo = obf_model(xo).logits[0].double()
        if perm is not None:
            lo = lo[:, perm]  # column i = obfuscated logit of plain token i
        n = min(lp.shape[-1], lo.shape[-1])
        lp, lo = lp[:, :n], lo[:, :n]
        agree += int((lp.argmax(-1) == lo.argmax(-1)).sum())
        kl_sum += F.kl_div(F.log_softmax(lo, -1), F.log_softmax(lp, -1), log_target=True, reduction="sum")
        max_err = torch.maximum(max_err, (lp - lo).abs().max())
        n_pos += lp.shape[0]
        if greedy_tokens:
            gp = plain_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=greedy_tokens, do_sample=False,
                                      eos_token_id=eos_plain, pad_token_id=(eos_plain or [0])[0])[0, x.shape[1]:].tolist()
            eo = encode(eos_plain) if eos_plain else None
            go = obf_model.generate(xo, attention_mask=torch.ones_like(xo), max_new_tokens=greedy_tokens, do_sample=False,
                                    eos_token_id=eo, pad_token_id=(eo or [0])[0])[0, xo.shape[1]:].tolist()
            greedy_same += int(decode(go) == gp)
    return Fidelity(agree / n_pos, float(kl_sum) / n_pos, float(max_err), greedy_same / max(1, len(prompts_ids)),
                    n_pos, len(prompts_ids), greedy_tokens)


def builtin_prompt_ids(tokenizer, vocab_size: int, n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Chat-templated built-in prompts, or random ids when the model has no tokenizer."""
    prompts = BUILTIN_PROMPTS[:n] if n else BUILTIN_PROMPTS
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (16,), generator=g).tolist() for _ in prompts]
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out
