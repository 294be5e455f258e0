"""A flood on the aloepri proxy: many clients at once, on loopback only, bounded in count and in time.

``aloepri proxy`` (its own process, SmolLM2's tokenizer, a synthetic key over its vocabulary, ``api_keys`` client
keys) in front of a stand-in engine (its own process, zero compute) whose reply is the tail of the prompt it was
sent: so every answer names the request it answers, and a reply that went to another request or client shows.
``clients`` concurrent clients (client c uses key c mod ``api_keys``) send ``requests`` completion requests in all,
half of them streamed, each prompt unique (``client C request R``). A request answered 429 is sent again after the
``Retry-After`` it was given.

Measured per part: request latency p50/p99 (from the first send to the whole answer, retries included), the
number of 429s, the proxy's RSS after warm-up, at its peak (sampled every 50 ms) and after the flood, and that every
request got exactly its own answer. Parts: ``default_limits`` (the proxy's default per-key limits) and
``tight_limits`` (``tight_concurrent`` in flight and ``tight_queue`` queued per key, a rate limit of
``tight_rate`` per second per key): the 429 path under load.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    clients: int = 100
    requests: int = 5000
    api_keys: int = 10
    reply_tokens: int = 8
    deadline_s: float = 900.0  # the whole part; what is not done by then is reported as not done
    tight_requests: int = 1000
    tight_concurrent: int = 2
    tight_queue: int = 2
    tight_rate: float = 50.0
    seed: int = 2026


# ------------------------------------------------------------------------------- the stand-in engine


def engine_app(fingerprint: str, vocab_size: int):
    """OpenAI completions with token-id prompts (vLLM's shape): the reply is the prompt's last ``max_tokens``
    ids, in order; lists and stamps the key's fingerprint."""
    import json

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    stamp = {"x-aloepri-model-fingerprint": fingerprint}

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "flood", "object": "model", "max_model_len": 4096,
                                                         "aloepri": {"model_fingerprint": fingerprint,
                                                                     "vocab_size": vocab_size}}]}, headers=stamp)

    async def completions(request):
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt[-int(body.get("max_tokens") or 16):]
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}},
                                headers=stamp)

        async def events():
            for i in ids:
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i],
                                                          "finish_reason": None}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [],
                                                      "finish_reason": "length"}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=stamp)

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health)])


# ------------------------------------------------------------------------------------------ the flood


def _rss_sampler(pid: int):
    """Start sampling ``pid``'s RSS every 50 ms; returns (samples list, stop function)."""
    import threading

    import psutil

    proc, samples, stop = psutil.Process(pid), [], threading.Event()

    def loop():
        while not stop.wait(0.05):
            try:
                samples.append(proc.memory_info().rss)
            except psutil.Error:
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return samples, lambda: (stop.set(), t.join())


async def _flood(url: str, tok, s: Settings, requests: int, keys: list[str]) -> dict:
    """``requests`` requests from ``s.clients`` clients; each checks that its answers are its own."""
    import asyncio
    import json
    import time

    import httpx2

    per_client = [requests // s.clients + (1 if c < requests % s.clients else 0) for c in range(s.clients)]
    latencies, refused, wrong, failed, done = [], [0], [], [], [0]
    deadline = time.monotonic() + s.deadline_s

    async def client(http, c: int):
        headers = {"Authorization": f"Bearer {keys[c % len(keys)]}"}
        for r in range(per_client[c]):
            prompt = f"client {c} request {r}"
            want = tok.decode(tok.encode(prompt)[-s.reply_tokens:])
            stream = (c + r) % 2 == 1
            body = {"prompt": prompt, "max_tokens": s.reply_tokens, "temperature": 0, "stream": stream}
            t0 = time.perf_counter()
            while True:
                if time.monotonic() > deadline:
                    return
                try:
                    resp = await http.post(url + "/v1/completions", json=body, headers=headers)
                except httpx2.HTTPError as e:
                    failed.append(f"client {c} request {r}: {type(e).__name__}")
                    break
                if resp.status_code == 429:
                    refused[0] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    continue
                if resp.status_code != 200:
                    failed.append(f"client {c} request {r}: HTTP {resp.status_code}")
                    break
                if stream:
                    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.text.splitlines()
                                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
                else:
                    text = resp.json()["choices"][0]["text"]
                if text != want:
                    wrong.append({"client": c, "request": r, "want": want, "got": text})
                latencies.append(time.perf_counter() - t0)
                done[0] += 1
                break

    limits = httpx2.Limits(max_connections=s.clients, max_keepalive_connections=s.clients)
    t0 = time.perf_counter()
    async with httpx2.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http, c) for c in range(s.clients)))
    return {"seconds": time.perf_counter() - t0, "latencies": latencies, "refused_429": refused[0],
            "wrong": wrong, "failed": failed, "done": done[0]}


