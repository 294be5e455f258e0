"""Fidelity of the `default` preset (and `noisy` beside it) on real SmolLM2 with held-out prompts.

The presets were chosen on the 20 built-in prompts of `aloepri verify`; this measures them on prompts that took no
part in that choice: chat requests carrying Faker PII (aloepri.attacks.data.private_prompts, seed 1) and questions
about fortune cookies (Debian `fortunes`, when installed). Same prompts, same plaintext model, one key per seed,
float32, greedy continuation of ``greedy_tokens`` tokens. Also asks "What is the capital of France?" at temperature
0 through PrivateModel and through the plaintext model, as `aloepri demo --compare` does.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path

FRANCE = "What is the capital of France?"


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    presets: tuple[str, ...] = ("default", "noisy")
    seeds: tuple[int, ...] = (21,)
    pii_prompts: int = 12
    fortune_prompts: int = 12
    greedy_tokens: int = 24
    france_tokens: int = 40
    threads: int = 1


def held_out_prompts(tok, n_pii: int, n_fortunes: int) -> tuple[list[str], list[list[int]]]:
    from aloepri.attacks.data import private_prompts
    from aloepri.corpora import CorpusNotInstalledError, corpus

    texts = private_prompts(tok, n_pii, seed=1).texts if n_pii else []
    if n_fortunes:
        try:
            cookies = [c.strip() for doc in corpus("fortunes") for c in doc.split("\n\n")
                       if 40 <= len(c.strip()) <= 240]
            step = max(1, len(cookies) // n_fortunes)
            texts += [f"What does this saying mean?\n\n{c}" for c in cookies[::step][:n_fortunes]]
        except CorpusNotInstalledError:
            pass
    ids = []
    for t in texts:
        x = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        ids.append(list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x))
    return texts, ids


def plaintext_answer(plain, tok, prompt_ids: list[int], eos, max_new_tokens: int) -> str:
    import torch

    x = torch.tensor([prompt_ids])
    g = plain.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None)
    return tok.decode(g[0, x.shape[1]:], skip_special_tokens=True)


def run(s: Settings, store: ResultStore) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from aloepri import PrivateModel, load_key, resolve_params
    from aloepri.eval.fidelity import compare
    from aloepri.runtime.inference import load_plain_model, load_tokenizer

    from ..lib.targets import obfuscated

    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    plain = None
    for preset in s.presets:
        for seed in s.seeds:
            name = f"{preset}|{seed}"
            if store.has(name):
                print(f"skip {name} (done)")
                continue
            plain = plain if plain is not None else load_plain_model(src)
            params = resolve_params(preset)
            target = obfuscated(src, params, seed)
            key = load_key(target.key_path)
            tok = load_tokenizer(key, src)
            texts, ids = held_out_prompts(tok, s.pii_prompts, s.fortune_prompts)
            obf = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.float32).eval()
            fid = compare(plain, obf, key, ids, s.greedy_tokens)
            pm = PrivateModel(key, target.model_dir, tokenizer=src)
            reply = pm.chat(FRANCE, max_new_tokens=s.france_tokens)
            plain_reply = plaintext_answer(plain, pm.tokenizer, reply.plain_prompt_ids,
                                           key.special_tokens.get("eos_token_id"), s.france_tokens)
            row = {**fid.to_dict(), "model": s.model, "preset": preset, "params": params.to_dict(), "seed": seed,
                   "dtype": "float32",
                   "prompts_source": f"{min(s.pii_prompts, len(texts))} Faker PII chat prompts (seed 1) + "
                                     f"{len(texts) - min(s.pii_prompts, len(texts))} fortune-cookie questions",
                   "france": {"prompt": FRANCE, "private": reply.text, "plaintext": plain_reply,
                              "equal": reply.text == plain_reply}}
            store.put(name, row)
            print(f"{name:18s} top1={fid.top1_agreement:.4f} KL={fid.mean_kl:.2e} maxerr={fid.max_logit_error:.3g} "
                  f"greedy={fid.greedy_match_rate:.3f} ({fid.prompts} prompts) france_equal={row['france']['equal']}"
                  f" {reply.text!r}", flush=True)
            del obf, pm


def report(store: ResultStore) -> str:
    rows = ["| preset | key seed | prompts (positions) | top-1 agreement | mean KL (nats) | max logit error | "
            "greedy match | France: private answer = plaintext's |",
            "|---|---|---|---|---|---|---|---|"]
    for e in store.entries().values():
        greedy = round(e["greedy_match_rate"] * e["prompts"])
        fr = e["france"]
        rows.append(f"| `{e['preset']}` | {e['seed']} | {e['prompts']} ({e['positions']:,}) | "
                    f"{e['top1_agreement']:.4f} | "
                    f"{e['mean_kl']:.2g} | {e['max_logit_error']:.2g} | {greedy}/{e['prompts']} | "
                    f"{'yes' if fr['equal'] else 'no'}: {fr['private']!r} |")
    return "\n".join(rows)


SUMMARY = "fidelity of the default and noisy presets on held-out prompts (Faker PII, fortunes), real SmolLM2"
CONFIGS = {"full": Settings(),
           "smoke": Settings(presets=("noisy",), pii_prompts=2, fortune_prompts=1, greedy_tokens=4,
                             france_tokens=8)}
DOCS = ("docs/accuracy.md",)
NOTES = ("full: two obfuscations of SmolLM2 and 24 prompts, minutes on 1 thread; needs faker (and the Debian "
         "fortunes corpus for the fortune prompts)")
