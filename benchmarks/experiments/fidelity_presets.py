"""Fidelity of every preset (and of single-knob ablations) on a real model, side by side in one run.

Each labelled setting of ABLATIONS is a preset with overrides (and the dtype the server stores); ``only`` picks
some. Prompt metrics on the built-in chat prompts (aloepri.eval.fidelity); docs/design.md's table is the report.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore, UsageError
from ..lib.models import model_path
from ..lib.presets import drift_notes

FLOOR = "plain bf16 (floor)"
ABLATIONS: dict[str, tuple[str | None, dict]] = {
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
    FLOOR: (None, {}),
    "exact,bf16": ("exact", {"dtype": "bfloat16"}),
    "exact,bf16,gaussian U_vo": ("exact", {"dtype": "bfloat16", "vo_mixing": "gaussian"}),
}


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    prompts: int = 20
    greedy_tokens: int = 24
    seed: int = 1234
    only: tuple[str, ...] = ()  # labels of ABLATIONS; empty: all of them
    threads: int = 2


def bf16_floor(plain, src, s: Settings) -> dict:
    """The plaintext model itself in bfloat16 against float32: the noise floor of low-precision serving."""
    import copy

    import torch

    from aloepri.keyfile import KeyFile
    from aloepri.eval.fidelity import builtin_prompt_ids, compare
    from aloepri.runtime.inference import load_tokenizer

    tok = load_tokenizer(KeyFile([0, 1], "", {}, 0, 0, 0, "", "", tokenizer=None), src)
    vocab = plain.config.vocab_size
    identity = KeyFile(list(range(vocab)), "", {}, 0, 0, 0, "", "",
                       special_tokens={"eos_token_id": plain.config.eos_token_id})
    low = copy.deepcopy(plain).to(torch.bfloat16)
    fid = compare(plain, low, identity, builtin_prompt_ids(tok, vocab, s.prompts), s.greedy_tokens)
    return {**fid.to_dict(), "params": None, "dtype": "bfloat16"}


def run(s: Settings, store: ResultStore) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from aloepri import load_key, resolve_params
    from aloepri.eval.fidelity import builtin_prompt_ids, compare
    from aloepri.runtime.inference import load_plain_model, load_tokenizer

    from ..lib.targets import obfuscated

    unknown = [n for n in s.only if n not in ABLATIONS]
    if unknown:
        raise UsageError(f"fidelity_presets: unknown setting(s) {unknown}; settings: {', '.join(ABLATIONS)}")
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    plain = None
    for name in s.only or list(ABLATIONS):
        if store.has(name):
            print(f"skip {name} (done)")
            continue
        plain = plain if plain is not None else load_plain_model(src)
        if name == FLOOR:
            store.put(name, bf16_floor(plain, src, s))
            print(f"{name:32s} top1={store.get(name)['top1_agreement']:.3f}", flush=True)
            continue
        preset, overrides = ABLATIONS[name]
        overrides = dict(overrides)
        dtype = overrides.pop("dtype", "float32")
        params = resolve_params(preset, **overrides)
        target = obfuscated(src, params, s.seed, **({} if dtype == "float32" else {"dtype": dtype}))
        key = load_key(target.key_path)
        tok = load_tokenizer(key, src)
        obf = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=getattr(torch, dtype)).eval()
        fid = compare(plain, obf, key, builtin_prompt_ids(tok, key.vocab_size, s.prompts), s.greedy_tokens)
        store.put(name, {**fid.to_dict(), "params": params.to_dict(), "seed": s.seed, "dtype": dtype})
        print(f"{name:32s} top1={fid.top1_agreement:.3f} KL={fid.mean_kl:.4f} maxerr={fid.max_logit_error:.3g} "
              f"greedy={fid.greedy_match_rate:.2f}", flush=True)
        del obf


def report(store: ResultStore) -> str:
    rows = ["| setting | top-1 agreement | mean KL (nats) | greedy match |", "|---|---|---|---|"]
    drift = []
    for name, r in store.entries().items():
        rows.append(f"| {name} | {r['top1_agreement']:.3f} | {r['mean_kl']:.4f} | {r['greedy_match_rate']:.2f} |")
        preset, overrides = ABLATIONS.get(name, (None, {}))
        drift.append((name, preset, r.get("params"), {k: v for k, v in overrides.items() if k != "dtype"}))
    return "\n".join(rows) + drift_notes(drift)


SUMMARY = "prompt fidelity of every preset and single-knob ablation (built-in prompts), side by side"
CONFIGS = {"smollm2": Settings(),
           "qwen-coder": Settings(model="qwen-coder"),
           "smoke": Settings(only=("noisy",), prompts=2, greedy_tokens=4, seed=21)}
DOCS = ("docs/design.md", "docs/accuracy.md")
NOTES = "smollm2: ~25 obfuscations of SmolLM2, an hour or more on 2 threads"
