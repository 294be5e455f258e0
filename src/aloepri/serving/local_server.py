"""``aloepri serve-local``: a small OpenAI-compatible inference server over an obfuscated HF directory.

This is the *server* side: it loads the obfuscated checkpoint with stock transformers and generates from the
token ids it is sent. It never sees the key (it has no way to read plaintext), only the public files of the
server directory: config.json, generation_config.json (the permuted EOS) and aloepri_model.json (the public
fingerprint, which it lists in ``/v1/models`` and stamps on every answer, header ``x-aloepri-model-fingerprint``,
so that clients can check their key against it, reply by reply).

Endpoints (request and response shapes follow vLLM and llama.cpp, so the client's adapters are tested on it):

- ``GET /v1/models``, ``GET /health``
- ``POST /v1/completions``: ``prompt`` as a list of ints (or a string, if the directory ships a tokenizer),
  ``return_token_ids`` gives ``choices[i].token_ids`` as vLLM does; ``n`` choices; ``logprobs`` in vLLM's shape
  (``"token_id:N"`` labels with ``return_tokens_as_token_ids``); streaming with SSE.
- ``POST /completion``: llama.cpp's native shape (``n_predict``, ``return_tokens`` -> ``tokens``; ``n`` choices
  as a list of answers, or events with their ``index``; ``n_probs`` -> ``completion_probabilities`` by id).

Requests are scheduled round-robin one decoding step at a time by a single worker thread (no batching), so
concurrent streams all make progress; a request whose client disconnects is dropped at its next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..keyfile import MODEL_META_FILE
from ..runtime.inference import forward_cached
from .client.prompt import max_chars_per_token
from .http import (DEFAULT_MAX_REQUEST_BYTES, SSE_DONE, BadRequest, client_disconnected, error_body, error_response,
                   event_stream, number, openai_app, parse_json_body, read_body, sse)

log = logging.getLogger("aloepri.serving.local_server")

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_CHOICES = 16


@dataclass
class GenRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_ids: set[int] = field(default_factory=set)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # vLLM's: the sampled token's logprob and the k most likely ones, per step


class Session:
    """One request inside the engine; events go back to the asyncio side through a queue."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop, events: asyncio.Queue | None = None,
                 index: int = 0):
        self.req, self.loop, self.index = req, loop, index
        self.events: asyncio.Queue = events if events is not None else asyncio.Queue()  # shared by a request's n
        self.cancelled = threading.Event()
        self.cache = None
        self.generated: list[int] = []
        self.generator = None
        if req.seed is not None:
            self.generator = torch.Generator().manual_seed(int(req.seed))

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value, self.index))
        except RuntimeError:  # the event loop is gone
            self.cancelled.set()


