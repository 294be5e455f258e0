"""The vLLM side of aloepri's ``vllm`` attack engine (aloepri.attacks.engines.VllmEngine), run by path with the
vLLM venv's python (``python vllm_worker.py MODEL DTYPE MAX_LEN WORKDIR``): it imports nothing of aloepri (vLLM pins
its own torch and transformers).

One model, loaded once in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so that a forward hook on the model's
logits processor sees the full rows vLLM computes, the values it turns into prompt log-probabilities). Requests are
JSON lines on stdin, ``{"seqs": [[ids...], ...]}``; for each request the logits at every position of every
sequence, (n, L, V) float32, are saved as a .npy file in WORKDIR and its name is the JSON line answered. Each
sequence is run as a prompt with two placeholder tokens after it and ``prompt_logprobs``: the prompt rows then hold
the logits after each of its first L + 1 positions (the sampled next token's row is the other, one-row capture),
and the first L are the sequence's. The answers go to a copy of the original stdout; vLLM's own prints go to stderr.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> int:
    model, dtype, max_len, workdir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints must not mix with the answers
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import json

    try:  # never past the model's own context (vLLM refuses a longer max_model_len)
        config = json.loads(open(os.path.join(model, "config.json")).read())
        max_len = min(max_len, int(config.get("max_position_embeddings") or max_len))
    except (OSError, ValueError, TypeError):
        pass
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=max_len,
              max_num_seqs=1, seed=0, max_logprobs=1)
    captured: list = []

    def install(m):
        m.logits_processor.register_forward_hook(lambda mod, i, o: captured.append(o.detach().float().cpu().clone()))
        return True

    assert llm.apply_model(install) == [True]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
    vocab = None
    answer.write(json.dumps({"ready": True}) + "\n")
    answer.flush()
    for n, line in enumerate(sys.stdin):
        req = json.loads(line)
        out = []
        for seq in req["seqs"]:
            captured.clear()
            llm.generate([TokensPrompt(prompt_token_ids=list(seq) + [0, 0])], params, use_tqdm=False)
            rows = [c for c in captured if c.shape[0] == len(seq) + 1]
            if len(rows) != 1:
                raise RuntimeError(f"expected one capture of {len(seq) + 1} prompt rows, got shapes "
                                   f"{[tuple(c.shape) for c in captured]}")
            out.append(rows[0][:len(seq)])
            vocab = out[-1].shape[-1]
        path = os.path.join(workdir, f"logits-{n}.npy")
        np.save(path, torch.stack(out).numpy() if out else np.zeros((0, 0, vocab or 0), np.float32))
        answer.write(json.dumps({"file": path}) + "\n")
        answer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
