"""Privacy-utility frontier and parameter tuning: accuracy and attacks measured on the same obfuscated model.

A *setting* is (source model, ObfuscationParams, seed). ``evaluate_setting`` obfuscates once, then measures
fidelity against the plaintext model and runs the attacks of ``aloepri.attacks`` on that very output, so privacy
and accuracy always come from the same run. ``ResultStore`` (aloepri.storage.results) keeps results in one JSON file that several processes
can share (an exclusive lock around every read-modify-write; a setting is claimed before it is computed), so a
sweep resumes where it stopped and two workers on two cores split it. ``tune`` searches a candidate list for the
setting with the lowest attack success inside an accuracy budget and writes a preset file for ``obfuscate``.

``tune`` is a branch and bound over that list, so that it finishes in minutes rather than hours: a setting outside
the accuracy budget is never attacked (it cannot be chosen), and an admissible setting stops being attacked as soon
as it provably cannot beat the best admissible setting found so far (its max TTRSR already exceeds the best one's,
or an attack recovered 100%, which fixes its max). The noisiest candidates go first, so a low bound is found early.
Every entry records the attacks skipped and why; the choice is the one a full evaluation would make.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..obfuscation.params import ObfuscationParams
from ..progress import Progress
from ..storage.results import ResultStore

# Attacks used when none are named: every registered attack that needs no training run (the trained ones, IMA
# and SDA, are minutes each even at small budgets; name them explicitly to include them). "behavioural" (run both
# models, match output profiles) is the strongest measured attacker on small-noise settings and costs minutes at
# the small budget on SmolLM2, so the tuner optimises against it too. They run in this order, cheapest first
# (Gate-IA takes seconds and recovers ~100% at light noise), which lets the tuner's bound cut a setting early.
DEFAULT_ATTACKS = ("gate-ia", "tfma", "nn", "attn-ia", "vma", "freq-ridge", "behavioural")


@dataclass
class Criterion:
    """The accuracy budget: a setting is admissible if every given bound holds."""

    max_kl: float | None = None
    min_top1: float | None = None

    def admits(self, fidelity: dict[str, Any]) -> bool:
        if self.max_kl is not None and fidelity["mean_kl"] > self.max_kl:
            return False
        if self.min_top1 is not None and fidelity["top1_agreement"] < self.min_top1:
            return False
        return True

    def describe(self) -> str:
        parts = [f"mean KL <= {self.max_kl}" if self.max_kl is not None else "",
                 f"top-1 agreement >= {self.min_top1}" if self.min_top1 is not None else ""]
        return " and ".join(p for p in parts if p) or "no accuracy bound"


def setting_key(model: str, params: ObfuscationParams, seed: int, extra: dict[str, Any] | None = None) -> str:
    blob = json.dumps({"model": model, "params": params.to_dict(), "seed": seed, **(extra or {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Evaluator:
    """Everything shared by the settings of one sweep: the plaintext model, prompts, private data, attacks."""

    src: Path
    attacks: Sequence[str] = DEFAULT_ATTACKS
    budget: str = "small"
    fidelity_prompts: int = 20
    greedy_tokens: int = 0
    private_prompts: int = 30
    _plain: Any = field(default=None, repr=False)
    _tok: Any = field(default=None, repr=False)
    _data: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from ..attacks import REGISTRY

        self.src = Path(self.src)
        unknown = [a for a in self.attacks if a not in REGISTRY]
        if unknown:
            raise ValueError(f"unknown attack(s) {unknown}; available: {sorted(REGISTRY)}")

    def _prepare(self) -> None:
        if self._plain is not None:
            return
        from ..attacks.data import private_prompts
        from .fidelity import builtin_prompt_ids
        from ..runtime.inference import load_plain_model

        self._plain = load_plain_model(self.src)
        from transformers import AutoTokenizer

        p = self.src
        self._tok = (AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name) if p.is_file()
                     else AutoTokenizer.from_pretrained(str(p)))
        self._fid_ids = builtin_prompt_ids(self._tok, self._plain.config.vocab_size, self.fidelity_prompts)
        self._data = private_prompts(self._tok, self.private_prompts, seed=0)

    def evaluate(self, params: ObfuscationParams, seed: int, workdir: Path | None = None,
                 stage: Callable[[str], None] = lambda what: None,
                 stop: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None) -> dict[str, Any]:
        """Obfuscate with ``params``/``seed``, then fidelity and the attacks on that output; ``stage`` is told
        what runs now (for a progress bar). ``stop(fidelity, attacks_so_far)`` is asked before each attack; a
        reason from it skips the remaining attacks (recorded with the reason, and the max TTRSR marked inexact)."""
        from transformers import AutoModelForCausalLM

        from ..obfuscation.pipeline import obfuscate
        from ..attacks import REGISTRY, AttackTarget, Budget
        from .fidelity import compare
        from ..keyfile import load_key

        stage("loading the plaintext model")
        self._prepare()
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            out, key_path = Path(tmp) / "model", Path(tmp) / "key.json"
            stage("obfuscating")
            obfuscate(self.src, out, key_path, params, seed=seed, allow_weak_seed=True, progress=False,
                      dtype="float32")  # fidelity measured against float32 plaintext, whatever the source
            key = load_key(key_path)
            stage("fidelity")
            obf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
            fid = compare(self._plain, obf, key, self._fid_ids, greedy_tokens=self.greedy_tokens).to_dict()
            del obf
            target = AttackTarget(self.src, out, key)
            target.__dict__["plain_model"] = self._plain  # share the loaded plaintext model (cached_property slot)
            target.__dict__["tokenizer"] = self._tok
            def run(i: int, name: str) -> dict[str, Any]:
                stage(f"attack {i + 1}/{len(self.attacks)} {name}")
                res = REGISTRY[name](target, self._data, Budget.named(self.budget), seed)
                return {"ttrsr": res.ttrsr, "piirsr": res.piirsr, "seconds": res.seconds, "budget": res.budget,
                        **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float)) or v is None}}

            outcome = attacks_in_turn(self.attacks, run, None if stop is None else lambda done: stop(fid, done))
        return {"params": params.to_dict(), "seed": seed, "fidelity": fid, **outcome, "budget": self.budget,
                "seconds": time.perf_counter() - t0}


def attacks_in_turn(names: Sequence[str], run: Callable[[int, str], dict[str, Any]],
                    stop: Callable[[dict[str, Any]], str | None] | None = None) -> dict[str, Any]:
    """Run ``run(i, name)`` for each attack in order, asking ``stop(results so far)`` before each; a reason from
    it skips the rest. Returns an entry's attack fields: per-attack results, the skipped ones and why, the max
    TTRSR and whether it is exact (with attacks skipped it is a lower bound, unless one already reached 100%)."""
    attacks: dict[str, Any] = {}
    stopped = None
    for i, name in enumerate(names):
        stopped = stop(attacks) if stop is not None else None
        if stopped:
            break
        attacks[name] = run(i, name)
    skipped = [a for a in names if a not in attacks]
    max_ttrsr = _max_ttrsr(attacks)
    return {"attacks": attacks, "max_ttrsr": max_ttrsr, "attacks_skipped": skipped, "stopped": stopped,
            "max_ttrsr_exact": not skipped or (max_ttrsr is not None and max_ttrsr >= 1.0)}


def _max_ttrsr(attacks: dict[str, Any]) -> float | None:
    ttrsrs = [a["ttrsr"] for a in attacks.values() if a.get("ttrsr") is not None]
    return max(ttrsrs) if ttrsrs else None


def stop_reason(criterion: Criterion, fidelity: dict[str, Any], attacks: dict[str, Any],
                best: dict[str, Any] | None) -> str | None:
    """Why the remaining attacks on a setting cannot change the tuner's choice, or None if they can.

    ``best`` is the admissible setting with the lowest exact max TTRSR so far. The max TTRSR only grows as
    attacks run, so once it exceeds the best one's (or equals it without a better top-1) this setting loses."""
    if not criterion.admits(fidelity):
        return f"outside the accuracy budget ({criterion.describe()}): it cannot be chosen"
    running = _max_ttrsr(attacks)
    if running is None:
        return None
    if running >= 1.0:
        return "an attack recovered 100% of tokens: no further attack changes this setting's max TTRSR"
    if best is None:
        return None
    if running > best["max_ttrsr"]:
        return f"max TTRSR already {running:.4f}, above the best admissible setting's {best['max_ttrsr']:.4f}"
    if running == best["max_ttrsr"] and fidelity["top1_agreement"] <= best["fidelity"]["top1_agreement"]:
        return "ties the best admissible setting's max TTRSR without a better top-1"
    return None


