"""Learned inversion: IMA with the attacker's own keys, and with the victim's key (oracle).

IMA (after Kugler et al. 2021, the paper's setting): a small transformer (2 layers, d=128) reads obfuscated
states at a layer (default 0: the embedding output, as the paper) and predicts the plaintext token embedding;
the guess is its nearest plaintext token over the FULL vocabulary. ``ima`` trains on the attacker's own corpus
obfuscated with keys it samples itself (``aloepri.obfuscate`` with its own seeds and the public hyperparameters);
``ima_oracle`` trains on pairs made with the victim's own key, a stronger attacker than the threat model allows.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.modules import ModelModules
from ..runtime.probe import batched_states, layer_states
from .base import (UNPROTECTED, AttackResult, AttackTarget, Budget, PrivateData, built_from_seed, register_variant,
                   score_attacked_prompts)


class InversionModel(torch.nn.Module):
    """Obfuscated states (batch, n, D_in) -> predicted plaintext embeddings (batch, n, d_out): an input projection,
    learned positions, a small bidirectional transformer encoder (the attacker sees the whole prompt)."""

    def __init__(self, d_in: int, d_out: int, width: int = 128, layers: int = 2, heads: int = 4, max_len: int = 256):
        super().__init__()
        self.inp = torch.nn.Sequential(torch.nn.LayerNorm(d_in), torch.nn.Linear(d_in, width))
        self.pos = torch.nn.Embedding(max_len, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = torch.nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(x.shape[1], device=x.device)).unsqueeze(0)
        return self.out(self.enc(self.inp(x) + pos))


@dataclass
class IMAConfig:
    layer: int = 0  # 0 = embedding output (the paper's IMA inverts obfuscated embeddings)
    steps: int = 1500
    batch: int = 16
    seq_len: int = 48
    train_tokens: int = 200_000  # attacker corpus size (tokens)
    keys: int = 2  # attacker-sampled keys (own seeds) in the self-obfuscated variant
    negatives: int = 2048  # random full-vocabulary negatives per step in the sampled softmax
    lr: float = 1e-3
    width: int = 128
    depth: int = 2

    @classmethod
    def for_budget(cls, budget: Budget, **kw: Any) -> "IMAConfig":
        s = budget.scale
        cfg = cls(steps=max(60, int(3000 * s)), train_tokens=max(5_000, int(400_000 * s)),
                  keys=max(1, min(3, int(round(4 * s)))))
        return cfg if not kw else IMAConfig(**{**cfg.__dict__, **kw})


def attacker_token_stream(target: AttackTarget, n_tokens: int, seed: int, vocab: int) -> tuple[np.ndarray, str]:
    """The attacker's public training text as plaintext ids, and where it came from."""
    try:
        from ..corpora import corpus, tokenize_texts

        tok = target.tokenizer
        texts = corpus("fortunes") + corpus("debian-reference")
        order = np.random.default_rng(seed).permutation(len(texts))
        ids = tokenize_texts(tok, [texts[i] for i in order], max_tokens=n_tokens)
        if len(ids) >= min(n_tokens, 1000):
            return ids, ("fortunes + debian-reference (aloepri.corpora.corpus; disjoint from the victim's "
                         "PII prompts)")
    except Exception:
        pass
    # no tokenizer (tiny test checkpoints) or no corpus installed: Zipf-distributed random ids over the vocabulary
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = (1.0 / ranks) / (1.0 / ranks).sum()
    return rng.permutation(vocab)[rng.choice(vocab, size=n_tokens, p=p)], f"synthetic Zipf ids over {vocab} tokens"


def _attacker_views(target: AttackTarget, chunks: torch.Tensor, cfg: IMAConfig, seed: int, oracle: bool,
                    workdir: Path) -> tuple[list[torch.Tensor], str]:
    """Training inputs: the attacker's chunks as some obfuscated model sees them, one tensor per key."""
    params = dict(target.key.params) if target.key is not None else {}
    if oracle:
        obf_ids = torch.as_tensor(target.key.permutation)[chunks]  # the victim's key: oracle only
        views = [batched_states(target.obf_model, cfg.layer, obf_ids)]
        return views, "oracle pairs from the victim's own key and model"
    if params.get("mechanism") == UNPROTECTED:
        return [batched_states(target.plain_model, cfg.layer, chunks)], "no protection (target is the plaintext model)"
    from transformers import AutoModelForCausalLM

    from ..keyfile import load_key
    from ..obfuscation.params import ObfuscationParams
    from ..obfuscation.pipeline import obfuscate

    p = ObfuscationParams.from_dict(params)
    views = []
    for k in range(cfg.keys):
        own_seed = int(np.random.default_rng([seed, k]).integers(1 << 31))
        out, key_path = workdir / f"own-{k}", workdir / f"own-{k}.key"
        obfuscate(target.plain_src, out, key_path, p, seed=own_seed, allow_weak_seed=True, progress=False)
        own_key = load_key(key_path)
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=target.dtype).eval()
        obf_ids = torch.as_tensor(own_key.permutation)[chunks]
        views.append(batched_states(model, cfg.layer, obf_ids))
        del model
    return views, (f"{cfg.keys} attacker-sampled keys (aloepri.obfuscate of the public model, its own seeds, the "
                   "target's public hyperparameters)")


