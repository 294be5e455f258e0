"""``aloepri audit PLAIN --obfuscated DIR --key KEY``: the thin command over aloepri.audit.run_audit."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def cmd_audit(a: argparse.Namespace) -> int:
    from .run import run_audit  # validates every input before a model loads: one line, exit 2 (aloepri.cli)

    command = shlex.join(["aloepri", "audit", str(a.plain), "--obfuscated", str(a.obfuscated), "--key", str(a.key),
                          "--budget", a.budget, "--out", str(a.out), "--seed", str(a.seed), "--threads", str(a.threads)]
                         + (["--prompts", str(a.prompts)] if a.prompts is not None else [])
                         + (["--all-attacks"] if a.all_attacks else [])
                         + (["--traffic-tokens", str(a.traffic_tokens)] if a.traffic_tokens is not None else [])
                         + ["--engine", a.engine] + (["--device", str(a.device)] if a.device not in (None, "cpu") else []))
    rep = run_audit(a.plain, a.obfuscated, a.key, a.budget, a.out, a.prompts, a.seed, a.threads,
                    progress=not a.quiet, command=command, all_attacks=a.all_attacks, engine=a.engine,
                    device=a.device or "cpu", traffic_tokens=a.traffic_tokens,
                    log=None if a.quiet else (lambda m: print(m, file=sys.stderr)))
    print(rep.verdict["headline"])
    for key in ("provider", "id_stream"):
        print(f"- {rep.verdict[key]['text']}")
    print(f"wrote {rep.json_path} and {rep.html_path}")
    return 0


def add_audit_commands(sub: Any) -> None:
    """Add ``audit`` to the ``aloepri`` subcommands."""
    p = sub.add_parser("audit", help="who can read your prompts: fidelity and the strongest attacks on one "
                                     "obfuscated model, as report.json and a self-contained report.html")
    p.add_argument("plain", help="the public plaintext model the obfuscated one was made from (.gguf, HF directory "
                                  "or a bundled model name such as smollm2)")
    p.add_argument("--obfuscated", required=True, help="the obfuscated model directory (the server's artifact)")
    p.add_argument("--key", required=True, help="the client key (used to score the attacks, never written out)")
    p.add_argument("--budget", default="ci", metavar="ci|small|full",
                   help="how much the attacks may spend: ci (minutes on a 135M model, the strongest attacks "
                        "only), small, full (every attack of the threat model). Default ci")
    p.add_argument("--out", required=True, help="directory for report.json and report.html")
    p.add_argument("--prompts", type=int, default=None,
                   help="number of private PII prompts the attacks try to recover (default 20 at ci, 50 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the attacks (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--all-attacks", action="store_true",
                   help="run every planned attack, also those that cannot change the verdict (an observer already "
                        "at 100%%)")
    from ..attacks.engines import AUTO, CHOICES, ENGINE_HELP
    from ..attacks.log_reader import DEFAULT_TRAFFIC_TOKENS

    p.add_argument("--traffic-tokens", type=int, default=None, metavar="N",
                   help="the volume of logs the log reader (stream-decipher) is given: N tokens of requests, your "
                        "prompts among public PII-like prompts, through your key; the report gives its recovery "
                        f"at volumes up to N (default {DEFAULT_TRAFFIC_TOKENS:,}: about a day of one user's ordinary "
                        "use, some 100 requests)")
    from ..storage.devices import add_device_option

    p.add_argument("--engine", default=AUTO, choices=CHOICES, help=ENGINE_HELP)
    add_device_option(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_audit)