class Engine:
    def __init__(self, model: Any, eos_ids: list[int]):
        self.model = model
        self.eos_ids = set(eos_ids)
        self._incoming: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="aloepri-serve-local-engine", daemon=True)
        self._thread.start()

    def submit(self, req: GenRequest, events: asyncio.Queue | None = None, index: int = 0) -> Session:
        s = Session(req, asyncio.get_running_loop(), events, index)
        self._incoming.put(s)
        return s

    def shutdown(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=10)

    def _take(self, block: bool) -> list:
        items = []
        try:
            items.append(self._incoming.get(block=block))
            while True:
                items.append(self._incoming.get_nowait())
        except queue.Empty:
            pass
        return items

    def _run(self) -> None:
        active: list[Session] = []
        while True:
            for s in self._take(block=not active):
                if s is None:  # shutdown
                    for a in active:
                        a.emit("error", "the server is shutting down")
                    return
                active.append(s)
            for s in list(active):
                if s.cancelled.is_set():
                    active.remove(s)
                    continue
                try:
                    done = self._step(s)
                except Exception as e:  # noqa: BLE001 - report to the client, keep serving others
                    log.exception("generation failed")
                    s.emit("error", f"generation failed: {type(e).__name__}")
                    done = True
                if done:
                    s.cache = None
                    active.remove(s)

    @torch.inference_mode()
    def _step(self, s: Session) -> bool:
        r = s.req
        ids = torch.tensor([r.prompt]) if s.cache is None else torch.tensor([[s.generated[-1]]])
        out, s.cache = forward_cached(self.model, ids, s.cache)
        logits = out.logits[0, -1].float()
        # logprobs as vLLM gives them by default: of the model's raw distribution, before sampling parameters
        raw = torch.log_softmax(logits, dim=-1) if r.logprobs is not None else None
        tok = self._sample(logits.clone() if raw is not None else logits, s)
        s.generated.append(tok)
        pairs = None
        if raw is not None:  # the sampled token first, then the k most likely (k + 1 entries at most, as vLLM)
            top = torch.topk(raw, min(r.logprobs, raw.numel())) if r.logprobs else None
            pairs = [(tok, float(raw[tok]))]
            if top is not None:
                pairs += [(int(i), float(v)) for v, i in zip(top.values, top.indices) if int(i) != tok]
        s.emit("token", (tok, pairs))
        if tok in self.eos_ids or tok in r.stop_ids:
            s.emit("done", "stop")
            return True
        if len(s.generated) >= r.max_tokens:
            s.emit("done", "length")
            return True
        return False

    @staticmethod
    def _sample(logits: torch.Tensor, s: Session) -> int:
        r = s.req
        if r.logit_bias:
            idx = torch.tensor(list(r.logit_bias.keys()))
            logits[idx] += torch.tensor(list(r.logit_bias.values()), dtype=logits.dtype)
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt) | set(s.generated)))
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
        if s.generated and (r.presence_penalty or r.frequency_penalty):
            ids, counts = torch.tensor(s.generated).unique(return_counts=True)
            logits[ids] -= r.presence_penalty + r.frequency_penalty * counts.to(logits.dtype)
        if r.temperature <= 1e-5:
            return int(torch.argmax(logits))
        logits = logits / r.temperature
        if 0 < r.top_k < logits.numel():
            kth = torch.topk(logits, r.top_k).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if r.min_p > 0:
            probs[probs < r.min_p * probs.max()] = 0
        if r.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, 0)
            sp[(cum - sp) > r.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=s.generator))


# ------------------------------------------------------------------------------------------------ HTTP side


