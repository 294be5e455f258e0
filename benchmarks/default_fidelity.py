"""Fidelity of the `default` preset (and `noisy` beside it) on real SmolLM2 with held-out prompts.

The presets were chosen on the 20 built-in prompts of `aloepri verify`; this measures them on prompts that took no
part in that choice: chat requests carrying Faker PII (aloepri.attacks.data.private_prompts, seed 1) and questions
about fortune cookies (Debian `fortunes`, when installed). Same prompts, same plaintext model, one key per seed,
float32, greedy continuation of --greedy-tokens tokens. Also asks "What is the capital of France?" at temperature 0
through PrivateModel and through the plaintext model, as `aloepri demo --compare` does.

Usage: OMP_NUM_THREADS=1 python benchmarks/default_fidelity.py [--presets default noisy] [--seeds 21]
       [--pii-prompts 12 --fortune-prompts 12 --greedy-tokens 24]
Writes benchmarks/results/default_fidelity.json (resumable: finished (preset, seed) runs are skipped).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from aloepri import PrivateModel, load_key, obfuscate, resolve_params
from aloepri.models import smollm2_gguf
from aloepri.eval.fidelity import compare
from aloepri.runtime.inference import load_plain_model, load_tokenizer

FRANCE = "What is the capital of France?"


def held_out_prompts(tok, n_pii: int, n_fortunes: int) -> tuple[list[str], list[list[int]]]:
    from aloepri.attacks.data import private_prompts
    from aloepri.corpora import CorpusNotInstalledError, corpus

    texts = private_prompts(tok, n_pii, seed=1).texts
    try:
        cookies = [c.strip() for doc in corpus("fortunes") for c in doc.split("\n\n") if 40 <= len(c.strip()) <= 240]
        step = max(1, len(cookies) // max(1, n_fortunes))
        texts += [f"What does this saying mean?\n\n{c}" for c in cookies[::step][:n_fortunes]]
    except CorpusNotInstalledError:
        pass
    ids = []
    for t in texts:
        x = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        ids.append(list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x))
    return texts, ids


def plaintext_answer(plain, tok, prompt_ids: list[int], eos, max_new_tokens: int) -> str:
    x = torch.tensor([prompt_ids])
    g = plain.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None)
    return tok.decode(g[0, x.shape[1]:], skip_special_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["default", "noisy"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[21])
    ap.add_argument("--pii-prompts", type=int, default=12)
    ap.add_argument("--fortune-prompts", type=int, default=12)
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "default_fidelity.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    src = smollm2_gguf()
    out_path = Path(a.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {"model": src.name, "runs": {}}
    plain = load_plain_model(src)
    work = Path(tempfile.mkdtemp(prefix="aloepri-bench-"))
    try:
        for preset in a.presets:
            for seed in a.seeds:
                name = f"{preset}/seed{seed}"
                if name in results["runs"]:
                    print(f"skip {name} (done)")
                    continue
                params = resolve_params(preset)
                t = time.perf_counter()
                obfuscate(src, work / "m", work / "k.json", params, seed=seed, allow_weak_seed=True, overwrite=True,
                          progress=False)
                t_obf = time.perf_counter() - t
                key = load_key(work / "k.json")
                tok = load_tokenizer(key, src)
                texts, ids = held_out_prompts(tok, a.pii_prompts, a.fortune_prompts)
                obf = AutoModelForCausalLM.from_pretrained(work / "m", dtype=torch.float32).eval()
                fid = compare(plain, obf, key, ids, a.greedy_tokens)
                pm = PrivateModel(key, work / "m", tokenizer=src)
                reply = pm.chat(FRANCE, max_new_tokens=40)
                plain_reply = plaintext_answer(plain, pm.tokenizer, reply.plain_prompt_ids,
                                               key.special_tokens.get("eos_token_id"), 40)
                row = {**fid.to_dict(), "preset": preset, "params": params.to_dict(), "seed": seed,
                       "dtype": "float32", "prompts_source": f"{a.pii_prompts} Faker PII chat prompts (seed 1) + "
                       f"{len(texts) - a.pii_prompts} fortune-cookie questions",
                       "obfuscate_seconds": round(t_obf, 1),
                       "france": {"prompt": FRANCE, "private": reply.text, "plaintext": plain_reply,
                                  "equal": reply.text == plain_reply}}
                results["runs"][name] = row
                print(f"{name:18s} top1={fid.top1_agreement:.4f} KL={fid.mean_kl:.2e} maxerr={fid.max_logit_error:.3g} "
                      f"greedy={fid.greedy_match_rate:.3f} ({fid.prompts} prompts) france_equal={row['france']['equal']}"
                      f" {reply.text!r}", flush=True)
                out_path.parent.mkdir(parents=True, exist_ok=True)
                tmp = out_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=2) + "\n")
                tmp.replace(out_path)
                del obf, pm
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
