"""Behavioural attacks (aloepri.attacks.behavioural) on the bundled models: TTRSR / PIIRSR / vocabulary recovery for
permutation-only, the presets and points of the alpha_e = alpha_h frontier, plus the composed pipeline (VMA ->
behavioural -> ridge), each next to the top-1 agreement of the very output attacked. Rows keyed
``model/target/attack/budget``; the fidelity of a target ``model/target/fidelity/-``."""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.attack_targets import pct, print_entry, run_attack, target_record
from ..lib.models import model_path

ATTACKS = ("behavioural", "behavioural-composed")
# not a registered attack: `behavioural` with no chat-template pairs (anchors = the published special ids only),
# to measure how much the template bootstrap matters
NO_TEMPLATE = "behavioural-specials-only"
# reduced: one output-profile round (the `small` budget's first, 96 x 16 contexts) and no input-side re-ranking,
# for runs that would not finish otherwise (Qwen's 151,936-token vocabulary on a loaded 2-core machine); stored
# under the budget key "<budget>-reduced" so it never mixes with full-budget rows
REDUCED = {"round_seqs": (96,), "rerank_ids": 0}


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("smollm2",)
    targets: tuple[str, ...] = ("permutation-only", "exact", "noisy", "paper", "alpha-0.3", "alpha-0.5",
                                "alpha-1.0")
    attacks: tuple[str, ...] = ATTACKS  # and/or behavioural-specials-only
    budget: str = "small"
    prompts: int = 50
    seed: int = 1234
    threads: int = 1
    reduced: bool = False  # the REDUCED budget above (budget key "<budget>-reduced")


def _attack(name: str, config: dict | None):
    """The attack function for ``name`` (None: the registered one)."""
    from aloepri.attacks.behavioural import run_behavioural, run_composed

    if name == NO_TEMPLATE:  # ablation of the bootstrap: published special ids only
        return lambda t, d, b, s: run_behavioural(t, d, b, s, template=([], []), config=config)[0]
    if config is None:
        return None
    if name == "behavioural":
        return lambda t, d, b, s: run_behavioural(t, d, b, s, config=config)[0]
    return lambda t, d, b, s: run_composed(t, d, b, s, config=config)


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import Budget
    from aloepri.attacks.cli import private_data
    from aloepri.runtime.inference import load_plain_model

    from ..lib.attack_targets import PERMUTATION_ONLY, build_target, fidelity_entry

    bad = set(s.attacks) - {*ATTACKS, NO_TEMPLATE}
    if bad:
        raise ValueError(f"attacks {sorted(bad)}: not behavioural ({', '.join((*ATTACKS, NO_TEMPLATE))})")
    torch.set_num_threads(s.threads)
    budget = Budget.named(s.budget)
    budget.threads = s.threads
    config = dict(REDUCED) if s.reduced else None
    bkey = f"{s.budget}-reduced" if s.reduced else s.budget
    for model in s.models:
        src = model_path(model)
        plain = None
        for target in s.targets:
            todo = [n for n in s.attacks if not store.has(f"{model}/{target}/{n}/{bkey}")]
            fkey = f"{model}/{target}/fidelity/-"
            need_fidelity = target != PERMUTATION_ONLY and not store.has(fkey)
            if not todo and not need_fidelity:
                continue
            if plain is None:
                plain = load_plain_model(src)
            t = build_target(src, target, s.seed, plain)
            if need_fidelity:
                store.put(fkey, fidelity_entry(plain, t))
                print(f"{fkey}: {store.get(fkey)}", flush=True)
            data = private_data(t.tokenizer, s.prompts, 0)
            for name in todo:
                key = f"{model}/{target}/{name}/{bkey}"
                print(f"{key} ...", flush=True)
                entry = run_attack(name, t, data, budget, _attack(name, config))
                entry["target_params"] = None if target == PERMUTATION_ONLY else target_record(target)
                if config is not None:
                    entry["budget"]["reduced"] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
                store.put(key, entry)
                print_entry(key, entry)
            del t


