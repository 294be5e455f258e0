"""The AloePri paper's Table 1 on a bundled model: SANTEXT, RANTEXT, DP-Forward, SGT and aloepri's presets, each
with its accuracy and every attack the paper ran on it, beside the paper's numbers (Qwen2.5-14B-Instruct).

Same prompts and metrics for every method: TTRSR/PIIRSR/CosSim on the 50 Faker-PII prompts (seed 0; direct
observation for SANTEXT/RANTEXT, NN + IMA for DP-Forward and SGT), accuracy as fidelity to the plaintext model
(top-1 agreement and KL of the next-token distribution on the 20 built-in chat prompts) -- not the paper's task
benchmarks (SST2, MMLU, PIQA, IFEval), which these small models and CPUs cannot run meaningfully.

Baseline points the ``baselines`` experiment already measured with the same settings (config ``reuse``) are read
from there, not rerun; the rest, and SGT, are measured here. SGT's noise generator is trained first
(aloepri.baselines.sgt, seeded) and saved beside the results as ``sgt-<model>-<config digest>.pt``, so a rerun
reuses it. aloepri's rows come from the stored attack and fidelity results (benchmarks.lib.baseline_points).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.baseline_points import SEED, aloepri_points, fmt, parse_point, point_key

# The paper's Table 1 (Qwen2.5-14B-Instruct), quoted from its tex: accuracy (SST2, MMLU, PIQA, IFEval, %) and
# (attack, TTRSR %, CosSim) per method. DP-Forward has no generation accuracy ("cannot support auto-regressive
# generation"). Settings (appendix): SANTEXT eps 3, RANTEXT eps 30, DP-Forward eps 5 after the first decoder layer.
PAPER = {
    "plaintext": {"accuracy": (97.25, 81.95, 77.45, 77.09), "attacks": ()},
    "santext": {"accuracy": (81.31, 51.07, 49.72, 57.45), "attacks": (("direct-observation", 62.90, 0.93),)},
    "rantext": {"accuracy": (87.50, 37.77, 18.30, 57.18), "attacks": (("direct-observation", 56.92, 0.88),)},
    "dp-forward": {"accuracy": (93.60, None, None, None), "attacks": (("nn", 37.82, 0.51), ("ima", 77.08, 0.84))},
    "sgt": {"accuracy": (92.43, 30.30, 26.06, 34.66), "attacks": (("nn", 11.12, 0.69), ("ima", 98.58, 0.99))},
    "aloepri": {"accuracy": (97.13, 80.61, 75.23, 79.49),
                "attacks": (("vma", 13.51, 0.31), ("nn", 0.0, 0.42), ("ima", 0.0, 0.36), ("ia", 5.95, 0.40),
                            ("isa", 0.0, 0.20))},
}


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    points: tuple[str, ...] = ("santext@3", "rantext@30", "dp-forward-paper@5", "dp-forward@5", "sgt")
    budget: str = "small"  # IMA budget (DP-Forward, SGT)
    prompts: int = 50
    reuse: str = "smollm2"  # the `baselines` config whose points with these settings are read, not rerun ("": none)
    # SGT's generator and training (aloepri.baselines.sgt.SGTConfig; the paper's loss coefficients)
    sgt_width: int = 32
    sgt_depth: int = 1
    sgt_steps: int = 48
    sgt_batch: int = 2
    sgt_seq_len: int = 32
    sgt_lr: float = 3e-3
    sgt_seed: int = 0
    threads: int = 2


def sgt_config(s: Settings):
    from aloepri.baselines.sgt import SGTConfig

    return SGTConfig(width=s.sgt_width, depth=s.sgt_depth, steps=s.sgt_steps, batch=s.sgt_batch,
                     seq_len=s.sgt_seq_len, lr=s.sgt_lr, seed=s.sgt_seed)


def reused_entry(s: Settings, key: str) -> dict | None:
    """The `baselines` experiment's entry for ``key`` when it was measured with these settings."""
    if not s.reuse:
        return None
    from ..lib.registry import get_experiment

    e = get_experiment("baselines").store(s.reuse).get(key)
    if e and e.get("privacy") and e.get("prompts") == s.prompts and e.get("seed") == SEED \
            and e.get("ima_budget") == s.budget and e.get("model", "").lower().startswith(s.model):
        return e
    return None