class LocalServer:
    """``max_request_bytes``: the largest request body (413 above)."""

    def __init__(self, model_dir: str | Path, model_name: str | None = None, dtype: torch.dtype | str = "auto",
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir}: no config.json; give the obfuscated model directory")
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype).eval()
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        gen_path = self.model_dir / "generation_config.json"
        eos: Any = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
        if eos is None:
            eos = cfg.eos_token_id
        self.eos_ids = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [int(eos)])
        meta_path = self.model_dir / MODEL_META_FILE
        self.meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        self.model_name = model_name or self.model_dir.name
        self.tokenizer = None
        if any((self.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.max_chars_per_token = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else None
        self.max_request_bytes = max_request_bytes
        self.engine = Engine(self.model, self.eos_ids)
        self.created = int(time.time())

    # -- request parsing
    def _prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (list, str)):
            p = p[0]
        if isinstance(p, str):
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer: send 'prompt' as a list of token ids", "prompt")
            if self.max_chars_per_token and len(p) > self.max_len * self.max_chars_per_token:  # before tokenizing
                raise BadRequest(f"the prompt is too long: its {len(p)} characters make at least "
                                 f"{-(-len(p) // self.max_chars_per_token)} tokens; this model's context is "
                                 f"{self.max_len}", "prompt")
            add = body.get("add_special_tokens", True)
            ids = self.tokenizer.encode(p, add_special_tokens=bool(add))
        elif isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            ids = p
        else:
            raise BadRequest("'prompt' must be a list of token ids (or one string)", "prompt")
        if not ids:
            raise BadRequest("'prompt' is empty", "prompt")
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise BadRequest(f"'prompt' holds a token id outside 0..{self.vocab_size - 1}", "prompt")
        if len(ids) >= self.max_len:
            raise BadRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_len}", "prompt")
        return list(ids)

    def _gen_request(self, body: dict, prompt: list[int], native: bool) -> GenRequest:
        room = self.max_len - len(prompt)
        if native:
            n = number(body, "n_predict", -1, lo=-1, integer=True)
            max_tokens = room if n < 0 else min(n, room)
            temperature = number(body, "temperature", 0.8, lo=0)
            top_k = number(body, "top_k", 40, lo=0, integer=True)
            top_p = number(body, "top_p", 0.95, lo=0, hi=1)
            min_p = number(body, "min_p", 0.05, lo=0, hi=1)
            rep = number(body, "repeat_penalty", 1.0, lo=0.01)
            bias_raw = body.get("logit_bias") or []
            bias_items = [(b[0], b[1]) for b in bias_raw] if isinstance(bias_raw, list) and all(
                isinstance(b, list) and len(b) == 2 for b in bias_raw) else None
        else:
            max_tokens = min(number(body, "max_tokens", 16, lo=1, integer=True), room)
            temperature = number(body, "temperature", 1.0, lo=0)
            top_k = number(body, "top_k", 0, lo=-1, integer=True)
            top_p = number(body, "top_p", 1.0, lo=0, hi=1)
            min_p = number(body, "min_p", 0.0, lo=0, hi=1)
            rep = number(body, "repetition_penalty", 1.0, lo=0.01)
            bias_raw = body.get("logit_bias") or {}
            bias_items = list(bias_raw.items()) if isinstance(bias_raw, dict) else None
        if bias_items is None:
            raise BadRequest("'logit_bias' is malformed", "logit_bias")
        try:
            bias = {int(k): float(v) for k, v in bias_items}
        except (TypeError, ValueError, OverflowError):
            raise BadRequest("'logit_bias' is malformed", "logit_bias") from None
        if not all(math.isfinite(b) for b in bias.values()):
            raise BadRequest("'logit_bias' holds a bias that is not a finite number", "logit_bias")
        if any(not 0 <= k < self.vocab_size for k in bias):
            raise BadRequest("'logit_bias' names a token id outside the vocabulary", "logit_bias")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(i, int) for i in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        if body.get("stop"):
            raise BadRequest("serve-local does not match stop strings (its text is neutral symbols); "
                             "use 'stop_token_ids'", "stop")
        if native:
            logprobs = number(body, "n_probs", 0, lo=0, hi=MAX_LOGPROBS, integer=True) or None
        else:
            logprobs = number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        return GenRequest(
            prompt=prompt, max_tokens=max(1, max_tokens), temperature=temperature, top_p=top_p,
            top_k=max(top_k, 0), min_p=min_p, seed=number(body, "seed", None, integer=True), stop_ids=set(stop_ids),
            presence_penalty=number(body, "presence_penalty", 0.0, lo=-2, hi=2),
            frequency_penalty=number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
            repetition_penalty=rep, logit_bias=bias, logprobs=logprobs)

    def _choices(self, body: dict, native: bool) -> int:
        if native and body.get("n_cmpl") is not None:  # llama-server's name; "n" is its alias
            return number(body, "n_cmpl", 1, lo=1, hi=MAX_CHOICES, integer=True)
        return number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)

    @staticmethod
    def _native_probs(steps: list) -> list[dict]:
        """llama.cpp's ``completion_probabilities`` for some steps [(token id, [(id, logprob), ...]), ...]."""
        return [{"id": tid, "token": "", "logprob": max(pairs[0][1], -9999.0),
                 "top_logprobs": [{"id": i, "token": "", "logprob": max(v, -9999.0)} for i, v in pairs]}
                for tid, pairs in steps]

    def _token_label(self, tid: int, as_id: bool) -> str:
        if as_id or self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])

    def _logprobs(self, steps: list, as_id: bool, offset: int) -> dict:
        """vLLM's completions ``logprobs`` for some steps [(token id, [(id, logprob), ...]), ...]."""
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, pairs in steps:
            label = self._token_label(tid, as_id)
            out["text_offset"].append(offset)
            out["tokens"].append(label)
            out["token_logprobs"].append(max(pairs[0][1], -9999.0))
            out["top_logprobs"].append({self._token_label(i, as_id): max(v, -9999.0) for i, v in pairs})
            offset += len(label)
        return out

    def _detok(self):
        if self.tokenizer is None:
            return None
        from .client.decode import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer)

    # -- endpoints
    def app(self):
        from starlette.routing import Route

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/completion", self.native_completion, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        app = openai_app(routes, on_shutdown=self.engine.shutdown)
        fingerprint = self.meta.get("model_fingerprint")
        return _stamped(app, fingerprint) if isinstance(fingerprint, str) and fingerprint.isalnum() else app

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def models(self, request):
        from starlette.responses import JSONResponse

        entry = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "aloepri-serve-local",
                 "max_model_len": self.max_len}
        if self.meta.get("model_fingerprint"):
            entry["aloepri"] = {"model_fingerprint": self.meta["model_fingerprint"], "vocab_size": self.vocab_size}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat_completions(self, request):
        return error_response(400, "this server holds an obfuscated model and no chat template: render the chat on "
                                   "the client (aloepri.Client or aloepri proxy) and send token ids to /v1/completions")

    async def completions(self, request):
        return await self._complete(request, native=False)

    async def native_completion(self, request):
        return await self._complete(request, native=True)

    def _parse(self, raw: bytes, native: bool) -> tuple[dict, list[int], GenRequest, int]:
        """The request from its bytes: body, prompt ids, generation request, choices (in a worker thread: a long
        text prompt is tokenized off the event loop)."""
        body = parse_json_body(raw)
        prompt = self._prompt(body)
        return body, prompt, self._gen_request(body, prompt, native), self._choices(body, native)

    async def _complete(self, request, native: bool):
        import anyio
        from starlette.responses import JSONResponse

        try:
            raw = await read_body(request, self.max_request_bytes)
            body, prompt, req, n = await anyio.to_thread.run_sync(self._parse, raw, native)
        except BadRequest as e:
            return e.response()
        stream = bool(body.get("stream"))
        want_ids = bool(body.get("return_tokens" if native else "return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        events: asyncio.Queue = asyncio.Queue()  # one queue for the request's n choices
        # n samples of one request: the seed, if given, is offset per choice so that they differ reproducibly
        sessions = [self.engine.submit(req if i == 0 else replace(req, seed=None if req.seed is None else req.seed + i),
                                       events, i) for i in range(n)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if stream:
            gen = self._stream_native(sessions, want_ids) if native else \
                self._stream_openai(sessions, rid, want_ids, as_ids)
            return event_stream(gen)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, sessions))
        try:
            results, err = await _collect(sessions)
        finally:
            watcher.cancel()
            for s in sessions:
                s.cancel()
        if err:
            return error_response(500, err, etype="server_error")
        out = await anyio.to_thread.run_sync(self._answer, results, prompt, req, rid, native, want_ids, as_ids)
        return JSONResponse(out)

    def _answer(self, results: list, prompt: list[int], req: GenRequest, rid: str, native: bool, want_ids: bool,
                as_ids: bool) -> dict:
        """A whole (not streamed) answer's JSON; detokenized in a worker thread."""
        if native:  # one answer, or with n > 1 a list of them (as llama-server does)
            answers = []
            for i, (ids, steps, finish) in enumerate(results):
                detok = self._detok()
                answer = {"index": i, "content": detok.push(ids, final=True) if detok else "",
                          "tokens": ids if want_ids else [], "stop": True, "model": self.model_name,
                          "stop_type": "limit" if finish == "length" else "eos", "tokens_predicted": len(ids),
                          "tokens_evaluated": len(prompt)}
                if req.logprobs is not None:
                    answer["completion_probabilities"] = self._native_probs(steps)
                answers.append(answer)
            return answers[0] if len(answers) == 1 else answers
        choices = []
        for i, (ids, steps, finish) in enumerate(results):
            detok = self._detok()
            choice = {"index": i, "text": detok.push(ids, final=True) if detok else "",
                      "logprobs": self._logprobs(steps, as_ids, 0) if req.logprobs is not None else None,
                      "finish_reason": finish}
            if want_ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = prompt
            choices.append(choice)
        done = sum(len(r[0]) for r in results)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": {"prompt_tokens": len(prompt), "completion_tokens": done,
                                              "total_tokens": len(prompt) + done}}

    async def _stream_openai(self, sessions: list[Session], rid: str, want_ids: bool, as_ids: bool):
        n_choices, prompt = len(sessions), sessions[0].req.prompt
        detoks = [self._detok() for _ in sessions]
        counts, offsets, open_ = [0] * n_choices, [0] * n_choices, set(range(n_choices))
        created, with_lps = int(time.time()), sessions[0].req.logprobs is not None
        events = sessions[0].events
        try:
            while open_:
                kind, value, i = await events.get()
                if kind == "error":
                    yield sse(error_body(value, "server_error"))
                    return
                detok = detoks[i]
                choice: dict[str, Any] = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
                if kind == "token":
                    tid, pairs = value
                    counts[i] += 1
                    choice["text"] = detok.push([tid]) if detok else ""
                    if with_lps:
                        choice["logprobs"] = self._logprobs([(tid, pairs)], as_ids, offsets[i])
                        offsets[i] += len(choice["logprobs"]["tokens"][0])
                    if want_ids:
                        choice["token_ids"] = [tid]
                    if counts[i] == 1 and want_ids:
                        choice["prompt_token_ids"] = prompt
                else:
                    open_.discard(i)
                    choice["finish_reason"] = value
                    choice["text"] = detok.flush() if detok else ""
                    if want_ids:
                        choice["token_ids"] = []
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [choice]})
            p, done = len(prompt), sum(counts)
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": done,
                                                "total_tokens": p + done}})
            yield SSE_DONE
        finally:
            for s in sessions:
                s.cancel()

    async def _stream_native(self, sessions: list[Session], want_ids: bool):
        detoks, counts = [self._detok() for _ in sessions], [0] * len(sessions)
        open_, with_lps = set(range(len(sessions))), sessions[0].req.logprobs is not None
        events = sessions[0].events
        try:
            while open_:
                kind, value, i = await events.get()
                if kind == "error":
                    yield sse({"error": {"message": value, "type": "server_error", "code": 500}})  # llama.cpp's shape
                    return
                detok = detoks[i]
                if kind == "token":
                    counts[i] += 1
                    tid = value[0]
                    event = {"index": i, "content": detok.push([tid]) if detok else "",
                             "tokens": [tid] if want_ids else [], "stop": False}
                    if with_lps:
                        event["completion_probabilities"] = self._native_probs([value])
                    yield sse(event)
                else:
                    open_.discard(i)
                    yield sse({"index": i, "content": detok.flush() if detok else "", "tokens": [], "stop": True,
                               "model": self.model_name, "stop_type": "limit" if value == "length" else "eos",
                               "tokens_predicted": counts[i], "tokens_evaluated": len(sessions[0].req.prompt)})
        finally:
            for s in sessions:
                s.cancel()


