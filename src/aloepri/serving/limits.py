"""Per-client limits of the proxy: a request rate (token bucket), a number of requests in flight, and a bounded
queue for the requests waiting for a slot. Whatever is over a limit is answered 429 with ``Retry-After`` at
once, never held without bound: a flood costs the proxy a fixed amount of memory.

A client is its API key when the proxy has client keys (``--api-key``), else its address (on loopback every
local program is the same client). Pure asyncio, no I/O: :class:`ClientLimits` is fed a client id and a clock.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

DEFAULT_MAX_CONCURRENT = 32  # requests of one client in flight upstream at once
DEFAULT_MAX_QUEUE = 128  # requests of one client waiting for one of those slots


class Limited(Exception):
    """Over a limit: answer 429 with ``Retry-After: retry_after`` (whole seconds, at least 1)."""

    def __init__(self, message: str, retry_after: float, code: str):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
        self.code = code


@dataclass
class _State:
    tokens: float
    stamp: float
    active: int = 0
    waiters: deque = field(default_factory=deque)

    def idle(self, burst: float) -> bool:
        return self.active == 0 and not self.waiters and self.tokens >= burst


class Slot:
    """One admitted request; :meth:`release` (idempotent) frees its place for the next one in the queue."""

    def __init__(self, limits: ClientLimits | None, client: str):
        self._limits, self._client = limits, client

    def release(self) -> None:
        if self._limits is not None:
            limits, self._limits = self._limits, None
            limits._release(self._client)


class ClientLimits:
    """``rate``: requests per second per client (None: no rate limit), with bursts of up to ``burst`` requests
    (default: one second's worth, at least 1). ``max_concurrent``: a client's requests in flight at once (None: no
    limit); the next ``max_queue`` wait in order for a slot; any more are refused."""

    def __init__(self, rate: float | None = None, burst: float | None = None,
                 max_concurrent: int | None = DEFAULT_MAX_CONCURRENT, max_queue: int = DEFAULT_MAX_QUEUE,
                 clock: Callable[[], float] = time.monotonic):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"the rate limit must be a positive number of requests per second, not {rate}")
        if burst is not None and not (math.isfinite(burst) and burst >= 1):
            raise ValueError(f"the burst must be at least 1 request, not {burst}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"the concurrency limit must be at least 1, not {max_concurrent}")
        if max_queue < 0:
            raise ValueError(f"the queue length must be 0 or more, not {max_queue}")
        self.rate, self.max_concurrent, self.max_queue, self.clock = rate, max_concurrent, max_queue, clock
        self.burst = float(burst if burst is not None else max(1.0, rate or 1.0))
        self._clients: dict[str, _State] = {}
        self.refused = {"rate": 0, "queue": 0}

    @property
    def active(self) -> int:
        return sum(s.active for s in self._clients.values())

    @property
    def queued(self) -> int:
        return sum(len(s.waiters) for s in self._clients.values())

    def _state(self, client: str, now: float) -> _State:
        st = self._clients.get(client)
        if st is None:
            if len(self._clients) > 1024:  # forget clients with nothing going on (their bucket is full anyway)
                for k in [k for k, s in self._clients.items() if s.idle(self.burst)]:
                    del self._clients[k]
            st = self._clients[client] = _State(self.burst, now)
        return st

    def check_rate(self, client: str) -> None:
        """Take one request from ``client``'s bucket, or raise :class:`Limited` (the request is not counted)."""
        if self.rate is None:
            return
        now = self.clock()
        st = self._state(client, now)
        st.tokens = min(self.burst, st.tokens + (now - st.stamp) * self.rate)
        st.stamp = now
        if st.tokens < 1:
            self.refused["rate"] += 1
            raise Limited(f"rate limit reached: at most {self.rate:g} requests per second per client "
                          f"(bursts of {self.burst:g}); retry later", (1 - st.tokens) / self.rate,
                          "rate_limit_exceeded")
        st.tokens -= 1

    def try_enter(self, client: str) -> Slot | None:
        """A slot for one request of ``client`` if one is free now; None if it must wait in the queue
        (:meth:`enter`); :class:`Limited` if the queue is full."""
        if self.max_concurrent is None:
            return Slot(None, client)
        st = self._state(client, self.clock())
        if st.active < self.max_concurrent and not st.waiters:
            st.active += 1
            return Slot(self, client)
        if len(st.waiters) >= self.max_queue:
            self.refused["queue"] += 1
            raise Limited(f"too many requests at once: {self.max_concurrent} in flight and {self.max_queue} waiting "
                          "per client; retry later", 1, "too_many_concurrent_requests")
        return None

    async def enter(self, client: str) -> Slot:
        """A slot for one request of ``client``: at once, after waiting in its queue, or :class:`Limited` when
        the queue is full. Cancelling the wait (the client left) gives up the place in the queue."""
        slot = self.try_enter(client)
        if slot is not None:
            return slot
        st = self._clients[client]
        fut = asyncio.get_running_loop().create_future()
        st.waiters.append(fut)
        try:
            await fut  # the releasing request hands its slot over (active stays counted)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed over just as we were cancelled: pass it on
                self._release(client)
            else:
                try:
                    st.waiters.remove(fut)
                except ValueError:
                    pass
            raise
        return Slot(self, client)

    def _release(self, client: str) -> None:
        st = self._clients.get(client)
        if st is None:
            return
        while st.waiters:
            fut = st.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to it: active unchanged
                return
        st.active -= 1
