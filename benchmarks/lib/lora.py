"""LoRA fine-tuning of a causal LM on CPU for experiments (benchmarks/experiments/finetune_attack.py): a public
corpus split and packed into blocks, low-rank adapters on every attention and MLP projection, the merged
checkpoint a client would ship, and how far it drifted from the base model. Imports torch: load it lazily."""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
from pathlib import Path

import torch


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
