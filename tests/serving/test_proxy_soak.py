"""A bounded soak of the proxy: hundreds of requests from 16 concurrent clients, mixed streaming,
tools, logprobs, n > 1 and clients that leave mid-stream, against a stand-in engine on loopback (no model: a
few seconds in all). Every answer must equal the same request's answer when sent alone, none may fail, and at
the end nothing is left over: no request in flight in the proxy, no upstream request still open, no more upstream
connections than the proxy's keep-alive pool, and the process's memory back near where it was after warm-up."""
import asyncio
import gc
import json
import random
import time

import httpx2
import pytest

from aloepri.serving.local_server import ServerThread
from aloepri.serving.proxy import build_proxy
from serving_helpers import EchoUpstream, synthetic_key
from test_proxy_openai import WEATHER, ToolTokenizer

psutil = pytest.importorskip("psutil")

REQUESTS = 400
CONCURRENCY = 16
KEEPALIVE = 32 + 4  # AsyncClient's pools: 32 kept-alive connections for replies, 4 for key checks
RSS_SLACK = 48 << 20


def _request(kind: str, variant: int) -> tuple[str, dict]:
    """One request of a kind; ``variant`` changes its prompt (so replies differ between variants)."""
    text = f"question {variant} about {'abcdefghij'[variant]}"
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0}
    return {
        "chat": ("/v1/chat/completions", chat),
        "chat-stream": ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        "tools": ("/v1/chat/completions", {**chat, "tools": [WEATHER]}),
        "tools-stream": ("/v1/chat/completions", {**chat, "tools": [WEATHER], "stream": True}),
        "chat-logprobs": ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1}),
        "completion-logprobs": ("/v1/completions", {"prompt": text, "max_tokens": 5, "logprobs": 1}),
        "completion-stream-n": ("/v1/completions", {"prompt": text, "max_tokens": 5, "n": 2, "stream": True}),
        "leave": ("/v1/chat/completions", {**chat, "stream": True}),  # the client leaves after the first chunk
    }[kind]


KINDS = ["chat", "chat-stream", "tools", "tools-stream", "chat-logprobs", "completion-logprobs",
         "completion-stream-n", "leave"]


def _answer(path: str, body: dict, raw: bytes) -> object:
    """What a client reads from an answer, without what differs between two sends (ids, times, call ids)."""
    if not body.get("stream"):
        out = json.loads(raw)
        for choice in out["choices"]:
            for call in (choice.get("message") or {}).get("tool_calls") or []:
                call.pop("id")
        return out["choices"], out["usage"]
    per_choice: dict[int, list] = {}
    usage = None
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for c in event["choices"]:
            delta = c.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                call.pop("id", None)
            per_choice.setdefault(c["index"], []).append((c.get("text"), delta, c.get("finish_reason"),
                                                          c.get("logprobs")))
    assert raw.rstrip().endswith(b"data: [DONE]")
    return per_choice, usage