def train_or_load_sgt(s: Settings, store: ResultStore, model, tok):
    import hashlib

    from aloepri.baselines.sgt import SGT, train_sgt, train_stream

    cfg = sgt_config(s)
    path = store.figure_path(".json").parent / f"sgt-{s.model}-{cfg.digest()}.pt"
    if path.exists():
        mech = SGT.load(path, model)
    else:
        stream, provenance = train_stream(tok, cfg.steps * cfg.batch * cfg.seq_len * 4, cfg.seed,
                                          int(model.get_input_embeddings().weight.shape[0]))
        mech = train_sgt(model, stream, cfg, log_every=4)
        mech.facts["train_data"] = provenance
        mech.save(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return mech, {"sgt_params": path.name, "sgt_params_sha256": digest}


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.data import private_prompts
    from aloepri.baselines.harness import make_method, user_content_prompts

    from ..lib.baseline_points import DATA_SEED, load, measure_point

    torch.set_num_threads(s.threads)
    todo = [p for p in s.points if not store.has(point_key(*parse_point(p))) and not reused_entry(s, p)]
    if not todo:
        return
    src, tok, model = load(s.model)
    data = private_prompts(tok, s.prompts, DATA_SEED)
    prompts = user_content_prompts(tok)
    for point in todo:
        method, eps = parse_point(point)
        extra = {}
        if method == "sgt":
            mech, extra = train_or_load_sgt(s, store, model, tok)
        else:
            mech = make_method(method, model, eps)
        entry = {**measure_point(mech, method, eps, model, tok, data, prompts, src, s.budget), **extra}
        store.put(point_key(method, eps), entry)
        print(f"{point}: worst TTRSR {entry['privacy']['worst_ttrsr']:.4f} top-1 "
              f"{entry['fidelity']['top1_agreement']:.4f} ({entry['seconds']:.0f}s)", flush=True)


def _paper_family(method: str) -> str:
    return "dp-forward" if method.startswith("dp-forward") else method


def _paper_acc(family: str) -> str:
    return " / ".join(fmt(v, 2) for v in PAPER[family]["accuracy"])


def report(store: ResultStore) -> str:
    settings = store.load().get("settings") or {}
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}) if settings else Settings()
    head = ["| method | setting | attack | TTRSR | PIIRSR | CosSim | top-1 agreement (all / from first perturbed) "
            "| mean KL | paper: attack TTRSR % (CosSim) | paper: SST2 / MMLU / PIQA / IFEval % |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [f"| plaintext | - | - | - | - | - | 1.000 / 1.000 | 0.000 | - | {_paper_acc('plaintext')} |"]
    missing = []
    for point in s.points:
        method, eps = parse_point(point)
        key = point_key(method, eps)
        e, source = store.get(key), "here"
        if e is None:
            e, source = reused_entry(s, key), f"baselines/{s.reuse}"
        if e is None:
            missing.append(point)
            continue
        fam = _paper_family(method)
        paper = {a: (t, c) for a, t, c in PAPER[fam]["attacks"]}
        attacks = {a: v for a, v in e["privacy"].items() if isinstance(v, dict)}
        worst = max(attacks, key=lambda a: attacks[a]["ttrsr"])
        fid = e["fidelity"]
        setting = ("trained generator" if method == "sgt" else f"eps {eps:g}") + (
            f" (from {source})" if source != "here" else "")
        if method == "sgt":
            t = e["mechanism"]["training"]
            setting += f", {t['steps']} steps"
        for i, (a, v) in enumerate(sorted(attacks.items())):
            mark = "**" if a == worst else ""
            p = paper.get(a)
            rows.append(f"| {method if i == 0 else ''} | {setting if i == 0 else ''} | {mark}{a}{mark} | "
                        f"{mark}{v['ttrsr']:.3f}{mark} | {fmt(v['piirsr'])} | {fmt(v.get('cossim'))} | "
                        + (f"{fid['top1_agreement']:.3f} / {fid['top1_agreement_from_first_change']:.3f} | "
                           f"{fid['mean_kl']:.3f}" if i == 0 else " | ")
                        + f" | {'-' if p is None else f'{p[0]:.2f} ({p[1]:.2f})'} | "
                        + (_paper_acc(fam) if i == 0 else "") + " |")
    presets, _ = aloepri_points(s.model)
    paper_aloepri = "; ".join(f"{a.upper()} {t:.2f} ({c:.2f})" for a, t, c in PAPER["aloepri"]["attacks"])
    for j, p in enumerate(presets):
        rows.append(f"| {p['label']} | preset | **{p['worst_attack']}** (worst of {len(p['attacks'])}: "
                    f"{', '.join(p['attacks'])}) | **{p['worst_ttrsr']:.3f}** | {fmt(p['worst_piirsr'])} | "
                    f"{fmt(p['worst_cossim'])} | {fmt(p['top1'])} / {fmt(p['top1'])} | {fmt(p['mean_kl'])} | "
                    + (f"{paper_aloepri} | {_paper_acc('aloepri')} |" if j == 0 else " | |"))
    out = [f"### Table 1 on {s.model} (ours) beside the paper's Table 1 (Qwen2.5-14B-Instruct)", "", *head, *rows, "",
           f"Bold: the worst attack per method. Ours: {s.prompts} Faker-PII prompts (seed 0), IMA budget {s.budget}, "
           "fidelity on the 20 built-in chat prompts; the paper's columns are quoted from its Table 1 and measure task "
           "accuracy on another model. aloepri rows: the stored attack suite (known-pair ridge excluded) and "
           "fidelity results."]
    sgt = store.get("sgt")
    if sgt:
        t = sgt["mechanism"]["training"]
        first, last = t["loss_first"], t["loss_last"]
        out += ["", f"SGT generator: {sgt['mechanism']['generator_parameters']} parameters, {t['steps']} steps, "
                    f"{t['train_tokens_seen']} training tokens ({t.get('train_data', '?')}), {t['seconds']:.0f} s; "
                    "loss (mean of the first / last %d steps): " % t["loss_window"]
                + ", ".join(f"{k} {first[k]:.4g} -> {last[k]:.4g}" for k in first)
                + f"; parameters `{sgt['sgt_params']}` (sha256 {sgt['sgt_params_sha256']})."]
    if missing:
        out += ["", f"Not measured yet: {', '.join(missing)} (`python -m benchmarks run table1 --config "
                    f"{store.config}`)."]
    return "\n".join(out) + "\n"


SUMMARY = ("the paper's Table 1 (SANTEXT, RANTEXT, DP-Forward, SGT, aloepri presets: accuracy and every attack) "
           "on a bundled model beside the paper's numbers (tens of minutes on CPU)")
CONFIGS = {
    "smollm2": Settings(),
    "smoke": Settings(points=("santext@3", "sgt"), budget="ci", prompts=3, reuse="", sgt_steps=2,
                      sgt_seq_len=16, sgt_width=16, threads=1),
}
DOCS = ("docs/baselines.md",)
NOTES = ("smollm2: SGT training (~48 steps of the 135M model's forward+backward) + NN + IMA (budget small) + "
         "fidelity; SANTEXT/RANTEXT/DP-Forward points are read from `baselines/smollm2` when measured alike")
