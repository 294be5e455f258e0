"""``aloepri baseline METHOD``: score a Table 1 baseline the way ``aloepri attack`` scores aloepri — the same PII
prompts, TTRSR/PIIRSR (direct observation for SANTEXT/RANTEXT, NN + IMA for DP-Forward and SGT) and the same fidelity
numbers — and write a JSON + Markdown report."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..storage.staging import write_text_atomic


def markdown(report: dict[str, Any]) -> str:
    m = report["mechanism"]
    budget = "" if m.get("eps") is None else f" (eps {m['eps']:g})"
    lines = [f"# {m['method']}{budget} on {Path(report['plain']).name}", "",
             f"Mechanism: `{json.dumps(m)}`", "",
             "| attack | TTRSR | PIIRSR | BLEU-4 | CosSim |", "|---|---|---|---|---|"]
    for name, r in report["privacy"].items():
        if isinstance(r, dict):
            cos = "-" if r.get("cossim") is None else f"{r['cossim']:.3f}"
            bleu = "-" if r.get("bleu4") is None else f"{r['bleu4']:.2f}"
            lines.append(f"| {name} | {r['ttrsr']:.4f} | {r['piirsr'] if r['piirsr'] is None else round(r['piirsr'], 4)}"
                         f" | {bleu} | {cos} |")
    if "fidelity" in report:
        f = report["fidelity"]
        lines += ["", f"Fidelity (built-in chat prompts, {f['positions']} positions): top-1 agreement "
                      f"{f['top1_agreement']:.4f}, mean KL {f['mean_kl']:.4f} nats"
                      + (f", token change rate {f['token_change_rate']:.4f}" if "token_change_rate" in f else "")]
    return "\n".join(lines) + "\n"


def cmd_baseline(a: argparse.Namespace) -> int:
    import torch

    from ..attacks.cli import private_data
    from ..runtime.inference import load_plain_model
    from .harness import fidelity, make_method, privacy, user_content_prompts
    from .token_substitution import fresh_seed

    if a.method == "sgt":
        if a.sgt_params is None:
            raise ValueError("sgt needs --sgt-params FILE (a generator trained by aloepri.baselines.sgt.train_sgt, "
                             "e.g. by `python -m benchmarks run table1`)")
        if not Path(a.sgt_params).is_file():
            raise ValueError(f"--sgt-params {a.sgt_params}: no such file")
    elif a.eps is None or not (a.eps > 0 and math.isfinite(a.eps)):
        raise ValueError(f"--eps must be a positive finite number, got {a.eps}")
    if not 0 < a.delta < 1:
        raise ValueError(f"--delta must lie in (0, 1), got {a.delta}")
    if a.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {a.prompts}")
    from ..models import resolve_model

    src = resolve_model(a.plain)
    torch.set_num_threads(max(1, a.threads))
    from transformers import AutoTokenizer

    tok = (AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name) if src.is_file()
           else AutoTokenizer.from_pretrained(str(src)))
    model = load_plain_model(src)
    method = make_method(a.method, model, a.eps, a.delta, a.layer, a.clip_norm, sgt_params=a.sgt_params)
    seed = fresh_seed() if a.seed is None else a.seed  # the mechanism's noise: OS CSPRNG unless asked
    data = private_data(tok, a.prompts, a.data_seed)
    report: dict[str, Any] = {"plain": str(src), "mechanism": method.describe(), "prompts": a.prompts,
                              "data_seed": a.data_seed, "seed_given": a.seed is not None, "budget": a.budget,
                              "privacy": privacy(method, model, tok, data, seed, a.budget)}
    if not a.no_fidelity:
        report["fidelity"] = fidelity(method, model, user_content_prompts(tok), seed)
    out = Path(a.report_dir)
    stem = f"baseline-{a.method}" + ("" if a.method == "sgt" else f"-eps{a.eps:g}")
    write_text_atomic(out / f"{stem}.json", json.dumps(report, indent=1))
    write_text_atomic(out / f"{stem}.md", markdown(report))
    print(markdown(report))
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0


def add_baseline_commands(sub: Any) -> None:
    from .harness import METHODS

    p = sub.add_parser("baseline", help="score a Table 1 baseline (SANTEXT, RANTEXT, DP-Forward, SGT) with aloepri's "
                                        "attacks and fidelity metrics")
    p.add_argument("method", choices=METHODS, help="dp-forward: token-level LDP with clipping (a real guarantee); "
                                                    "dp-forward-paper: the AloePri paper's unclipped setting; "
                                                    "sgt: a trained Stained Glass Transform (--sgt-params)")
    p.add_argument("--plain", required=True, help="the plaintext model (GGUF file or HF directory)")
    p.add_argument("--eps", type=float, default=None, help="privacy parameter, required except for sgt (paper: "
                                                           "santext 3, rantext 30, dp-forward 5)")
    p.add_argument("--sgt-params", default=None, help="sgt: the trained noise generator (.pt, SGT.save)")
    p.add_argument("--delta", type=float, default=1e-5, help="DP-Forward delta (default 1e-5)")
    p.add_argument("--layer", type=int, default=None, help="DP-Forward: noise after this many decoder layers "
                                                           "(default 0 = embeddings; paper setting 1)")
    p.add_argument("--clip-norm", type=float, default=None, help="DP-Forward row clipping norm (default at layer 0: "
                                                                 "the largest embedding-row norm)")
    p.add_argument("--prompts", type=int, default=50, help="number of private PII prompts (default 50)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the Faker PII prompts (default 0)")
    p.add_argument("--seed", type=int, default=None, help="mechanism seed, for a reproducible run (default: OS "
                                                          "randomness)")
    p.add_argument("--budget", default="small", choices=["ci", "small", "full"], help="IMA budget (DP-Forward, SGT)")
    p.add_argument("--no-fidelity", action="store_true", help="skip the fidelity measurement")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-dir", default="baseline-report", help="where the JSON and Markdown go")
    p.set_defaults(func=cmd_baseline)
