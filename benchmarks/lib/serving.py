"""What the serving experiments share: the chat prompts, streamed completions on llama.cpp (neutral text) and vLLM
(int prompts) timed per token event, interleaved rounds, medians and robust ratios, weight bytes and FLOPs per
token. The engine servers themselves: aloepri.testing.engines."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

PROMPTS = [
    "Write a short story about a lighthouse keeper and the sea.",
    "Explain how photosynthesis works.",
    "Describe the water cycle in a few sentences.",
    "Give me some tips for learning a new language.",
    "What are the benefits of regular exercise?",
]


def chat_prompts(tok, n: int) -> list[list[int]]:
    """The first ``n`` PROMPTS as chat-template ids (plaintext vocabulary)."""
    out = []
    for q in PROMPTS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def llamacpp_stream(http, url: str, body: dict) -> dict:
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


def matmul_flops_per_token(cfg: dict, context: float) -> dict:
    """Per decoded token: 2 * (weights of every matmul) and attention over ``context`` positions."""
    d, inter, vocab, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // nh
    per_layer = d * nh * hd + 2 * d * nkv * hd + nh * hd * d + 3 * d * inter
    weights = 2 * (layers * per_layer + d * vocab)
    attention = 2 * 2 * layers * nh * hd * context  # q.k over the context, then the weighted sum of v
    return {"hidden": d, "weight_matmul_flops": weights, "attention_flops": attention, "total": weights + attention}


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
