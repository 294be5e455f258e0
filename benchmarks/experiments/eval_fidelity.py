"""Fidelity per preset with aloepri.eval.fidelity: prompt metrics + perplexity on real text (debian-reference).

One config per model: Qwen2.5-Coder-0.5B runs a smaller budget (10 prompts, 16 greedy tokens, 16 documents x 96
tokens) to fit the CPU budget. Targets come from benchmarks.lib.targets (same seed as `humaneval`: shared cache).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path
from ..lib.presets import drift_notes


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    presets: tuple[str, ...] = ("exact", "noisy", "paper")
    seed: int = 20261122
    prompts: int | None = None  # None: all built-in prompts
    greedy_tokens: int = 24
    corpus_texts: int = 32
    max_tokens: int = 128
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    import aloepri
    from aloepri.eval.fidelity import load_and_report

    from ..lib.targets import obfuscated

    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    budget = dict(prompts=s.prompts, greedy_tokens=s.greedy_tokens, corpus_texts_n=s.corpus_texts,
                  max_tokens=s.max_tokens)
    for preset in s.presets:
        if store.has(preset):
            continue
        params = aloepri.resolve_params(preset)
        target = obfuscated(src, params, s.seed)
        t = time.perf_counter()
        rep = load_and_report(src, target.model_dir, target.key_path, **budget)
        store.put(preset, {"model": s.model, "preset": preset, "params": params.to_dict(), "seed": s.seed,
                           "budget": budget, "seconds": time.perf_counter() - t, **rep})
        print(preset, rep, flush=True)


def _ppl(p: dict) -> str:
    r = p["relative_increase"]
    rel = f"x{p['obfuscated'] / p['plain']:.3g}" if r >= 1 else f"{r * 100:+.2f}%"
    obf = f"{p['obfuscated']:.2f}" if p["obfuscated"] < 1000 else f"{p['obfuscated']:.1f}"
    return f"{p['plain']:.2f} → {obf} ({rel})"


def report(store: ResultStore) -> str:
    rows = ["| model | preset | prompts: top-1 | prompts: mean KL | prompts: max logit err | greedy match | "
            "corpus: top-1 | corpus: mean KL | perplexity plain → obfuscated (rel.) |",
            "|---|---|---|---|---|---|---|---|---|"]
    drift = []
    for key, e in store.entries().items():
        p, c = e["prompts"], e["corpus"]
        rows.append(f"| {e['model']} | {e['preset']} | {p['top1_agreement']:.3f} | {p['mean_kl']:.4f} | "
                    f"{p['max_logit_error']:.3g} | {p['greedy_match_rate']:.2f} | {c['top1_agreement']:.3f} | "
                    f"{c['mean_kl']:.4f} | {_ppl(c['perplexity'])} |")
        drift.append((f"{e['model']} {e['preset']}", e["preset"], e.get("params"), {}))
    return "\n".join(rows) + drift_notes(drift)


SUMMARY = "prompt fidelity, corpus top-1/KL and perplexity per preset (aloepri.eval.fidelity), one config per model"
CONFIGS = {"smollm2": Settings(),
           "qwen-coder": Settings(model="qwen-coder", presets=("noisy", "paper", "exact"), prompts=10,
                                  greedy_tokens=16, corpus_texts=16, max_tokens=96),
           "smoke": Settings(presets=("noisy",), seed=21, prompts=2, greedy_tokens=4, corpus_texts=2,
                             max_tokens=32)}
DOCS = ("docs/accuracy.md",)
NOTES = ("smollm2: ~1 h on 1 thread (exact's float64 products dominate); qwen-coder: hours; needs the "
         "debian-reference corpus")
