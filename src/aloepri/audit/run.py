"""Run an audit: validate the inputs once, measure fidelity, run the planned attacks, write report.json and
report.html atomically.

report.json (``format`` "aloepri-audit", ``version`` 1) holds at least:
- ``worst_prompt_token_recovery``: the best attack's TTRSR on the private prompts, a fraction in [0, 1] (null when
  no attack ran), and ``worst_attack``;
- ``verdict``: ``headline`` and, per observer (``id_stream``, ``provider``), level, recovery, attack, whether the
  figure is a lower bound, the attacks that did not run and why, and the text;
- ``attacks``: one entry per planned attack: ``status`` "ran" (with ttrsr, piirsr, tokens scored, seconds, what it
  used, its budget), "skipped" (with ``reason``) or "failed" (with ``error``);
- ``fidelity`` (top-1 agreement, mean KL, greedy match rate, max logit error; corpus perplexity at small / full),
  ``parameters`` (from the key; never the secret seed or permutation), ``private_prompts``, ``budget``, ``seed``,
  ``versions`` (aloepri, torch, transformers, python, numpy), ``git`` (commit of the aloepri checkout if it is
  one), ``machine`` and ``time``.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..keyfile import KeyFile, check_key_matches, load_key
from ..models import BUNDLED_MODELS, resolve_model
from ..progress import Progress
from ..storage.staging import check_writable_destination, clean_stale, make_staging_file
from . import plan as plan_mod
from .verdict import FAILED, RAN, SKIPPED, headline, verdicts

REPORT_FORMAT, REPORT_VERSION = "aloepri-audit", 1
# fidelity per budget: built-in chat prompts, greedy tokens, corpus texts for perplexity (0: none)
FIDELITY_BUDGETS = {"ci": (8, 16, 0), "small": (20, 24, 16), "full": (20, 24, 32)}
DEFAULT_PROMPTS = {"ci": 20, "small": 50, "full": 50}
PENDING = "the audit had not reached this step when the report was written"


class AuditInputError(ValueError):
    """A bad audit input, described in one actionable line."""


@dataclass
class AuditInputs:
    plain: Path
    obfuscated: Path
    key_path: Path
    key: KeyFile
    budget: str
    out: Path
    prompts: int
    seed: int
    threads: int
    engine: str = "torch"  # aloepri.attacks.engines.ENGINES
    engine_why: str = ""
    traffic_tokens: int = 20_000  # the log reader's volume (aloepri.attacks.log_reader.DEFAULT_TRAFFIC_TOKENS)


@dataclass
class AuditReport:
    data: dict[str, Any]  # the content of report.json
    json_path: Path | None = None
    html_path: Path | None = None
    attacks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def worst_prompt_token_recovery(self) -> float | None:
        return self.data["worst_prompt_token_recovery"]

    @property
    def verdict(self) -> dict[str, Any]:
        return self.data["verdict"]


def validate_inputs(plain: str | Path, obfuscated: str | Path, key: str | Path, budget: str, out: str | Path,
                    prompts: int | None = None, seed: int = 0, threads: int = 1, engine: str = "torch",
                    device: str = "cpu", traffic_tokens: int | None = None) -> AuditInputs:
    """Every check of the audit's inputs, before any model loads; raises AuditInputError with one line."""
    if budget not in plan_mod.BUDGETS:
        raise AuditInputError(f"unknown budget {budget!r}; choose one of {', '.join(plan_mod.BUDGETS)}")
    plain, obfuscated, key_path, out = Path(plain), Path(obfuscated), Path(key), Path(out)
    if not plain.exists() and str(plain) in BUNDLED_MODELS:  # a bundled model's name (`aloepri models`)
        try:
            plain = resolve_model(str(plain))
        except OSError as e:
            raise AuditInputError(" ".join(str(e).split())) from None
    if not plain.exists():
        raise AuditInputError(f"plaintext model {plain} not found; give the public model the obfuscated one was "
                              "made from (a .gguf file or a Hugging Face directory)")
    if plain.is_dir() and not (plain / "config.json").is_file():
        raise AuditInputError(f"{plain} has no config.json: not a Hugging Face model directory")
    if not (obfuscated / "config.json").is_file():
        raise AuditInputError(f"obfuscated model {obfuscated} not found (no config.json); give the directory "
                              "`aloepri obfuscate` wrote")
    if not key_path.is_file():
        raise AuditInputError(f"key file {key_path} not found; give the key written by `aloepri obfuscate --key-out`")
    try:
        key_obj = load_key(key_path)
        check_key_matches(key_obj, obfuscated)
    except (ValueError, OSError) as e:  # KeyFileError / KeyMismatchError are ValueErrors
        raise AuditInputError(" ".join(str(e).split())) from None
    if plain.is_dir():
        vocab = json.loads((plain / "config.json").read_text()).get("vocab_size")
        if vocab is not None and int(vocab) != key_obj.vocab_size:
            raise AuditInputError(f"the plaintext model {plain} has {vocab} tokens but the key {key_path} has "
                                  f"{key_obj.vocab_size}: give the model that was obfuscated")
    if prompts is not None and prompts < 1:
        raise AuditInputError(f"--prompts must be at least 1 (got {prompts})")
    if threads < 1:
        raise AuditInputError(f"--threads must be at least 1 (got {threads})")
    from ..attacks.log_reader import DEFAULT_TRAFFIC_TOKENS

    if traffic_tokens is not None and not 1_000 <= traffic_tokens <= 10_000_000:
        raise AuditInputError(f"--traffic-tokens must be between 1000 and 10000000 (got {traffic_tokens})")
    if out.exists() and not out.is_dir():
        raise AuditInputError(f"--out {out} is a file; give a directory for report.json and report.html")
    try:
        check_writable_destination(out / "report.json", "audit report")
    except ValueError as e:
        raise AuditInputError(str(e)) from None
    import importlib.util

    if importlib.util.find_spec("faker") is None:
        raise AuditInputError("the audit's private prompts need Faker: pip install 'aloepri[attacks]'")
    from ..attacks.engines import EngineError, choose_engine
    from ..storage.devices import resolve_device

    try:
        choice = choose_engine(engine, obfuscated, resolve_device(device))
    except EngineError as e:
        raise AuditInputError(str(e)) from None
    return AuditInputs(plain, obfuscated, key_path, key_obj, budget, out,
                       prompts if prompts is not None else DEFAULT_PROMPTS[budget], seed, threads, choice.name,
                       choice.why, traffic_tokens if traffic_tokens is not None else DEFAULT_TRAFFIC_TOKENS)


