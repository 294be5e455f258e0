"""``python -m benchmarks list | run NAME | report NAME | render-docs`` (see benchmarks/__init__.py)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from .lib import UsageError, all_experiments, get_experiment
from .lib.fields import parse_assignments, to_jsonable


def _list(args) -> int:
    for exp in all_experiments().values():
        stored = []
        for cfg in (*exp.config_names, *exp.legacy_configs):
            path = exp.store(cfg).path
            if path.exists():
                stored.append(cfg)
        print(f"{exp.name}: {exp.summary}")
        print(f"    configs: {', '.join(exp.config_names)}"
              + (f"; kept results only: {', '.join(exp.legacy_configs)}" if exp.legacy_configs else "")
              + f"; stored: {', '.join(stored) or 'none'}")
        if args.verbose:
            if exp.notes:
                print(f"    notes: {exp.notes}")
            if exp.docs:
                print(f"    cited in: {', '.join(exp.docs)}")
    return 0


def _run(args) -> int:
    exp = get_experiment(args.name)
    name = args.config or exp.default_config or exp.config_names[0]
    settings = exp.config(name)
    if args.set:
        if not args.save_as:
            raise UsageError("--set changes a named config: give the result a name of its own with --save-as NAME")
        try:
            settings = dataclasses.replace(settings, **parse_assignments(exp.settings, args.set))
        except ValueError as e:
            raise UsageError(f"--set: {e}") from None
    if args.save_as:
        if args.save_as in exp.configs and args.set:
            raise UsageError(f"--save-as {args.save_as}: that name is a config of {exp.name}; choose another")
        name = args.save_as
    if args.dry_run:
        print(f"{exp.name} / {name}: {to_jsonable(settings)}")
        return 0
    store = exp.store(name, settings)
    store.begin(argv=["python", "-m", "benchmarks", *sys.argv[1:]], fresh=args.fresh)
    print(f"{exp.name} / {name} -> {store.path}", flush=True)
    try:
        exp.run(settings, store)
    except BaseException:
        store.abandon()  # a run that failed before storing anything leaves no trace
        raise
    print(exp.report(store))
    return 0


def _report(args) -> int:
    exp = get_experiment(args.name)
    names = [args.config] if args.config else [c for c in (*exp.config_names, *exp.legacy_configs)
                                                if exp.store(c).path.exists()]
    if not names:
        raise UsageError(f"{exp.name}: no stored results; run `python -m benchmarks run {exp.name}`")
    for name in names:
        store = exp.store(name)
        if not store.path.exists():
            raise UsageError(f"{store.path} does not exist; run "
                                    f"`python -m benchmarks run {exp.name} --config {name}`")
        print(f"## {exp.name} / {name}\n")
        print(exp.report(store))
        print()
    return 0


def _render_docs(args) -> int:
    from .lib.docs import default_files, render_docs, render_generated

    files = [Path(f) for f in args.files] if args.files else default_files()
    stale = render_docs(files, check=args.check)
    if not args.files:  # the audit's measured context, from its rendered source
        stale += render_generated(check=args.check)
    for line in stale:
        print(f"{line}: {'stale' if args.check else 'rendered'}")
    if args.check and stale:
        print(f"{len(stale)} report block(s) or figure(s) differ from the store; `python -m benchmarks render-docs` "
              "rewrites them", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description="aloepri's experiments")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="experiments, configs and stored results")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_list)
    p = sub.add_parser("run", help="run (or resume) one experiment under a named config")
    p.add_argument("name")
    p.add_argument("--config")
    p.add_argument("--set", nargs="+", metavar="FIELD=VALUE", help="override settings (needs --save-as)")
    p.add_argument("--save-as", metavar="NAME", help="store under this config name")
    p.add_argument("--fresh", action="store_true", help="discard the stored results of this config first")
    p.add_argument("--dry-run", action="store_true", help="print the settings and stop")
    p.set_defaults(func=_run)
    p = sub.add_parser("report", help="tables (and figures) from stored results")
    p.add_argument("name")
    p.add_argument("--config")
    p.set_defaults(func=_report)
    p = sub.add_parser("render-docs", help="rewrite the docs' report blocks from the stored results")
    p.add_argument("files", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 listing the stale blocks")
    p.set_defaults(func=_render_docs)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:  # errors inside an experiment keep their traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
