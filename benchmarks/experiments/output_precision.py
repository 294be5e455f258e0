"""Which output precision to serve from a quantized GGUF source: the obfuscated model written and run in each dtype,
measured against the plaintext model run in the same dtype (what the user would otherwise serve), against the
float32 plaintext model, and the plaintext model's own floor in that dtype (plaintext dtype against plaintext
float32); with the checkpoint's size on disk.

Every comparison is ``aloepri.eval.fidelity.compare`` on the built-in chat prompts (top-1 agreement, mean KL in
nats, greedy match over ``greedy_tokens``), both models computed in the dtype named (transformers on the CPU).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.variants import preset_params


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    preset: str = "default"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    prompts: int = 10
    greedy_tokens: int = 16
    seed: int = 1234
    threads: int = 2


def run(s: Settings, store: ResultStore) -> None:
    """One model in memory at a time (PlainReference), so that a 1.5B model fits: the float32 plaintext model's
    outputs, then the plaintext model in the dtype, then the obfuscated one."""
    import torch

    import aloepri
    from aloepri.eval.fidelity import PlainReference, builtin_prompt_ids, compare_with_reference, release_memory
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer

    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    reference32 = None
    for name in s.dtypes:
        if store.has(name):
            continue
        dtype = getattr(torch, name)
        with tempfile.TemporaryDirectory(prefix="output-precision-") as work:
            out, key_path = Path(work) / "server", Path(work) / "client.key"
            res = aloepri.obfuscate(src, out, key_path, preset_params(s.preset), seed=s.seed, dtype=name,
                                    allow_weak_seed=True, progress=False)
            key = aloepri.load_key(key_path)
            prompts = builtin_prompt_ids(load_tokenizer(key, src), key.vocab_size, s.prompts)
            eos = key.special_tokens.get("eos_token_id")
            if reference32 is None:
                reference32 = PlainReference(load_plain_model(src), prompts, s.greedy_tokens, eos)
                release_memory()
            plain = load_plain_model(src, dtype=dtype)
            reference = PlainReference(plain, prompts, s.greedy_tokens, eos)
            floor = compare_with_reference(reference32, plain, None)
            del plain
            release_memory()
            obf = load_obfuscated_model(out, dtype=dtype)
            entry = {
                "model": s.model, "preset": s.preset, "dtype": name, "prompts": s.prompts,
                "greedy_tokens": s.greedy_tokens, "kept_dims": list(res.kept_dims),
                "kept_dims_rule": res.kept_dims_rule,
                "output_bytes": sum(f.stat().st_size for f in out.iterdir()),
                "against_plaintext_same_dtype": compare_with_reference(reference, obf, key).to_dict(),
                "against_plaintext_float32": compare_with_reference(reference32, obf, key).to_dict(),
                "plaintext_floor": floor.to_dict(),
            }
            del obf
            release_memory()
        store.put(name, entry)
        same = entry["against_plaintext_same_dtype"]
        print(f"{name}: {entry['output_bytes'] / 1e6:.0f} MB, {len(res.kept_dims)} dimensions kept "
              f"({res.kept_dims_rule}), against plaintext {name}: top-1 "
              f"{same['top1_agreement']:.4f}, KL {same['mean_kl']:.2e}, greedy {same['greedy_match_rate']:.2f}",
              flush=True)


def _cells(f: dict) -> str:
    return f"{f['top1_agreement']:.4f} | {f['mean_kl']:.2e} | {f['greedy_match_rate']:.2f}"


def report(store: ResultStore) -> str:
    rows = ["Columns in threes (top-1 agreement, mean KL in nats, greedy match): against the plaintext model in the "
            "same dtype; against the plaintext model in float32; the plaintext model in that dtype against itself "
            "in float32 (the floor).", "",
            "| output dtype | size on disk | same dtype: top-1 | KL | greedy | plaintext float32: top-1 | KL | greedy "
            "| floor: top-1 | KL | greedy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in store.entries().items():
        rows.append(f"| {name} | {e['output_bytes'] / 1e6:.0f} MB | {_cells(e['against_plaintext_same_dtype'])} | "
                    f"{_cells(e['against_plaintext_float32'])} | {_cells(e['plaintext_floor'])} |")
    return "\n".join(rows)


SUMMARY = ("output precision for a GGUF source: the obfuscated model in float32 / bfloat16 against plaintext in the "
           "same dtype")
CONFIGS = {"smollm2": Settings(prompts=8, greedy_tokens=12),
           "smoke": Settings(prompts=2, greedy_tokens=4),
           # bfloat16 only, as for the 1.5B (its float32 output is the question of the SmolLM2 config)
           "qwen-coder": Settings(model="qwen-coder", dtypes=("bfloat16",), prompts=8, greedy_tokens=12),
           # bfloat16 only (a float32 output is 7 GB); one model in memory at a time, about 7.5 GB at the peak
           "qwen-coder-1.5b": Settings(model="qwen-coder-1.5b", dtypes=("bfloat16",), prompts=4, greedy_tokens=8),
           # 8 residual dimensions chosen from the weights kept out of the key's mixing: on this model the 4 of
           # the rule before outlier_rms left a dimension at 185x the median RMS mixed (experiment residual_outliers)
           "qwen-coder-1.5b-outliers8": Settings(model="qwen-coder-1.5b", preset="default+outlier_dims=8",
                                                 dtypes=("bfloat16",), prompts=4, greedy_tokens=8)}
# `default` measured while it kept 4 dimensions chosen from the weights (outlier_dims=4), before outlier_rms
LEGACY_CONFIGS = ("smollm2-weights4", "qwen-coder-1.5b-weights4")
DOCS = ("docs/accuracy.md",)
NOTES = "smollm2: about 10 minutes on a loaded 2-core machine (bfloat16 matrix products are slow on CPUs without AMX)"