def _entry_decides(entry: dict[str, Any], criterion: Criterion | None, best: dict[str, Any] | None) -> bool:
    """Whether a stored entry is enough for this run: complete, or (for the tuner) its skipped attacks still
    cannot change the choice."""
    if entry.get("status") != "done":
        return False
    if not entry.get("attacks_skipped"):
        return True
    return criterion is not None and stop_reason(criterion, entry["fidelity"], entry["attacks"], best) is not None


def sweep(evaluator: Evaluator, settings: Iterable[ObfuscationParams], store: ResultStore, seed: int = 1,
          label: str = "", progress: bool = True, criterion: Criterion | None = None) -> list[dict[str, Any]]:
    """Evaluate every setting not yet in ``store`` (resumable; run it from two processes to use two cores), with
    a progress bar per setting (count, ETA) that names the stage running now.

    With a ``criterion`` (the tuner) a setting's attacks stop once ``stop_reason`` says they cannot change the
    choice; a stored entry cut short under another budget or bound is recomputed when that no longer holds."""
    settings = list(settings)
    extra = {"attacks": sorted(evaluator.attacks), "budget": evaluator.budget,
             "fidelity_prompts": evaluator.fidelity_prompts, "private_prompts": evaluator.private_prompts}
    keys = [setting_key(str(evaluator.src.name), params, seed, extra) for params in settings]

    def stored_and_best() -> tuple[dict[str, Any], dict[str, Any] | None]:
        stored = store.load()
        if criterion is None:
            return stored, None
        return stored, choose([stored[k] for k in keys if stored.get(k, {}).get("status") == "done"], criterion)

    stored, best = stored_and_best()
    already = sum(_entry_decides(stored.get(k, {}), criterion, best) for k in keys)
    done = []
    with Progress(len(settings), label or "settings", unit="setting", enabled=progress, done=already) as bar:
        for params, key in zip(settings, keys):
            stored, best = stored_and_best()
            entry = stored.get(key)
            if entry and _entry_decides(entry, criterion, best):
                done.append(entry)
                continue
            redo = bool(entry and entry.get("status") == "done")
            if not store.claim(key, {"label": label, "params": params.to_dict()}, redo=redo):
                continue  # another worker is computing it
            summary = params_summary(params)
            bar.start(summary)
            kwargs = {}
            if criterion is not None:
                kwargs["stop"] = lambda fid, attacks, best=best: stop_reason(criterion, fid, attacks, best)
            try:
                entry = {"label": label, "model": evaluator.src.name,
                         **evaluator.evaluate(params, seed, stage=lambda what: bar.start(f"{summary}: {what}"),
                                              **kwargs)}
            except BaseException:
                store.release(key)
                raise
            store.put(key, entry)
            done.append(entry)
            bar.advance()
            f = entry["fidelity"]
            cut = (f"; {len(entry['attacks_skipped'])} attack(s) skipped: {entry['stopped']}"
                   if entry.get("attacks_skipped") else "")
            bar.note(f"[{label}] top-1 {f['top1_agreement']:.3f} KL {f['mean_kl']:.4f} max TTRSR "
                     f"{entry['max_ttrsr']} ({entry['seconds']:.0f} s) {summary}{cut}")
    return done


