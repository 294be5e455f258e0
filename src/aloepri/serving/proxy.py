"""``aloepri proxy``: a local OpenAI-compatible endpoint that keeps the key and talks to the untrusted server.

Any OpenAI client (the official ``openai`` SDK, curl, LangChain) points its ``base_url`` at the proxy. For each
request the proxy renders the chat template, tokenizes and permutes on the way out (through
:class:`aloepri.serving.client.AsyncClient`), and maps ids back, detokenizes and applies stop strings on the way back.
It forwards only what it understands: unknown request fields are dropped, never sent upstream.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{name}``, ``GET /health``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (both with ``stream: true`` as server-sent events; ``n``, ``logprobs`` and, on chat,
``tools`` are served: see docs/serving.md's table), ``POST /v1/embeddings`` (refused). With client API keys every
``/v1`` route needs one (401 otherwise). Errors are OpenAI-shaped ``{"error": {...}}``: 404 for a model name
other than the served one, 400 for malformed requests, 502 when the server is unreachable, answers badly or
serves another model than the key's (checked reply by reply before decoding, see
:class:`aloepri.serving.client.UpstreamGuard`), 504 when it times out.
Nothing is logged in plaintext unless ``log_plaintext`` is set: the log has ids of requests, token counts,
timings and statuses only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import AsyncClient, AsyncReplyStream, Completion, GenerationParams, TokenLogprob, UpstreamError
from .http import (DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_NAMES, SSE_DONE, BadRequest, browser_guard,
                   client_disconnected, error_body, error_response, event_stream, number, openai_app, parse_json_body,
                   read_body, sse)
from .limits import DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_QUEUE, ClientLimits, Limited, Slot
from .tools import ToolCallStream, check_tools, parse_tool_calls, template_tool_calls

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


MAX_CHOICES = 16  # n
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs


def _common_params(body: dict, vocab_size: int, max_tokens_default: int | None) -> GenerationParams:
    n = number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
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
        n=n,
    )


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (0..20) -> the number of top tokens, None for none."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise BadRequest("'logprobs' must be a boolean", "logprobs")
    top = number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if top and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None


def _include_usage(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return bool(so.get("include_usage"))


def _flag(body: dict, name: str) -> bool:
    """A boolean field, false when absent or null."""
    flag = body.get(name, False)
    if flag is None:
        return False
    if not isinstance(flag, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return flag


def _special_tokens_flag(body: dict) -> bool:
    """``parse_special_tokens: true`` (an aloepri extension): the caller's text may hold the template's control
    tokens (``<|im_end|>``...) and they are tokenized as such. Off by default, as in OpenAI's API: text is text."""
    return _flag(body, "parse_special_tokens")


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            if role == "function":
                raise BadRequest(f"messages[{i}]: the deprecated 'function' role is not supported; use 'tool'",
                                 "messages")
            raise BadRequest(f"messages[{i}]: 'role' must be one of {sorted(_ROLES)}", "messages")
        extra: dict[str, Any] = {}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise BadRequest(f"messages[{i}]: only assistant messages have 'tool_calls'", "messages")
            try:
                extra["tool_calls"] = template_tool_calls(m["tool_calls"], f"messages[{i}]")
            except ValueError as e:
                raise BadRequest(str(e), "messages") from None
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"messages[{i}]: a tool message needs 'tool_call_id'", "messages")
            extra["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                extra["name"] = m["name"]
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
        out.append({"role": "system" if role == "developer" else role, "content": content, **extra})
    return out


def _tools(body: dict, tokenizer: Any) -> list[dict] | None:
    """The tools to render into the prompt (None: no tool calling for this request)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise BadRequest("the deprecated 'functions' / 'function_call' are not supported; use 'tools'", "functions")
    if choice is not None and choice not in ("none", "auto"):
        if choice == "required" or isinstance(choice, dict):
            raise BadRequest("tool_choice 'required' or a named function needs constrained decoding on the server, "
                             "which masks tokens by their text; the server sees only the obfuscated vocabulary, so "
                             "it cannot enforce it: use 'auto'", "tool_choice")
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or a named function", "tool_choice")
    if tools is None or tools == [] or choice == "none":
        if tools is not None:
            try:
                check_tools(tools)
            except ValueError as e:
                raise BadRequest(str(e), "tools") from None
        return None
    try:
        tools = check_tools(tools)
    except ValueError as e:
        raise BadRequest(str(e), "tools") from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tools" not in template:
        raise BadRequest("this model's chat template does not render tools, so the model would never see them: "
                         "tool calling needs a model trained for it (e.g. Qwen2.5)", "tools")
    return tools


def _reject_unsupported(body: dict, endpoint: str) -> None:
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise BadRequest("'response_format' json_object / json_schema is not supported: it needs constrained "
                         "decoding on the server, which masks tokens by their text, and the server sees only the "
                         "obfuscated vocabulary (it cannot tell which token is which without the key). Ask for "
                         "JSON in the prompt and validate the reply on your side", "response_format")
    if endpoint != "chat":
        if body.get("tools") is not None or body.get("tool_choice") is not None:
            raise BadRequest("tools are a chat feature: use /v1/chat/completions", "tools")
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


@dataclass
class _Ask:
    """One parsed request: what to send (plaintext prompt ids, parameters) and how to answer."""

    kind: str  # "chat" | "completions"
    plain: list[int]
    params: GenerationParams
    stream: bool = False
    include_usage: bool = False
    ids_out: bool = False  # completions: the plaintext reply ids too
    tools: list[dict] | None = None  # chat: parse tool calls from the reply


def _api_key_guard(app, keys: list[str]):
    """Every ``/v1`` route needs ``Authorization: Bearer KEY`` with one of ``keys`` (as ``vllm serve --api-key``);
    compared in constant time. ``/health`` stays open."""
    import hmac

    expected = [k.encode() for k in keys]

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            ok = False
            for k in expected:  # every key compared, so timing tells nothing about which matched
                ok |= hmac.compare_digest(token, k)
            if not ok:
                resp = error_response(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with a key "
                                           "this proxy was started with (--api-key)", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        return await app(scope, receive, send)

    return guarded


STABLE_MODEL_NAME = "aloepri"  # always accepted, whatever the upstream calls its model (start order, restarts)


class Proxy:
    """The proxy app. ``context_len``: the model's context (prompt + reply tokens), None if unknown;
    ``max_tokens_limit``: a ceiling on the reply length set by the operator. A request's ``max_tokens`` is capped
    at both (at the context less the prompt). ``api_keys``: the keys a client must send (none: open).
    ``max_request_bytes``: the largest request body (413 above). ``allowed_hosts`` / ``allowed_origins``: the
    ``Host`` names and browser ``Origin`` headers answered (see :func:`aloepri.serving.http.browser_guard`).
    ``limits``: each client's request rate, requests in flight and queue (:class:`~aloepri.serving.limits.ClientLimits`;
    default: the default concurrency and queue, no rate limit); over them, 429 with ``Retry-After``."""

    def __init__(self, client: AsyncClient, model_name: str, *, log_plaintext: bool = False,
                 chat_max_tokens: int | None = None, context_len: int | None = None,
                 max_tokens_limit: int | None = None, api_keys: list[str] | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allowed_hosts: list[str] | None = None,
                 allowed_origins: list[str] | None = None, limits: ClientLimits | None = None):
        self.client = client
        self.model_name = model_name
        self.log_plaintext = log_plaintext
        self.chat_max_tokens = chat_max_tokens if chat_max_tokens is not None else client.core.default_max_tokens
        self.context_len = context_len
        self.max_tokens_limit = max_tokens_limit
        self.api_keys = [k for k in (api_keys or []) if k]
        self.max_request_bytes = max_request_bytes
        self.allowed_hosts = list(LOOPBACK_NAMES) + list(allowed_hosts or [])
        self.allowed_origins = list(allowed_origins or [])
        self.limits = limits if limits is not None else ClientLimits()
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
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", _guard(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", _guard(self.completions), methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ]
        app = openai_app(routes, on_shutdown=self.client.aclose)
        app = _api_key_guard(app, self.api_keys) if self.api_keys else app
        return browser_guard(app, self.allowed_hosts, self.allowed_origins)

    async def health(self, request):
        from starlette.responses import JSONResponse

        guard = self.client.core.guard
        counts = {"in_flight": self.in_flight, "queued": self.limits.queued}
        if guard.status == "mismatch":
            return JSONResponse({"status": "error", **counts, "key_check": guard.status, "detail": guard.problem},
                                status_code=503)
        return JSONResponse({"status": "ok", **counts, "key_check": guard.status})

    def _model_entry(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "aloepri-proxy"}

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def model(self, request):
        from starlette.responses import JSONResponse

        name = request.path_params["model"]
        if not self._serves(name):
            return self._unknown_model(name).response()
        return JSONResponse(self._model_entry())

    def _serves(self, name: str) -> bool:
        return name in (self.model_name, STABLE_MODEL_NAME)

    def _unknown_model(self, name: str) -> BadRequest:
        return BadRequest(f"The model `{name}` does not exist. This proxy serves `{self.model_name}` (also "
                          f"called `{STABLE_MODEL_NAME}`).", "model", status=404, code="model_not_found")

    async def embeddings(self, request):
        return error_response(400, "/v1/embeddings is not supported by the aloepri proxy: it serves a generative "
                                   "model through token ids, and an embedding endpoint of the server would return "
                                   "vectors of the obfuscated model, not of the plaintext one",
                              code="unsupported_endpoint")

    # -- endpoints: each parses its body into an _Ask, and what to log
    async def chat_completions(self, request):
        return await self._endpoint(request, "chat", "chatcmpl", self._parse_chat)

    async def completions(self, request):
        return await self._endpoint(request, "completions", "cmpl", self._parse_completion)

    def _parse_chat(self, body: dict):
        messages = _messages(body)
        params = _common_params(body, self.client.key.vocab_size, self.chat_max_tokens)
        params.logprobs = _chat_logprobs(body)
        if self.client.tokenizer is None:
            raise BadRequest("this proxy has no tokenizer (and chat template) for the model: use /v1/completions "
                             "with token ids, or start the proxy with --tokenizer")
        tools = _tools(body, self.client.tokenizer)
        # the messages' text alone: a template renders all of it (other fields it may drop), so this never
        # refuses a prompt that fits
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        special_tokens = _special_tokens_flag(body)
        try:
            plain = self.client.core.chat_prompt_ids(messages, tools=tools, special_tokens=special_tokens)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise BadRequest(f"the chat template rejected the messages ({type(e).__name__})", "messages") from None
        return _Ask("chat", plain, params, tools=tools), ("messages", messages)

    def _parse_completion(self, body: dict):
        prompt = _completion_prompt(body, self.client.tokenizer is not None)
        params = _common_params(body, self.client.key.vocab_size, 16)  # OpenAI's default for completions
        params.logprobs = number(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
        if isinstance(prompt, str):
            self._check_prompt_chars(len(prompt), "prompt")
        special_tokens = _special_tokens_flag(body)
        try:
            plain = self.client.core.completion_prompt_ids(prompt, special_tokens=special_tokens)
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from None
        if params.stop and self.client.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer; this proxy has none for the model", "stop")
        ids_out = self.client.tokenizer is None or bool(body.get("return_token_ids"))
        return (_Ask("completions", plain, params, ids_out=ids_out),
                ("prompt", prompt if isinstance(prompt, str) else list(prompt)))

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a text too long for the context before tokenizing it: no token stands for more than
        ``max_chars_per_token`` characters, so the prompt has at least chars / that many tokens."""
        per_token = self.client.core.prompts.max_chars_per_token if self.client.core.prompts else None
        if self.context_len is None or per_token is None:
            return
        if chars > self.context_len * per_token:
            raise BadRequest(f"the prompt is too long: its {chars} characters make at least {-(-chars // per_token)} "
                             f"tokens; the model's context is {self.context_len}", param)

    def _parse(self, raw: bytes, kind: str, parse) -> tuple[_Ask, tuple[str, Any]]:
        """The whole request, from its bytes to the prompt's ids: validation, template and tokenizer, in one place
        (run in a worker thread: the CPU-heavy part of a request never holds up the event loop)."""
        body = parse_json_body(raw)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string", "model")
        if model is not None and not self._serves(model):
            raise self._unknown_model(model)
        _reject_unsupported(body, kind)
        stream, include_usage = _flag(body, "stream"), _include_usage(body)
        ask, logged = parse(body)
        ask.stream, ask.include_usage = stream, include_usage
        return ask, logged

    def _client_id(self, request) -> str:
        """Whose limits a request counts against: its API key when the proxy has keys (the key guard has checked
        it), else its address."""
        if self.api_keys:
            auth = request.headers.get("authorization", "")
            return "key:" + auth[7:].strip()
        return "addr:" + (request.client.host if request.client else "")

    async def _endpoint(self, request, kind: str, id_prefix: str, parse):
        import anyio

        rid = f"{id_prefix}-{uuid.uuid4().hex[:24]}"
        t0 = time.perf_counter()
        who = self._client_id(request)
        slot = None
        try:
            self.limits.check_rate(who)
            raw = await read_body(request, self.max_request_bytes)
            slot = self.limits.try_enter(who)
            if slot is None:  # wait in the client's queue, unless the client leaves first
                slot = await _unless_disconnected(request, self.limits.enter(who))
                if slot is None:
                    log.info("%s %s client disconnected while queued after %.0f ms", rid, kind,
                             1e3 * (time.perf_counter() - t0))
                    return error_response(499, "client closed the request")
            ask, (what, plaintext) = await anyio.to_thread.run_sync(self._parse, raw, kind, parse)
        except Limited as e:
            log.info("%s %s 429 %s", rid, kind, e.code)
            return error_response(429, str(e), "rate_limit_error", code=e.code,
                                  headers={"Retry-After": str(e.retry_after)})
        except BadRequest as e:
            if slot is not None:
                slot.release()
            log.info("%s %s %d %s", rid, kind, e.status, "unknown model" if e.status == 404 else e)
            return e.response()
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        if self.log_plaintext:
            log.info("%s %s plaintext %s=%s", rid, kind, what, json.dumps(plaintext, ensure_ascii=False))
        return await self._serve(request, rid, ask, t0, slot)

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

    async def _serve(self, request, rid: str, ask: _Ask, t0: float, slot: Slot | None = None):
        """Answer one parsed request; ``slot`` (its place among the client's requests in flight) is released
        when the answer is complete: at once for a whole answer, when the stream closes for a stream."""
        slot = slot or Slot(None, "")
        streaming = False
        try:
            response = await self._answer(request, rid, ask, t0, slot)
            streaming = ask.stream and response.status_code == 200
            return response
        finally:
            if not streaming:
                slot.release()

    async def _answer(self, request, rid: str, ask: _Ask, t0: float, slot: Slot):
        from starlette.responses import JSONResponse

        kind, params = ask.kind, ask.params
        try:
            asked = params.max_tokens
            params.max_tokens = self._capped_max_tokens(asked, len(ask.plain),
                                                        "messages" if kind == "chat" else "prompt")
        except BadRequest as e:
            log.info("%s %s 400 %s", rid, kind, e)
            return error_response(400, str(e), param=e.param)
        if params.max_tokens != asked:
            log.info("%s %s max_tokens %s capped at %d", rid, kind, asked, params.max_tokens)
        self.in_flight += 1
        try:
            if ask.stream:
                rs = await self.client.open(ask.plain, params, stream=True, default_max=params.max_tokens)
            else:  # the upstream answers only when done: watch the client from the request on, not just the reply
                results = await _unless_disconnected(request, self._complete(ask.plain, params))
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
        if ask.stream:
            closed = False

            async def on_close():
                nonlocal closed
                if not closed:
                    closed = True
                    self.in_flight -= 1
                    try:
                        await rs.aclose()
                    finally:
                        slot.release()

            return event_stream(self._sse(rs, rid, ask, t0), on_close)
        self.in_flight -= 1
        if results is None:
            log.info("%s %s client disconnected after %.0f ms", rid, kind, 1e3 * (time.perf_counter() - t0))
            return error_response(499, "client closed the request")
        self._log_done(rid, kind, results, t0, stream=False)
        choices = [self._choice(ask, r) for r in results]
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": results[0].usage})

    def _choice(self, ask: _Ask, r: Completion) -> dict:
        """One whole choice in OpenAI's shape."""
        text = r.text or ""
        if ask.kind == "completions":
            choice = {"index": r.index, "text": text, "logprobs": _completion_logprobs(r.logprobs, 0),
                      "finish_reason": r.finish_reason}
            if ask.ids_out:
                choice["token_ids"] = r.token_ids
            return choice
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = r.finish_reason
        parsed = parse_tool_calls(text, _tool_names(ask.tools)) if ask.tools else None
        if parsed is not None:
            message["content"], message["tool_calls"] = parsed
            finish = "tool_calls"
        return {"index": r.index, "message": message, "logprobs": _chat_logprobs_out(r.logprobs),
                "finish_reason": finish}

    async def _complete(self, plain: list[int], params: GenerationParams) -> list[Completion]:
        rs = await self.client.open(plain, params, stream=False, default_max=params.max_tokens)
        await rs.collect()
        return rs.results

    def _log_done(self, rid: str, kind: str, results: list[Completion], t0: float, stream: bool) -> None:
        first = results[0]
        log.info("%s %s 200 stream=%s prompt_tokens=%d completion_tokens=%d choices=%d finish=%s ms=%.0f", rid, kind,
                 stream, first.usage["prompt_tokens"], first.usage["completion_tokens"], len(results),
                 ",".join(r.finish_reason for r in results), 1e3 * (time.perf_counter() - t0))
        if self.log_plaintext:
            log.info("%s %s plaintext reply=%s", rid, kind, json.dumps([r.text for r in results], ensure_ascii=False))

    async def _sse(self, rs: AsyncReplyStream, rid: str, ask: _Ask, t0: float):
        import anyio

        kind = ask.kind
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = ask.params.n
        tool_streams = [ToolCallStream(_tool_names(ask.tools)) for _ in range(n)] if ask.tools else None
        offsets = [0] * n  # completions' text_offset, per choice

        def chunk(index: int, delta: dict | None = None, text: str | None = None, finish: str | None = None,
                  token_ids: list[int] | None = None, logprobs: Any = None):
            if kind == "chat":
                choice = {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
                if ask.ids_out:
                    choice["token_ids"] = token_ids or []
            out = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            return sse(out, ensure_ascii=False)

        completed = False
        try:
            if kind == "chat":
                for i in range(n):
                    yield chunk(i, {"role": "assistant", "content": ""})
            async for d in rs:
                i, text = d.index, d.text if d.text else None
                if kind == "chat":
                    if tool_streams is not None and text is not None:
                        text = tool_streams[i].push(text) or None
                    lps = _chat_logprobs_out(d.logprobs) if d.logprobs else None
                    if text is not None or lps:
                        yield chunk(i, {"content": text or ""}, logprobs=lps)
                elif text is not None or d.token_ids or d.logprobs:
                    lps = _completion_logprobs(d.logprobs, offsets[i]) if d.logprobs else None
                    if lps:
                        offsets[i] += sum(len(t) for t in lps["tokens"])
                    yield chunk(i, text=text, token_ids=d.token_ids, logprobs=lps)
            results = rs.results
            for r in results:
                i, finish = r.index, r.finish_reason
                if tool_streams is not None:
                    rest, calls = tool_streams[i].finish()
                    if rest:
                        yield chunk(i, {"content": rest})
                    if calls:
                        finish = "tool_calls"
                        yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                yield chunk(i, {} if kind == "chat" else None, finish=finish)
            if ask.include_usage:
                u = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                     "usage": results[0].usage}
                yield sse(u)
            yield SSE_DONE
            completed = True
            self._log_done(rid, kind, results, t0, stream=True)
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


