"""Served TTFT and TPOT on llama.cpp: obfuscated vs plaintext SmolLM2-135M (f32 GGUFs), next to the FLOP ratio.

Both models are f32 GGUFs served by llama-cpp-python's OpenAI server, each in its own process on loopback, with
the same settings (``threads`` for decoding and prompt batches, f32 KV cache, ``n_ctx``): the obfuscated model
is SmolLM2 obfuscated with the ``exact`` preset and exported with ``export_gguf(..., "f32")``; the plaintext
model is the same f32 weights the obfuscation started from (``plaintext_reference_dir`` exported the same way).
Both get the same chat prompts as neutral text, the obfuscated one permuted by the key; greedy, no repeat
penalty, so both generate the same tokens (checked). Runs alternate obfuscated / plaintext (the order flips every
run); before every measured request a one-token request evicts the server's reused prompt prefix. TTFT: request
sent -> first token event; TPOT: first -> last token event over (tokens - 1), as seen by an HTTP client on
loopback; llama.cpp's own per-token times (its perf lines in the server log) beside them.

Theory: every weight matmul has the hidden width D = d + 2h as one dimension, so per-token matmul FLOPs grow by
D/d; attention over the context does not depend on D and dilutes the ratio a little.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    tokens: int = 32  # max_tokens per request
    reps: int = 2  # measured runs per prompt and model
    prompts: int = 3
    threads: int = 1
    n_ctx: int = 512
    preset: str = "exact"
    seed: int = 2026


def run(s: Settings, store: ResultStore) -> None:
    import json
    import os
    import statistics
    import tempfile
    import time
    from pathlib import Path

    import httpx2

    import aloepri
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text
    from aloepri.runtime.inference import load_tokenizer
    from aloepri.testing.engines import LlamaCppServer

    from ..lib import serving
    from ..lib.targets import obfuscated

    if store.has(s.model):
        return
    src = model_path(s.model)
    target = obfuscated(src, aloepri.resolve_params(s.preset), s.seed)
    with tempfile.TemporaryDirectory(prefix="aloepri-llamacpp-serving-") as tmp:
        work = Path(tmp)
        export_gguf(target.model_dir, work / "obf.gguf", "f32")
        plaintext_reference_dir(src, work / "plain")
        export_gguf(work / "plain", work / "plain.gguf", "f32")
        key = aloepri.load_key(target.key_path)
        prompts = serving.chat_prompts(load_tokenizer(key, src), s.prompts)
        common = {"max_tokens": s.tokens, "temperature": 0, "repeat_penalty": 1.0}
        models = {"obfuscated": (work / "obf.gguf", key.encode_ids), "plaintext": (work / "plain.gguf", lambda x: x)}
        servers = {name: LlamaCppServer(g, work / f"{name}.log", n_ctx=s.n_ctx, alias=name, threads=s.threads,
                                        verbose=True) for name, (g, _) in models.items()}
        rows: dict[str, list[dict]] = {name: [] for name in models}
        load_start = os.getloadavg()
        try:
            for srv in servers.values():
                srv.start()
            with httpx2.Client(timeout=600) as http:
                def request(name: str, plain_ids: list[int], measured: bool) -> None:
                    srv, enc = servers[name], models[name][1]
                    ids = enc(plain_ids)
                    bust = [(ids[0] + 1) % key.vocab_size]  # evict the reused prompt prefix
                    http.post(srv.url + "/v1/completions", json={"prompt": ids_to_neutral_text(bust), **common,
                                                                 "max_tokens": 1}).raise_for_status()
                    r = serving.llamacpp_stream(http, srv.url, {"prompt": ids_to_neutral_text(ids), **common})
                    r["ids"] = key.decode_ids(r["ids"]) if name == "obfuscated" else r["ids"]
                    if measured:
                        rows[name].append({"prompt": len(plain_ids), **r})

                for p in prompts[:1]:  # warm-up: page the weights in, first-request costs
                    request("obfuscated", p, False)
                    request("plaintext", p, False)
                for rep in range(s.reps):
                    for i, p in enumerate(prompts):
                        order = ("obfuscated", "plaintext") if (rep + i) % 2 == 0 else ("plaintext", "obfuscated")
                        for name in order:
                            request(name, p, True)
            time.sleep(0.5)  # the servers print their perf lines after the last event
            perf = {name: srv.perf() for name, srv in servers.items()}
        finally:
            for srv in servers.values():
                srv.stop()
        res: dict = {}
        for name, rs in rows.items():
            res[name] = serving.summarize(rs)
            res[name]["reply_tokens"] = [len(r["ids"]) for r in rs]
            res[name].update(serving.engine_times(perf[name], len(rs)))
        ratios = {"ttft": res["obfuscated"]["ttft_ms"] / res["plaintext"]["ttft_ms"],
                  "tpot": res["obfuscated"]["tpot_ms"] / res["plaintext"]["tpot_ms"],
                  **serving.engine_ratios(res["obfuscated"], res["plaintext"])}
        cfg_obf = json.loads((target.model_dir / "config.json").read_text())
        cfg_plain = json.loads((work / "plain" / "config.json").read_text())
        ctx = statistics.mean(len(p) for p in prompts) + s.tokens / 2
        f_obf, f_plain = serving.matmul_flops_per_token(cfg_obf, ctx), serving.matmul_flops_per_token(cfg_plain, ctx)
        gguf_ratio = (work / "obf.gguf").stat().st_size / (work / "plain.gguf").stat().st_size
    store.put(s.model, {
        "settings": {"kv_cache": "f32", "weights": "f32 GGUF", "prompts": [len(p) for p in prompts],
                     "sampling": "greedy (temperature 0, repeat_penalty 1.0)"},
        "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
        "same_reply_ids": all(o["ids"] == p["ids"] for o, p in zip(rows["obfuscated"], rows["plaintext"])),
        **res, "ratio_obfuscated_over_plaintext": ratios,
        "theory": {"hidden_plaintext": f_plain["hidden"], "hidden_obfuscated": f_obf["hidden"],
                   "weight_matmul_flop_ratio": f_obf["weight_matmul_flops"] / f_plain["weight_matmul_flops"],
                   "mean_context": ctx, "flop_ratio_with_attention_at_mean_context": f_obf["total"] / f_plain["total"],
                   # file sizes: the obfuscated GGUF stores embedding and head apart, plaintext SmolLM2 ties them
                   "gguf_file_size_ratio": gguf_ratio},
    })


def report(store: ResultStore) -> str:
    out = []
    for model, e in store.entries().items():
        rows = [f"{model}: same reply ids {e['same_reply_ids']}; load average "
                f"{e.get('load_average_at_start')} -> {e.get('load_average_at_end')}", "",
                "| | TTFT (ms) | TPOT (ms) | llama.cpp decode (ms/token) | llama.cpp prefill (ms/token) |",
                "|---|---|---|---|---|"]
        for name in ("plaintext", "obfuscated"):
            r = e[name]
            rows.append(f"| {name} | {r['ttft_ms']:.0f} | {r['tpot_ms']:.1f} "
                        f"| {r.get('engine_decode_ms_per_token', float('nan')):.1f} "
                        f"| {r.get('engine_prefill_ms_per_token', float('nan')):.1f} |")
        q = e["ratio_obfuscated_over_plaintext"]
        rows.append(f"| ratio | {q['ttft']:.2f} | {q['tpot']:.2f} | {q.get('engine_decode', q.get('engine_decode_per_token', float('nan'))):.2f} "
                    f"| {q.get('engine_prefill', q.get('engine_prefill_per_token', float('nan'))):.2f} |")
        t = e["theory"]
        rows.append(f"\ntheory: weight-matmul FLOP ratio {t['weight_matmul_flop_ratio']:.3f} (D {t['hidden_obfuscated']} / "
                    f"d {t['hidden_plaintext']}); with attention at context {t['mean_context']:.0f}: "
                    f"{t['flop_ratio_with_attention_at_mean_context']:.3f}; GGUF file size ratio "
                    f"{t['gguf_file_size_ratio']:.2f}")
        out.append("\n".join(rows))
    return "\n\n".join(out)


SUMMARY = "served TTFT/TPOT on llama.cpp, obfuscated (exact, f32) vs plaintext SmolLM2 (a few minutes)"
CONFIGS = {"default": Settings()}
DOCS = ("docs/serving.md",)
NOTES = "needs llama-cpp-python[server] (the `llamacpp` extra)"
