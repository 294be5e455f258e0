"""What the expansion h buys: the state attacks (isa_anchor, nn, isa_attention, ima) and the accuracy of the same
obfuscated model, for presets and preset variants at several h, on the bundled models.

h values are the requested ones ("d/8" and "d/4" are fractions of the hidden size); the pipeline rounds each up to
the smallest even h' with num_heads | d + 2h' (SmolLM2: 2 and 16 both become 18), so rows are keyed by the
effective h and a duplicate is run once: ``model/preset/h<effective>/<attack or fidelity>/<budget>``. Obfuscation
seed 4242; victim: Faker PII prompts (seed 7). ``fidelity`` is the teacher-forced top-1 agreement and KL of the
same obfuscated model against plaintext on public text (aloepri.eval.fidelity), so privacy and accuracy are
measured on one artifact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path

ATTACKS = ("fidelity", "isa_anchor", "nn", "isa_attention", "ima")
OBFUSCATION_SEED = 4242
VICTIM_SEED = 7


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    hs: tuple[str, ...] = ("2", "16", "d/8", "d/4", "128")  # requested h: an integer, d/8 or d/4
    presets: tuple[str, ...] = ("exact", "noisy")
    variants: tuple[str, ...] = ()  # LABEL=PRESET:field=value,... (benchmarks.lib.variants), each its own row
    attacks: tuple[str, ...] = ("fidelity", "isa_anchor", "nn")
    budget: str = "ci"
    prompts: int = 20  # victim PII prompts (Faker, seed 7)
    isa_prompts: int = 3  # prompts inverted by the ISA attacks
    isa_len: int = 24  # positions per prompt inverted by the ISA attacks
    fidelity_texts: int = 16
    threads: int = 1


def fidelity(target, texts: int, max_tokens: int) -> dict:
    from aloepri.eval.fidelity import compare, corpus_ids, corpus_texts

    src_texts, prov = corpus_texts(None, texts)
    ids = corpus_ids(target.tokenizer, src_texts, max_tokens)
    fid = compare(target.plain_model, target.obf_model, target.key, ids, greedy_tokens=0).to_dict()
    return {"top1_agreement": fid["top1_agreement"], "mean_kl": fid.get("mean_kl"), "corpus": prov,
            "texts": len(ids), "max_tokens": max_tokens}


def requested_h(text: str, d: int) -> int:
    fractions = {"d/8": d // 8, "d/4": d // 4}
    if text in fractions:
        return fractions[text]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"h {text!r}: an integer, d/8 or d/4") from None


def run(s: Settings, store: ResultStore) -> None:
    import torch

    import aloepri
    from aloepri.attacks.base import AttackTarget, Budget
    from aloepri.attacks.data import private_prompts
    from aloepri.attacks.ima import run_ima
    from aloepri.attacks.isa import ISAConfig, isa_anchor_attack, isa_attention_attack
    from aloepri.attacks.nearest_neighbour import run_nn
    from aloepri.obfuscation.shape import effective_h

    from ..lib.targets import obfuscated
    from ..lib.variants import parse_variant

    unknown = set(s.attacks) - set(ATTACKS)
    if unknown:
        raise ValueError(f"unknown attack(s) {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    budget = Budget.named(s.budget)
    isa_cfg = ISAConfig.for_budget(budget, max_prompts=s.isa_prompts, max_len=s.isa_len)
    variants = {p: aloepri.resolve_params(p) for p in s.presets}
    variants.update(parse_variant(v) for v in s.variants)
    config = None
    for preset, base in variants.items():
        for req in s.hs:
            if config is None:
                config = AttackTarget(src, src, None).plain_model.config
            d, heads = int(config.hidden_size), int(config.num_attention_heads)
            h_req = requested_h(req, d)
            h_eff = effective_h(d, h_req, heads)
            todo = [a for a in s.attacks if not store.has(f"{s.model}/{preset}/h{h_eff}/{a}/{s.budget}")]
            if not todo:
                continue
            params = base.replace(h=h_eff)
            built = obfuscated(src, params, OBFUSCATION_SEED)
            target = AttackTarget(src, built.model_dir, built.key_path)
            data = private_prompts(target.tokenizer, n=s.prompts, seed=VICTIM_SEED)
            runners = {"isa_anchor": lambda t: isa_anchor_attack(t, data, budget, 0, cfg=isa_cfg),
                       "isa_attention": lambda t: isa_attention_attack(t, data, budget, 0, cfg=isa_cfg),
                       "nn": lambda t: run_nn(t, data, budget, 0),
                       "ima": lambda t: run_ima(t, data, budget, 0, oracle=False)}
            for attack in todo:
                key = f"{s.model}/{preset}/h{h_eff}/{attack}/{s.budget}"
                t0 = time.perf_counter()
                entry = (fidelity(target, s.fidelity_texts, 128) if attack == "fidelity"
                         else runners[attack](target).to_dict())
                entry.update(model=s.model, preset=preset, h_requested=h_req, h_effective=h_eff,
                             hidden_size=d + 2 * h_eff, plain_hidden_size=d, seconds=time.perf_counter() - t0,
                             victim=f"{s.prompts} Faker PII prompts, seed {VICTIM_SEED}",
                             obfuscation_seed=OBFUSCATION_SEED, params=params.to_dict())
                store.put(key, entry)
                shown = (f"top1={entry['top1_agreement']:.3f}" if attack == "fidelity"
                         else f"ttrsr={entry['ttrsr']} piirsr={entry['piirsr']}")
                print(f"{key}: {shown} ({entry['seconds']:.0f}s)", flush=True)
            del target


def report(store: ResultStore) -> str:
    """Markdown: one row per (model, preset, effective h); TTRSR / PIIRSR (%) per attack, top-1 agreement."""
    rows: dict[tuple, dict] = {}
    for e in store.entries().values():
        rows.setdefault((e["model"], e["preset"], e["h_effective"]), {"D": e["hidden_size"]})[e.get("attack", "fidelity")] = e
    attacks = [a for a in ATTACKS if a != "fidelity"]
    out = ["| model | preset | h (effective) | width d+2h | top-1 agreement | "
           + " | ".join(f"{a} TTRSR / PIIRSR" for a in attacks) + " | isa_anchor: vocabulary from mapped embedding / map error |",
           "|---|---|---|---|---|" + "---|" * len(attacks) + "---|"]
    for (model, preset, h), r in sorted(rows.items()):
        fid = r.get("fidelity")
        cells = [f"{100 * r[a]['ttrsr']:.1f} / {100 * r[a]['piirsr']:.1f}" if a in r else "not run" for a in attacks]
        m = r.get("isa_anchor", {}).get("metrics", {})
        voc, err = m.get("vocab_recovery_from_mapped_embedding"), m.get("map_relative_error_on_victim_states")
        out.append(f"| {model} | {preset} | {h} | {r['D']} | {fid['top1_agreement']:.3f} |" if fid else
                   f"| {model} | {preset} | {h} | {r['D']} | not run |")
        out[-1] += " " + " | ".join(cells) + f" | {'not run' if voc is None else f'{100 * voc:.2f}% / {err:.2g}'} |"
    return "\n".join(out)


SUMMARY = ("what the expansion h buys: state attacks and accuracy of the same obfuscation per h (minutes per "
           "row on SmolLM2; isa_attention several minutes)")
CONFIGS = {
    # docs/expansion.md, the main table
    "smollm2-ci": Settings(),
    # ... its isa_attention and ima columns, per h
    "attention-ci": Settings(hs=("144", "72"), attacks=("isa_attention", "ima")),
    # docs/expansion.md "Qwen2.5-Coder-0.5B": the paper's h on noisy
    "qwen-coder-h128": Settings(model="qwen-coder", presets=("noisy",), hs=("128",),
                                attacks=("isa_anchor", "nn", "fidelity"), isa_prompts=2, isa_len=16,
                                fidelity_texts=8),
    # docs/expansion.md "h = 0 through the whole attack sweep"
    "h0-ci": Settings(hs=("0",), attacks=ATTACKS),
    # docs/expansion.md: lambda and the block permutation at h = 0
    "lam-beta-h0": Settings(hs=("0",), presets=(), variants=("noisy_lam0_beta1=noisy:lam=0.0,beta=1",),
                            attacks=("fidelity", "isa_attention")),
    # a check that the path runs: exact at h = 0, accuracy on 2 public texts
    "smoke": Settings(hs=("0",), presets=("exact",), attacks=("fidelity",), fidelity_texts=2),
}
DEFAULT_CONFIG = "smollm2-ci"
DOCS = ("docs/expansion.md", "docs/security.md")
NOTES = ("CPU; each (preset, h) is obfuscated once and cached by parameter hash (benchmarks.lib.targets). The kept "
         "results name presets as they were then ('default' was noisy-like); every row records its parameters")