# --- facts about the environment ---------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"aloepri": _version("aloepri"), "torch": _version("torch"), "transformers": _version("transformers"),
            "numpy": _version("numpy"), "python": platform.python_version()}


def git_commit() -> dict[str, Any] | None:
    """The commit of the aloepri source tree when it is a git checkout (None for an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--", str(here.parent)], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict[str, Any]:
    import torch

    out = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor() or None,
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": "cpu"}
    if torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name(0)
    return out


def matching_presets(params: dict[str, Any]) -> list[str]:
    """The named presets whose parameters equal the key's (none: a custom setting)."""
    from ..obfuscation.params import PRESETS

    return sorted(name for name, p in PRESETS.items() if p.to_dict() == params)


def parameters(key: KeyFile) -> dict[str, Any]:
    """What the key says about the setting: parameters and shapes. The seed and the permutation stay out."""
    return {"params": dict(key.params), "matches_presets": matching_presets(dict(key.params)),
            "h_effective": key.h_effective, "hidden_size": key.hidden_size, "architecture": key.architecture,
            "vocab_size": key.vocab_size, "source": key.source, "model_fingerprint": key.model_fingerprint}


# --- the measurements ---------------------------------------------------------------------------------------------


def measure_fidelity(target, key: KeyFile, budget: str, has_tok: bool) -> dict[str, Any]:
    """Prompt fidelity (and, with a tokenizer at small / full, corpus top-1, KL and perplexity), holding one model at
    a time as ``aloepri eval fidelity`` does: the plaintext model's logits and greedy continuations are taken (the
    logits kept in a temporary directory), that model is freed, then the obfuscated one runs. On the target's
    engine: torch (float32, the reference) or llama.cpp (both models at the engine's type; the figures then
    include what that quantization costs the obfuscated model against the plaintext one at the same type)."""
    import tempfile

    from ..attacks.engines import TORCH, EngineAsModel, LlamaCppEngine, engine_files
    from ..eval.fidelity import ReportReferences, compare_at_precision, fidelity_verdict, release_memory, \
        report_texts, report_with_references, stored_precision

    n_prompts, greedy, corpus_n = FIDELITY_BUDGETS[budget]
    tok = target.tokenizer if has_tok else None
    t0 = time.perf_counter()
    texts = report_texts(key, tok, n_prompts, None, corpus_n if tok is not None else 0)
    threads = target.threads or 1
    if target.engine == TORCH:
        dev, where = target.device, f"torch {str(target.dtype).replace('torch.', '')} on {target.device}"
        load_plain, load_obf = (lambda: target.plain_model), (lambda: target.obf_model)
    else:
        plain_path, obf_path, precision = engine_files(target.engine, target.plain_src, target.obfuscated_dir)
        dev, where = "cpu", f"llama.cpp {precision}, both models"
        load_plain = lambda: EngineAsModel(LlamaCppEngine(plain_path, precision, threads))  # noqa: E731
        load_obf = lambda: EngineAsModel(LlamaCppEngine(obf_path, precision, threads))  # noqa: E731
    target.release()
    with tempfile.TemporaryDirectory(prefix="aloepri-audit-reference-") as spill:
        plain = load_plain()
        references = ReportReferences(plain, key, tok, greedy_tokens=greedy, device=dev, spill_dir=spill,
                                      texts=texts)
        # a narrower output (bfloat16) is read against plaintext rounded to its precision, as `verify` does (the
        # model is rounded in place: it is released below, the next step loads it again)
        dtype = stored_precision(target.obfuscated_dir)
        at_precision = compare_at_precision(references.prompts, plain, dtype, dev) if target.engine == TORCH else None
        if isinstance(plain, EngineAsModel):
            plain.engine.close()
        del plain
        target.release()
        release_memory()
        obf = load_obf()
        rep = report_with_references(references, obf, key, dev)
        if isinstance(obf, EngineAsModel):
            obf.engine.close()
        del obf
        target.release()
    if target.engine == TORCH:
        rep["prompts"].update(fidelity_verdict(rep["prompts"], at_precision, dtype))
    return {"status": RAN, **rep["prompts"], **({"corpus": rep["corpus"]} if "corpus" in rep else {}),
            "prompt_kind": "built-in chat prompts" if tok is not None else "random ids",
            "engine": where, "models_held": "one at a time",
            "seconds": round(time.perf_counter() - t0, 1)}


