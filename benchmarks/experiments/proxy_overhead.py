"""Overhead of the aloepri proxy, per request and per token: direct-to-upstream vs through the proxy, side by side.

Each server runs in its own process (`aloepri proxy`, `aloepri serve-local`, a stand-in upstream), the measuring
client in this one; runs alternate direct / proxy so that drift hits both alike. Two parts:

A. zero-cost upstream (benchmarks/lib/fake_upstream.py): streams a fixed reply (real SmolLM2 token ids, permuted)
   as fast as it can. Whatever the proxy adds shows up in full: per request (TTFT difference) and per token (slope
   of the total time difference over the reply length). Detokenization uses the real SmolLM2 tokenizer.
B. real model: `aloepri serve-local` on SmolLM2-135M obfuscated with the exact preset (torch threads 1). The
   direct client sends the same permuted prompt ids the proxy sends, so both get the same reply; TPOT and TTFT
   are compared and the proxy's per-token cost is put against the TPOT.
C. latency percentiles (config ``latency``): many whole (not streamed) chat requests through the proxy against the
   zero-cost upstream, each next to the same request sent direct, one client and several at once: p50 and p99
   of both, and of the latency the proxy adds (proxy minus direct, paired per round).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    reps: int = 9
    tokens: tuple[int, ...] = (16, 256)  # reply lengths of part A (shortest and longest give the slope)
    model_tokens: int = 64  # reply length of part B
    skip_model: bool = False  # part A only
    seed: int = 2026
    latency_only: bool = False  # part C only
    latency_requests: int = 300  # per client count, for each of direct and proxy
    latency_tokens: int = 16
    latency_clients: tuple[int, ...] = (1, 8)


def _stream_times(http, url: str, body: dict) -> tuple[float, list[float]]:
    """POST a streaming request; return (start, arrival time of each event that carries tokens)."""
    import json
    import time

    t0 = time.perf_counter()
    arrivals = []
    with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ch = (json.loads(line[5:]).get("choices") or [{}])[0]
            if ch.get("token_ids") or (ch.get("delta") or {}).get("content") or ch.get("text"):
                arrivals.append(time.perf_counter())
    return t0, arrivals


def _measure(http, direct: tuple[str, dict], proxied: tuple[str, dict], reps: int) -> dict:
    import statistics

    import numpy as np

    rows = {"direct": [], "proxy": []}
    for _ in range(2):  # warm-up (connections, caches)
        _stream_times(http, *direct)
        _stream_times(http, *proxied)
    for _ in range(reps):
        for name, (url, body) in (("direct", direct), ("proxy", proxied)):
            t0, arr = _stream_times(http, url, body)
            rows[name].append({"ttft": arr[0] - t0, "total": arr[-1] - t0, "events": len(arr),
                               "span": arr[-1] - arr[0], "gaps": np.diff(arr).tolist()})
    n_tokens = rows["direct"][0]["events"]  # the direct stream has one event per token; the proxy's may merge some
    out = {}
    for name, rs in rows.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in ("ttft", "total")}
        out[name]["tpot"] = statistics.median(r["span"] for r in rs) / max(n_tokens - 1, 1)
        # robust to stalls from other load on the machine: the median of all inter-token gaps
        out[name]["tpot_median_gap"] = float(np.median([g for r in rs for g in r["gaps"]])) if n_tokens > 1 else 0.0
        out[name]["events"] = rs[0]["events"]
    return out


def _proxy(key_path, upstream: str, log, extra: tuple[str, ...] = ()):
    import sys

    from aloepri.testing.engines import CommandServer

    return CommandServer(lambda port: [sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(key_path),
                                       "--upstream", upstream, "--port", str(port), "--log-level", "warning", *extra],
                         log, name="aloepri proxy")


def _synthetic_key(tok_path, work):
    """A key with a random permutation over the SmolLM2 vocabulary and its tokenizer (part A needs no model)."""
    import numpy as np

    from aloepri.keyfile import KeyFile, write_key

    vocab = 49152
    perm = np.random.default_rng(0).permutation(vocab).tolist()
    key = KeyFile(vocab_permutation=perm, model_fingerprint="0" * 64, params={}, seed=0, h_effective=0, hidden_size=0,
                  source=str(tok_path), architecture="llama", special_tokens={"eos_token_id": 2},
                  tokenizer={"pretrained_model_name_or_path": str(tok_path.parent), "gguf_file": tok_path.name})
    write_key(key, work / "synthetic.key", overwrite=True)
    return key, work / "synthetic.key"


def _zero_cost_stack(smol, work, reply_tokens: int):
    """The synthetic key, the SmolLM2 tokenizer, the fake upstream streaming ``reply_tokens`` real SmolLM2 ids
    (permuted), and a proxy in front of it (both servers still to be entered), and a chat prompt with its
    permuted ids (what the direct client sends)."""
    import json
    import sys

    from transformers import AutoTokenizer

    from aloepri.testing.engines import CommandServer

    from ..lib.provenance import REPO

    key, key_path = _synthetic_key(smol, work)
    tok = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    text = ("The ocean covers most of the planet and holds a great variety of life, from tiny plankton to whales. "
            "Its currents move heat around the globe and shape the weather on every continent. ") * 40
    reply = key.encode_ids(tok.encode(text)[:reply_tokens])
    (work / "reply.json").write_text(json.dumps(reply))
    upstream = CommandServer(lambda port: [sys.executable, "-m", "benchmarks.lib.fake_upstream", str(port),
                                           str(work / "reply.json")], work / "upstream.log", name="fake upstream",
                             cwd=REPO)
    messages = [{"role": "user", "content": "Tell me about the ocean."}]
    prompt_server = key.encode_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                                   ["input_ids"])
    return key_path, upstream, messages, prompt_server


def _part_a(smol, work, s: Settings) -> dict:
    import httpx2

    key_path, upstream, messages, prompt_server = _zero_cost_stack(smol, work, max(s.tokens))
    with upstream as up_url, _proxy(key_path, up_url, work / "proxy-a.log", ("--no-verify",)) as px_url:
        res = {}
        with httpx2.Client(timeout=60) as http:
            for n in s.tokens:
                direct = (f"{up_url}/v1/completions",
                          {"prompt": prompt_server, "max_tokens": n, "stream": True, "return_token_ids": True})
                proxied = (f"{px_url}/v1/chat/completions", {"messages": messages, "max_tokens": n, "stream": True})
                res[n] = _measure(http, direct, proxied, s.reps)
    lo, hi = min(s.tokens), max(s.tokens)
    d_lo = res[lo]["proxy"]["total"] - res[lo]["direct"]["total"]
    d_hi = res[hi]["proxy"]["total"] - res[hi]["direct"]["total"]
    return {"upstream": "fake engine streaming precomputed ids (zero compute)",
            "by_reply_tokens": {str(n): r for n, r in res.items()},
            "per_request_overhead_ms": 1e3 * (res[lo]["proxy"]["ttft"] - res[lo]["direct"]["ttft"]),
            "per_token_overhead_us": 1e6 * (d_hi - d_lo) / (hi - lo)}


def _part_b(smol, work, s: Settings) -> dict:
    import sys

    import httpx2

    import aloepri
    from aloepri.runtime.inference import load_tokenizer
    from aloepri.testing.engines import CommandServer

    from ..lib.targets import obfuscated

    target = obfuscated(smol, aloepri.resolve_params("exact"), s.seed)
    key = aloepri.load_key(target.key_path)
    tok = load_tokenizer(key, smol)
    upstream = CommandServer(lambda port: [sys.executable, "-m", "aloepri.cli", "serve-local", str(target.model_dir),
                                           "--port", str(port), "--threads", "1", "--log-level", "warning"],
                             work / "serve-local.log", name="aloepri serve-local")
    with upstream as up_url, _proxy(target.key_path, up_url, work / "proxy-b.log", ("--tokenizer", str(smol))) as px:
        messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        direct = (f"{up_url}/v1/completions",
                  {"prompt": key.encode_ids(ids), "max_tokens": s.model_tokens, "temperature": 0, "stream": True,
                   "return_token_ids": True, "stop_token_ids": key.obfuscated_eos_ids()})
        proxied = (f"{px}/v1/chat/completions",
                   {"messages": messages, "max_tokens": s.model_tokens, "temperature": 0, "stream": True})
        with httpx2.Client(timeout=300) as http:
            r = _measure(http, direct, proxied, s.reps)
    tpot = r["direct"]["tpot"]
    return {"upstream": "aloepri serve-local (transformers, torch threads 1), SmolLM2-135M exact preset",
            "reply_tokens": s.model_tokens, **r,
            "ttft_overhead_ms": 1e3 * (r["proxy"]["ttft"] - r["direct"]["ttft"]),
            "tpot_overhead_pct": 100 * (r["proxy"]["tpot"] - tpot) / tpot,
            "tpot_median_gap_overhead_pct": 100 * (r["proxy"]["tpot_median_gap"] - r["direct"]["tpot_median_gap"])
            / r["direct"]["tpot_median_gap"]}


def _percentiles(xs: list[float]) -> dict:
    import numpy as np

    return {"p50_ms": 1e3 * float(np.percentile(xs, 50)), "p99_ms": 1e3 * float(np.percentile(xs, 99)),
            "n": len(xs)}


def _part_c(smol, work, s: Settings) -> dict:
    """Whole chat requests, direct and through the proxy, alternating, from ``clients`` concurrent clients."""
    import asyncio
    import time

    import httpx2

    key_path, upstream, messages, prompt_server = _zero_cost_stack(smol, work, s.latency_tokens)
    direct_body = {"prompt": prompt_server, "max_tokens": s.latency_tokens, "return_token_ids": True}
    proxy_body = {"messages": messages, "max_tokens": s.latency_tokens}

    async def client(http, up_url, px_url, rounds, direct, proxied, added):
        for _ in range(rounds):
            t0 = time.perf_counter()
            (await http.post(up_url + "/v1/completions", json=direct_body)).raise_for_status()
            t1 = time.perf_counter()
            (await http.post(px_url + "/v1/chat/completions", json=proxy_body)).raise_for_status()
            t2 = time.perf_counter()
            direct.append(t1 - t0)
            proxied.append(t2 - t1)
            added.append((t2 - t1) - (t1 - t0))

    async def measure(up_url, px_url, clients):
        direct, proxied, added = [], [], []
        async with httpx2.AsyncClient(timeout=60, limits=httpx2.Limits(max_connections=2 * clients)) as http:
            await client(http, up_url, px_url, 5, [], [], [])  # warm-up
            rounds = max(1, s.latency_requests // clients)
            await asyncio.gather(*(client(http, up_url, px_url, rounds, direct, proxied, added)
                                   for _ in range(clients)))
        return {"direct": _percentiles(direct), "proxy": _percentiles(proxied), "added": _percentiles(added)}

    with upstream as up_url, _proxy(key_path, up_url, work / "proxy-c.log", ("--no-verify",)) as px_url:
        by_clients = {str(c): asyncio.run(measure(up_url, px_url, c)) for c in s.latency_clients}
    return {"upstream": "fake engine answering precomputed ids (zero compute)", "reply_tokens": s.latency_tokens,
            "request": "whole chat completion (not streamed)", "by_clients": by_clients}


def run(s: Settings, store: ResultStore) -> None:
    import os
    import tempfile
    from pathlib import Path

    smol = model_path("smollm2")
    with tempfile.TemporaryDirectory(prefix="aloepri-proxy-overhead-") as tmp:
        if s.latency_only:
            if not store.has("latency_percentiles"):
                load0 = os.getloadavg()
                store.put("latency_percentiles", {**_part_c(smol, Path(tmp), s),
                                                  "load_average": [load0, os.getloadavg()]})
            return
        if not store.has("zero_cost_upstream"):
            load0 = os.getloadavg()
            store.put("zero_cost_upstream", {**_part_a(smol, Path(tmp), s), "load_average": [load0, os.getloadavg()]})
        if not s.skip_model and not store.has("serve_local_smollm2"):
            load0 = os.getloadavg()
            b = _part_b(smol, Path(tmp), s)
            b["proxy_per_token_cost_pct_of_tpot"] = (
                100 * store.get("zero_cost_upstream")["per_token_overhead_us"] / 1e6 / b["direct"]["tpot"])
            store.put("serve_local_smollm2", {**b, "load_average": [load0, os.getloadavg()]})


def report(store: ResultStore) -> str:
    e = store.entries()
    out = []
    a = e.get("zero_cost_upstream")
    if a:
        out.append(f"zero-cost upstream: {a['per_request_overhead_ms']:.2f} ms per request, "
                   f"{a['per_token_overhead_us']:.0f} µs per token (slope over {', '.join(a['by_reply_tokens'])} "
                   f"reply tokens)")
    b = e.get("serve_local_smollm2")
    if b:
        out.append(f"serve-local SmolLM2 ({b['reply_tokens']} tokens): direct TPOT {1e3 * b['direct']['tpot']:.1f} ms, "
                   f"proxy {1e3 * b['proxy']['tpot']:.1f} ms ({b['tpot_overhead_pct']:+.2f}%, median gap "
                   f"{b['tpot_median_gap_overhead_pct']:+.2f}%); TTFT +{b['ttft_overhead_ms']:.1f} ms; the proxy's "
                   f"per-token cost from part A is {b['proxy_per_token_cost_pct_of_tpot']:.2f}% of TPOT")
    c = e.get("latency_percentiles")
    if c:
        for clients, r in c["by_clients"].items():
            out.append(f"{clients} client(s), whole chat requests of {c['reply_tokens']} tokens: direct p50/p99 "
                       f"{r['direct']['p50_ms']:.2f}/{r['direct']['p99_ms']:.2f} ms, through the proxy "
                       f"{r['proxy']['p50_ms']:.2f}/{r['proxy']['p99_ms']:.2f} ms; added (paired) p50 "
                       f"{r['added']['p50_ms']:.2f} ms, p99 {r['added']['p99_ms']:.2f} ms")
    return "\n".join(out) or "(nothing stored)"


SUMMARY = "what the aloepri proxy adds per request and per token, direct vs proxied (a few minutes)"
CONFIGS = {"default": Settings(), "smoke": Settings(reps=2, tokens=(8, 32), skip_model=True),
           "latency": Settings(latency_only=True),
           "latency-smoke": Settings(latency_only=True, latency_requests=20, latency_clients=(1, 2))}
DOCS = ("docs/serving.md",)
