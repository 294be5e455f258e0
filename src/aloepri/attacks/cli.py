"""``aloepri attack NAME|all``: run attacks on one obfuscated deployment and write a JSON + Markdown report."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .base import PrivateData


def private_data(tokenizer, n: int, seed: int) -> PrivateData:
    """The victim's prompts: Faker PII prompts (aloepri.attacks.data); the built-in fidelity prompts with an
    all-False PII mask if that module is unavailable (PIIRSR is then not measured)."""
    try:
        from .data import private_prompts
    except ImportError:  # pragma: no cover - data.py ships with the package; kept for partial installs
        from ..eval.fidelity import BUILTIN_PROMPTS

        texts = (BUILTIN_PROMPTS * (n // len(BUILTIN_PROMPTS) + 1))[:n]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return PrivateData(texts, ids, [[False] * len(i) for i in ids])
    return private_prompts(tokenizer, n, seed)


def victim_prompts(target, n: int, seed: int, has_tok: bool | None = None) -> tuple[PrivateData, dict[str, Any]]:
    """(the victim's prompts, their description) for an attack or an audit: Faker PII prompts through the public
    tokenizer (``private_data``); without one (test and synthetic checkpoints) ``n`` seeded 16-token prompts of
    random ids (no PII mask: PIIRSR is then not measured). ``has_tok``: whether the tokenizer loads, when known."""
    import numpy as np

    from .base import has_tokenizer

    if has_tok if has_tok is not None else has_tokenizer(target):
        data = private_data(target.tokenizer, n, seed)
        kind = "Faker PII prompts in realistic templates (aloepri.attacks.data)"
    else:
        rng = np.random.default_rng(seed)
        ids = [rng.integers(16, target.vocab_size, size=16).tolist() for _ in range(n)]
        data = PrivateData([""] * n, ids, [[False] * 16 for _ in ids])
        kind = "random token ids (the plaintext model ships no tokenizer; PII recovery not measured)"
    return data, {"kind": kind, "count": len(data.plain_ids), "seed": seed,
                  "tokens": sum(map(len, data.plain_ids)), "pii_tokens": sum(sum(m) for m in data.pii_mask)}


def needed_text(results: list[dict[str, Any]]) -> list[str]:
    """The attacks among a report's ``results`` that stopped because the plaintext model ships no tokenizer."""
    from .base import NoTokenizerError

    return [r["attack"] for r in results
            if str((r.get("metrics") or {}).get("error", "")).startswith(NoTokenizerError.__name__ + ":")]


def cmd_attack(args: argparse.Namespace) -> int:
    import torch

    from . import UNAVAILABLE
    from .base import AttackTarget, Budget
    from ..storage.devices import describe_device
    from .report import resolve_names, run_ablation, run_suite, write_ablation

    torch.set_num_threads(max(1, args.threads))
    for mod, why in UNAVAILABLE.items():
        print(f"note: {why}")
    names = resolve_names(args.name)
    budget = Budget.named(args.budget)
    budget.threads = max(1, args.threads)
    if args.batch is not None:
        if args.batch < 1:
            raise ValueError(f"--batch must be a positive number of sequences, got {args.batch}")
        budget.batch = args.batch
    out = Path(args.report_dir)
    from ..models import resolve_model

    args.plain = resolve_model(args.plain)  # a bundled model's name or a path
    from ..storage.devices import resolve_device
    from .engines import choose_engine

    if not (Path(args.obfuscated) / "config.json").is_file():
        raise ValueError(f"obfuscated model {args.obfuscated} not found (no config.json); give the directory "
                         "`aloepri obfuscate` wrote")
    engine = choose_engine(args.engine, args.obfuscated, resolve_device(args.device))
    target = AttackTarget(args.plain, args.obfuscated, args.key, device=args.device, engine=engine.name,
                          engine_why=engine.why, threads=budget.threads)
    context: dict[str, Any] = {"plain": str(args.plain), "obfuscated": str(args.obfuscated), "budget": args.budget,
                               "prompts": args.prompts, "seed": args.seed, "attacks": names,
                               "device": describe_device(target.device), "batch": args.batch,
                               "engine": engine.name, "engine_why": engine.why}
    if args.ablation:
        from ..obfuscation.params import ObfuscationParams, resolve_params

        base = resolve_params(args.ablation_preset) if args.ablation_preset else \
            ObfuscationParams.from_dict(target.key.params)
        rows = run_ablation(args.plain, base, out / "ablation-models", lambda t: victim_prompts(t, args.prompts,
                            args.seed)[0], names, budget, args.seed, device=target.device)
        j, m = write_ablation(rows, out, {**context, "base_params": base.to_dict()})
    else:
        data, context["private_prompts"] = victim_prompts(target, args.prompts, args.seed)
        context["params"] = target.key.params
        # what the figures depend on: a report in --report-dir with the same run is resumed
        context["run"] = {k: context[k] for k in ("plain", "obfuscated", "budget", "prompts", "seed", "device",
                                                   "batch", "engine")} | {"model_fingerprint": target.key.model_fingerprint}
        j, m = run_suite(target, data, names, budget, out, context, args.seed, progress=not args.quiet)
        import json

        text = needed_text(json.loads(j.read_text())["results"])
        if text:
            from .base import NoTokenizerError

            ran = "" if len(text) == len(names) else f" (the others are in {j})"
            raise NoTokenizerError(f"{', '.join(text)} tokenize{'s' if len(text) == 1 else ''} text, and the "
                                   f"plaintext model {args.plain} ships no tokenizer: give the plaintext model "
                                   f"with its tokenizer, or run the attacks that need none{ran}")
    print(f"wrote {j} and {m}")
    return 0


def attack_listing() -> str:
    """Every registered attack with the first line of its description (for ``aloepri attack --help``)."""
    from . import REGISTRY, UNAVAILABLE

    def first_sentence(doc: str | None) -> str:
        text = " ".join((doc or "").strip().split("\n\n")[0].split())
        return text.split(". ")[0].rstrip(".") + "." if text else "(no description)"

    width = max(len(n) for n in REGISTRY)
    lines = ["attacks:"] + [f"  {n.ljust(width)}  {first_sentence(fn.__doc__)}" for n, fn in sorted(REGISTRY.items())]
    lines += [f"  (unavailable: {why})" for why in UNAVAILABLE.values()]
    return "\n".join(lines) + "\n"


def add_attack_commands(sub: Any) -> None:
    """Add ``attack`` to the ``aloepri`` subcommands."""
    from ..storage.devices import add_device_option

    p = sub.add_parser("attack", help="run privacy attacks (VMA, IA, NN, ISA, IMA, TFMA, SDA, behavioural, ...) on an "
                                      "obfuscated model and write a JSON + Markdown report")
    p.add_argument("name", help="attack name, comma-separated names, or 'all' (every attack is listed below)")
    base_help = p.format_help
    p.format_help = lambda: base_help() + "\n" + attack_listing()  # lazy: the registry imports every module
    p.add_argument("--plain", required=True, help="the public plaintext model (GGUF file or HF directory)")
    p.add_argument("--obfuscated", required=True, help="the obfuscated model directory (the server's artifact)")
    p.add_argument("--key", required=True, help="the client key (ground truth, used only to score)")
    p.add_argument("--budget", default="small", choices=["ci", "small", "full"],
                   help="attack budget: data sizes, training steps, sources (default small)")
    p.add_argument("--prompts", type=int, default=50, help="number of private PII prompts (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_device_option(p)
    from .engines import AUTO, CHOICES, ENGINE_HELP

    p.add_argument("--engine", default=AUTO, choices=CHOICES, help=ENGINE_HELP)
    p.add_argument("--batch", type=int, default=None,
                   help="probe sequences per forward pass for the attacks that run both models on many inputs "
                        "(behavioural); default: each stage's own (16 for output profiles); raise it on a GPU")
    p.add_argument("--report-dir", default="attack-report",
                   help="where the JSON and Markdown go; written after every attack, and a rerun with the same "
                        "directory and arguments skips the attacks it already holds")
    p.add_argument("--quiet", action="store_true", help="no progress bar (one line per attack instead)")
    p.add_argument("--ablation", action="store_true",
                   help="reproduce the paper's ablation table: obfuscate --plain three times (Noise / +KeyMat / "
                        "+Head&BlockPerm, base parameters from --key or --ablation-preset) and attack each")
    p.add_argument("--ablation-preset", default=None, help="base parameters for --ablation (default: the key's)")
    p.set_defaults(func=cmd_attack)
