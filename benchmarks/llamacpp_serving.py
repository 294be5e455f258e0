"""Served TTFT and TPOT on llama.cpp: obfuscated vs plaintext SmolLM2-135M, next to the theoretical FLOP ratio.

Both models are f32 GGUFs served by llama-cpp-python's OpenAI server (``python -m llama_cpp.server``), each in
its own process on loopback, with the same settings (``--threads`` for decoding and prompt batches, f32 KV
cache, n_ctx 512): the obfuscated model is SmolLM2 obfuscated with the exact preset and exported with
``export_gguf(..., "f32")``; the plaintext model is the same f32 weights the obfuscation started from
(``plaintext_reference_dir`` exported the same way). Both get the same chat prompts as neutral text (the text
path: this server takes no int prompts), the obfuscated one permuted by the key; greedy, no repeat penalty, so
both generate the same tokens (checked).

Runs alternate obfuscated / plaintext (the order flips every run) so that drift on a shared machine hits both
alike. Before every measured request a one-token request evicts the server's reused prompt prefix, so TTFT is
the prefill of the whole prompt plus the first decode step. TTFT: request sent -> first token event; TPOT: first
-> last token event over (tokens - 1); both as seen by an HTTP client on loopback ("served"). The engine's own
per-token times (llama.cpp's perf lines in the server log) are reported too.

Theory: every weight matmul of the obfuscated model has the hidden width D = d + 2h as one of its two
dimensions where the plaintext one has d (q/k/v/o, gate/up/down, output head), so per-token matmul FLOPs (and
weight bytes read per decoded token) grow by D/d; attention over the context (scores and weighted values) does
not depend on D and dilutes the ratio a little.

Results: benchmarks/results/llamacpp_serving.json
Usage: python benchmarks/llamacpp_serving.py [--tokens 32] [--reps 2] [--prompts 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

PROMPTS = [
    "Write a short story about a lighthouse keeper and the sea.",
    "Explain how photosynthesis works.",
    "Describe the water cycle in a few sentences.",
    "Give me some tips for learning a new language.",
    "What are the benefits of regular exercise?",
]
PERF_RE = re.compile(r"^llama_perf_context_print:\s+(prompt eval|eval) time =\s+([0-9.]+) ms /\s+(\d+) (?:tokens|runs)",
                     re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, gguf: Path, log: Path, threads: int, n_ctx: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem,
                    "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                    "--type_k", "0", "--type_v", "0", "--use_mlock", "False", "--verbose", "True",
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.env: dict | None = None  # subclasses serving other engines set their own command and environment
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> "Server":
        """Own process group (an engine's workers stop with it); ready once /v1/models answers."""
        self._f = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._f, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[2]} exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx2.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.start_seconds = time.monotonic() - t0
                    return self
            except httpx2.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.cmd[2]} did not come up: {self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # workers outliving their parent
            except (ProcessLookupError, PermissionError):
                pass
        self._f.close()

    def perf(self) -> list[dict]:
        """llama.cpp's own timings, one entry per request: prompt eval and eval (decode) ms / count."""
        out, cur = [], {}
        for kind, ms, n in PERF_RE.findall(self.log.read_text(errors="replace")):
            cur[kind] = (float(ms), int(n))
            if kind == "eval":
                out.append(cur)
                cur = {}
        return out


def stream(http: httpx2.Client, url: str, body: dict) -> dict:
    """One streaming completion: send time, arrival of every token event, and the ids (neutral text)."""
    from aloepri.obfuscation.server_tokenizer import neutral_text_to_ids

    text, arrivals, sizes = "", [], []
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for ch in json.loads(line[5:]).get("choices") or []:
                if ch.get("text"):
                    arrivals.append(time.perf_counter())
                    sizes.append(len(neutral_text_to_ids(ch["text"])))
                    text += ch["text"]
    ids = neutral_text_to_ids(text)
    if len(ids) < 2 or any(s != 1 for s in sizes):
        raise RuntimeError(f"expected one token per event and >= 2 tokens, got {sizes}")
    return {"ttft": arrivals[0] - t0, "tpot": (arrivals[-1] - arrivals[0]) / (len(ids) - 1), "ids": ids}


def matmul_flops_per_token(cfg: dict, context: float) -> dict:
    """Per decoded token: 2 * (weights of every matmul) and attention over ``context`` positions."""
    d, inter, vocab, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // nh
    per_layer = d * nh * hd + 2 * d * nkv * hd + nh * hd * d + 3 * d * inter
    weights = 2 * (layers * per_layer + d * vocab)
    attention = 2 * 2 * layers * nh * hd * context  # q.k over the context, then the weighted sum of v
    return {"hidden": d, "weight_matmul_flops": weights, "attention_flops": attention, "total": weights + attention}


def main() -> None:
    import aloepri
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.runtime.inference import load_tokenizer
    from aloepri.models import smollm2_gguf
    from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--reps", type=int, default=2, help="measured runs per prompt and model")
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (decode and prompt batches)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--work", help="reuse/keep this directory (obfuscated model, GGUFs, server logs)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "llamacpp_serving.json"))
    a = ap.parse_args()

    smol = smollm2_gguf()
    tmp = None if a.work else tempfile.TemporaryDirectory()
    work = Path(a.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "client.key").is_file():
        aloepri.obfuscate(smol, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=2026,
                          allow_weak_seed=True,
                          progress=False)
    if not (work / "obf.gguf").is_file():
        export_gguf(work / "server", work / "obf.gguf", "f32")
    if not (work / "plain.gguf").is_file():
        if not (work / "plain").is_dir():
            plaintext_reference_dir(smol, work / "plain")
        export_gguf(work / "plain", work / "plain.gguf", "f32")
    key = aloepri.load_key(work / "client.key")
    tok = load_tokenizer(key, smol)

    prompts = []
    for q in PROMPTS[: a.prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    common = {"max_tokens": a.tokens, "temperature": 0, "repeat_penalty": 1.0}
    models = {"obfuscated": (work / "obf.gguf", key.encode_ids), "plaintext": (work / "plain.gguf", lambda x: x)}
    servers = {name: Server(g, work / f"{name}.log", a.threads, a.n_ctx) for name, (g, _) in models.items()}
    rows: dict[str, list[dict]] = {name: [] for name in models}
    load_start = os.getloadavg()
    try:
        for s in servers.values():
            s.start()
        with httpx2.Client(timeout=600) as http:
            def run(name: str, plain_ids: list[int], measured: bool) -> None:
                s, enc = servers[name], models[name][1]
                ids = enc(plain_ids)
                # evict the reused prefix: a one-token prompt that differs from this prompt's first token
                bust = [(ids[0] + 1) % key.vocab_size]
                http.post(s.url + "/v1/completions", json={"prompt": ids_to_neutral_text(bust), **common,
                                                           "max_tokens": 1}).raise_for_status()
                r = stream(http, s.url, {"prompt": ids_to_neutral_text(ids), **common})
                r["ids"] = key.decode_ids(r["ids"]) if name == "obfuscated" else r["ids"]
                if measured:
                    rows[name].append({"prompt": len(plain_ids), **r})

            for p in prompts[:1]:  # warm-up: page the weights in, first-request costs
                run("obfuscated", p, False)
                run("plaintext", p, False)
            for rep in range(a.reps):
                for i, p in enumerate(prompts):
                    order = ("obfuscated", "plaintext") if (rep + i) % 2 == 0 else ("plaintext", "obfuscated")
                    for name in order:
                        run(name, p, True)
        time.sleep(0.5)  # the servers print their perf lines after the last event
        perf = {name: s.perf() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()

    same = all(o["ids"] == p["ids"] for o, p in zip(rows["obfuscated"], rows["plaintext"]))
    res: dict = {}
    for name, rs in rows.items():
        res[name] = {"ttft_ms": 1e3 * statistics.median(r["ttft"] for r in rs),
                     "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in rs),
                     "ttft_ms_all": [round(1e3 * r["ttft"], 2) for r in rs],
                     "tpot_ms_all": [round(1e3 * r["tpot"], 2) for r in rs],
                     "reply_tokens": [len(r["ids"]) for r in rs]}
        # per request: bust, measured (the warm-up requests come first); keep the measured ones
        pr = perf[name][2 * len(prompts[:1]):][1::2]
        if len(pr) == len(rs) and all("eval" in x and "prompt eval" in x for x in pr):
            res[name]["engine_decode_ms_per_token"] = statistics.median(x["eval"][0] / x["eval"][1] for x in pr)
            res[name]["engine_prefill_ms_per_token"] = statistics.median(
                x["prompt eval"][0] / x["prompt eval"][1] for x in pr)
    cfg_obf = json.loads((work / "server" / "config.json").read_text())
    cfg_plain = json.loads((work / "plain" / "config.json").read_text())
    ctx = statistics.mean(len(p) for p in prompts) + a.tokens / 2
    f_obf, f_plain = matmul_flops_per_token(cfg_obf, ctx), matmul_flops_per_token(cfg_plain, ctx)
    out = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "engine": "llama-cpp-python server " + _version("llama_cpp_python"),
        "settings": {"threads": a.threads, "n_ctx": a.n_ctx, "kv_cache": "f32", "weights": "f32 GGUF",
                     "max_tokens": a.tokens, "reps": a.reps, "prompts": [len(p) for p in prompts],
                     "sampling": "greedy (temperature 0, repeat_penalty 1.0)", "preset": "exact"},
        "note": "medians over prompts x reps; obfuscated/plaintext runs alternate; every server in its own process "
                "on loopback; prompt-prefix cache evicted before each measured request",
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
        "same_reply_ids": same,
        **res,
        "ratio_obfuscated_over_plaintext": {
            "ttft": res["obfuscated"]["ttft_ms"] / res["plaintext"]["ttft_ms"],
            "tpot": res["obfuscated"]["tpot_ms"] / res["plaintext"]["tpot_ms"],
            **({"engine_decode_per_token": res["obfuscated"]["engine_decode_ms_per_token"]
                / res["plaintext"]["engine_decode_ms_per_token"],
                "engine_prefill_per_token": res["obfuscated"]["engine_prefill_ms_per_token"]
                / res["plaintext"]["engine_prefill_ms_per_token"]}
               if "engine_decode_ms_per_token" in res["obfuscated"] and "engine_decode_ms_per_token" in res["plaintext"]
               else {}),
        },
        "theory": {
            "hidden_plaintext": f_plain["hidden"], "hidden_obfuscated": f_obf["hidden"],
            "weight_matmul_gflops_per_token": {"plaintext": f_plain["weight_matmul_flops"] / 1e9,
                                               "obfuscated": f_obf["weight_matmul_flops"] / 1e9},
            "weight_matmul_flop_ratio": f_obf["weight_matmul_flops"] / f_plain["weight_matmul_flops"],
            "mean_context": ctx,
            "flop_ratio_with_attention_at_mean_context": f_obf["total"] / f_plain["total"],
            # file sizes, not bytes read per token: the obfuscated GGUF stores the embedding table and the output
            # head separately, the plaintext one ties them (per decoded token only one embedding row is read)
            "gguf_file_size_ratio": (work / "obf.gguf").stat().st_size / (work / "plain.gguf").stat().st_size,
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("same_reply_ids", "ratio_obfuscated_over_plaintext", "theory")}, indent=2))
    for name in models:
        print(name, {k: round(v, 2) for k, v in res[name].items() if isinstance(v, float)})
    print(f"wrote {a.out}")
    if tmp is not None:
        tmp.cleanup()


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