async def _send(http, url: str, kind: str, variant: int):
    path, body = _request(kind, variant)
    if kind == "leave":
        async with http.stream("POST", url + path, json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break  # gone, mid-stream
        return None
    r = await http.post(url + path, json=body)
    assert r.status_code == 200, (kind, r.text)
    return _answer(path, body, r.content)


def test_soak_mixed_traffic_answers_as_alone_and_leaves_nothing_behind():
    key = synthetic_key(96)
    upstream = EchoUpstream(key, reply_len=8, delay=0.002)
    up = ServerThread(upstream.app()).start()
    proxy = build_proxy(key, up.url, tokenizer=ToolTokenizer())
    px = ServerThread(proxy.app()).start()
    try:
        async def alone() -> dict:
            async with httpx2.AsyncClient(timeout=60) as http:
                return {(k, v): await _send(http, px.url, k, v) for k in KINDS for v in range(10)}

        expected = asyncio.run(alone())  # also the warm-up
        gc.collect()
        rss0 = psutil.Process().memory_info().rss
        rng = random.Random(33)
        plan = [(rng.choice(KINDS), rng.randrange(10)) for _ in range(REQUESTS)]

        async def soak() -> list:
            limits = httpx2.Limits(max_connections=CONCURRENCY)
            async with httpx2.AsyncClient(timeout=60, limits=limits) as http:
                sem = asyncio.Semaphore(CONCURRENCY)

                async def one(kind, variant):
                    async with sem:
                        return await _send(http, px.url, kind, variant)

                return await asyncio.gather(*(one(k, v) for k, v in plan))

        t0 = time.perf_counter()
        answers = asyncio.run(soak())
        seconds = time.perf_counter() - t0
        for (kind, variant), got in zip(plan, answers):
            assert got == expected[(kind, variant)], (kind, variant)
        deadline = time.monotonic() + 10  # the last streams' upstream requests close right after their clients
        state = up.server.server_state
        while (state.tasks or proxy.in_flight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proxy.in_flight == 0
        assert not state.tasks, f"{len(state.tasks)} upstream requests still open"
        assert len(state.connections) <= KEEPALIVE, f"{len(state.connections)} upstream connections left open"
        gc.collect()
        grown = psutil.Process().memory_info().rss - rss0
        assert grown < RSS_SLACK, f"RSS grew {grown >> 20} MiB over {REQUESTS} requests"
        assert len(upstream.seen) == len(expected) + REQUESTS  # every request, also those left, reached it
        print(f"soak: {REQUESTS} requests in {seconds:.1f} s, RSS {grown / 2**20:+.1f} MiB, "
              f"{len(state.connections)} upstream connections kept alive")
    finally:
        px.stop()
        up.stop()


FLOOD_CLIENTS = 40
FLOOD_REQUESTS = 240
FLOOD_KEYS = [f"key-{i}" for i in range(4)]


def test_flood_with_tight_limits_answers_every_request_with_its_own_reply():
    """A bounded flood: 40 clients over 4 API keys send 240 requests (streamed and not) to a proxy that lets each
    key have 2 requests in flight and 2 queued: the rest get 429 with Retry-After and are sent again (sooner than
    Retry-After asks, to keep the test fast). Every request ends with exactly its own reply (nothing lost or
    mixed between clients), and nothing is left in flight or queued. The figures at 100 clients and 5,000
    requests: benchmarks/experiments/proxy_flood.py."""
    key = synthetic_key(96)
    upstream = EchoUpstream(key, reply_len=6, delay=0.001)
    up = ServerThread(upstream.app()).start()
    proxy = build_proxy(key, up.url, tokenizer=ToolTokenizer(), client_api_key=FLOOD_KEYS, max_concurrent=2,
                        max_queue=2)
    px = ServerThread(proxy.app()).start()
    try:
        async def flood():
            refused, answers = [0], {}
            limits = httpx2.Limits(max_connections=FLOOD_CLIENTS)
            async with httpx2.AsyncClient(timeout=60, limits=limits) as http:
                async def client(c: int):
                    headers = {"Authorization": f"Bearer {FLOOD_KEYS[c % len(FLOOD_KEYS)]}"}
                    for r in range(FLOOD_REQUESTS // FLOOD_CLIENTS):
                        body = {"prompt": f"c{c} r{r}", "max_tokens": 6, "stream": r % 2 == 1}
                        while True:
                            resp = await http.post(px.url + "/v1/completions", json=body, headers=headers)
                            if resp.status_code != 429:
                                break
                            assert int(resp.headers["retry-after"]) >= 1
                            refused[0] += 1
                            await asyncio.sleep(0.01)
                        assert resp.status_code == 200, resp.text
                        answers[(c, r)] = _answer("/v1/completions", body, resp.content)
                await asyncio.gather(*(client(c) for c in range(FLOOD_CLIENTS)))
            return refused[0], answers

        t0 = time.perf_counter()
        refused, answers = asyncio.run(flood())
        seconds = time.perf_counter() - t0
        assert len(answers) == FLOOD_REQUESTS
        tok = ToolTokenizer()
        for (c, r), got in answers.items():  # the stand-in engine replies with the prompt's tail, newest first
            want = tok.decode(tok.encode(f"c{c} r{r}")[::-1][:6])
            text = "".join(t for ch in got[0].values() for t, *_ in ch) if isinstance(got[0], dict) \
                else got[0][0]["text"]
            assert text == want, (c, r, text, want)
        assert refused > 0  # the limits did refuse
        deadline = time.monotonic() + 10
        while (proxy.in_flight or proxy.limits.active or proxy.limits.queued) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.in_flight == 0 and proxy.limits.active == 0 and proxy.limits.queued == 0
        assert len(upstream.seen) == FLOOD_REQUESTS  # a refused request never reached the engine
        print(f"flood: {FLOOD_REQUESTS} requests from {FLOOD_CLIENTS} clients in {seconds:.1f} s, {refused} 429s")
    finally:
        px.stop()
        up.stop()
