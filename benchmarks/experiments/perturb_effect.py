"""What online token perturbation (aloepri.runtime.perturb) does to SmolLM2-135M's answers, and its eps_1.

Perturbation is client-side on plaintext ids before the key maps them, and the exact preset reproduces the
plaintext logits, so the effect on accuracy is measured on the plaintext model (noisy presets add their own,
separately measured, loss). Per eps_tok: fraction of user-content tokens replaced, fraction of the first
``prompts`` built-in prompts whose greedy reply is unchanged, and the mean sequence budget eps_1 = l * eps_tok.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    eps_tok: tuple[float, ...] = (1e9, 100.0, 40.0)  # 1e9: no perturbation in effect (the control)
    prompts: int = 8  # the first N built-in prompts (CPU budget)
    greedy_tokens: int = 16
    seed: int = 7
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch
    from transformers import AutoTokenizer

    from aloepri.eval.fidelity import BUILTIN_PROMPTS
    from aloepri.runtime.perturb import TokenPerturbation, content_span
    from aloepri.runtime.inference import load_plain_model

    todo = [eps for eps in s.eps_tok if not store.has(str(float(eps)))]
    if not todo:
        return
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = load_plain_model(src)
    eos = tok.eos_token_id

    def reply(ids):
        x = torch.tensor([ids])
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=s.greedy_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()

    spans = [content_span(tok, [{"role": "user", "content": p}]) for p in BUILTIN_PROMPTS[:s.prompts]]
    base = [reply(ids) for ids, _ in spans]
    for eps in todo:
        pert = TokenPerturbation.from_plain_model(model, eps, s.seed, exclude_ids=tok.all_special_ids)
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
        entry = {"eps_tok": eps, "token_change_rate": changed / total, "greedy_reply_unchanged": same / len(spans),
                 "mean_eps_1": sum(eps1) / len(eps1), "examples": examples, "prompts": len(spans),
                 "greedy_tokens": s.greedy_tokens, "seed": s.seed}
        store.put(str(float(eps)), entry)
        print(entry, flush=True)


def report(store: ResultStore) -> str:
    rows = ["| eps_tok | user tokens replaced | greedy reply unchanged | mean eps_1 = l * eps_tok | example (prompt 1) |",
            "|---|---|---|---|---|"]
    for e in sorted(store.entries().values(), key=lambda e: -e["eps_tok"]):
        eps = "inf (1e9)" if e["eps_tok"] >= 1e9 else f"{e['eps_tok']:g}"
        mean = "-" if e["eps_tok"] >= 1e9 else f"{e['mean_eps_1']:,.0f}"
        same = round(e["greedy_reply_unchanged"] * e["prompts"])
        rows.append(f"| {eps} | {100 * e['token_change_rate']:.1f}% | {same}/{e['prompts']} | {mean} | "
                    f"{e['examples'][0]!r} |")
    return "\n".join(rows)


SUMMARY = "online token perturbation on SmolLM2: tokens replaced, greedy replies unchanged, eps_1 (minutes)"
CONFIGS = {"full": Settings(), "smoke": Settings(eps_tok=(1e9, 40.0), prompts=2, greedy_tokens=8)}
DOCS = ("docs/accuracy.md",)
