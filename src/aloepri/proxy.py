"""``aloepri proxy``: a local OpenAI-compatible endpoint that keeps the key and talks to the untrusted server.

Any OpenAI client (the official ``openai`` SDK, curl, LangChain) points its ``base_url`` at the proxy. For each
request the proxy renders the chat template, tokenizes and permutes on the way out (through
:class:`aloepri.client.AsyncClient`), and maps ids back, detokenizes and applies stop strings on the way back.
It forwards only what it understands: unknown request fields are dropped, never sent upstream.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(both with ``stream: true`` as server-sent events). Errors are OpenAI-shaped ``{"error": {...}}``:
400 for malformed requests, 502 when the server is unreachable or answers badly, 504 when it times out.
Nothing is logged in plaintext unless ``log_plaintext`` is set: the log has ids of requests, token counts,
timings and statuses only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from .client import AsyncClient, AsyncReplyStream, Completion, GenerationParams, UpstreamError

log = logging.getLogger("aloepri.proxy")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": etype, "param": param, "code": code}},
                        status_code=status)


def _upstream_error_body(e: UpstreamError) -> dict:
    etype = "invalid_request_error" if e.status == 400 else "upstream_error"
    return {"error": {"message": str(e), "type": etype, "param": None, "code": e.code}}


# --------------------------------------------------------------------------------------------- validation


def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be in {rng}", name)
    return int(v) if integer else float(v)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise BadRequest("'stop' must be a string or a list of strings", "stop")


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for k, v in lb.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' keys must be token ids", "logit_bias") from None
        if not 0 <= tid < vocab_size or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest("'logit_bias' holds an unknown token id or a bias outside [-100, 100]", "logit_bias")
        out[tid] = float(v)
    return out or None


def _common_params(body: dict, vocab_size: int, max_tokens_default: int | None) -> GenerationParams:
    n = body.get("n")
    if n not in (None, 1):
        raise BadRequest("only n=1 is supported", "n")
    max_tokens = _number(body, "max_completion_tokens", lo=1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", lo=1, integer=True)
    return GenerationParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1),
        top_k=_number(body, "top_k", -1, integer=True),
        min_p=_number(body, "min_p", 0, 1),
        seed=_number(body, "seed", integer=True),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2),
        repetition_penalty=_number(body, "repetition_penalty", 0.01, 10),
        logit_bias=_logit_bias(body, vocab_size),
        stop=_stop(body),
    )


def _include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return bool(so.get("include_usage"))


def _stream_flag(body: dict) -> bool:
    s = body.get("stream", False)
    if s is None:
        return False
    if not isinstance(s, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    return s


_ROLES = {"system", "developer", "user", "assistant"}


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            if role in ("tool", "function"):
                raise BadRequest(f"messages[{i}]: tool messages are not supported by the aloepri proxy", "messages")
            raise BadRequest(f"messages[{i}]: 'role' must be one of {sorted(_ROLES)}", "messages")
        if m.get("tool_calls"):
            raise BadRequest(f"messages[{i}]: tool calls are not supported by the aloepri proxy", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}]: 'content' must be a string or a list of text parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _reject_unsupported(body: dict, endpoint: str) -> None:
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none", "auto"):
        raise BadRequest("tool calling is not supported by the aloepri proxy", "tools")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise BadRequest("'response_format' other than text is not supported by the aloepri proxy", "response_format")
    if endpoint == "chat":
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
            raise BadRequest("logprobs are not supported by the aloepri proxy", "logprobs")
    else:
        if body.get("logprobs") is not None:
            raise BadRequest("logprobs are not supported by the aloepri proxy", "logprobs")
        if body.get("echo"):
            raise BadRequest("'echo' is not supported by the aloepri proxy", "echo")
        if body.get("suffix") is not None:
            raise BadRequest("'suffix' is not supported by the aloepri proxy", "suffix")
        if body.get("best_of") not in (None, 1):
            raise BadRequest("only best_of=1 is supported", "best_of")


def _completion_prompt(body: dict, has_tokenizer: bool) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise BadRequest("'prompt' is empty", "prompt")
        if not has_tokenizer:
            raise BadRequest("this proxy has no tokenizer for the model: send 'prompt' as token ids", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise BadRequest("only one prompt per request is supported", "prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", "prompt")


async def _json_body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


# ----------------------------------------------------------------------------------------------- the app


def _guard(handler):
    """Unexpected exceptions become a 500 whose log line names the exception type only (its message or
    traceback could carry plaintext)."""
    import functools

    @functools.wraps(handler)
    async def wrapped(request):
        try:
            return await handler(request)
        except Exception as e:  # noqa: BLE001
            log.error("internal error (%s)", type(e).__name__)
            return error_response(500, "internal error in the aloepri proxy", "server_error")

    return wrapped


def _closing_stream(gen, on_close):
    """A StreamingResponse that always runs ``on_close`` (also when the client leaves before the first byte)."""
    import anyio
    from starlette.responses import StreamingResponse

    class _Closing(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                with anyio.CancelScope(shield=True):
                    await on_close()

    return _Closing(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})


class Proxy:
    def __init__(self, client: AsyncClient, model_name: str, *, log_plaintext: bool = False,
                 chat_max_tokens: int | None = None, fingerprint_status: str = "unchecked"):
        self.client = client
        self.model_name = model_name
        self.log_plaintext = log_plaintext
        self.chat_max_tokens = chat_max_tokens if chat_max_tokens is not None else client.core.default_max_tokens
        self.fingerprint_status = fingerprint_status
        self.created = int(time.time())
        self.in_flight = 0

    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def http_error(request, exc):
            etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return error_response(exc.status_code, str(exc.detail), etype)

        import contextlib

        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await self.client.aclose()

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", _guard(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", _guard(self.completions), methods=["POST"]),
        ]
        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "in_flight": self.in_flight, "key_check": self.fingerprint_status})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "aloepri-proxy"}]})

    # -- chat
    async def chat_completions(self, request):
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        t0 = time.perf_counter()
        try:
            body = await _json_body(request)
            _reject_unsupported(body, "chat")
            messages = _messages(body)
            params = _common_params(body, self.client.key.vocab_size, self.chat_max_tokens)
            stream, include_usage = _stream_flag(body), _include_usage(body)
            if self.client.tokenizer is None:
                raise BadRequest("this proxy has no tokenizer (and chat template) for the model: use /v1/completions "
                                 "with token ids, or start the proxy with --tokenizer")
            try:
                plain = self.client.core.chat_prompt_ids(messages)
            except Exception as e:  # a template that rejects the conversation (e.g. role order)
                raise BadRequest(f"the chat template rejected the messages ({type(e).__name__})", "messages") from None
        except BadRequest as e:
            log.info("%s chat 400 %s", rid, e)
            return error_response(400, str(e), param=e.param)
        if self.log_plaintext:
            log.info("%s chat plaintext messages=%s", rid, json.dumps(messages, ensure_ascii=False))
        return await self._serve(request, rid, "chat", plain, params, stream, include_usage, t0)

    # -- completions
    async def completions(self, request):
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        t0 = time.perf_counter()
        try:
            body = await _json_body(request)
            _reject_unsupported(body, "completions")
            prompt = _completion_prompt(body, self.client.tokenizer is not None)
            params = _common_params(body, self.client.key.vocab_size, 16)  # OpenAI's default for completions
            stream, include_usage = _stream_flag(body), _include_usage(body)
            try:
                plain = self.client.core.completion_prompt_ids(prompt)
            except ValueError as e:
                raise BadRequest(str(e), "prompt") from None
            if params.stop and self.client.tokenizer is None:
                raise BadRequest("stop strings need a tokenizer; this proxy has none for the model", "stop")
        except BadRequest as e:
            log.info("%s completions 400 %s", rid, e)
            return error_response(400, str(e), param=e.param)
        if self.log_plaintext:
            log.info("%s completions plaintext prompt=%s", rid,
                     json.dumps(prompt if isinstance(prompt, str) else list(prompt), ensure_ascii=False))
        ids_out = self.client.tokenizer is None or bool(body.get("return_token_ids"))
        return await self._serve(request, rid, "completions", plain, params, stream, include_usage, t0, ids_out)

    # -- shared
    async def _serve(self, request, rid, kind, plain, params, stream, include_usage, t0, ids_out=False):
        from starlette.responses import JSONResponse

        self.in_flight += 1
        try:
            rs = await self.client.open(plain, params, stream=stream, default_max=params.max_tokens)
        except UpstreamError as e:
            self.in_flight -= 1
            log.warning("%s %s %d upstream: %s", rid, kind, e.status, e.code)
            return JSONResponse(_upstream_error_body(e), status_code=e.status)
        except ValueError as e:
            self.in_flight -= 1
            return error_response(400, str(e))
        except BaseException:
            self.in_flight -= 1
            raise
        if stream:
            closed = False

            async def on_close():
                nonlocal closed
                if not closed:
                    closed = True
                    self.in_flight -= 1
                    await rs.aclose()

            return _closing_stream(self._sse(rs, rid, kind, include_usage, t0, ids_out), on_close)
        try:
            result = await _collect_unless_disconnected(request, rs)
        except UpstreamError as e:
            log.warning("%s %s %d upstream: %s", rid, kind, e.status, e.code)
            return JSONResponse(_upstream_error_body(e), status_code=e.status)
        finally:
            self.in_flight -= 1
        if result is None:
            log.info("%s %s client disconnected after %.0f ms", rid, kind, 1e3 * (time.perf_counter() - t0))
            return error_response(499, "client closed the request")
        self._log_done(rid, kind, result, t0, stream=False)
        created = int(time.time())
        if kind == "chat":
            out = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text or ""},
                                "logprobs": None, "finish_reason": result.finish_reason}],
                   "usage": result.usage}
        else:
            choice = {"index": 0, "text": result.text or "", "logprobs": None, "finish_reason": result.finish_reason}
            if ids_out:
                choice["token_ids"] = result.token_ids
            out = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [choice], "usage": result.usage}
        return JSONResponse(out)

    def _log_done(self, rid: str, kind: str, result: Completion, t0: float, stream: bool) -> None:
        log.info("%s %s 200 stream=%s prompt_tokens=%d completion_tokens=%d finish=%s ms=%.0f", rid, kind, stream,
                 result.usage["prompt_tokens"], result.usage["completion_tokens"], result.finish_reason,
                 1e3 * (time.perf_counter() - t0))
        if self.log_plaintext:
            log.info("%s %s plaintext reply=%s", rid, kind, json.dumps(result.text, ensure_ascii=False))

    async def _sse(self, rs: AsyncReplyStream, rid: str, kind: str, include_usage: bool, t0: float, ids_out: bool):
        import anyio

        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, token_ids: list[int] | None = None, first=False):
            if kind == "chat":
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
                if ids_out:
                    choice["token_ids"] = token_ids or []
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            return f"data: {json.dumps(out, ensure_ascii=False, separators=(',', ':'))}\n\n"

        completed = False
        try:
            if kind == "chat":
                yield chunk("", None, first=True)
            async for d in rs:
                text = d.text if d.text else None
                if text is not None or (kind != "chat" and d.token_ids):
                    yield chunk(text, None, d.token_ids)
            result = rs.result
            yield chunk(None if kind == "chat" else "", result.finish_reason)
            if include_usage:
                u = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                     "usage": result.usage}
                yield f"data: {json.dumps(u, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"
            completed = True
            self._log_done(rid, kind, result, t0, stream=True)
        except UpstreamError as e:
            log.warning("%s %s upstream error mid-stream: %s", rid, kind, e.code)
            yield f"data: {json.dumps(_upstream_error_body(e), separators=(',', ':'))}\n\n"
        except Exception as e:  # noqa: BLE001 - type only in the log (the message could carry plaintext)
            log.error("%s %s internal error mid-stream (%s)", rid, kind, type(e).__name__)
            err = {"error": {"message": "internal error in the aloepri proxy", "type": "server_error", "param": None,
                             "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            if not completed:
                log.info("%s %s stream ended early after %.0f ms", rid, kind, 1e3 * (time.perf_counter() - t0))
            with anyio.CancelScope(shield=True):
                await rs.aclose()


async def _collect_unless_disconnected(request, rs: AsyncReplyStream) -> Completion | None:
    """Collect a reply; if the HTTP client goes away first, close the upstream request and return None."""
    work = asyncio.ensure_future(rs.collect())

    async def disconnected():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        try:
            await work
        except (asyncio.CancelledError, Exception):
            pass
        await rs.aclose()
        return None
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()


def build_proxy(key, upstream: str, *, model: str | None = None, served_model_name: str | None = None,
                backend: str = "openai-completions", tokenizer: Any = None, server_tokenizer: Any = None,
                api_key: str | None = None, timeout: float = 300.0, log_plaintext: bool = False,
                chat_max_tokens: int = 512, verify: bool = True, model_meta: str | None = None) -> Proxy:
    """Load the key and tokenizer, check the key where possible, and return the :class:`Proxy`.

    Key checks: against ``model_meta`` (a local copy of the server directory's aloepri_model.json) if given,
    and against the fingerprint the upstream lists in /v1/models if it lists one (``aloepri serve-local`` does;
    vLLM and llama.cpp do not). A mismatch raises KeyMismatchError.
    """
    from .client import UpstreamTimeout, UpstreamUnreachable, check_model_meta, fetch_models, fingerprint_in_listing
    from .keyfile import KeyMismatchError, load_key

    keyfile = load_key(key) if not hasattr(key, "vocab_permutation") else key
    status = "unchecked"
    if model_meta:
        check_model_meta(keyfile, model_meta)
        status = "verified-local-meta"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    listing = None
    try:
        listing = fetch_models(upstream, headers, timeout=min(timeout, 10.0))
    except (UpstreamUnreachable, UpstreamTimeout) as e:
        log.warning("upstream not reachable at start (%s); the key was not checked against it", e)
    entries = [m for m in (listing or {}).get("data") or [] if isinstance(m, dict)] if isinstance(listing, dict) else []
    if model is None and entries:
        model = entries[0].get("id")
    if verify and entries:
        fp = fingerprint_in_listing(listing, model)
        if fp is not None and fp != keyfile.model_fingerprint:
            raise KeyMismatchError(
                f"the key does not belong to the model {upstream} serves: key fingerprint "
                f"{keyfile.model_fingerprint[:16]}..., served model {fp[:16]}...")
        if fp is not None:
            status = "verified-upstream"
        elif status == "unchecked":
            log.warning("the upstream does not publish the model fingerprint: the key could not be checked "
                        "(give --model-meta with the server directory's aloepri_model.json to check it)")
    client = AsyncClient(keyfile, upstream, model=model, tokenizer=tokenizer, api_key=api_key, timeout=timeout,
                         backend=backend, server_tokenizer=server_tokenizer, default_max_tokens=chat_max_tokens)
    return Proxy(client, served_model_name or model or "aloepri", log_plaintext=log_plaintext,
                 chat_max_tokens=chat_max_tokens, fingerprint_status=status)