def _stamped(app: Any, fingerprint: str):
    """Every HTTP answer carries the model's public fingerprint (header ``x-aloepri-model-fingerprint``), so a
    client checks each reply against its key: the stamp and the reply arrive together, so no restart of the
    server can fall between the check and the ids it decodes."""
    from .client.guard import FINGERPRINT_HEADER

    header = (FINGERPRINT_HEADER.encode(), fingerprint.encode())

    async def stamped_app(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def stamped_send(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), header]}
            await send(msg)

        await app(scope, receive, stamped_send)

    return stamped_app


async def _collect(sessions: list[Session]) -> tuple[list[tuple[list[int], list, str]], str | None]:
    """Every choice's (token ids, [(id, logprobs) per step], finish reason), or the first error."""
    ids: list[list[int]] = [[] for _ in sessions]
    steps: list[list] = [[] for _ in sessions]
    finish: list[str | None] = [None] * len(sessions)
    events = sessions[0].events
    while any(f is None for f in finish):
        kind, value, i = await events.get()
        if kind == "token":
            ids[i].append(value[0])
            if value[1] is not None:
                steps[i].append(value)
        elif kind == "done":
            finish[i] = value
        else:
            return [], value
    return list(zip(ids, steps, finish)), None


async def _cancel_on_disconnect(request, sessions: list[Session]) -> None:
    await client_disconnected(request)
    for s in sessions:
        s.cancel()
    sessions[0].events.put_nowait(("error", "the client disconnected", 0))  # ends _collect: no handler left waiting


def serve_local(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                threads: int | None = None, log_level: str = "info", dtype: str = "auto",
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    import uvicorn

    if threads:
        torch.set_num_threads(threads)
    server = LocalServer(model_dir, model_name, dtype=dtype if dtype == "auto" else getattr(torch, dtype),
                         max_request_bytes=max_request_bytes)
    print(f"aloepri serve-local: {server.model_name} ({server.model_dir}) on http://{host}:{port}  "
          f"[no key here: the server sees token ids only]", flush=True)
    uvicorn.run(server.app(), host=host, port=port, log_level=log_level)


class ServerThread:
    """Run an ASGI app with uvicorn in a background thread on a loopback port (tests, benchmarks, embedding).

    ``with ServerThread(app) as url: ...``; the port is bound before the thread starts (port 0: a free one).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket

        import uvicorn

        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it every answer
        # written in two parts (headers, body) waits ~40 ms for the client's delayed ACK
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()