def _not_installed(err: BaseException) -> bool:
    from ..corpora import CorpusNotInstalledError

    return isinstance(err, (CorpusNotInstalledError, ImportError))


def _attack_entry(planned: plan_mod.PlannedAttack) -> dict[str, Any]:
    return {"name": planned.name, "observer": planned.observer, "who": plan_mod.OBSERVERS[planned.observer],
            "applicable": True}


def run_planned(planned: plan_mod.PlannedAttack, target, data, budget, seed: int) -> dict[str, Any]:
    """One attack through the registry; its outcome as a report entry (an exception is recorded, never raised)."""
    from ..attacks import REGISTRY

    entry = _attack_entry(planned)
    t0 = time.perf_counter()
    try:
        res = REGISTRY[planned.name](target, data, budget, seed)
    except Exception as err:  # noqa: BLE001 - every outcome goes into the report
        why = " ".join(f"{type(err).__name__}: {err}".split())
        if _not_installed(err):
            return {**entry, "status": SKIPPED, "reason": f"not installed: {why}", "why": "not installed",
                    "seconds": round(time.perf_counter() - t0, 1)}
        return {**entry, "status": FAILED, "error": why, "why": "failed", "traceback": traceback.format_exc(limit=6),
                "seconds": round(time.perf_counter() - t0, 1)}
    m = res.metrics
    ttrsr = None if res.ttrsr is None else min(1.0, max(0.0, float(res.ttrsr)))
    if ttrsr is None:
        return {**entry, "status": FAILED, "error": "the attack returned no token recovery figure", "why": "failed",
                "seconds": round(res.seconds, 1)}
    vocab = m.get("vocab_recovery_sampled", m.get("vocab_recovery"))
    return {**entry, "status": RAN, "ttrsr": ttrsr, "piirsr": res.piirsr, "tokens_scored": m.get("tokens_scored"),
            "pii_tokens_scored": m.get("pii_tokens_scored"), "vocab_recovery": vocab, "bleu4": m.get("bleu4"),
            "tokens_observed": m.get("tokens_observed"),  # the traffic an id-stream attack saw (its volume)
            **({"curve": m["curve"]} if "curve" in m else {}),  # the log reader: recovery against volume
            "seconds": round(res.seconds, 1), "uses": res.uses, "attack_budget": res.budget}


