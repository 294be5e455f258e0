"""``aloepri proxy``: a local OpenAI-compatible endpoint that keeps the key and talks to the untrusted server.

Any OpenAI client (the official ``openai`` SDK, curl, LangChain) points its ``base_url`` at the proxy. For each
request the proxy renders the chat template, tokenizes and permutes on the way out (through
:class:`aloepri.serving.client.AsyncClient`), and maps ids back, detokenizes and applies stop strings on the way back.
It forwards only what it understands: unknown request fields are dropped, never sent upstream.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(both with ``stream: true`` as server-sent events). Errors are OpenAI-shaped ``{"error": {...}}``:
400 for malformed requests, 502 when the server is unreachable, answers badly or serves another model than the
key's (checked reply by reply before decoding, see :class:`aloepri.serving.client.UpstreamGuard`), 504 when it times out.
Nothing is logged in plaintext unless ``log_plaintext`` is set: the log has ids of requests, token counts,
timings and statuses only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from .client import AsyncClient, AsyncReplyStream, Completion, GenerationParams, UpstreamError
from .http import (SSE_DONE, BadRequest, client_disconnected, error_body, error_response, event_stream, number,
                   openai_app, read_json_body, sse)

log = logging.getLogger("aloepri.serving.proxy")


def _upstream_error_body(e: UpstreamError) -> dict:
    return error_body(str(e), "invalid_request_error" if e.status == 400 else "upstream_error", code=e.code)


# --------------------------------------------------------------------------------------------- validation


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
    if number(body, "n", 1, integer=True) != 1:
        raise BadRequest("only n=1 is supported", "n")
    max_tokens = number(body, "max_completion_tokens", lo=1, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", lo=1, integer=True)
    return GenerationParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=number(body, "temperature", lo=0, hi=2),
        top_p=number(body, "top_p", lo=0, hi=1),
        top_k=number(body, "top_k", lo=-1, hi=1 << 31, integer=True),
        min_p=number(body, "min_p", lo=0, hi=1),
        seed=number(body, "seed", integer=True),
        presence_penalty=number(body, "presence_penalty", lo=-2, hi=2),
        frequency_penalty=number(body, "frequency_penalty", lo=-2, hi=2),
        repetition_penalty=number(body, "repetition_penalty", lo=0.01, hi=10),
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
        if not isinstance(role, str) or role not in _ROLES:
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
        if number(body, "best_of", 1, integer=True) != 1:
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


class Proxy:
    """The proxy app. ``context_len``: the model's context (prompt + reply tokens), None if unknown;
    ``max_tokens_limit``: a ceiling on the reply length set by the operator. A request's ``max_tokens`` is capped
    at both (at the context less the prompt)."""

    def __init__(self, client: AsyncClient, model_name: str, *, log_plaintext: bool = False,
                 chat_max_tokens: int | None = None, context_len: int | None = None,
                 max_tokens_limit: int | None = None):
        self.client = client
        self.model_name = model_name
        self.log_plaintext = log_plaintext
        self.chat_max_tokens = chat_max_tokens if chat_max_tokens is not None else client.core.default_max_tokens
        self.context_len = context_len
        self.max_tokens_limit = max_tokens_limit
        self.created = int(time.time())
        self.in_flight = 0

    @property
    def fingerprint_status(self) -> str:
        """How the key was last checked against the upstream (see :class:`aloepri.serving.client.UpstreamGuard`)."""
        return self.client.core.guard.status

    def app(self):
        from starlette.routing import Route

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", _guard(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", _guard(self.completions), methods=["POST"]),
        ]
        return openai_app(routes, on_shutdown=self.client.aclose)

    async def health(self, request):
        from starlette.responses import JSONResponse

        guard = self.client.core.guard
        if guard.status == "mismatch":
            return JSONResponse({"status": "error", "in_flight": self.in_flight, "key_check": guard.status,
                                 "detail": guard.problem}, status_code=503)
        return JSONResponse({"status": "ok", "in_flight": self.in_flight, "key_check": guard.status})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "aloepri-proxy"}]})

    # -- endpoints: each parses its body into (plaintext prompt ids, parameters, what to log, ids out?)
    async def chat_completions(self, request):
        return await self._endpoint(request, "chat", "chatcmpl", self._parse_chat)

    async def completions(self, request):
        return await self._endpoint(request, "completions", "cmpl", self._parse_completion)

    def _parse_chat(self, body: dict):
        messages = _messages(body)
        params = _common_params(body, self.client.key.vocab_size, self.chat_max_tokens)
        if self.client.tokenizer is None:
            raise BadRequest("this proxy has no tokenizer (and chat template) for the model: use /v1/completions "
                             "with token ids, or start the proxy with --tokenizer")
        try:
            plain = self.client.core.chat_prompt_ids(messages)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise BadRequest(f"the chat template rejected the messages ({type(e).__name__})", "messages") from None
        return plain, params, ("messages", messages), False

    def _parse_completion(self, body: dict):
        prompt = _completion_prompt(body, self.client.tokenizer is not None)
        params = _common_params(body, self.client.key.vocab_size, 16)  # OpenAI's default for completions
        try:
            plain = self.client.core.completion_prompt_ids(prompt)
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from None
        if params.stop and self.client.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer; this proxy has none for the model", "stop")
        ids_out = self.client.tokenizer is None or bool(body.get("return_token_ids"))
        return plain, params, ("prompt", prompt if isinstance(prompt, str) else list(prompt)), ids_out

    async def _endpoint(self, request, kind: str, id_prefix: str, parse):
        rid = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
        t0 = time.perf_counter()
        try:
            body = await read_json_body(request)
            _reject_unsupported(body, kind)
            stream, include_usage = _stream_flag(body), _include_usage(body)
            plain, params, (what, plaintext), ids_out = parse(body)
        except BadRequest as e:
            log.info("%s %s 400 %s", rid, kind, e)
            return error_response(400, str(e), param=e.param)
        if self.log_plaintext:
            log.info("%s %s plaintext %s=%s", rid, kind, what, json.dumps(plaintext, ensure_ascii=False))
        return await self._serve(request, rid, kind, plain, params, stream, include_usage, t0, ids_out)

    # -- shared
    def _capped_max_tokens(self, max_tokens: int | None, prompt_len: int, param: str) -> int | None:
        caps = [] if self.max_tokens_limit is None else [self.max_tokens_limit]
        if self.context_len is not None:
            if prompt_len >= self.context_len:
                raise BadRequest(f"the prompt has {prompt_len} tokens; the model's context is {self.context_len}",
                                 param)
            caps.append(self.context_len - prompt_len)
        bounds = [b for b in (max_tokens, *caps) if b is not None]
        return min(bounds) if bounds else None

    async def _serve(self, request, rid, kind, plain, params, stream, include_usage, t0, ids_out=False):
        from starlette.responses import JSONResponse

        try:
            asked = params.max_tokens
            params.max_tokens = self._capped_max_tokens(asked, len(plain), "messages" if kind == "chat" else "prompt")
        except BadRequest as e:
            log.info("%s %s 400 %s", rid, kind, e)
            return error_response(400, str(e), param=e.param)
        if params.max_tokens != asked:
            log.info("%s %s max_tokens %s capped at %d", rid, kind, asked, params.max_tokens)
        self.in_flight += 1
        try:
            if stream:
                rs = await self.client.open(plain, params, stream=True, default_max=params.max_tokens)
            else:  # the upstream answers only when done: watch the client from the request on, not just the reply
                result = await _unless_disconnected(request, self._complete(plain, params))
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

            return event_stream(self._sse(rs, rid, kind, include_usage, t0, ids_out), on_close)
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

    async def _complete(self, plain: list[int], params: GenerationParams) -> Completion:
        rs = await self.client.open(plain, params, stream=False, default_max=params.max_tokens)
        return await rs.collect()

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
            return sse(out, ensure_ascii=False)

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
                yield sse(u)
            yield SSE_DONE
            completed = True
            self._log_done(rid, kind, result, t0, stream=True)
        except UpstreamError as e:
            log.warning("%s %s upstream error mid-stream: %s", rid, kind, e.code)
            yield sse(_upstream_error_body(e))
        except Exception as e:  # noqa: BLE001 - type only in the log (the message could carry plaintext)
            log.error("%s %s internal error mid-stream (%s)", rid, kind, type(e).__name__)
            yield sse(error_body("internal error in the aloepri proxy", "server_error"))
        finally:
            if not completed:
                log.info("%s %s stream ended early after %.0f ms", rid, kind, 1e3 * (time.perf_counter() - t0))
            with anyio.CancelScope(shield=True):
                await rs.aclose()


async def _unless_disconnected(request, work):
    """Await ``work``; if the HTTP client goes away first, cancel it and return None. Cancelling closes the
    upstream request (also while still waiting for the upstream's answer), so the server stops generating."""
    task = asyncio.ensure_future(work)

    watch = asyncio.ensure_future(client_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return None
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


def build_proxy(key, upstream: str, *, model: str | None = None, served_model_name: str | None = None,
                backend: str = "openai-completions", tokenizer: Any = None, server_tokenizer: Any = None,
                api_key: str | None = None, timeout: float = 300.0, log_plaintext: bool = False,
                chat_max_tokens: int = 512, verify: bool = True, model_meta: str | None = None,
                max_tokens_limit: int | None = None) -> Proxy:
    """Load the key and tokenizer, check the key where possible, and return the :class:`Proxy`.

    Key checks at start: against ``model_meta`` (a local copy of the server directory's aloepri_model.json) if
    given, and against the fingerprint the upstream lists in /v1/models if it lists one (``aloepri serve-local``
    does; vLLM and llama.cpp do not). A mismatch raises KeyMismatchError. After that (unless ``verify`` is off)
    every reply is checked before it is decoded, so a server restarted with another model is refused, not
    decoded into garbage: see :class:`aloepri.serving.client.UpstreamGuard`.

    ``max_tokens`` of a request is capped at the model's context less the prompt (the context from the
    upstream's /v1/models, else the source checkpoint's config.json) and at ``max_tokens_limit`` if given.
    """
    from .client import (UpstreamGuard, UpstreamTimeout, UpstreamUnreachable, check_model_meta, listing_entries,
                         context_in_listing, fetch_models, fingerprint_in_listing, normalize_base_url)
    from ..keyfile import check_fingerprint, load_key

    upstream = normalize_base_url(upstream)
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be at least 1, not {max_tokens_limit}")
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
        log.warning("upstream not reachable at start (%s); the key will be checked against its first answer", e)
    entries = listing_entries(listing) or []
    if model is None and entries:
        model = entries[0].get("id")
    if verify and entries:
        fp = fingerprint_in_listing(listing, model)
        if fp is not None:
            check_fingerprint(keyfile, fp, f"the model {upstream} serves")
            status = "verified-upstream"
        elif status == "unchecked":
            log.warning("the upstream does not publish the model fingerprint: the key could not be checked "
                        "(give --model-meta with the server directory's aloepri_model.json to check it)")
    context_len = context_in_listing(listing, model) or _source_context(keyfile)
    if context_len is None and max_tokens_limit is None:
        log.warning("the model's context length is unknown (the upstream lists none): max_tokens is forwarded "
                    "uncapped; give --max-tokens-limit to cap it")
    client = AsyncClient(keyfile, upstream, model=model, tokenizer=tokenizer, api_key=api_key, timeout=timeout,
                         backend=backend, server_tokenizer=server_tokenizer, default_max_tokens=chat_max_tokens)
    client.core.guard = UpstreamGuard(keyfile.model_fingerprint, model, listing if verify else None, status,
                                      mode="pin" if verify else "off")
    return Proxy(client, served_model_name or model or "aloepri", log_plaintext=log_plaintext,
                 chat_max_tokens=chat_max_tokens, context_len=context_len, max_tokens_limit=max_tokens_limit)


def _source_context(key) -> int | None:
    """``max_position_embeddings`` of the source checkpoint the key names, if it is a directory still there."""
    try:
        cfg = json.loads((Path(key.source) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    ctx = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