def table(entries: dict[str, dict]) -> str:
    lines = ["| Model | Target | top-1 agreement | Attack | TTRSR (%) | PIIRSR (%) | Vocab. recovery (%) | "
             "Confident ids (%) | Wall time (s) | Threads | Budget |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fidelity = {k.rsplit("/", 2)[0]: v for k, v in entries.items() if "/fidelity/" in k}
    for key in sorted(entries):
        e = entries[key]
        model, target, attack, budget = key.split("/")
        if attack == "fidelity":
            continue
        m = e["metrics"]
        top1 = fidelity.get(f"{model}/{target}", {}).get("top1_agreement")
        top1 = "1 (plaintext logits)" if target == "permutation-only" else ("-" if top1 is None else f"{top1:.3f}")
        if "error" in m:
            lines.append(f"| {model} | {target} | {top1} | {attack} | error: {m['error'][:80]} | | | | | | {budget} |")
            continue
        lines.append(f"| {model} | {target} | {top1} | {attack} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | "
                     f"{pct(m.get('vocab_recovery'))} | {pct(m.get('confident_fraction'))} | "
                     f"{'-' if e.get('seconds') is None else format(e['seconds'], '.0f')} | "
                     f"{e['budget'].get('threads', '-')} | {budget} |")
    return "\n".join(lines)


def plot(entries: dict[str, dict], path) -> None:
    """Top-1 agreement (x) against TTRSR (y) of each attack, one point per obfuscated target."""
    from ..lib.plots import figure

    with figure(path, (6, 4)) as ax:
        for model in sorted({k.split("/")[0] for k in entries}):
            for attack in sorted({k.split("/")[2] for k in entries if k.startswith(model + "/")} - {"fidelity"}):
                pts = []
                for key, e in entries.items():
                    m, target, a, _ = key.split("/")
                    fid = entries.get(f"{m}/{target}/fidelity/-")
                    if m == model and a == attack and fid and e.get("ttrsr") is not None:
                        pts.append((fid["top1_agreement"], e["ttrsr"], target))
                pts.sort()
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{model} {attack}")
                    for x, y, t in pts:
                        ax.annotate(t, (x, y), fontsize=7)
        ax.set_xlabel("top-1 agreement with the plaintext model")
        ax.set_ylabel("TTRSR (prompt tokens recovered)")
        ax.set_title("Behavioural attacks: accuracy vs. leakage (same obfuscated output)")
        ax.legend(fontsize=7)


def report(store: ResultStore) -> str:
    entries = store.entries()
    if any(e.get("ttrsr") is not None for e in entries.values()):
        plot(entries, store.figure_path(".png"))
    return table(entries)


SUMMARY = ("behavioural attacks (and VMA -> behavioural -> ridge) next to the accuracy of the same output "
           "(tens of minutes per target on SmolLM2, ~36 min reduced on Qwen)")
CONFIGS = {
    # docs/security.md "Behavioural attacks" table and plot, docs/accuracy.md's frontier points
    "smollm2-small": Settings(),
    # lambda and the block permutation against the behavioural attack (docs/expansion.md)
    "lam-beta-small": Settings(targets=("noisy:lam=0.1", "default:lam=0.0", "default:lam=0.0,beta=1"),
                               attacks=("behavioural",)),
    "qwen-coder-small": Settings(models=("qwen-coder",), targets=("exact", "noisy"), attacks=("behavioural",)),
    # Qwen, paper preset: the composed pipeline at the reduced budget (docs/security.md)
    "qwen-coder-paper-reduced": Settings(models=("qwen-coder",), targets=("paper",),
                                         attacks=("behavioural-composed",), reduced=True),
    # a check that the whole path runs (positive control, ci budget, 5 prompts)
    "smoke": Settings(targets=("permutation-only",), attacks=("behavioural",), budget="ci", prompts=5),
}
DEFAULT_CONFIG = "smollm2-small"
DOCS = ("docs/security.md", "docs/accuracy.md", "docs/expansion.md", "docs/defences.md",
        "docs/audit.md")
NOTES = ("CPU; the frontier and audit_frontier experiments read every stored config of this one. The kept "
         "results name targets as the presets were then ('default' was noisy-like then); every row records its "
         "parameters (target_params)")
