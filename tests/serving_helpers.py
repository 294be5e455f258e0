"""Helpers for the serving tests: a character tokenizer for the tiny models, and an ASGI recorder."""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

import torch

SPECIALS = 3  # 0 pad, 1 bos, 2 eos (as in tiny_models.TINY_COMMON)


class CharTokenizer:
    """One printable ASCII character per id (ids 3..95 of the tiny models' 96-token vocabulary).

    Duck-types the parts of a Hugging Face tokenizer that the client uses: encode, decode, apply_chat_template.
    """

    eos_token_id = 2
    bos_token_id = 1

    def __init__(self, vocab_size: int = 96):
        self.chars = [chr(32 + i) for i in range(vocab_size - SPECIALS)]
        self.index = {c: i + SPECIALS for i, c in enumerate(self.chars)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.index.get(c, self.index["?"]) for c in text]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True, **_: Any) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < SPECIALS:
                if not skip_special_tokens:
                    out.append(["<pad>", "<s>", "</s>"][i])
                continue
            out.append(self.chars[i - SPECIALS])
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **_: Any):
        text = "".join(f"{m['role'][0]}:{m['content']}\n" for m in messages) + ("a:" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | list[int]) -> list[int]:
    """Plaintext reference: transformers' own greedy generate, EOS excluded from the returned ids."""
    ids = torch.tensor([prompt_ids])
    eos_list = eos if isinstance(eos, list) else [eos]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_list, pad_token_id=eos_list[0])[0, len(prompt_ids):].tolist()
    if out and out[-1] in eos_list:
        out = out[:-1]
    return out


class Recorder:
    """ASGI middleware keeping every request body and response body that passes through (the 'server view')."""

    def __init__(self, app):
        self.app = app
        self.exchanges: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec = {"path": scope["path"], "request": b"", "response": b"", "status": None}
        with self.lock:
            self.exchanges.append(rec)

        async def rx():
            msg = await receive()
            if msg["type"] == "http.request":
                rec["request"] += msg.get("body", b"")
            return msg

        async def tx(msg):
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                rec["response"] += msg.get("body", b"")
            await send(msg)

        await self.app(scope, rx, tx)

    def clear(self) -> None:
        with self.lock:
            self.exchanges.clear()


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ngrams(seq: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}
