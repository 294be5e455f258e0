"""Fidelity per preset with aloepri.eval.fidelity: prompt metrics + perplexity on real text (debian-reference).

Resumable JSON benchmarks/results/eval_fidelity.json keyed "model|preset". One thread.
    OMP_NUM_THREADS=1 nohup python benchmarks/eval_fidelity.py &
Qwen runs use a smaller budget (10 prompts, 16 greedy tokens, 16 documents x 96 tokens) to fit the CPU budget.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import aloepri
from aloepri.eval.fidelity import load_and_report
from aloepri.eval.humaneval import load_json, save_json_atomic
from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

OUT = Path(__file__).parent / "results" / "eval_fidelity.json"
SEED = 20261122
RUNS = [("smollm2", p, dict(prompts=None, greedy_tokens=24, corpus_texts_n=32, max_tokens=128))
        for p in ("exact", "noisy", "paper")] + \
       [("qwen-coder-0.5b", p, dict(prompts=10, greedy_tokens=16, corpus_texts_n=16, max_tokens=96))
        for p in ("noisy", "paper", "exact")]


def main() -> int:
    torch.set_num_threads(1)
    data = load_json(OUT)
    for model, preset, budget in RUNS:
        key = f"{model}|{preset}"
        if key in data:
            continue
        if model == "smollm2":
            src, work = smollm2_gguf(), Path("/tmp/aloepri-evalfid") / f"smol-{preset}"
            if not (work / "server" / "model.safetensors.index.json").is_file():
                aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params(preset),
                                  seed=SEED, allow_weak_seed=True, overwrite=True, progress=False)
        else:  # the HumanEval benchmark's artifacts (same seed)
            src, work = qwen25_coder_05b_gguf(), Path("/tmp/aloepri-humaneval") / f"qwen-{preset}"
            if not (work / "server" / "model.safetensors.index.json").is_file():
                print(f"skip {key}: run benchmarks/humaneval.py first", flush=True)
                continue
        t = time.perf_counter()
        rep = load_and_report(src, work / "server", work / "client.key", **budget)
        data[key] = {"params": aloepri.resolve_params(preset).to_dict(), "seed": SEED, "budget": budget,
                     "seconds": time.perf_counter() - t, **rep}
        save_json_atomic(OUT, data)
        print(key, rep, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
