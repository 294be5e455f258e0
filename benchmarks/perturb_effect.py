"""What online token perturbation (aloepri.runtime.perturb) does to SmolLM2-135M's answers, and its eps_1.

Perturbation is client-side on plaintext ids before the key maps them, and the exact preset reproduces the
plaintext logits, so the effect on accuracy is measured on the plaintext model (noisy presets add their own,
separately measured, loss). Per eps_tok: fraction of user-content tokens replaced, fraction of the first N_PROMPTS built-in
prompts whose greedy reply (16 tokens) is unchanged, and the mean sequence budget eps_1 = l * eps_tok.

    OMP_NUM_THREADS=1 python benchmarks/perturb_effect.py   # writes benchmarks/results/perturb_effect.json
"""
import json
import sys
from pathlib import Path

import torch

from aloepri.eval.fidelity import BUILTIN_PROMPTS
from aloepri.runtime.perturb import TokenPerturbation, content_span
from aloepri.runtime.inference import load_plain_model
from aloepri.models import smollm2_gguf

OUT = Path(__file__).parent / "results" / "perturb_effect.json"
EPS_TOK = [1e9, 100.0, 40.0]
N_PROMPTS = 8  # the first 8 built-in prompts (CPU budget)
GREEDY, SEED = 16, 7


def main() -> int:
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    src = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = load_plain_model(src)
    data = json.loads(OUT.read_text()) if OUT.is_file() else {}
    eos = tok.eos_token_id

    def reply(ids):
        x = torch.tensor([ids])
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()

    spans = [content_span(tok, [{"role": "user", "content": p}]) for p in BUILTIN_PROMPTS[:N_PROMPTS]]
    base = [reply(ids) for ids, _ in spans]
    for eps in EPS_TOK:
        if str(eps) in data:
            continue
        pert = TokenPerturbation.from_plain_model(model, eps, SEED, exclude_ids=tok.all_special_ids)
        changed = total = same = 0
        eps1 = []
        examples = []
        for k, ((ids, span), ref) in enumerate(zip(spans, base)):
            noisy = pert.apply(ids, list(span), call_index=k)
            changed += sum(a != b for a, b in zip(noisy, ids))
            total += len(span)
            same += int(reply(noisy) == ref)
            eps1.append(eps * len(span))
            if k < 3:
                examples.append(tok.decode(noisy[span.start:span.stop]))
        data[str(eps)] = {"eps_tok": eps, "token_change_rate": changed / total, "greedy_reply_unchanged": same / len(spans),
                          "mean_eps_1": sum(eps1) / len(eps1), "examples": examples, "prompts": len(spans),
                          "greedy_tokens": GREEDY, "seed": SEED}
        OUT.write_text(json.dumps(data, indent=1))
        print(data[str(eps)], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
