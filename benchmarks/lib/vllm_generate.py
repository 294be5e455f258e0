"""Greedy generation timed on vLLM, in vLLM's own venv: run by path with that venv's python
(``python benchmarks/lib/vllm_generate.py JOB.json``), importing nothing of aloepri (vLLM pins its own torch).

One job: one model directory at one dtype and tensor-parallel size. Each prompt (token ids) gets a one-token request
(its prefill) and a full greedy request of ``max_tokens`` with EOS ignored, so every model generates the same count;
the decode time per token is (full - one token) / (max_tokens - 1). Requests run one at a time.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    t0 = time.monotonic()
    llm = LLM(model=job["model"], dtype=job["dtype"], tensor_parallel_size=job["tp"], enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=1, seed=0,
              distributed_executor_backend="mp" if job["tp"] > 1 else None)
    load_seconds = time.monotonic() - t0

    def greedy(ids: list[int], n: int) -> tuple[list[int], float]:
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), time.perf_counter() - t

    greedy(job["prompts"][0], 2)  # warm-up
    rows = []
    for ids in job["prompts"]:
        _, prefill = greedy(ids, 1)
        reply, full = greedy(ids, job["max_tokens"])
        rows.append({"reply": reply, "prefill_seconds": round(prefill, 4),
                     "decode_seconds_per_token": round((full - prefill) / (len(reply) - 1), 5)})
    result = {"load_seconds": round(load_seconds, 1), "rows": rows}
    out = Path(job["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


if __name__ == "__main__":
    main(sys.argv[1])
