"""What the expansion h buys: the state attacks (isa_anchor, nn, isa_attention, ima) and the accuracy of the same
obfuscated model, for `exact` and `noisy` at several h, on SmolLM2-135M (and Qwen2.5-Coder-0.5B with --model qwen).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/expansion_sweep.py --model smollm2 --budget ci
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/expansion_sweep.py --model smollm2 --attacks isa_attention

h values are the requested ones (default: 2, 16, d/8, d/4 and the paper's 128); the pipeline rounds each up to the
smallest even h' with num_heads | d + 2h' (SmolLM2: 2 and 16 both become 18), so runs are keyed by the effective
h and a duplicate is run once. Resumable: results/expansion_sweep.json is keyed by
model/preset/h<effective>/<attack or fidelity>/<budget>; existing entries are skipped. Obfuscation seed 4242;
victim: --prompts Faker PII prompts (seed 7). `fidelity` is the teacher-forced top-1 agreement and KL of the same
obfuscated model against plaintext on public text (aloepri.eval.fidelity), so privacy and accuracy are measured
on one artifact.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import aloepri
from aloepri.attacks.base import AttackTarget, Budget
from aloepri.attacks.data import private_prompts
from aloepri.attacks.ima import run_ima
from aloepri.attacks.isa import ISAConfig, isa_anchor_attack, isa_attention_attack
from aloepri.attacks.nearest_neighbour import run_nn
from aloepri.obfuscation.secrets import effective_h
from variants import parse_variant  # same directory

RESULTS = Path(__file__).parent / "results" / "expansion_sweep.json"
ATTACKS = ("fidelity", "isa_anchor", "nn", "isa_attention", "ima")


def model_src(name: str) -> Path:
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    return {"smollm2": smollm2_gguf, "qwen": qwen25_coder_05b_gguf}[name]()


def _save(key: str, entry: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # re-read: other runs may share it
    results[key] = entry
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(RESULTS)


def fidelity(target: AttackTarget, texts: int, max_tokens: int) -> dict:
    from aloepri.eval.fidelity import compare, corpus_ids, corpus_texts

    src_texts, prov = corpus_texts(None, texts)
    ids = corpus_ids(target.tokenizer, src_texts, max_tokens)
    fid = compare(target.plain_model, target.obf_model, target.key, ids, greedy_tokens=0).to_dict()
    return {"top1_agreement": fid["top1_agreement"], "mean_kl": fid.get("mean_kl"), "corpus": prov,
            "texts": len(ids), "max_tokens": max_tokens}


def table() -> str:
    """Markdown: one row per (model, preset, effective h); TTRSR / PIIRSR (%) per attack, top-1 agreement."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows: dict[tuple, dict] = {}
    for e in results.values():
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen"])
    ap.add_argument("--hs", default="", help="comma list of requested h (default: 2,16,d/8,d/4,128)")
    ap.add_argument("--presets", default="exact,noisy")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=PRESET:key=value,...",
                    help="also run a preset with overrides under its own label (benchmarks/variants.py), e.g. "
                         "default_beta1=noisy:beta=1; repeatable")
    ap.add_argument("--attacks", default="fidelity,isa_anchor,nn", help=f"comma list from {','.join(ATTACKS)}")
    ap.add_argument("--budget", default="ci", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=20, help="victim PII prompts (Faker, seed 7)")
    ap.add_argument("--isa-prompts", type=int, default=3, help="prompts inverted by the ISA attacks")
    ap.add_argument("--isa-len", type=int, default=24, help="positions per prompt inverted by the ISA attacks")
    ap.add_argument("--fidelity-texts", type=int, default=16)
    ap.add_argument("--work", default="/tmp/aloepri-expansion-sweep")
    ap.add_argument("--keep", action="store_true", help="keep the obfuscated models under --work")
    ap.add_argument("--print", action="store_true", help="print the markdown table of the saved results and exit")
    args = ap.parse_args()
    if args.print:
        print(table())
        return
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = model_src(args.model)
    budget = Budget.named(args.budget)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise SystemExit(f"unknown attack(s) {sorted(unknown)}; choose from {ATTACKS}")
    isa_cfg = ISAConfig.for_budget(budget, max_prompts=args.isa_prompts, max_len=args.isa_len)

    variants = {p: aloepri.resolve_params(p) for p in args.presets.split(",") if p}
    variants.update(parse_variant(v) for v in args.variant)
    plain = None
    for preset, base in variants.items():
        for req in (args.hs.split(",") if args.hs else ["2", "16", "d/8", "d/4", "128"]):
            if plain is None:
                plain = AttackTarget(src, src, None).plain_model.config
            d, heads = int(plain.hidden_size), int(plain.num_attention_heads)
            h_req = {"d/8": d // 8, "d/4": d // 4}.get(req) or int(req)
            h_eff = effective_h(d, h_req, heads)
            todo = [a for a in attacks if f"{args.model}/{preset}/h{h_eff}/{a}/{args.budget}" not in
                    (json.loads(RESULTS.read_text()) if RESULTS.exists() else {})]
            if not todo:
                continue
            out, key = work / f"{args.model}-{preset}-h{h_eff}", work / f"{args.model}-{preset}-h{h_eff}.key"
            if not (out / "config.json").exists():
                t0 = time.perf_counter()
                aloepri.obfuscate(src, out, key, base.replace(h=h_eff), seed=4242,
                                  allow_weak_seed=True, progress=False, overwrite=True)
                print(f"obfuscated {preset} h={h_eff} in {time.perf_counter() - t0:.0f}s", flush=True)
            target = AttackTarget(src, out, key)
            data = private_prompts(target.tokenizer, n=args.prompts, seed=7)
            for attack in todo:
                k = f"{args.model}/{preset}/h{h_eff}/{attack}/{args.budget}"
                t0 = time.perf_counter()
                if attack == "fidelity":
                    entry = fidelity(target, args.fidelity_texts, 128)
                else:
                    runners = {"isa_anchor": lambda: isa_anchor_attack(target, data, budget, 0, cfg=isa_cfg),
                               "isa_attention": lambda: isa_attention_attack(target, data, budget, 0, cfg=isa_cfg),
                               "nn": lambda: run_nn(target, data, budget, 0),
                               "ima": lambda: run_ima(target, data, budget, 0, oracle=False)}
                    entry = runners[attack]().to_dict()
                entry.update(model=args.model, preset=preset, h_requested=h_req, h_effective=h_eff,
                             hidden_size=d + 2 * h_eff, plain_hidden_size=d, seconds=time.perf_counter() - t0,
                             victim=f"{args.prompts} Faker PII prompts, seed 7", obfuscation_seed=4242,
                             params=base.replace(h=h_eff).to_dict(),
                             time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                _save(k, entry)
                shown = (f"top1={entry['top1_agreement']:.3f}" if attack == "fidelity"
                         else f"ttrsr={entry['ttrsr']} piirsr={entry['piirsr']}")
                print(f"{k}: {shown} ({entry['seconds']:.0f}s)", flush=True)
            del target
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