def decided_by(planned: plan_mod.PlannedAttack, ran: list[dict[str, Any]]) -> str | None:
    """Why ``planned`` cannot change the verdict (in words), or None when it can: every observer it counts
    against (the provider sees the id stream too) already has an attack at 100% as printed."""
    from .verdict import below_maximum

    against = [plan_mod.PROVIDER] + ([plan_mod.ID_STREAM] if planned.observer == plan_mod.ID_STREAM else [])
    reasons = []
    for observer in against:
        full = [a for a in ran if a["status"] == RAN and a.get("ttrsr") is not None and not below_maximum(a["ttrsr"])
                and (observer == plan_mod.PROVIDER or a["observer"] == observer)]
        if not full:
            return None
        who = plan_mod.OBSERVERS[observer]
        reasons.append(f"{who}{',' if ',' in who else ''} already reads 100% ({full[0]['name']})")
    return "; ".join(reasons) + ", which no attack can raise"


def _is_moe(obfuscated: Path) -> bool:
    from ..obfuscation.archs import spec_for_hf

    cfg = json.loads((obfuscated / "config.json").read_text())
    return spec_for_hf(cfg.get("architectures")).moe is not None


def run_audit(plain: str | Path, obfuscated: str | Path, key: str | Path, budget: str = "ci",
              out: str | Path = "audit-report", prompts: int | None = None, seed: int = 0, threads: int = 1,
              progress: bool = True, plan: tuple[plan_mod.PlannedAttack, ...] | None = None,
              command: str | None = None, log: Callable[[str], None] | None = None,
              all_attacks: bool = False, engine: str = "torch", device: str = "cpu",
              traffic_tokens: int | None = None) -> "AuditReport":
    """Audit one obfuscated deployment: fidelity and the planned attacks within ``budget``, then report.json and
    report.html in ``out`` (each written atomically). ``plan`` replaces the attack plan (tests).

    An attack is not run when every observer it counts against already has a figure of 100% (``decided_by``):
    no attack can raise it, so the verdict is the one running it would give; the report lists it as not run,
    with the reason. ``all_attacks`` runs it anyway (the full table).

    ``engine`` (aloepri.attacks.engines.CHOICES; ``auto`` picks one from the model's size and the hardware): how
    the fidelity step and the attacks that run the models run them; the report records which and why. Each step
    loads what it needs and frees it before the next, so the audit's peak is its largest step's."""
    inp = validate_inputs(plain, obfuscated, key, budget, out, prompts, seed, threads, engine, device, traffic_tokens)

    import torch

    from ..attacks import REGISTRY, UNAVAILABLE
    from ..attacks.base import AttackTarget, Budget, has_tokenizer, peak_rss_gib, reset_peak_rss
    from ..attacks.cli import victim_prompts

    started = time.time()
    torch.set_num_threads(inp.threads)
    target = AttackTarget(inp.plain, inp.obfuscated, inp.key, device=device, engine=inp.engine,
                          engine_why=inp.engine_why, threads=inp.threads)
    if target.vocab_size != inp.key.vocab_size:  # (a .gguf PLAIN is only readable once loaded)
        raise AuditInputError(f"the plaintext model {inp.plain} has {target.vocab_size} tokens but the key has "
                              f"{inp.key.vocab_size}: give the model that was obfuscated")
    has_tok = has_tokenizer(target)
    attack_budget = Budget.named(inp.budget)
    attack_budget.threads = inp.threads
    attack_budget.traffic_tokens = inp.traffic_tokens  # the log reader's volume (aloepri.attacks.log_reader)
    is_moe = _is_moe(inp.obfuscated)
    planned = plan if plan is not None else plan_mod.PLAN

    entries: list[dict[str, Any]] = []
    to_run = []
    for p in planned:
        skip = plan_mod.why_not_run(p, inp.budget, set(REGISTRY), UNAVAILABLE, has_tok, is_moe)
        if skip is None:
            to_run.append(p)
            entries.append(None)
        else:
            entries.append({**_attack_entry(p), "status": SKIPPED, "reason": skip[0], "why": skip[1],
                            "applicable": skip[2]})

    results: dict[str, dict[str, Any]] = {}
    fidelity: dict[str, Any] = {"status": SKIPPED, "reason": PENDING}
    prompt_info: dict[str, Any] = {}

    def report(complete: bool) -> dict[str, Any]:
        """The report as far as the audit got: an attack not reached yet is 'not run' (a killed audit leaves an
        honest partial report, never a figure without its caveat)."""
        attacks = [e if e is not None else results.get(p.name) or
                   {**_attack_entry(p), "status": SKIPPED, "reason": PENDING, "why": "not reached"}
                   for p, e in zip(planned, entries)]
        v = verdicts(attacks)
        ran = [a for a in attacks if a["status"] == RAN]
        worst = max(ran, key=lambda a: a["ttrsr"]) if ran else None
        now = time.time()
        return {
            "format": REPORT_FORMAT, "version": REPORT_VERSION, "complete": complete,
            "worst_prompt_token_recovery": worst["ttrsr"] if worst else None,
            "worst_attack": worst["name"] if worst else None,
            "verdict": {"headline": headline(v), **{k: o.to_dict() for k, o in v.items()}},
            "warnings": input_warnings(inp, fidelity) + ([] if complete else [
                "this report is partial: the audit stopped (or is still running) before every attack ran"]),
            "attacks": attacks,
            "traffic_tokens": inp.traffic_tokens,
            # the log reader's recovery against volume, up to traffic_tokens (stream-decipher, model-free)
            "log_reader_curve": next((a["curve"] for a in attacks if a["name"] == "stream-decipher"
                                      and a.get("curve")), None),
            "fidelity": fidelity,
            "parameters": parameters(inp.key),
            "private_prompts": prompt_info,
            "inputs": {"plain": str(inp.plain), "obfuscated": str(inp.obfuscated), "key": str(inp.key_path)},
            "budget": inp.budget, "seed": inp.seed, "threads": inp.threads,
            "engine": {"name": inp.engine, "why": inp.engine_why,
                       "note": "the fidelity step and the attacks that run the models (behavioural) use it; the "
                               "attacks that read weights or hidden states run on torch"},
            "excluded_attacks": "oracle variants (ridge-k*, ima_oracle, routing_leak_oracle) read the key beyond "
                                "scoring, outside the threat model; an audit does not run them",
            "command": command,
            "versions": env["versions"], "git": env["git"], "machine": env["machine"],
            "time": {"started": _iso(started), "finished": _iso(now) if complete else None,
                     "seconds": round(now - started, 1)},
        }

    env = {"versions": versions(), "git": git_commit(), "machine": machine()}
    with Progress(len(to_run) + 1, "audit", unit="step", enabled=progress) as bar:
        bar.start("fidelity")
        data, prompt_info = victim_prompts(target, inp.prompts, inp.seed, has_tok)
        try:
            reset_peak_rss()
            fidelity = measure_fidelity(target, inp.key, inp.budget, has_tok)
            fidelity["peak_rss_gib"] = peak_rss_gib()  # one model at a time
        except Exception as err:  # noqa: BLE001 - reported; the attacks still run
            fidelity = {"status": FAILED, "error": " ".join(f"{type(err).__name__}: {err}".split())}
        write_report(report(False), inp.out)
        bar.advance()
        for p in to_run:
            bar.start(p.name)
            decided = None if all_attacks else decided_by(p, list(results.values()))
            if decided is not None:
                r = results[p.name] = {**_attack_entry(p), "status": SKIPPED, "why": "not needed", "seconds": 0.0,
                                       "reason": f"not needed: {decided} (--all-attacks runs it)"}
            else:
                r = results[p.name] = run_planned(p, target, data, attack_budget, inp.seed)
                # what the next attack does not use is freed: the engine after the attacks that run the
                # models, the torch models before them when the engine is another
                nxt = next((q for q in to_run[to_run.index(p) + 1:]), None)
                nxt_engine = nxt is not None and getattr(REGISTRY.get(nxt.name), "uses_engine", False)
                target.release(models=nxt_engine and inp.engine != "torch", engines=not nxt_engine)
            write_report(report(False), inp.out)
            bar.advance()
            if log:
                line = f"{p.name}: " + (f"{100 * r['ttrsr']:.1f}% of prompt tokens" if r["status"] == RAN
                                        else f"{r['status']}: {r.get('reason') or r.get('error')}")
                if progress:
                    bar.note(line)  # above the bar, not through it
                else:
                    log(line)
    return write_report(report(True), inp.out)


