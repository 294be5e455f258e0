"""Run attacks against one deployment and write a JSON + Markdown report (a table like the paper's Table 1), and
the ablation mode that reproduces the paper's Table "Ablative studies" (Noise / +KeyMat / +Head&BlockPerm).

Ablation mapping (ObfuscationParams cannot switch the key matrix U off, so "no KeyMat" is the weakest key the
pipeline builds: a random orthogonal U with lambda = 0 and no C / E energy):

    Noise                    the base noise (alpha_e, alpha_h of the base parameters); lam 0, c_scale 0, e_scale 0,
                             qk/ffn/vo scale ranges 1.0 (no per-block, per-neuron or V/O conditioning scalings),
                             head_permutation False, beta 1 (no block permutation)
    Noise + KeyMat           as above with the base lam, c_scale, e_scale and scale ranges (B = U + lam V, C, E, H)
    Noise + KeyMat + Head&BlockPerm   the base parameters (head permutation on, the base beta; the paper uses 8)

The base parameters are the target key's (the paper's ablation uses alpha_e 1.0, alpha_h 0.2: pass a key of the
``paper`` preset, or ``--ablation-preset paper``).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..progress import Progress
from .base import REGISTRY, AttackResult, AttackTarget, Budget, PrivateData


def resolve_names(names: Sequence[str] | str) -> list[str]:
    """'all' (or ['all']) -> every registered attack, in a stable order; unknown names raise with the known list."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n]
    if list(names) == ["all"]:
        return sorted(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown attack(s) {unknown}; available: {sorted(REGISTRY)} or 'all'")
    return list(names)


def run_attacks(target: AttackTarget, data: PrivateData, names: Sequence[str] | str, budget: Budget | str,
                seed: int = 0, log: Callable[[str], None] | None = print,
                on_result: Callable[[list[AttackResult]], None] | None = None,
                done: dict[str, AttackResult] | None = None, progress: bool = False) -> list[AttackResult]:
    """Run the named attacks (or 'all') one after another. An attack that fails is recorded with its error (and
    no numbers) rather than stopping the suite. ``done``: results an earlier run already has (resumed), kept
    as they are and not rerun. ``progress``: a bar with the count and an ETA on stderr (lines then go above it).
    ``on_result`` is called after each attack with every result so far, in order."""
    budget = Budget.named(budget) if isinstance(budget, str) else budget
    done = done or {}
    names = resolve_names(names)
    results: dict[str, AttackResult] = {n: done[n] for n in names if n in done}
    with Progress(len(names), "attacks", unit="attack", enabled=progress, done=len(results)) as bar:
        say = bar.note if progress else log
        for name in names:
            if name in results:
                continue
            bar.start(name)
            t0 = time.perf_counter()
            try:
                res = REGISTRY[name](target, data, budget, seed)
                res.attack = name  # the registry name, so report rows match the CLI names
            except Exception as err:  # noqa: BLE001 - recorded in the report, never silently
                res = AttackResult(name, None, None, {"error": f"{type(err).__name__}: {err}",
                                                      "traceback": traceback.format_exc(limit=5)},
                                   budget={"budget": budget.name}, seconds=time.perf_counter() - t0)
            results[name] = res
            bar.advance()
            if say:
                say(f"{name}: " + (f"error {res.metrics['error']}" if "error" in res.metrics else
                                   f"TTRSR {_pct(res.ttrsr)} PIIRSR {_pct(res.piirsr)} ({res.seconds:.0f} s)"))
            if on_result:
                on_result([results[n] for n in names if n in results])
    return [results[n] for n in names]


def resumable_results(out_dir: str | Path, context: dict[str, Any], stem: str = "attack_report"
                      ) -> dict[str, AttackResult]:
    """The attacks a report in ``out_dir`` already holds for the same run (same ``context``: models, key,
    budget, prompts, seed, ...), by name; failed ones are left out so that a rerun tries them again. Empty when
    there is no report or it belongs to another run."""
    path = Path(out_dir) / f"{stem}.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or old.get("context", {}).get("run") != context.get("run"):
        return {}
    kept = {}
    for r in old.get("results", []):
        res = AttackResult(**r)
        if "error" not in res.metrics:
            kept[res.attack] = res
    return kept


def run_suite(target: AttackTarget, data: PrivateData, names: Sequence[str], budget: Budget | str,
              out_dir: str | Path, context: dict[str, Any], seed: int = 0, progress: bool = True,
              log: Callable[[str], None] | None = print) -> tuple[Path, Path]:
    """``run_attacks`` with the report in ``out_dir`` rewritten after every attack (a stopped run keeps what it
    measured, and the report lists the attacks not run yet), resumed from a report there whose
    ``context["run"]`` (what the figures depend on) is the same. Returns the report's paths."""
    done = resumable_results(out_dir, context)
    if done and log:
        log(f"resuming: {len(done)} attack(s) already in {out_dir} are kept ({', '.join(sorted(done))})")

    def save(so_far: list[AttackResult]) -> None:
        ran = {r.attack for r in so_far}
        write_report(so_far, out_dir, context, pending=[n for n in names if n not in ran])

    results = run_attacks(target, data, names, budget, seed, log=log, on_result=save, done=done, progress=progress)
    return write_report(results, out_dir, context)


# --- formatting ------------------------------------------------------------------------------------------------


def _pct(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * float(x):.2f}"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(float(x))


def _budget_text(b: dict[str, Any]) -> str:
    """Compact budget cell: long lists become their length (the JSON keeps them in full)."""
    b = dict(b)
    parts = []
    if "candidate_pool" in b:
        full = b.pop("candidate_pool_is_full_vocabulary", None)
        parts.append(f"pool={b.pop('candidate_pool')}" + (" (full vocab)" if full else ""))
    for k, v in b.items():
        parts.append(f"{k}={len(v)}" if isinstance(v, (list, tuple)) and len(v) > 3 else f"{k}={v}")
    return "; ".join(parts)


def markdown_table(results: Sequence[AttackResult]) -> str:
    """Rows = attacks; TTRSR / PIIRSR in %, BLEU-4 (0-100), CosSim, vocabulary recovery, wall time, budget."""
    lines = ["| Attack | TTRSR (%) | PIIRSR (%) | BLEU-4 | CosSim | Vocab. recovery (%) | Wall time (s) | Budget |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.metrics
        if "error" in m:
            lines.append(f"| {r.attack} | error | | | | | {r.seconds:.0f} | {m['error'][:120]} |")
            continue
        vocab = m.get("vocab_recovery_sampled", m.get("vocab_recovery"))
        lines.append(f"| {r.attack} | {_pct(r.ttrsr)} | {_pct(r.piirsr)} | {_num(m.get('bleu4'))} | "
                     f"{_num(m.get('cossim'), '{:.3f}')} | {_pct(vocab)} | {r.seconds:.0f} | "
                     f"{_budget_text(r.budget)} |")
    return "\n".join(lines)


def write_report(results: Sequence[AttackResult], out_dir: str | Path, context: dict[str, Any],
                 stem: str = "attack_report", title: str = "Attack report",
                 pending: Sequence[str] = ()) -> tuple[Path, Path]:
    """``<stem>.json`` (every field of every result + context) and ``<stem>.md`` (the table), each replaced
    atomically. ``pending``: attacks not run yet (a report written while the suite runs says so)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = {**context, "python": platform.python_version(),
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "complete": not pending, **({"pending": list(pending)} if pending else {})}
    jpath, mpath = out / f"{stem}.json", out / f"{stem}.md"
    head = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in ctx.items()] + [""]
    if pending:
        head += [f"**Partial report**: {len(pending)} attack(s) not run yet: {', '.join(pending)}.", ""]
    uses = ["", "What each attack used:", ""] + [f"- **{r.attack}**: {r.uses or '(not stated)'}" for r in results]
    _replace(jpath, json.dumps({"context": ctx, "results": [r.to_dict() for r in results]}, indent=2,
                               default=str) + "\n")
    _replace(mpath, "\n".join(head) + markdown_table(results) + "\n" + "\n".join(uses) + "\n")
    return jpath, mpath


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader (or a rerun resuming) never sees half a report


# --- ablation --------------------------------------------------------------------------------------------------

ABLATION_ROWS = ("Noise", "Noise + KeyMat", "Noise + KeyMat + Head&BlockPerm")


def ablation_params(base) -> dict[str, Any]:
    """The three rows of the paper's ablation table as ObfuscationParams derived from ``base`` (see module doc)."""
    noise_only = base.replace(lam=0.0, c_scale=0.0, e_scale=0.0, qk_scale_range=1.0, ffn_scale_range=1.0,
                              vo_scale_range=1.0, head_permutation=False, beta=1)
    keymat = base.replace(head_permutation=False, beta=1)
    return dict(zip(ABLATION_ROWS, (noise_only, keymat, base)))


@dataclass
class AblationRow:
    row: str
    params: dict[str, Any]
    results: list[AttackResult]


def run_ablation(plain_src: str | Path, base_params, work_dir: str | Path, data_fn: Callable[[Any], PrivateData],
                 names: Sequence[str] | str, budget: Budget | str, seed: int = 0,
                 log: Callable[[str], None] | None = print, device: Any = None) -> list[AblationRow]:
    """Obfuscate ``plain_src`` once per ablation row (into work_dir/<row>) and run the attacks on each (models on
    ``device``, default cpu)."""
    from ..obfuscation.pipeline import obfuscate

    rows = []
    for i, (row, params) in enumerate(ablation_params(base_params).items()):
        d = Path(work_dir) / f"ablation-{i}"
        if not (d / "model" / "config.json").exists():
            if log:
                log(f"ablation: obfuscating row '{row}'")
            obfuscate(plain_src, d / "model", d / "key.json", params, seed=seed,
                      allow_weak_seed=True, overwrite=True, progress=False)
        target = AttackTarget(plain_src, d / "model", d / "key.json", device=device)
        rows.append(AblationRow(row, params.to_dict(), run_attacks(target, data_fn(target), names, budget, seed, log)))
    return rows


def ablation_markdown(rows: Sequence[AblationRow]) -> str:
    """Rows = applied mechanisms, columns = TTRSR (%) per attack (the paper's layout)."""
    attacks = [r.attack for r in rows[0].results] if rows else []
    lines = ["| Applied mechanism | " + " | ".join(f"{a} TTRSR (%)" for a in attacks) + " |",
             "|---|" + "---|" * len(attacks)]
    for row in rows:
        cells = ["error" if "error" in r.metrics else _pct(r.ttrsr) for r in row.results]
        lines.append(f"| {row.row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_ablation(rows: Sequence[AblationRow], out_dir: str | Path, context: dict[str, Any]) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / "ablation_report.json", out / "ablation_report.md"
    jpath.write_text(json.dumps({"context": context, "rows": [
        {"row": r.row, "params": r.params, "results": [x.to_dict() for x in r.results]} for r in rows]},
        indent=2, default=str) + "\n")
    head = ["# Ablation (the paper's Table \"Ablative studies\")", ""] + [f"- {k}: {v}" for k, v in context.items()]
    mpath.write_text("\n".join(head) + "\n\n" + ablation_markdown(rows) + "\n\nParameters per row: see the JSON "
                     "(mapping documented in aloepri/attacks/report.py).\n")
    return jpath, mpath
