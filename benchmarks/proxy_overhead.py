"""Overhead of the aloepri proxy, per request and per token: direct-to-upstream vs through the proxy, side by side.

Each server runs in its own process (`aloepri proxy`, `aloepri serve-local`, a fake upstream), the measuring
client in this one; runs alternate direct / proxy so that drift hits both alike. Two parts:

A. zero-cost upstream: a fake engine that streams a fixed reply (real SmolLM2 token ids, permuted) as fast as
   it can. Whatever the proxy adds shows up in full: per request (TTFT difference) and per token (slope of the
   total time difference over the reply length). Detokenization uses the real SmolLM2 tokenizer.
B. real model: `aloepri serve-local` on SmolLM2-135M obfuscated with the exact preset (torch threads 1). The
   direct client sends the same permuted prompt ids the proxy sends, so both get the same reply; TPOT and TTFT
   are compared and the proxy's per-token cost is put against the TPOT.

Results: benchmarks/results/proxy_overhead.json
Usage: python benchmarks/proxy_overhead.py [--reps 7] [--tokens 16 256] [--model-tokens 64] [--skip-model]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
import numpy as np

FAKE_UPSTREAM = r"""
import json, sys, asyncio
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
reply = json.loads(open(sys.argv[2]).read())

async def completions(request):
    body = await request.json()
    n = min(int(body.get("max_tokens") or 16), len(reply))
    ids = reply[:n]
    if not body.get("stream"):
        return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
    async def events():
        for i in ids:
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [i], "finish_reason": None}]}
            yield "data: " + json.dumps(chunk) + "\n\n"
        last = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}
        yield "data: " + json.dumps(last) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

async def health(request):
    return JSONResponse({"status": "ok"})

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], health: str, timeout: float = 180) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {p.stderr.read()[-2000:]}")
        try:
            if httpx2.get(health, timeout=1).status_code == 200:
                return p
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"{health} did not come up")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def stream_times(http: httpx2.Client, url: str, body: dict) -> tuple[float, list[float]]:
    """POST a streaming request; return (start, arrival time of each event that carries tokens)."""
    t0 = time.perf_counter()
    arrivals = []
    with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            ch = (ev.get("choices") or [{}])[0]
            if ch.get("token_ids") or (ch.get("delta") or {}).get("content") or ch.get("text"):
                arrivals.append(time.perf_counter())
    return t0, arrivals


def measure(http, direct: tuple[str, dict], proxied: tuple[str, dict], reps: int) -> dict:
    rows = {"direct": [], "proxy": []}
    for _ in range(2):  # warm-up (connections, caches)
        stream_times(http, *direct)
        stream_times(http, *proxied)
    for _ in range(reps):
        for name, (url, body) in (("direct", direct), ("proxy", proxied)):
            t0, arr = stream_times(http, url, body)
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


def synthetic_key(tok_path: Path, work: Path):
    """A key with a random permutation over the SmolLM2 vocabulary and its tokenizer (part A needs no model)."""
    from aloepri.keyfile import KeyFile, write_key

    vocab = 49152
    perm = np.random.default_rng(0).permutation(vocab).tolist()
    key = KeyFile(vocab_permutation=perm, model_fingerprint="0" * 64, params={}, seed=0, h_effective=0, hidden_size=0,
                  source=str(tok_path), architecture="llama", special_tokens={"eos_token_id": 2},
                  tokenizer={"pretrained_model_name_or_path": str(tok_path.parent), "gguf_file": tok_path.name})
    write_key(key, work / "synthetic.key", overwrite=True)
    return key, work / "synthetic.key"