def _part(smol, work, s: Settings, name: str, requests: int, extra: tuple[str, ...]) -> dict:
    import asyncio
    import dataclasses
    import gc
    import os
    import time

    import httpx2
    import numpy as np
    import psutil
    from transformers import AutoTokenizer

    from aloepri.testing.engines import CommandServer

    from ..lib.provenance import REPO
    from .proxy_overhead import _synthetic_key

    key, key_path = _synthetic_key(smol, work)
    os.chmod(key_path, 0o600)
    tok = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    keys = [f"flood-key-{i}" for i in range(s.api_keys)]
    engine = CommandServer(lambda port: [sys.executable, "-m", "benchmarks.experiments.proxy_flood", "engine",
                                         str(port), key.model_fingerprint, str(key.vocab_size)],
                           work / f"engine-{name}.log", name="stand-in engine", cwd=REPO)
    with engine as up:
        proxy = CommandServer(lambda port: [sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(key_path),
                                            "--upstream", up, "--port", str(port), "--tokenizer", str(smol),
                                            "--log-level", "warning", *(a for k in keys for a in ("--api-key", k)),
                                            *extra],
                              work / f"proxy-{name}.log", name="aloepri proxy")
        with proxy as px:
            pid = proxy.proc.pid
            asyncio.run(_flood(px, tok, dataclasses.replace(s, clients=4), 40, keys))  # warm-up
            gc.collect()
            time.sleep(0.5)
            rss0 = psutil.Process(pid).memory_info().rss
            samples, stop = _rss_sampler(pid)
            load0 = os.getloadavg()
            res = asyncio.run(_flood(px, tok, s, requests, keys))
            load1 = os.getloadavg()
            stop()
            time.sleep(1.0)  # the last streams close just after their clients
            health = httpx2.get(px + "/health", timeout=10).json()
            rss1 = psutil.Process(pid).memory_info().rss
    lat = np.array(res["latencies"]) * 1e3
    return {"clients": s.clients, "api_keys": s.api_keys, "requests": requests, "answered": res["done"],
            "wrong_answers": len(res["wrong"]), "wrong_examples": res["wrong"][:5], "failed": len(res["failed"]),
            "failed_examples": res["failed"][:5], "refused_429": res["refused_429"], "seconds": res["seconds"],
            "requests_per_s": res["done"] / res["seconds"],
            "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
                           "max": float(lat.max())} if len(lat) else None,
            "rss_mib": {"before": rss0 / 2**20, "peak": max(samples, default=rss0) / 2**20, "after": rss1 / 2**20},
            "proxy_after": {"in_flight": health.get("in_flight"), "queued": health.get("queued")},
            "proxy_flags": list(extra), "reply_tokens": s.reply_tokens, "streamed_share": 0.5,
            "load_average": [load0, load1], "complete": res["done"] == requests}


def run(s: Settings, store: ResultStore) -> None:
    import tempfile
    from pathlib import Path

    smol = model_path("smollm2")
    with tempfile.TemporaryDirectory(prefix="aloepri-proxy-flood-") as tmp:
        if not store.has("default_limits"):
            store.put("default_limits", _part(smol, Path(tmp), s, "default", s.requests, ()))
        if s.tight_requests and not store.has("tight_limits"):
            extra = ("--max-concurrent", str(s.tight_concurrent), "--max-queue", str(s.tight_queue),
                     "--rate-limit", f"{s.tight_rate:g}")
            store.put("tight_limits", _part(smol, Path(tmp), s, "tight", s.tight_requests, extra))


def report(store: ResultStore) -> str:
    e = store.entries()
    rows = ["| part | clients / API keys | requests answered | wrong or lost | 429s (then retried) | latency p50 / p99 "
            "ms | RSS MiB before / peak / after | requests/s |", "|---|---|---|---|---|---|---|---|"]
    names = {"default_limits": "default limits", "tight_limits": "tight limits"}
    for part, label in names.items():
        r = e.get(part)
        if not r:
            continue
        if r["proxy_flags"]:
            label += f" ({' '.join(r['proxy_flags'])})"
        lat = r["latency_ms"] or {"p50": float("nan"), "p99": float("nan")}
        rss = r["rss_mib"]
        rows.append(f"| {label} | {r['clients']} / {r['api_keys']} | {r['answered']}/{r['requests']} | "
                    f"{r['wrong_answers']} wrong, {r['requests'] - r['answered']} lost | {r['refused_429']} | "
                    f"{lat['p50']:.1f} / {lat['p99']:.1f} | {rss['before']:.0f} / {rss['peak']:.0f} / "
                    f"{rss['after']:.0f} | {r['requests_per_s']:.0f} |")
    return "\n".join(rows) if len(rows) > 2 else "(nothing stored)"


SUMMARY = "a flood on the proxy: 100 clients, 5,000 requests on loopback; latency, 429s, RSS, nothing lost or mixed"
CONFIGS = {"default": Settings(), "smoke": Settings(clients=10, requests=100, api_keys=2, tight_requests=60)}
DOCS = ("docs/serving.md",)
NOTES = "a few minutes on 2 cores; SmolLM2's tokenizer (bundled); no model is run"


if __name__ == "__main__" and sys.argv[1:2] == ["engine"]:
    import uvicorn

    _, _, port, fingerprint, vocab = sys.argv
    uvicorn.run(engine_app(fingerprint, int(vocab)), host="127.0.0.1", port=int(port), log_level="warning",
                access_log=False)
