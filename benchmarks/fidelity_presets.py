"""Fidelity of every preset (and of single-knob ablations) on a real model, side by side in one run.

Writes/extends benchmarks/results/fidelity_<model>.json (resumable: finished configurations are skipped).
Usage: python benchmarks/fidelity_presets.py [--model smollm2|qwen-coder] [--prompts 20] [--only NAME ...]
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

from aloepri import load_key, obfuscate, resolve_params
from aloepri.eval.fidelity import builtin_prompt_ids, compare
from aloepri.runtime.inference import load_plain_model, load_tokenizer
from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

CONFIGS = {
    "exact": ("exact", {}),
    "noisy": ("noisy", {}),
    "paper": ("paper", {}),
    # ablations on top of `exact`: one mechanism at a time
    "alpha_e=1.0": ("exact", {"alpha_e": 1.0}),
    "alpha_e=0.5": ("exact", {"alpha_e": 0.5}),
    "alpha_e=0.2": ("exact", {"alpha_e": 0.2}),
    "alpha_h=0.2": ("exact", {"alpha_h": 0.2}),
    "alpha_h=0.1": ("exact", {"alpha_h": 0.1}),
    "lam=0.3": ("exact", {"lam": 0.3}),
    "lam=0.1": ("exact", {"lam": 0.1}),
    "beta=8": ("exact", {"beta": 8}),
    "beta=4": ("exact", {"beta": 4}),
    "E+C(shared,c=1)": ("exact", {"e_scale": 1.0, "c_scale": 1.0}),
    "E+C(shared,c=10)": ("exact", {"e_scale": 1.0, "c_scale": 10.0}),
    "E+C(fresh per writer,c=1)": ("exact", {"e_scale": 1.0, "c_scale": 1.0, "shared_c": False}),
    "E+C(fresh per writer,c=10)": ("exact", {"e_scale": 1.0, "c_scale": 10.0, "shared_c": False}),
    "lam=0.3,kappa=embedding": ("exact", {"lam": 0.3, "kappa_mode": "embedding"}),
    "paper,kappa=embedding": ("paper", {"kappa_mode": "embedding"}),
    "paper,fresh C": ("paper", {"shared_c": False}),
    # candidates for the small-model default: every mechanism on, noise reduced
    "cand ae=0.1 ah=0.05": ("paper", {"alpha_e": 0.1, "alpha_h": 0.05, "lam": 0.1, "beta": 8}),
    "cand ae=0.2 ah=0.05": ("paper", {"alpha_e": 0.2, "alpha_h": 0.05, "lam": 0.1, "beta": 8}),
    "cand ae=0.1 ah=0.1": ("paper", {"alpha_e": 0.1, "alpha_h": 0.1, "lam": 0.1, "beta": 8}),
    # low-precision serving: the server stores bfloat16 weights (the obfuscated model, and the plain model
    # reference in fp32); the paper's Gaussian U_vo amplifies the rounding, the conditioned one does not
    "plain bf16 (floor)": (None, {}),
    "exact,bf16": ("exact", {"dtype": "bfloat16"}),
    "exact,bf16,gaussian U_vo": ("exact", {"dtype": "bfloat16", "vo_mixing": "gaussian"}),
}


def save(results: dict, out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out_path)


def bf16_floor(plain, src, a) -> dict:
    """The plaintext model itself in bfloat16 against float32: the noise floor of low-precision serving."""
    import copy

    import numpy as np

    from aloepri.keyfile import KeyFile

    tok = load_tokenizer(KeyFile([0, 1], "", {}, 0, 0, 0, "", "", tokenizer=None), src)
    identity = KeyFile(list(range(plain.config.vocab_size)), "", {}, 0, 0, 0, "", "",
                       special_tokens={"eos_token_id": plain.config.eos_token_id})
    low = copy.deepcopy(plain).to(torch.bfloat16)
    fid = compare(plain, low, identity, builtin_prompt_ids(tok, len(np.asarray(identity.vocab_permutation)), a.prompts),
                  a.greedy_tokens)
    return {**fid.to_dict(), "params": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    src = smollm2_gguf() if a.model == "smollm2" else qwen25_coder_05b_gguf()
    out_path = Path(a.out or Path(__file__).parent / "results" / f"fidelity_{a.model}.json")
    results = json.loads(out_path.read_text()) if out_path.exists() else {"model": str(src.name), "runs": {}}
    plain = load_plain_model(src)
    work = Path(tempfile.mkdtemp(prefix="aloepri-bench-"))
    names = a.only or list(CONFIGS)
    try:
        for name in names:
            if name in results["runs"] and results["runs"][name].get("prompts") == a.prompts:
                print(f"skip {name} (done)")
                continue
            if name == "plain bf16 (floor)":
                results["runs"][name] = {**bf16_floor(plain, src, a), "dtype": "bfloat16"}
                print(f"{name:32s} top1={results['runs'][name]['top1_agreement']:.3f}", flush=True)
                save(results, out_path)
                continue
            preset, overrides = CONFIGS[name]
            overrides = dict(overrides)
            dtype = overrides.pop("dtype", "float32")
            params = resolve_params(preset, **overrides)
            t = time.perf_counter()
            res = obfuscate(src, work / "m", work / "k.json", params, seed=a.seed,
                            allow_weak_seed=True, overwrite=True, progress=False,
                            dtype=dtype)
            t_obf = time.perf_counter() - t
            key = load_key(work / "k.json")
            tok = load_tokenizer(key, src)
            obf = AutoModelForCausalLM.from_pretrained(work / "m", dtype=getattr(torch, dtype)).eval()
            fid = compare(plain, obf, key, builtin_prompt_ids(tok, key.vocab_size, a.prompts), a.greedy_tokens)
            row = {**fid.to_dict(), "params": params.to_dict(), "h_effective": res.h, "obfuscate_seconds": round(t_obf, 1),
                   "seed": a.seed, "dtype": dtype}
            results["runs"][name] = row
            print(f"{name:32s} top1={fid.top1_agreement:.3f} KL={fid.mean_kl:.4f} maxerr={fid.max_logit_error:.3g} "
                  f"greedy={fid.greedy_match_rate:.2f}", flush=True)
            save(results, out_path)
            del obf
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
