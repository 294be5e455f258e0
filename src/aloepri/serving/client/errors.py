"""What can go wrong with the inference server, as :class:`UpstreamError` subclasses that carry the HTTP status a
proxy should answer with, and :func:`upstream_errors`, the one mapping of httpx transport errors onto them."""
from __future__ import annotations

import json
from contextlib import contextmanager


class UpstreamError(RuntimeError):
    """The inference server could not be used. ``status`` is the HTTP status a proxy should answer with."""

    status = 502
    code = "upstream_error"

    def __init__(self, message: str, upstream_status: int | None = None):
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamHTTPError(UpstreamError):
    """The server answered with an error status; 4xx about the request itself are the caller's to fix."""

    def __init__(self, message: str, upstream_status: int):
        super().__init__(message, upstream_status)
        if upstream_status in (400, 413, 422):
            self.status, self.code = 400, "upstream_rejected_request"
        elif upstream_status in (429, 503):
            self.status, self.code = upstream_status, "upstream_overloaded"
        else:
            self.status, self.code = 502, "upstream_http_error"


class UpstreamProtocolError(UpstreamError):
    """The server answered, but not in the shape the chosen backend expects."""

    code = "upstream_protocol_error"


class UpstreamModelMismatch(UpstreamError):
    """The server now serves another model than the one the key belongs to: its reply is not decoded (it would
    be garbage under this key)."""

    code = "upstream_model_mismatch"


def _upstream_error_message(resp_text: str) -> str:
    try:
        data = json.loads(resp_text)
    except ValueError:
        return resp_text.strip()[:500]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:500]
    if isinstance(err, str):
        return err[:500]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:500]
    return resp_text.strip()[:500]


def http_error(status: int, body: bytes | str) -> UpstreamHTTPError:
    """The error for an answer with a status other than 200 (``body``: what the server said)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return UpstreamHTTPError(f"the inference server answered {status}: {_upstream_error_message(text)}", status)


@contextmanager
def upstream_errors(stage: str, base_url: str = ""):
    """The one mapping of httpx transport errors to :class:`UpstreamError`; ``stage`` is what was under way:
    ``connect`` (sending a request), ``read`` (reading a whole answer) or ``stream`` (reading server-sent events)."""
    import httpx2

    try:
        yield
    except httpx2.TimeoutException as e:
        where = {"connect": f" at {base_url}", "read": "", "stream": ""}[stage]
        raise UpstreamTimeout(f"the inference server{where} timed out" + (" while streaming" if stage == "stream"
                                                                          else "")) from e
    except httpx2.TransportError as e:
        raise UpstreamUnreachable({"connect": f"cannot reach the inference server at {base_url}",
                                   "read": "the inference server dropped the connection",
                                   "stream": "the inference server dropped the stream"}[stage] + f": {e}") from e
    except httpx2.SSEError as e:
        raise UpstreamProtocolError(f"the server's stream is not server-sent events: {e}") from e
