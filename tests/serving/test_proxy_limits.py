"""The proxy's per-client limits: a request rate (429 with Retry-After past it), a number of requests in flight,
and a bounded queue for the rest (429 once it is full); one client's flood leaves another client's requests alone.
The limiter alone on a fake clock, then through the proxy against a stand-in engine on loopback."""
import asyncio
import time

import httpx2
import pytest

from aloepri.serving.limits import ClientLimits, Limited
from aloepri.serving.local_server import ServerThread
from aloepri.serving.proxy import build_proxy
from serving_helpers import CharTokenizer, EchoUpstream, synthetic_key


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_rate_limit_refills_at_the_rate_and_says_when_to_retry():
    clock = Clock()
    lim = ClientLimits(rate=2.0, burst=3, max_concurrent=None, clock=clock)
    for _ in range(3):  # the burst
        lim.check_rate("a")
    with pytest.raises(Limited) as e:
        lim.check_rate("a")
    assert e.value.retry_after == 1 and e.value.code == "rate_limit_exceeded"
    lim.check_rate("b")  # another client has its own bucket
    clock.t += 0.5  # one more request's worth at 2/s
    lim.check_rate("a")
    with pytest.raises(Limited):
        lim.check_rate("a")
    clock.t += 10  # a full bucket holds the burst, no more
    for _ in range(3):
        lim.check_rate("a")
    with pytest.raises(Limited):
        lim.check_rate("a")
    assert lim.refused["rate"] == 3
    slow = ClientLimits(rate=0.1, max_concurrent=None, clock=clock)
    slow.check_rate("a")
    with pytest.raises(Limited) as e:
        slow.check_rate("a")
    assert e.value.retry_after == 10  # a request's worth of tokens takes 10 s at 0.1/s


def test_concurrency_queue_is_first_come_first_served_bounded_and_cancellable():
    async def main():
        lim = ClientLimits(max_concurrent=2, max_queue=2)
        a, b = await lim.enter("x"), await lim.enter("x")
        order = []

        async def wait(name):
            slot = await lim.enter("x")
            order.append(name)
            return slot

        w1 = asyncio.ensure_future(wait("w1"))
        await asyncio.sleep(0)
        w2 = asyncio.ensure_future(wait("w2"))
        await asyncio.sleep(0)
        assert lim.queued == 2 and lim.active == 2
        with pytest.raises(Limited) as e:  # the queue is full
            lim.try_enter("x")
        assert e.value.retry_after == 1 and e.value.code == "too_many_concurrent_requests"
        assert (await lim.enter("y")) is not None  # another client is not held up
        w1.cancel()  # a client that leaves gives up its place
        await asyncio.sleep(0)
        assert lim.queued == 1
        a.release()
        a.release()  # idempotent
        s2 = await w2
        assert order == ["w2"] and lim.active == 3 and lim.queued == 0  # x: b and w2; y: one
        b.release()
        s2.release()
        assert lim.active == 1

    asyncio.run(main())


def test_bad_limits_are_refused():
    for kw in ({"rate": 0}, {"rate": float("nan")}, {"rate": 1, "burst": 0.5}, {"max_concurrent": 0},
               {"max_queue": -1}):
        with pytest.raises(ValueError):
            ClientLimits(**kw)


@pytest.fixture(scope="module")
def echo():
    key = synthetic_key(96)
    upstream = EchoUpstream(key, reply_len=6, delay=0.05)
    with ServerThread(upstream.app()) as url:
        yield key, url, upstream


def _settle(proxy) -> None:
    """Wait for the proxy to close what its clients have read to the end (a stream ends just after its last byte)."""
    deadline = time.monotonic() + 10
    while (proxy.limits.active or proxy.limits.queued) and time.monotonic() < deadline:
        time.sleep(0.01)


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4, "temperature": 0}


