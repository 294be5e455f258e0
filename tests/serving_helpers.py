"""Helpers for the serving tests: a character tokenizer for the tiny models, an ASGI recorder, a recording
forwarder in front of an out-of-process server (engine servers: aloepri.testing.engines)."""
from __future__ import annotations

import threading
from typing import Any

import torch

SPECIALS = 3  # 0 pad, 1 bos, 2 eos (as in aloepri.testing.tiny.TINY_COMMON)


class CharTokenizer:
    """One printable ASCII character per id (ids 3..95 of the tiny models' 96-token vocabulary).

    Duck-types the parts of a Hugging Face tokenizer that the client uses: encode, decode, apply_chat_template.
    """

    eos_token_id = 2
    bos_token_id = 1

    def __init__(self, vocab_size: int = 96):
        self.chars = [chr(32 + i) for i in range(vocab_size - SPECIALS)]
        self.index = {c: i + SPECIALS for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars) + SPECIALS

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


def ngrams(seq: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)}


class Forwarder:
    """ASGI app that relays every HTTP request unchanged to ``upstream`` and streams the answer back.

    Wrapped in :class:`Recorder` and run on a loopback :class:`aloepri.serving.local_server.ServerThread` it is a wire tap
    in front of a real server in another process: the recorder holds exactly the bytes that server received
    and sent."""

    HOP = {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"content-encoding"}

    def __init__(self, upstream: str, timeout: float = 300.0):
        self.upstream = upstream.rstrip("/")
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        import httpx2

        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        url = self.upstream + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k.lower() not in self.HOP]
        async with httpx2.AsyncClient(timeout=self.timeout) as http:
            try:
                resp = await http.send(http.build_request(scope["method"], url, content=body, headers=headers),
                                       stream=True)
            except httpx2.TransportError as e:
                await send({"type": "http.response.start", "status": 502,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": f"forwarder: {type(e).__name__}".encode()})
                return
            try:
                await send({"type": "http.response.start", "status": resp.status_code,
                            "headers": [(k.encode(), v.encode()) for k, v in resp.headers.items()
                                        if k.lower().encode() not in self.HOP]})
                async for chunk in resp.aiter_bytes():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await resp.aclose()


def sse_data(raw: bytes) -> list[Any]:
    """The JSON payloads of a recorded server-sent-events body (``data: [DONE]`` left out)."""
    import json

    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                out.append(json.loads(data))
    return out


def neutral_completion(url: str, prompt_ids: list[int], max_tokens: int, stream: bool,
                       **sampling: Any) -> tuple[list[int], str | None]:
    """Greedy ``/v1/completions`` on a GGUF with the neutral tokenizer, sent the ids themselves as neutral text
    (no key involved): (reply ids, finish_reason). The plaintext reference GGUF's neutral vocabulary is the
    identity, so this queries the plaintext model with the plaintext prompt ids."""
    import httpx2

    from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text, neutral_text_to_ids

    body = {"prompt": ids_to_neutral_text(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
            "repeat_penalty": 1.0, "stream": stream, **sampling}
    with httpx2.Client(timeout=300) as http:
        r = http.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        if not stream:
            choice = r.json()["choices"][0]
            return neutral_text_to_ids(choice["text"]), choice.get("finish_reason")
        text, finish = "", None
        for ev in sse_data(r.content):
            for c in ev.get("choices") or []:
                text += c.get("text") or ""
                finish = c.get("finish_reason") or finish
        return neutral_text_to_ids(text), finish


class EchoUpstream:
    """A stand-in engine (OpenAI completions with token-id prompts, as vLLM and serve-local speak it) whose reply is
    a function of the prompt: the prompt's last ``reply_len`` ids, newest first (no model, so no compute). It lists
    and stamps the key's fingerprint, answers ``n`` choices, streams (``delay`` seconds between tokens), gives
    vLLM-shaped logprobs labelled by id, and keeps every request body in ``seen``."""

    def __init__(self, key, reply_len: int = 6, delay: float = 0.0, vocab_size: int | None = None):
        self.key, self.reply_len, self.delay = key, reply_len, delay
        self.vocab_size = vocab_size if vocab_size is not None else key.vocab_size
        self.seen: list[dict] = []

    def reply(self, body: dict) -> list[int]:
        stops = set(body.get("stop_token_ids") or [])
        out = []
        for i in reversed(body["prompt"][-self.reply_len:]):
            if i in stops:
                break
            out.append(i)
        return out[:int(body.get("max_tokens") or 16)]

    @staticmethod
    def _logprobs(ids: list[int]) -> dict:
        return {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.25] * len(ids),
                "top_logprobs": [{f"token_id:{i}": -0.25} for i in ids], "text_offset": [0] * len(ids)}

    def app(self):
        import asyncio
        import json

        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        from aloepri.serving.client import FINGERPRINT_HEADER

        stamp = {FINGERPRINT_HEADER: self.key.model_fingerprint}

        async def models(request):
            return JSONResponse({"object": "list", "data": [
                {"id": "echo", "object": "model", "max_model_len": 4096,
                 "aloepri": {"model_fingerprint": self.key.model_fingerprint, "vocab_size": self.vocab_size}}]},
                headers=stamp)

        async def completions(request):
            body = await request.json()
            self.seen.append(body)
            ids, n, lps = self.reply(body), int(body.get("n") or 1), body.get("logprobs") is not None
            finish = "length" if len(ids) == int(body.get("max_tokens") or 16) else "stop"

            def choice(i, tokens, fin):
                return {"index": i, "text": "", "token_ids": tokens, "finish_reason": fin,
                        "logprobs": self._logprobs(tokens) if lps and tokens else None}

            if not body.get("stream"):
                return JSONResponse({"choices": [choice(i, ids, finish) for i in range(n)],
                                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n * len(ids)}},
                                    headers=stamp)

            async def events():
                for t in ids:
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    for i in range(n):
                        yield "data: " + json.dumps({"choices": [choice(i, [t], None)]}) + "\n\n"
                for i in range(n):
                    yield "data: " + json.dumps({"choices": [choice(i, [], finish)]}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=stamp)

        return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def synthetic_key(vocab_size: int, eos_token_id: int = 2, seed: int = 0):
    """A key for a model that does not exist: a random permutation of ``vocab_size`` ids (for tests against
    :class:`EchoUpstream`, where only the permutation matters)."""
    import random

    from aloepri.keyfile import KeyFile

    perm = list(range(vocab_size))
    random.Random(seed).shuffle(perm)
    return KeyFile(vocab_permutation=perm, model_fingerprint=f"{seed:064x}", params={}, seed=seed, h_effective=0,
                   hidden_size=8, source="", architecture="llama", special_tokens={"eos_token_id": eos_token_id})
