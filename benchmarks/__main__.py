"""``python -m benchmarks list | run NAME | report NAME | render-docs | cache`` (see benchmarks/__init__.py)."""
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


def _cache(args) -> int:
    """The obfuscated-target cache (benchmarks.lib.targets): its entries and size; --prune removes the least
    recently used ones down to the cap (--max-gb, default ALOEPRI_BENCH_CACHE_GB or the default cap)."""
    import time

    from .lib import targets

    if args.max_gb is not None and not 0 <= args.max_gb < float("inf"):
        raise UsageError(f"--max-gb must be a number of GB >= 0, got {args.max_gb}")
    try:
        cap = targets.cap_bytes() if args.max_gb is None else int(args.max_gb * 1e9)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.prune:
        # an explicit prune also takes what was used recently; a running experiment may lose a target it reads
        removed = targets.prune(cap, recent_seconds=0 if args.all else targets.RECENT_SECONDS)
        for e in removed:
            print(f"removed {e.path} ({e.bytes / 1e9:.2f} GB)")
    found = targets.entries()
    now = time.time()
    for e in found:
        print(f"{e.bytes / 1e9:8.2f} GB  used {(now - e.last_used) / 3600:7.1f} h ago  {e.path}")
    total = sum(e.bytes for e in found)
    print(f"{targets.WORK}: {len(found)} entries, {total / 1e9:.2f} GB; cap {cap / 1e9:.2f} GB "
          f"({targets.CAP_ENV}; entries used in the last {targets.RECENT_SECONDS / 3600:g} h are kept by automatic "
          "pruning)")
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
    p = sub.add_parser("cache", help="the obfuscated-target cache: size and entries; --prune to the cap")
    p.add_argument("--prune", action="store_true", help="remove least recently used entries down to the cap")
    p.add_argument("--max-gb", type=float, help="the cap for this --prune, in GB (0: remove everything)")
    p.add_argument("--all", action="store_true", help="with --prune: also entries used in the last hours")
    p.set_defaults(func=_cache)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:  # errors inside an experiment keep their traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
