"""Attack targets named by one grammar, shared by the attack experiments, and the rows they store.

A target name is one of:
  a preset (exact, noisy, paper, default)   ``aloepri.resolve_params`` of it
  PRESET:field=value,...                    a preset with overrides (benchmarks.lib.variants), e.g. noisy:lam=0.1
  exact-nohp                                exact with head_permutation=False (beta is already 1): the weak target
                                            of the paper's Attn-IA (positive control)
  ablation-0, ablation-1                    the paper's first two ablation rows from the paper preset (the third row,
                                            all mechanisms, IS the paper preset)
  alpha-X                                   the noisy preset with alpha_e = alpha_h = X (the accuracy frontier)
  SHAPE-X                                   the same with noise_shape SHAPE (isotropic, column, row, fisher)
  permutation-only                          the plaintext model with its vocabulary rows permuted, nothing else
                                            (positive control of NN; not obfuscated, so no parameters)
A suffix ``+headfit-N`` (a client-side step after obfuscation, benchmarks/experiments/defence_noise.py) does not
change the obfuscation parameters.

Stored attack rows are keyed ``model/target/attack/budget`` with the bundled model names (benchmarks.lib.models).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

PERMUTATION_ONLY = "permutation-only"
CLIENT_STEP = "+headfit-"


def target_params(target: str):
    """The ObfuscationParams a target name stands for (grammar above); ValueError for an unknown name."""
    import aloepri
    from aloepri.obfuscation.transforms import NOISE_SHAPES

    from .variants import parse_variant

    base = target.split(CLIENT_STEP, 1)[0]
    if ":" in base:
        return parse_variant(base)[1]
    if base in aloepri.PRESETS:
        return aloepri.resolve_params(base)
    if base == "exact-nohp":
        return aloepri.resolve_params("exact", head_permutation=False)
    if base.startswith("ablation-"):
        from aloepri.attacks.report import ablation_params

        return list(ablation_params(aloepri.resolve_params("paper")).values())[int(base.split("-", 1)[1])]
    shape, _, alpha = base.rpartition("-")
    if shape == "alpha" or shape in NOISE_SHAPES:
        try:
            a = float(alpha)
        except ValueError:
            raise ValueError(f"target {target!r}: {alpha!r} is not a number") from None
        shape_kw = {} if shape == "alpha" else {"noise_shape": shape}
        return aloepri.resolve_params("noisy", alpha_e=a, alpha_h=a, **shape_kw)
    raise ValueError(f"unknown target {target!r}")


def target_record(target: str) -> dict:
    """What a stored row says about its target's parameters."""
    if target == PERMUTATION_ONLY:
        return {"mechanism": PERMUTATION_ONLY}
    return target_params(target).to_dict()


def build_target(src: Path, target: str, seed: int, plain_model=None,
                 params_fn: Callable[[str], Any] | None = None, **obfuscate_kwargs):
    """The AttackTarget named ``target`` for the model file ``src``: obfuscated once and cached by a hash of its
    parameters (benchmarks.lib.targets), sharing ``plain_model`` between targets (memory). ``params_fn`` (default
    ``target_params``) maps the name to ObfuscationParams; ``obfuscate_kwargs`` go to aloepri.obfuscate (e.g.
    noise_factors)."""
    from aloepri.attacks.base import AttackTarget
    from aloepri.attacks.nearest_neighbour import permutation_only_target

    from .targets import obfuscated

    if target == PERMUTATION_ONLY:
        return permutation_only_target(src, seed, plain_model)
    built = obfuscated(src, (params_fn or target_params)(target), seed, **obfuscate_kwargs)
    t = AttackTarget(src, built.model_dir, built.key_path)
    if plain_model is not None:
        t.plain_model = plain_model
    return t


def failed_entry(name: str, err: Exception, t0: float) -> dict:
    """A result row for an attack that raised: recorded with its error, never hidden."""
    return {"attack": name, "ttrsr": None, "piirsr": None, "metrics": {"error": f"{type(err).__name__}: {err}"},
            "budget": {}, "uses": "", "seconds": time.perf_counter() - t0}


def print_entry(key: str, entry: dict) -> None:
    m = entry["metrics"]
    if "error" in m:
        print(f"{key}: error {m['error']}", flush=True)
        return
    print(f"{key}: TTRSR {entry['ttrsr']} PIIRSR {entry['piirsr']} vocab "
          f"{m.get('vocab_recovery', m.get('vocab_recovery_sampled'))} ({entry['seconds']:.0f} s)", flush=True)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def render(entries: dict[str, dict]) -> str:
    """Markdown tables of stored attack rows: one per (model, target, budget), and the paper's ablation table."""
    from aloepri.attacks.base import AttackResult
    from aloepri.attacks.report import ABLATION_ROWS, markdown_table

    groups: dict[tuple[str, str, str], list[AttackResult]] = {}
    for key, e in entries.items():
        model, target, attack, budget = key.split("/")
        if attack == "fidelity":
            continue
        fields = {k: e[k] for k in ("attack", "ttrsr", "piirsr", "metrics", "budget", "uses", "seconds")}
        groups.setdefault((model, target, budget), []).append(AttackResult(**fields))
    out = []
    for (model, target, budget), results in sorted(groups.items()):
        out += [f"### {model} / {target} (budget {budget})", "", markdown_table(results), ""]
    for model in sorted({k[0] for k in groups}):
        for budget in sorted({k[2] for k in groups}):
            rows = [(ABLATION_ROWS[i], groups.get((model, t, budget)))
                    for i, t in enumerate(("ablation-0", "ablation-1", "paper"))]  # row 3 = the paper preset
            if not any(r for _, r in rows):
                continue
            attacks = sorted({r.attack for _, rs in rows if rs for r in rs})
            out += [f"### Ablation, {model}, paper noise (budget {budget}): TTRSR (%)", "",
                    "| Applied mechanism | " + " | ".join(attacks) + " |", "|---|" + "---|" * len(attacks)]
            for row, rs in rows:
                by = {r.attack: r for r in rs or []}
                out.append(f"| {row} | " + " | ".join(
                    f"{100 * by[x].ttrsr:.2f}" if x in by and by[x].ttrsr is not None else "not run"
                    for x in attacks) + " |")
            out.append("")
    return "\n".join(out)


def run_attack(name: str, target, data, budget, attack: Callable | None = None) -> dict:
    """One attack (``attack`` or the registered one named ``name``) as a stored row; an error is recorded in it."""
    from aloepri.attacks import REGISTRY

    t0 = time.perf_counter()
    try:
        res = (attack or REGISTRY[name])(target, data, budget, 0)
    except Exception as err:  # noqa: BLE001 - recorded, not hidden
        return failed_entry(name, err, t0)
    res.attack = name
    res.seconds = time.perf_counter() - t0  # direct calls (not through the registry) have no clock of their own
    return res.to_dict()


def fidelity_entry(plain_model, target) -> dict:
    """Accuracy of the very output attacked: next-token agreement with the plaintext model on the 20 built-in chat
    prompts (as the tuner measures it)."""
    from aloepri.eval.fidelity import builtin_prompt_ids, compare

    ids = builtin_prompt_ids(target.tokenizer, plain_model.config.vocab_size, 20)
    return compare(plain_model, target.obf_model, target.key, ids, greedy_tokens=0).to_dict()