def _tool_names(tools: list[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def _token_bytes(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8"))


def _chat_logprobs_out(lps: list[TokenLogprob] | None) -> dict | None:
    """OpenAI chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    if lps is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _token_bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for _, t, lp in e.top]}
                        for e in lps]}


def _completion_logprobs(lps: list[TokenLogprob] | None, offset: int) -> dict | None:
    """OpenAI completions' ``logprobs`` (as vLLM fills it): tokens, token_logprobs, top_logprobs, text_offset."""
    if lps is None:
        return None
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for e in lps:
        token = e.token if e.token is not None else f"token_id:{e.token_id}"
        out["text_offset"].append(offset)
        out["tokens"].append(token)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({(t if t is not None else f"token_id:{tid}"): lp for tid, t, lp in e.top})
        offset += len(token)
    return out


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
                max_tokens_limit: int | None = None, client_api_key: str | list[str] | None = None,
                upstream_wait: float = 0.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None,
                rate_limit: float | None = None, rate_burst: float | None = None,
                max_concurrent: int | None = DEFAULT_MAX_CONCURRENT, max_queue: int = DEFAULT_MAX_QUEUE) -> Proxy:
    """Load the key and tokenizer, check the key where possible, and return the :class:`Proxy`.

    ``backend``: the wire protocol, or ``"auto"``: probe the upstream and choose (:mod:`aloepri.serving.detect`;
    the CLI's default); :class:`~aloepri.serving.detect.NoBackend` when it fits none.

    Key checks at start: the permutation must cover the tokenizer's vocabulary (and the upstream's, where its
    /v1/models tells it; a damaged key is refused, not left to fail every request); against ``model_meta`` (a
    local copy of the server directory's aloepri_model.json) if given, and against the fingerprint the upstream
    publishes: in /v1/models (``aloepri serve-local``) or in llama.cpp's /props (the chat template of a GGUF
    written by ``aloepri export-gguf`` carries it; vLLM publishes none). A mismatch raises KeyMismatchError. After
    that (unless ``verify`` is off) every reply is checked before it is decoded, so a server restarted with
    another model is refused, not decoded into garbage: see :class:`aloepri.serving.client.UpstreamGuard`.

    ``upstream_wait``: seconds to keep asking an upstream that is not up yet (started together with the proxy)
    before giving up with UpstreamUnreachable; 0 starts without it (its first answer is then checked).

    ``client_api_key``: the key (or keys) the proxy's own clients must send as ``Authorization: Bearer`` on every
    ``/v1`` route (``api_key`` is the upstream's).

    ``max_tokens`` of a request is capped at the model's context less the prompt (the context from the
    upstream's /v1/models, else the source checkpoint's config.json) and at ``max_tokens_limit`` if given.

    ``rate_limit`` (requests per second, bursts of ``rate_burst``), ``max_concurrent`` and ``max_queue``: each
    client's limits (see :mod:`aloepri.serving.limits`; a client is its API key, else its address).
    """
    from .client import (BACKENDS, UpstreamGuard, UpstreamTimeout, UpstreamUnreachable, check_model_meta,
                         context_in_listing, fingerprint_in_listing, listing_entries, normalize_base_url)
    from .client.guard import fingerprint_in_props
    from ..keyfile import KeyFileError, check_fingerprint, load_key

    upstream = normalize_base_url(upstream)
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be at least 1, not {max_tokens_limit}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose auto or one of {', '.join(BACKENDS)}")
    limits = ClientLimits(rate_limit, rate_burst, max_concurrent, max_queue)
    keyfile = load_key(key) if not hasattr(key, "vocab_permutation") else key
    status = "unchecked"
    if model_meta:
        check_model_meta(keyfile, model_meta)
        status = "verified-local-meta"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    listing, reachable = None, True
    try:
        listing = _wait_for_listing(upstream, headers, min(timeout, 10.0), upstream_wait)
    except (UpstreamUnreachable, UpstreamTimeout) as e:
        if upstream_wait > 0:
            raise UpstreamUnreachable(f"the upstream {upstream} did not answer within {upstream_wait:g} s ({e}); "
                                      "start it first, or give --upstream-wait SECONDS") from None
        if backend == "auto":
            raise UpstreamUnreachable(f"the upstream {upstream} is not reachable ({e}), so its protocol cannot be "
                                      "probed: start it first, give --upstream-wait SECONDS, or --backend") from None
        reachable = False
        log.warning("upstream not reachable at start (%s); the key will be checked against its first answer", e)
    entries = listing_entries(listing) or []
    if model is None and entries:
        model = entries[0].get("id")
    upstream_vocab = _vocab_in_listing(listing, model)
    if upstream_vocab is not None and upstream_vocab > keyfile.vocab_size:
        raise KeyFileError(f"the key is damaged or belongs to another model: its permutation covers "
                           f"{keyfile.vocab_size} token ids, the upstream's model has {upstream_vocab}")
    props = None
    if backend == "auto":
        detected = _detect(upstream, headers, min(timeout, 60.0), keyfile, model, server_tokenizer)
        backend, props = detected.backend, detected.props
        log.info("backend: %s, chosen because %s (--backend overrides)", backend, detected.reason)
    elif backend == "llamacpp-native" and verify and reachable:
        props = _llamacpp_props(upstream, headers, min(timeout, 10.0))
    if verify and (entries or props):
        fp = fingerprint_in_listing(listing, model) or fingerprint_in_props(props)
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
    keys = [client_api_key] if isinstance(client_api_key, str) else list(client_api_key or [])
    return Proxy(client, served_model_name or model or STABLE_MODEL_NAME, log_plaintext=log_plaintext,
                 chat_max_tokens=chat_max_tokens, context_len=context_len, max_tokens_limit=max_tokens_limit,
                 api_keys=keys, max_request_bytes=max_request_bytes, allowed_hosts=allowed_hosts,
                 allowed_origins=allowed_origins, limits=limits)


def _detect(upstream: str, headers: dict, timeout: float, key, model: str | None, server_tokenizer: Any):
    """:func:`aloepri.serving.detect.detect_backend` over a fresh connection, probing with the key's permuted
    end-of-text id."""
    import httpx2

    from .client import make_backend
    from .detect import detect_backend

    eos = key.obfuscated_eos_ids()
    probe_id = eos[0] if eos else int(key.encode_ids([0])[0])
    codec = make_backend("openai-text", server_tokenizer, key.vocab_size).codec
    with httpx2.Client(timeout=timeout) as http:
        return detect_backend(http, upstream, headers, probe_id, model, codec)


def _llamacpp_props(upstream: str, headers: dict, timeout: float) -> dict | None:
    """llama.cpp's /props (None when the server has none)."""
    import httpx2

    from .client import upstream_errors
    from .detect import llamacpp_props

    with upstream_errors("connect", upstream):
        r = httpx2.get(upstream + "/props", headers=headers, timeout=timeout)
    return llamacpp_props(r.status_code, r.content)


def _wait_for_listing(upstream: str, headers: dict, timeout: float, wait: float) -> Any:
    """The upstream's /v1/models (None when it has none), asked again every half second for up to ``wait`` seconds
    while nothing answers on its port yet (serve-local and vLLM open it once the model is loaded)."""
    from .client import UpstreamTimeout, UpstreamUnreachable, fetch_models

    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            return fetch_models(upstream, headers, timeout=timeout)
        except (UpstreamUnreachable, UpstreamTimeout):
            if time.monotonic() >= deadline:
                raise
        if not said:
            log.warning("waiting up to %g s for the upstream %s to come up", wait, upstream)
            said = True
        time.sleep(0.5)


def _vocab_in_listing(listing: Any, model: str | None) -> int | None:
    """The vocabulary size the upstream reports for ``model`` (serve-local: ``aloepri.vocab_size``), if any."""
    from .client import listing_entries

    for entry in listing_entries(listing) or []:
        if model is None or entry.get("id") == model:
            meta = entry.get("aloepri")
            size = meta.get("vocab_size") if isinstance(meta, dict) else None
            return size if isinstance(size, int) and not isinstance(size, bool) else None
    return None


def _source_context(key) -> int | None:
    """``max_position_embeddings`` of the source checkpoint the key names, if it is a directory still there."""
    try:
        cfg = json.loads((Path(key.source) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    ctx = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