def train_inversion_model(views: list[torch.Tensor], chunks: torch.Tensor, plain_emb: torch.Tensor, cfg: IMAConfig,
                          seed: int) -> tuple[InversionModel, float]:
    """Fit ``InversionModel`` on (view, plaintext chunk) pairs: sampled-softmax over cosine similarity to the
    plaintext embedding table (so tokens never seen in training are still reachable at test time)."""
    gen = torch.Generator().manual_seed(seed)
    target_emb = F.normalize(plain_emb.float(), dim=-1)
    model = built_from_seed(seed, lambda: InversionModel(views[0].shape[-1], plain_emb.shape[1], cfg.width, cfg.depth,
                                                         max_len=max(256, chunks.shape[1])))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    vocab = plain_emb.shape[0]
    n_neg = min(cfg.negatives, vocab)
    loss = torch.tensor(0.0)
    for step in range(cfg.steps):
        v = int(torch.randint(len(views), (1,), generator=gen))
        rows = torch.randint(len(chunks), (cfg.batch,), generator=gen)
        x, y = views[v][rows], chunks[rows]
        pred = F.normalize(model(x), dim=-1)  # (b, n, d)
        cand = torch.unique(torch.cat([y.flatten(), torch.randint(vocab, (n_neg,), generator=gen)]))
        logits = pred @ target_emb[cand].T / 0.05
        lookup = torch.full((vocab,), -1, dtype=torch.long)
        lookup[cand] = torch.arange(len(cand))
        loss = F.cross_entropy(logits.reshape(-1, len(cand)), lookup[y.flatten()])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), float(loss.detach())


def run_ima(target: AttackTarget, data: PrivateData, budget: Budget, seed: int, oracle: bool,
         cfg: IMAConfig | None = None) -> AttackResult:
    cfg = cfg or IMAConfig.for_budget(budget)
    plain_emb = ModelModules(target.plain_model).embed.weight.detach()
    vocab = plain_emb.shape[0]
    stream, provenance = attacker_token_stream(target, cfg.train_tokens, seed, vocab)
    n_chunks = len(stream) // cfg.seq_len
    if n_chunks < 2:
        raise ValueError(f"attacker corpus too small: {len(stream)} tokens for seq_len {cfg.seq_len}")
    chunks = torch.as_tensor(stream[: n_chunks * cfg.seq_len].reshape(n_chunks, cfg.seq_len), dtype=torch.long)
    with tempfile.TemporaryDirectory(prefix="aloepri-ima-") as tmp:
        views, source = _attacker_views(target, chunks, cfg, seed, oracle, Path(tmp))
    model, final_loss = train_inversion_model(views, chunks, plain_emb, cfg, seed)
    del views
    observed = data.observed(target)
    table = F.normalize(plain_emb.float(), dim=-1)
    predicted = []
    with torch.no_grad():
        for obs in observed:
            ids = torch.tensor([obs])
            x = layer_states(target.obf_model, cfg.layer, input_ids=ids).float()
            pred = F.normalize(model(x)[0], dim=-1)
            predicted.append((pred @ table.T).argmax(-1).tolist())
    idx = list(range(len(observed)))
    metrics = score_attacked_prompts(target, data, predicted, idx)
    metrics["final_train_loss"] = final_loss
    name = "ima_oracle" if oracle else "ima"
    n_params = sum(p.numel() for p in model.parameters())
    return AttackResult(
        name, metrics["ttrsr"], metrics["piirsr"], metrics,
        budget={"budget": budget.name, "layer": cfg.layer, "steps": cfg.steps, "batch": cfg.batch,
                "seq_len": cfg.seq_len, "train_tokens": int(n_chunks * cfg.seq_len), "keys": 1 if oracle else cfg.keys,
                "model": f"{cfg.depth}-layer encoder, width {cfg.width}, {n_params} parameters",
                "negatives": cfg.negatives, "train_data": provenance,
                "candidate_pool": f"full vocabulary ({vocab}), nearest plaintext embedding"},
        uses=(f"obfuscated states after decoder layer {cfg.layer} (0 = embedding output) of the victim's prompts; "
              f"training pairs: {source}; the public plaintext model and tokenizer"
              + ("; ORACLE: the victim's key was used to build training pairs (stronger than the threat model)"
                 if oracle else "")))


ima = register_variant(
    "ima", run_ima,
    "IMA, the paper's setting: inversion model trained on data the attacker obfuscates with its own keys.",
    oracle=False)
ima_oracle = register_variant(
    "ima_oracle", run_ima,
    "IMA with oracle pairs from the victim's own key (stronger than the threat model; reported separately).",
    oracle=True)
