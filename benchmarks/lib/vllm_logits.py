"""Full-vocabulary logits from vLLM, in vLLM's own venv: run by path with that venv's python
(``python benchmarks/lib/vllm_logits.py JOBS.json``), so it imports nothing of aloepri or of this repository
(vLLM pins its own torch and transformers). Also the scoring both sides share (numpy and torch only).

vLLM logits are the full rows its LogitsProcessor computes (a forward hook, in-process engine:
VLLM_ENABLE_V1_MULTIPROCESSING=0), the same values vLLM turns into prompt_logprobs (checked on the reference run).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def score(ref_logprobs: np.ndarray, logits: np.ndarray, reply_start: int) -> dict:
    """Per-position comparison of a model's logits (plaintext vocabulary order) with the reference log-probs,
    rows = predicted positions. Returns sums so that sequences can be pooled."""
    import torch

    ref = torch.from_numpy(ref_logprobs).double()
    test = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    kl = (ref.exp() * (ref - test)).sum(-1)
    agree = ref.argmax(-1) == test.argmax(-1)
    reply = agree[reply_start:]
    miss = (~reply).nonzero()
    return {"positions": int(ref.shape[0]), "top1_hits": int(agree.sum()), "kl_sum": float(kl.sum()),
            "reply_positions": int(reply.numel()), "reply_top1_hits": int(reply.sum()),
            "reply_kl_sum": float(kl[reply_start:].sum()), "kl_max": float(kl.max()),
            "greedy_agree": int(miss[0, 0]) if miss.numel() else int(reply.numel())}


def pool(per_seq: list[dict]) -> dict:
    n = sum(s["positions"] for s in per_seq)
    nr = sum(s["reply_positions"] for s in per_seq)
    return {"positions": n, "top1": round(sum(s["top1_hits"] for s in per_seq) / n, 5),
            "kl": round(sum(s["kl_sum"] for s in per_seq) / n, 6),
            "reply_top1": round(sum(s["reply_top1_hits"] for s in per_seq) / nr, 5),
            "reply_kl": round(sum(s["reply_kl_sum"] for s in per_seq) / nr, 6),
            "kl_max": round(max(s["kl_max"] for s in per_seq), 4),
            "greedy_agree_mean": round(float(np.mean([s["greedy_agree"] for s in per_seq])), 2),
            "greedy_identical": f"{sum(s['greedy_agree'] == s['reply_positions'] for s in per_seq)}/{len(per_seq)}"}


def worker(jobs_path: str) -> None:
    """Runs under the vLLM venv's python. Each job: one model directory at one dtype; writes its result file."""
    import gc

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    jobs = json.loads(Path(jobs_path).read_text())
    for job in jobs:
        out = Path(job["out"])
        if out.exists():
            continue
        t0 = time.monotonic()
        llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=1024, max_num_seqs=1, seed=0, max_logprobs=1)
        load_s = time.monotonic() - t0
        captured: list = []

        def install(model):
            model.logits_processor.register_forward_hook(
                lambda m, i, o: captured.append(o.detach().float().cpu().clone()))
            return True

        assert llm.apply_model(install) == [True]

        def full_logits(seq):
            """Logits predicting seq[1:], all positions, and vLLM's own prompt_logprobs for the same tokens."""
            captured.clear()
            res = llm.generate([TokensPrompt(prompt_token_ids=seq)],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False),
                               use_tqdm=False)[0]
            rows = torch.cat([c for c in captured if c.shape[0] > 1] or [captured[-1][:0]])
            assert rows.shape[0] == len(seq) - 1, (rows.shape, len(seq))
            vllm_lp = [res.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))]
            return rows, vllm_lp

        result = {"model": job["model"], "dtype": job["dtype"], "load_seconds": round(load_s, 1)}
        t1 = time.monotonic()
        if job["mode"] == "reference":
            sp = SamplingParams(max_tokens=job["reply_tokens"], temperature=0, stop_token_ids=[job["eos"]],
                                detokenize=False)
            replies = [list(o.outputs[0].token_ids) for o in
                       llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)]
            result["replies"] = replies
            max_dev = 0.0
            for i, (p, r) in enumerate(zip(job["prompts"], replies)):
                seq = p + r
                rows, vllm_lp = full_logits(seq)
                lp = torch.log_softmax(rows.double(), -1)
                mine = lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
                max_dev = max(max_dev, float((mine - torch.tensor(vllm_lp, dtype=torch.double)).abs().max()))
                np.save(Path(job["ref_dir"]) / f"ref{i}.npy", lp.float().numpy())
            result["hook_vs_prompt_logprobs_max_abs"] = max_dev
        else:
            perm = None if job["perm"] is None else torch.tensor(np.load(job["perm"]))
            per_seq, self_per_seq = [], []
            own = Path(job["self_dir"])  # this model's own float32 log-probs: what the rounding alone costs
            for i, (seq, rs) in enumerate(zip(job["seqs"], job["reply_starts"])):
                rows, _ = full_logits(seq)
                if perm is not None:
                    rows = rows[:, perm]  # column j = the model's logit for plaintext token j
                ref = np.load(Path(job["ref_dir"]) / f"ref{i}.npy")
                per_seq.append(score(ref, rows.numpy(), rs))
                if job["dtype"] == "float32":
                    np.save(own / f"self{i}.npy", torch.log_softmax(rows.double(), -1).float().numpy())
                elif (own / f"self{i}.npy").exists():
                    self_per_seq.append(score(np.load(own / f"self{i}.npy"), rows.numpy(), rs))
            result["per_seq"] = per_seq
            if self_per_seq:
                result["self_per_seq"] = self_per_seq
        result["score_seconds"] = round(time.monotonic() - t1, 1)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)
        print(json.dumps({k: v for k, v in result.items() if k not in ("per_seq", "replies")}), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    worker(sys.argv[1])
