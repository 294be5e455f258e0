"""The OpenAI HTTP scaffold shared by ``aloepri proxy`` and ``aloepri serve-local``: request-body validation, the
error JSON, the app (lifespan, JSON 404), server-sent-event framing, the client-disconnect watcher, and the guard
against web pages (Host and Origin, :func:`browser_guard`).

Every malformed input becomes a :class:`BadRequest` (a 400 with an OpenAI-shaped error), never an exception from
deeper down.

Checked here, once, for the whole body: it is sent as ``application/json`` (415 otherwise: a browser sends
``text/plain`` cross-origin without asking first), no larger than the server's limit (413, refused from the
``Content-Length`` or as soon as the bytes read pass it, never buffered whole), UTF-8 JSON (no NaN/Infinity literals, no nesting deep enough to
exhaust the parser), an object, and every string in it is encodable (a lone surrogate such as ``"\\ud800"`` is
valid JSON but no tokenizer takes it). Numbers are checked per field by :func:`number`: finite, in range, and
integers where an integer is meant (64-bit at most: seeds and token counts end up in C code).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, Awaitable, Callable

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt in JSON, with room


class BadRequest(ValueError):
    """A request refused: answered with ``status`` (400: malformed) and this message (``param`` names the field)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def response(self):
        etype = "not_found_error" if self.status == 404 else "invalid_request_error"
        return error_response(self.status, str(self), etype, param=self.param, code=self.code)


def error_body(message: str, etype: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(status: int, message: str, etype: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None):
    """:func:`error_body` as a JSON response with ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, etype, param, code), status_code=status, headers=headers)


def openai_app(routes: list, on_shutdown: Callable[[], Any]):
    """A Starlette app: ``routes``, OpenAI-shaped JSON for 404/405, and ``on_shutdown`` (sync or async) when the
    server stops."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    async def http_error(request, exc):
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), etype)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        done = on_shutdown()
        if asyncio.iscoroutine(done):
            await done

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def sse(obj: Any, ensure_ascii: bool = True) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=ensure_ascii, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def event_stream(gen, on_close: Callable[[], Awaitable[None]] | None = None):
    """A text/event-stream response of ``gen``; ``on_close`` always runs, also when the client leaves before the
    first byte."""
    import anyio
    from starlette.responses import StreamingResponse

    class _Closing(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                if on_close is not None:
                    with anyio.CancelScope(shield=True):
                        await on_close()

    return _Closing(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})


async def read_body(request, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> bytes:
    """The raw body of a JSON request, at most ``max_bytes``: 415 unless it is sent as ``application/json``, 413 when
    larger (before reading it when ``Content-Length`` says so, else as soon as the bytes read pass the limit)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise BadRequest("send the request body as JSON with 'Content-Type: application/json'", status=415,
                         code="unsupported_media_type")
    too_large = BadRequest(f"the request body is larger than this server's limit of {max_bytes} bytes",
                           status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def client_disconnected(request) -> None:
    """Returns when the HTTP client goes away (reads the request's remaining messages until the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or :class:`BadRequest`."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except ValueError:  # also invalid UTF-8 and NaN / Infinity
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    where = _first_unencodable(body, "")
    if where is not None:
        field_name = where.split(".")[0].split("[")[0]
        raise BadRequest(f"{where}: a string holds a lone UTF-16 surrogate (not a Unicode character); send valid "
                         "Unicode text", None if field_name.startswith("(") else field_name)
    return body


def _first_unencodable(value: Any, where: str) -> str | None:
    """Path of the first string (key or value) that is not encodable as UTF-8, or None. Iterative: the body may
    be nested as deeply as the JSON parser allowed."""
    todo = [(value, where)]
    while todo:
        v, w = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return w
        elif isinstance(v, dict):
            for k, item in v.items():
                p = f"{w}.{k}" if w else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{w}.(a field name)" if w else "(a field name)"
                todo.append((item, p))
        elif isinstance(v, list):
            todo.extend((item, f"{w}[{i}]") for i, item in enumerate(v))
    return None


def number(body: dict, name: str, default: Any = None, lo: float | None = None, hi: float | None = None,
           integer: bool = False):
    """``body[name]`` as a finite number in [lo, hi] (an int if ``integer``; 64-bit integers at most), or
    ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    what = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{name}' must be {what}", name)
    if isinstance(v, float):
        if not math.isfinite(v) or (integer and not v.is_integer()):
            raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a finite number'}", name)
        if integer:
            v = int(v)
    elif not integer:
        if not INT64_MIN <= v <= INT64_MAX:
            raise BadRequest(f"'{name}' is out of range", name)
        v = float(v)
    if integer:
        lo = INT64_MIN if lo is None else max(lo, INT64_MIN)
        hi = INT64_MAX if hi is None else min(hi, INT64_MAX)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be in {rng}", name)
    return v


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without the port: ``[::1]:8080`` -> ``::1``, ``LocalHost:80`` -> ``localhost``."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def browser_guard(app, allowed_hosts: list[str], allowed_origins: list[str]):
    """Refuse what a web page in the user's browser could send to a server on loopback (403, before anything else):

    * a ``Host`` not in ``allowed_hosts`` (DNS rebinding: a page on evil.example whose name now points at 127.0.0.1
      sends ``Host: evil.example``, and could read the answers as same-origin);
    * an ``Origin`` not in ``allowed_origins`` (a cross-origin page; browsers send ``Origin`` on every
      cross-origin POST and on CORS requests, and a page can POST without a preflight).

    ``"*"`` in either allows any. Allowed origins also get CORS answers (preflight included), so a page the operator
    trusts can read the replies."""
    hosts = {host_name(h) for h in allowed_hosts}
    origins = {o.strip().lower().rstrip("/") for o in allowed_origins}
    inner = app
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        inner = CORSMiddleware(app, allow_origins=["*"] if "*" in origins else sorted(origins),
                               allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host")
            if host is not None and "*" not in hosts and host_name(host.decode("latin-1")) not in hosts:
                return await error_response(
                    403, "this server answers only requests addressed to "
                         f"{', '.join(sorted(hosts))} (Host header); the operator allows more names with --allowed-host",
                    code="host_not_allowed")(scope, receive, send)
            origin = headers.get(b"origin")
            if origin is not None and "*" not in origins and origin.decode("latin-1").strip().lower() not in origins:
                return await error_response(
                    403, "cross-origin requests from web pages are refused; the operator allows an origin with "
                         "--allowed-origin", code="origin_not_allowed")(scope, receive, send)
        return await inner(scope, receive, send)

    return guarded