def params_summary(p: ObfuscationParams) -> str:
    return f"alpha_e={p.alpha_e} alpha_h={p.alpha_h} lam={p.lam} h={p.h} beta={p.beta}"


def default_candidates(base: ObfuscationParams) -> list[ObfuscationParams]:
    """Noise levels from light to heavy (the noise is what protects the vocabulary permutation).

    Two families: embedding-heavy (alpha_h small, the paper's ratio) and equal noise on both sides. The frontier
    (docs/accuracy.md) showed that with alpha_h small the head side leaks (VMA through down x head products at
    any alpha_e), so the equal-noise points are the ones that can lower the strongest attack.
    """
    pairs = ((0.05, 0.02), (0.1, 0.05), (0.2, 0.05), (0.5, 0.1), (1.0, 0.2),
             (0.1, 0.1), (0.2, 0.2), (0.3, 0.3), (0.5, 0.5), (0.7, 0.7), (1.0, 1.0))
    return [base.replace(alpha_e=ae, alpha_h=ah) for ae, ah in pairs]


def parse_candidates(base: ObfuscationParams, alpha_e: str, alpha_h: str | None) -> list[ObfuscationParams]:
    """``--alpha-e 0.1,0.3`` with ``--alpha-h 0.05`` (fixed), ``--alpha-h equal`` (alpha_h = alpha_e) or none
    (the base preset's alpha_h)."""
    try:
        values = [float(x) for x in alpha_e.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--alpha-e must be comma-separated numbers, got {alpha_e!r}") from None
    if not values:
        raise ValueError("--alpha-e is empty")
    if alpha_h is None:
        return [base.replace(alpha_e=v, alpha_h=base.alpha_h) for v in values]
    if alpha_h.strip().lower() == "equal":
        return [base.replace(alpha_e=v, alpha_h=v) for v in values]
    try:
        ah = float(alpha_h)
    except ValueError:
        raise ValueError(f"--alpha-h must be a number or 'equal', got {alpha_h!r}") from None
    return [base.replace(alpha_e=v, alpha_h=ah) for v in values]


def choose(results: Sequence[dict[str, Any]], criterion: Criterion) -> dict[str, Any] | None:
    """The admissible result with the lowest max TTRSR; ties go to the better top-1 agreement. A result whose
    attacks were cut short (its max TTRSR a lower bound) is never chosen: it was cut because it loses."""
    ok = [r for r in results if criterion.admits(r["fidelity"]) and r["max_ttrsr"] is not None
          and r.get("max_ttrsr_exact", True)]
    if not ok:
        return None
    return min(ok, key=lambda r: (r["max_ttrsr"], -r["fidelity"]["top1_agreement"]))


def tune(evaluator: Evaluator, criterion: Criterion, candidates: Sequence[ObfuscationParams], store: ResultStore,
         out_file: str | Path, seed: int = 1, progress: bool = True, all_attacks: bool = False) -> dict[str, Any]:
    """Evaluate the candidates (resumable), pick the most attack-resistant admissible one, write a preset file
    that ``aloepri obfuscate --preset-file`` takes. Raises ValueError when no candidate meets the budget.

    By default a branch and bound (module docstring): noisiest candidates first, attacks cut once they cannot
    change the choice. ``all_attacks`` runs every attack on every candidate (the full table, hours on SmolLM2)."""
    ordered = sorted(candidates, key=lambda p: p.alpha_e + p.alpha_h, reverse=True)
    results = sweep(evaluator, ordered, store, seed=seed, label="tune", progress=progress,
                    criterion=None if all_attacks else criterion)
    best = choose(results, criterion)
    table = [{"params": params_summary(ObfuscationParams.from_dict(r["params"])),
              "top1": r["fidelity"]["top1_agreement"], "kl": r["fidelity"]["mean_kl"], "max_ttrsr": r["max_ttrsr"],
              "max_ttrsr_exact": r.get("max_ttrsr_exact", True), "attacks_run": sorted(r["attacks"]),
              "stopped": r.get("stopped"), "admissible": criterion.admits(r["fidelity"])} for r in results]
    if best is None:
        raise ValueError(f"no candidate meets the accuracy budget ({criterion.describe()}); measured: {table}")
    preset = {"params": best["params"], "criterion": criterion.describe(), "model": evaluator.src.name,
              "measured": {"fidelity": best["fidelity"], "attacks": best["attacks"], "max_ttrsr": best["max_ttrsr"],
                           "attacks_skipped": best.get("attacks_skipped", []), "stopped": best.get("stopped"),
                           "budget": best["budget"], "seed": seed},
              "candidates": table}
    out_file = Path(out_file)
    tmp = out_file.with_suffix(out_file.suffix + ".partial")
    tmp.write_text(json.dumps(preset, indent=2) + "\n")
    os.replace(tmp, out_file)
    return preset


def add_tune_commands(sub) -> None:
    p = sub.add_parser("tune", help="search obfuscation parameters: lowest attack success within an accuracy budget")
    p.add_argument("src", help="plaintext model (HF directory or .gguf) -- also the attacker's public model")
    p.add_argument("--max-kl", type=float, default=None, help="accuracy budget: mean KL(plain || obf) per position")
    p.add_argument("--min-top1", type=float, default=None, help="accuracy budget: top-1 agreement")
    p.add_argument("--out", required=True, help="preset file to write (use with `obfuscate --preset-file`)")
    p.add_argument("--attacks", default=",".join(DEFAULT_ATTACKS), help="comma-separated attack names")
    p.add_argument("--budget", choices=["ci", "small", "full"], default="small")
    p.add_argument("--all-attacks", action="store_true",
                   help="run every attack on every candidate (default: skip attacks that cannot change the choice: "
                        "none on a candidate outside the accuracy budget, and none once a candidate is beaten)")
    p.add_argument("--alpha-e", default=None,
                   help="comma-separated alpha_e candidates (default: 11 settings, embedding-heavy and equal noise)")
    p.add_argument("--alpha-h", default=None,
                   help="alpha_h for the --alpha-e candidates: a number, or 'equal' for alpha_h = alpha_e "
                        "(default: the base preset's)")
    p.add_argument("--base-preset", default="noisy",
                   help="preset the candidates vary (its alpha_h is kept when --alpha-h is not given)")
    p.add_argument("--prompts", type=int, default=20, help="fidelity prompts (built-in chat prompts)")
    p.add_argument("--private-prompts", type=int, default=30, help="PII prompts the attacks try to recover")
    p.add_argument("--results", default=None, help="resumable results JSON (default: next to --out)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(a) -> int:
    from ..obfuscation.params import resolve_params

    if a.max_kl is None and a.min_top1 is None:
        raise ValueError("give an accuracy budget: --max-kl and/or --min-top1")
    torch.set_num_threads(max(1, a.threads))
    base = resolve_params(a.base_preset)
    if a.alpha_e:
        candidates = parse_candidates(base, a.alpha_e, a.alpha_h)
    elif a.alpha_h is not None:
        raise ValueError("--alpha-h goes with --alpha-e (the default candidates set both)")
    else:
        candidates = default_candidates(base)
    from ..models import resolve_model

    ev = Evaluator(resolve_model(a.src), [x for x in a.attacks.split(",") if x], a.budget, a.prompts, 0, a.private_prompts)
    store = ResultStore(a.results or Path(a.out).with_suffix(".results.json"))
    preset = tune(ev, Criterion(a.max_kl, a.min_top1), candidates, store, a.out, seed=a.seed, progress=not a.quiet,
                  all_attacks=a.all_attacks)
    m = preset["measured"]
    print(json.dumps({"chosen": preset["params"], "top1": m["fidelity"]["top1_agreement"],
                      "mean_kl": m["fidelity"]["mean_kl"], "max_ttrsr": m["max_ttrsr"],
                      "per_attack_ttrsr": {k: v["ttrsr"] for k, v in m["attacks"].items()},
                      **({"attacks_skipped": m["attacks_skipped"], "why": m["stopped"]} if m["attacks_skipped"] else {})},
                     indent=2))
    print(f"wrote {a.out}; use: aloepri obfuscate SRC OUT --key-out KEY --preset-file {a.out}")
    return 0