def input_warnings(inp: AuditInputs, fidelity: dict[str, Any]) -> list[str]:
    """Signs that PLAIN is not the model that was obfuscated: attacks that compare the two models would then
    recover less than a real provider, who holds the right one, and the audit would understate the exposure."""
    out = []
    made_from = Path(inp.key.source).name
    if made_from and made_from != inp.plain.name:
        out.append(f"the key says the obfuscated model was made from {made_from!r}, and the audit was given "
                   f"{inp.plain.name!r}: if that is another model, the attacks understate what the provider can read")
    top1 = fidelity.get("top1_agreement")
    if top1 is not None and top1 < 0.5:
        out.append(f"the obfuscated model agrees with the given plaintext model on only {100 * top1:.0f}% of "
                   "next-token choices: either the setting destroys accuracy, or the plaintext model is not the one "
                   "that was obfuscated (then the attacks understate what the provider can read)")
    return out


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _write_atomic(path: Path, text: str) -> None:
    clean_stale(path, ".tmp", "partial audit report")
    fd, tmp = make_staging_file(path, ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_report(report: dict[str, Any], out: str | Path) -> AuditReport:
    """report.json then report.html into ``out`` (created if needed), each file replaced atomically."""
    from .html import render_html

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jpath, hpath = out / "report.json", out / "report.html"
    _write_atomic(jpath, json.dumps(report, indent=2, default=str) + "\n")
    _write_atomic(hpath, render_html(report))
    return AuditReport(report, jpath, hpath, report["attacks"])
