"""The synchronous client: :class:`Client` and its :class:`ReplyStream` only move bytes between httpx and the
sans-IO :class:`~.exchange.ReplyState`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from ...keyfile import KeyFile
from .decode import Completion, Delta
from .errors import upstream_errors
from .exchange import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, ClientBase, ClientCore, ReplyState, ReplyStreamBase
from .guard import listing_of
from .wire import Backend, GenerationParams, generation_params, normalize_base_url


def fetch_models(base_url: str, headers: dict | None = None, timeout: Any = 10.0, http: Any = None) -> Any:
    """GET /v1/models of a server (sync); None if it has no usable one (error status, not JSON)."""
    import httpx2

    base = normalize_base_url(base_url)
    with upstream_errors("connect", base):
        if http is not None:
            r = http.get(base + "/v1/models", headers=headers or {})
        else:
            r = httpx2.get(base + "/v1/models", headers=headers or {}, timeout=timeout)
    return listing_of(r.status_code, r.content)


class Client(ClientBase):
    """Synchronous client; its API (``chat``, ``stream_chat``, ``complete``, ``stream_complete``) is
    :class:`~.exchange.ClientBase`'s. ``http_client``: an ``httpx2.Client`` to use instead of its own (then
    :meth:`close` leaves it open)."""

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT, *,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, http_client: Any = None):
        import httpx2

        self.core = ClientCore(key, base_url, model, tokenizer, api_key, timeout, backend, server_tokenizer,
                               default_max_tokens)
        self._http = http_client or httpx2.Client(timeout=self.core.http_timeout())
        self._own_http = http_client is None

    def close(self) -> None:
        if self._own_http:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def listing(self) -> Any:
        """The server's /v1/models, or None if it has no usable one."""
        return fetch_models(self.core.base_url, self.core.headers, http=self._http)

    def verify(self) -> bool:
        """Check the key against the fingerprint the server publishes (``aloepri serve-local`` does, in
        ``/v1/models``), and check every later reply against this listing. True: verified; False: the server
        publishes none; raises KeyMismatchError."""
        return self.core.verify_listing(self.listing())

    def open(self, plain_ids: list[int], params: GenerationParams, *, stream: bool = True,
             default_max: int | None = None) -> ReplyStream:
        """Send plaintext prompt ids: the connected :class:`ReplyStream`."""
        return ReplyStream(self, self.core.start(plain_ids, params, stream, default_max))

    def _reply(self, prompt_ids: Callable[[Any], list[int]], prompt: Any, params: dict[str, Any], stream: bool):
        rs = self.open(prompt_ids(prompt), generation_params(**params), stream=stream,
                       default_max=self.core.default_max_tokens)
        return rs if stream else rs.collect()


class ReplyStream(ReplyStreamBase):
    """Iterator of :class:`Delta`; ``result`` / ``results`` hold the completions once it is exhausted. It connects
    when made, so errors surface at the call."""

    def __init__(self, client: Client, state: ReplyState):
        super().__init__(state)
        self._resp = self._connect(client)

    def _connect(self, client: Client):
        st, http = self._state, client._http
        req = http.build_request(st.method, st.url, json=st.body, headers=st.headers)
        with upstream_errors("connect", st.base_url):
            resp = http.send(req, stream=True)
        try:
            step = st.on_head(resp.status_code, resp.headers, resp.extensions.get("network_stream"))
            if step == st.READ_ERROR:
                st.on_error_body(resp.read())
            elif step == st.CHECK_LISTING:
                st.on_listing(client.listing())
        except BaseException:
            resp.close()
            raise
        return resp

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            resp.close()

    def collect(self) -> Completion | list[Completion]:
        """Read the reply to its end: the completion (with ``n`` > 1 a list, one per choice)."""
        with self:
            for _ in self:
                pass
        return self._state.outcome()

    def _raw(self) -> Iterator[Any]:
        import httpx2

        if not self._state.upstream_stream:
            yield self._resp.read()
        else:
            for sse in httpx2.EventSource(self._resp):
                yield sse.data

    def __iter__(self) -> Iterator[Delta]:
        st = self._state
        try:
            with upstream_errors(st.stage):
                for raw in self._raw():
                    yield from st.feed(raw)
                    if not st.reads_on():
                        break
            yield from st.end()
        finally:
            self.close()