def part_a(smol: Path, work: Path, reps: int, token_counts: list[int]) -> dict:
    from transformers import AutoTokenizer

    key, key_path = synthetic_key(smol, work)
    tok = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    text = ("The ocean covers most of the planet and holds a great variety of life, from tiny plankton to whales. "
            "Its currents move heat around the globe and shape the weather on every continent. ") * 40
    reply = key.encode_ids(tok.encode(text)[: max(token_counts)])
    (work / "reply.json").write_text(json.dumps(reply))
    up_port, px_port = free_port(), free_port()
    procs = []
    try:
        procs.append(start([sys.executable, "-c", FAKE_UPSTREAM, str(up_port), str(work / "reply.json")],
                           f"http://127.0.0.1:{up_port}/health"))
        procs.append(start([sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(key_path), "--upstream",
                            f"http://127.0.0.1:{up_port}", "--port", str(px_port), "--log-level", "warning",
                            "--no-verify"], f"http://127.0.0.1:{px_port}/health"))
        messages = [{"role": "user", "content": "Tell me about the ocean."}]
        prompt_server = key.encode_ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                                       ["input_ids"])
        res = {}
        with httpx2.Client(timeout=60) as http:
            for n in token_counts:
                direct = (f"http://127.0.0.1:{up_port}/v1/completions",
                          {"prompt": prompt_server, "max_tokens": n, "stream": True, "return_token_ids": True})
                proxied = (f"http://127.0.0.1:{px_port}/v1/chat/completions",
                           {"messages": messages, "max_tokens": n, "stream": True})
                res[n] = measure(http, direct, proxied, reps)
        lo, hi = min(token_counts), max(token_counts)
        d_lo = res[lo]["proxy"]["total"] - res[lo]["direct"]["total"]
        d_hi = res[hi]["proxy"]["total"] - res[hi]["direct"]["total"]
        return {
            "upstream": "fake engine streaming precomputed ids (zero compute)",
            "by_reply_tokens": {str(n): r for n, r in res.items()},
            "per_request_overhead_ms": 1e3 * (res[lo]["proxy"]["ttft"] - res[lo]["direct"]["ttft"]),
            "per_token_overhead_us": 1e6 * (d_hi - d_lo) / (hi - lo),
        }
    finally:
        stop(procs)


def part_b(smol: Path, work: Path, reps: int, n_tokens: int) -> dict:
    import aloepri
    from aloepri.runtime.inference import load_tokenizer

    aloepri.obfuscate(smol, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=2026,
                      allow_weak_seed=True,
                      overwrite=True, progress=False)
    key = aloepri.load_key(work / "client.key")
    tok = load_tokenizer(key, smol)
    up_port, px_port = free_port(), free_port()
    procs = []
    try:
        procs.append(start([sys.executable, "-m", "aloepri.cli", "serve-local", str(work / "server"), "--port",
                            str(up_port), "--threads", "1", "--log-level", "warning"],
                           f"http://127.0.0.1:{up_port}/health"))
        procs.append(start([sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(work / "client.key"),
                            "--tokenizer", str(smol), "--upstream", f"http://127.0.0.1:{up_port}", "--port",
                            str(px_port), "--log-level", "warning"], f"http://127.0.0.1:{px_port}/health"))
        messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        direct = (f"http://127.0.0.1:{up_port}/v1/completions",
                  {"prompt": key.encode_ids(ids), "max_tokens": n_tokens, "temperature": 0, "stream": True,
                   "return_token_ids": True, "stop_token_ids": key.obfuscated_eos_ids()})
        proxied = (f"http://127.0.0.1:{px_port}/v1/chat/completions",
                   {"messages": messages, "max_tokens": n_tokens, "temperature": 0, "stream": True})
        with httpx2.Client(timeout=300) as http:
            r = measure(http, direct, proxied, reps)
        tpot = r["direct"]["tpot"]
        return {
            "upstream": "aloepri serve-local (transformers, torch threads 1), SmolLM2-135M exact preset",
            "reply_tokens": n_tokens, **r,
            "ttft_overhead_ms": 1e3 * (r["proxy"]["ttft"] - r["direct"]["ttft"]),
            "tpot_overhead_pct": 100 * (r["proxy"]["tpot"] - tpot) / tpot,
            "tpot_median_gap_overhead_pct": 100 * (r["proxy"]["tpot_median_gap"] - r["direct"]["tpot_median_gap"])
            / r["direct"]["tpot_median_gap"],
        }
    finally:
        stop(procs)


def main() -> None:
    from aloepri.models import smollm2_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, nargs=2, default=[16, 256], metavar=("SHORT", "LONG"))
    ap.add_argument("--model-tokens", type=int, default=64)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "proxy_overhead.json"))
    a = ap.parse_args()
    smol = smollm2_gguf()
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "reps": a.reps,
           "note": "medians; direct and proxy runs alternate; every server in its own process on loopback",
           "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as work:
        out["zero_cost_upstream"] = part_a(smol, Path(work), a.reps, a.tokens)
        print(json.dumps(out["zero_cost_upstream"], indent=2), flush=True)
        if not a.skip_model:
            out["serve_local_smollm2"] = part_b(smol, Path(work), a.reps, a.model_tokens)
            b = out["serve_local_smollm2"]
            b["proxy_per_token_cost_pct_of_tpot"] = (
                100 * out["zero_cost_upstream"]["per_token_overhead_us"] / 1e6 / b["direct"]["tpot"])
            print(json.dumps(b, indent=2), flush=True)
    out["load_average_at_end"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
