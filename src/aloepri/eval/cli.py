"""CLI: `aloepri eval humaneval|fidelity` and `aloepri privacy-budget` (thin layer over aloepri.eval)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..models import resolve_model


def cmd_eval_humaneval(a: argparse.Namespace) -> int:
    import torch

    from ..storage.devices import resolve_device
    from .humaneval import evaluate, load_json, load_runner, save_json_atomic, select_problems

    device = resolve_device(a.device)
    torch.set_num_threads(a.threads)
    if (a.server is None) != (a.key is None):
        raise ValueError("give both --server and --key (obfuscated model) or neither (plaintext model)")
    problems = select_problems(a.subset)
    label = "plaintext" if a.server is None else f"obfuscated:{a.server}"
    runner = load_runner(label, resolve_model(a.src), a.server, a.key, device=device)
    out = Path(a.out) if a.out else None
    data = load_json(out) if out else {}
    if data and data.get("label") not in (None, label):
        raise ValueError(f"{out} holds results of {data.get('label')!r}, not {label!r}; choose another --out")
    data.update(label=label, max_new_tokens=a.max_new_tokens)
    results = data.setdefault("results", {})

    def save(tid: str, r: dict) -> None:
        results[tid] = r
        print(f"{tid}: {r['status']} ({r['new_tokens']} tokens, {r['gen_seconds']:.1f}s)", file=sys.stderr)
        if out:
            save_json_atomic(out, data)

    summary = evaluate(runner, problems, a.max_new_tokens, a.timeout, done=results, on_result=save)
    print(json.dumps({"label": label, "subset": a.subset, **summary}, indent=2))
    return 0


def cmd_eval_fidelity(a: argparse.Namespace) -> int:
    import torch

    from ..storage.devices import resolve_device
    from .fidelity import load_and_report, verdict_line

    device = resolve_device(a.device)
    torch.set_num_threads(a.threads)
    report = load_and_report(resolve_model(a.src), a.out, a.key, device=device, progress=not a.quiet,
                             results=a.results, prompts=a.prompts, greedy_tokens=a.greedy_tokens,
                             corpus=a.corpus, corpus_texts_n=a.texts, max_tokens=a.max_tokens)
    print(json.dumps(report, indent=2))
    print(verdict_line(report["prompts"], report["prompts"]), file=sys.stderr)
    return 0


def cmd_privacy_budget(a: argparse.Namespace) -> int:
    from ..obfuscation.params import resolve_params
    from ..runtime.perturb import sequence_epsilon
    from .privacy import explain, privacy_budget

    params = resolve_params(a.preset, a.preset_file, alpha_e=a.alpha_e, alpha_h=a.alpha_h)
    if a.eps1 is not None and a.eps_tok is not None:
        raise ValueError("give --eps1 (sequence budget) or --eps-tok with --tokens, not both")
    eps_1 = math.inf
    if a.eps1 is not None:
        eps_1 = a.eps1
    elif a.eps_tok is not None:
        if a.tokens is None:
            raise ValueError("--eps-tok needs --tokens (how many positions the client perturbs)")
        eps_1 = sequence_epsilon(a.eps_tok, a.tokens)
    b = privacy_budget(resolve_model(a.src), params.alpha_e, params.alpha_h, eps_1)
    if a.json:
        print(json.dumps({"alpha_e": params.alpha_e, "alpha_h": params.alpha_h, **b.to_dict()}, indent=2))
    else:
        print(explain(b, params.alpha_e, params.alpha_h))
    return 0


def add_eval_commands(sub) -> None:
    from ..obfuscation.params import PRESETS
    from ..storage.devices import add_device_option

    ev = sub.add_parser("eval", help="accuracy evaluation: HumanEval pass@1, fidelity and perplexity")
    esub = ev.add_subparsers(dest="eval_command", required=True)

    p = esub.add_parser("humaneval", help="HumanEval pass@1 (greedy, sandboxed execution)")
    p.add_argument("src", help="plaintext model (HF directory or .gguf): the model, or the client's tokenizer")
    p.add_argument("--server", default=None, help="obfuscated model directory (omit for the plaintext model)")
    p.add_argument("--key", default=None, help="client key of --server")
    p.add_argument("--subset", default="ci", help="'ci' (fixed 20 problems), 'full' (164) or N")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per test program")
    p.add_argument("--out", default=None, help="resumable JSON of per-problem results")
    p.add_argument("--threads", type=int, default=1)
    add_device_option(p)
    p.set_defaults(func=cmd_eval_humaneval)

    p = esub.add_parser("fidelity", help="top-1/KL/logit error/greedy match on prompts, perplexity on real text")
    p.add_argument("src")
    p.add_argument("out", help="obfuscated model directory")
    p.add_argument("--key", required=True)
    p.add_argument("--corpus", default=None, help="aloepri.attacks.data corpus name or 'stdlib-docstrings' "
                                                   "(default: debian-reference when installed)")
    p.add_argument("--texts", type=int, default=32, help="number of corpus documents")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per document")
    p.add_argument("--prompts", type=int, default=None, help="built-in prompts (default all 20)")
    p.add_argument("--greedy-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--results", default=None, metavar="FILE",
                   help="keep each prompt's and text's measurement in this JSON file as it is made; a rerun with "
                        "the same file skips what was already measured")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_option(p)
    p.set_defaults(func=cmd_eval_fidelity)

    p = sub.add_parser("privacy-budget", help="the paper's RmDP epsilon for a model and noise setting")
    p.add_argument("src", help="plaintext model (HF directory or .gguf)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--preset-file", default=None)
    p.add_argument("--alpha-e", type=float, default=None, help="override the preset's alpha_e")
    p.add_argument("--alpha-h", type=float, default=None, help="override the preset's alpha_h")
    p.add_argument("--eps1", type=float, default=None, help="online token-perturbation budget eps_1 (sequence)")
    p.add_argument("--eps-tok", type=float, default=None, help="per-token budget of aloepri.runtime.perturb")
    p.add_argument("--tokens", type=int, default=None, help="perturbed positions (with --eps-tok)")
    p.add_argument("--json", action="store_true", help="the figures as JSON instead of the explanation in words")
    p.set_defaults(func=cmd_privacy_budget)
