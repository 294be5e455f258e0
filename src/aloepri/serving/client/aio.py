"""The asyncio client (the proxy's): :class:`AsyncClient` and its :class:`AsyncReplyStream` only move bytes
between httpx and the sans-IO :class:`~.exchange.ReplyState`, as :mod:`.sync` does."""
from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from ...keyfile import KeyFile
from .decode import Completion, Delta
from .errors import upstream_errors
from .exchange import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, ClientBase, ClientCore, ReplyStreamBase
from .guard import listing_of
from .wire import Backend, GenerationParams, generation_params


class AsyncClient(ClientBase):
    """The asyncio twin of :class:`~.sync.Client`: the same ``chat``, ``stream_chat``, ``complete`` and
    ``stream_complete``, as coroutines (``stream = await client.stream_chat(...)``, then ``async for delta in
    stream``)."""

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT, *,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, http_client: Any = None, max_connections: int = 256):
        import httpx2

        self.core = ClientCore(key, base_url, model, tokenizer, api_key, timeout, backend, server_tokenizer,
                               default_max_tokens)
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=32)
        self._http = http_client or httpx2.AsyncClient(timeout=self.core.http_timeout(), limits=limits)
        self._own_http = http_client is None
        # the guard's /v1/models checks get a pool of their own: a check holds back a reply that holds a connection,
        # so with every connection of the main pool held that way, checks drawing on it would wait forever
        self._check_http = http_client or httpx2.AsyncClient(timeout=self.core.http_timeout(),
                                                             limits=httpx2.Limits(max_connections=4))

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()
            await self._check_http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def listing(self, http: Any = None) -> Any:
        """The server's /v1/models, or None if it has no usable one (as :func:`~.sync.fetch_models`)."""
        with upstream_errors("connect", self.core.base_url):
            r = await (http or self._http).get(self.core.base_url + "/v1/models", headers=self.core.headers)
        return listing_of(r.status_code, r.content)

    async def verify(self) -> bool:
        """As :meth:`~.sync.Client.verify`."""
        return self.core.verify_listing(await self.listing())

    async def open(self, plain_ids: list[int], params: GenerationParams, *, stream: bool = True,
                   default_max: int | None = None) -> AsyncReplyStream:
        """Send plaintext prompt ids: the connected :class:`AsyncReplyStream`."""
        rs = AsyncReplyStream(self.core.start(plain_ids, params, stream, default_max))
        await rs._connect(self)
        return rs

    async def _reply(self, prompt_ids: Callable[[Any], list[int]], prompt: Any, params: dict[str, Any],
                     stream: bool):
        rs = await self.open(prompt_ids(prompt), generation_params(**params), stream=stream,
                             default_max=self.core.default_max_tokens)
        return rs if stream else await rs.collect()


OFFLOAD_BYTES = 16384


class AsyncReplyStream(ReplyStreamBase):
    """The asyncio twin of :class:`~.sync.ReplyStream`: the same :class:`~.exchange.ReplyState`, driven by an async
    connection."""

    async def _connect(self, client: AsyncClient) -> None:
        st, http = self._state, client._http
        req = http.build_request(st.method, st.url, json=st.body, headers=st.headers)
        with upstream_errors("connect", st.base_url):
            resp = await http.send(req, stream=True)
        try:
            step = st.on_head(resp.status_code, resp.headers, resp.extensions.get("network_stream"))
            if step == st.READ_ERROR:
                st.on_error_body(await resp.aread())
            elif step == st.CHECK_LISTING:
                st.on_listing(await client.listing(client._check_http))
        except BaseException:
            await resp.aclose()
            raise
        self._resp = resp

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def aclose(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            await resp.aclose()

    async def collect(self) -> Completion | list[Completion]:
        """Read the reply to its end: the completion (with ``n`` > 1 a list, one per choice)."""
        try:
            async for _ in self:
                pass
        finally:
            await self.aclose()
        return self._state.outcome()

    async def _raw(self) -> AsyncIterator[Any]:
        import httpx2

        if not self._state.upstream_stream:
            yield await self._resp.aread()
        else:
            async for sse in httpx2.EventSource(self._resp):
                yield sse.data

    async def __aiter__(self) -> AsyncIterator[Delta]:
        import anyio

        st = self._state
        try:
            with upstream_errors(st.stage):
                async with aclosing(self._raw()) as raws:
                    async for raw in raws:
                        # a large answer (a whole reply, logprobs) is decoded in a worker thread: the event loop
                        # serves other requests meanwhile; a streamed token is too small to be worth the hop
                        heavy = len(raw) > OFFLOAD_BYTES
                        for delta in (await anyio.to_thread.run_sync(st.feed, raw)) if heavy else st.feed(raw):
                            yield delta
                        if not st.reads_on():
                            break
            for delta in st.end():
                yield delta
        finally:
            await self.aclose()