def test_over_the_concurrency_and_queue_a_client_gets_429_and_another_client_is_served(echo):
    key, url, _ = echo
    proxy = build_proxy(key, url, tokenizer=CharTokenizer(), client_api_key=["k-flood", "k-calm"], max_concurrent=2,
                        max_queue=1)
    with ServerThread(proxy.app()) as px:
        async def main():
            async with httpx2.AsyncClient(timeout=30) as http:
                async def one(i, api_key):  # streamed: the stand-in engine takes 50 ms a token
                    r = await http.post(px + "/v1/chat/completions", json={**_chat(i), "stream": True},
                                        headers={"Authorization": f"Bearer {api_key}"})
                    return r

                flood = [asyncio.ensure_future(one(i, "k-flood")) for i in range(8)]
                await asyncio.sleep(0.02)
                calm = await one(99, "k-calm")
                return await asyncio.gather(*flood), calm

        flood, calm = asyncio.run(main())
        assert calm.status_code == 200
        codes = sorted(r.status_code for r in flood)
        assert codes == [200] * 3 + [429] * 5, codes  # two in flight, one queued, the rest refused
        refused = [r for r in flood if r.status_code == 429]
        assert all(r.headers["retry-after"] == "1" for r in refused)
        body = refused[0].json()["error"]
        assert body["code"] == "too_many_concurrent_requests" and body["type"] == "rate_limit_error"
        _settle(proxy)
        assert proxy.limits.active == 0 and proxy.limits.queued == 0
        assert httpx2.get(px + "/health").json()["queued"] == 0


def test_rate_limit_answers_429_with_retry_after_per_api_key(echo):
    key, url, _ = echo
    proxy = build_proxy(key, url, tokenizer=CharTokenizer(), client_api_key=["k-a", "k-b"], rate_limit=0.5,
                        rate_burst=2)
    with ServerThread(proxy.app()) as px, httpx2.Client(timeout=30) as http:
        def post(api_key):
            return http.post(px + "/v1/chat/completions", json=_chat(1), headers={"Authorization": f"Bearer {api_key}"})

        assert [post("k-a").status_code for _ in range(3)] == [200, 200, 429]
        r = post("k-a")
        assert r.status_code == 429 and r.headers["retry-after"] == "2"  # one request's worth at 0.5/s
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert post("k-b").status_code == 200  # another key has its own bucket
        assert http.post(px + "/v1/chat/completions", json=_chat(1)).status_code == 401  # no key: never counted


def test_a_streaming_request_holds_its_slot_until_the_stream_ends(echo):
    key, url, _ = echo
    proxy = build_proxy(key, url, tokenizer=CharTokenizer(), max_concurrent=1, max_queue=0)
    with ServerThread(proxy.app()) as px, httpx2.Client(timeout=30) as http:
        with http.stream("POST", px + "/v1/chat/completions", json={**_chat(1), "stream": True}) as s:
            assert s.status_code == 200
            assert http.post(px + "/v1/chat/completions", json=_chat(2)).status_code == 429
            for _ in s.iter_bytes():
                pass
        _settle(proxy)
        assert http.post(px + "/v1/chat/completions", json=_chat(2)).status_code == 200


def test_a_queued_client_that_leaves_gives_up_its_place(echo):
    key, url, upstream = echo
    proxy = build_proxy(key, url, tokenizer=CharTokenizer(), max_concurrent=1, max_queue=4)
    with ServerThread(proxy.app()) as px:
        async def main():
            async with httpx2.AsyncClient(timeout=30) as http:
                first = asyncio.ensure_future(http.post(px + "/v1/chat/completions",
                                                        json={**_chat(1), "max_tokens": 6, "stream": True}))
                await asyncio.sleep(0.05)
                seen = len(upstream.seen)
                with pytest.raises(httpx2.TimeoutException):  # queued behind the first, then gone
                    await http.post(px + "/v1/chat/completions", json=_chat(2), timeout=0.05)
                await asyncio.sleep(0.05)
                assert proxy.limits.queued == 0
                assert (await first).status_code == 200
                return seen

        seen = asyncio.run(main())
        assert len(upstream.seen) == seen  # the request that left never reached the engine
