"""SDA: a trained substitution decipherer (Aldarrab & May 2021; Kambhatla et al. 2023) against the vocabulary
permutation.

The server sees every prompt as a 1:1 substitution cipher of plaintext token ids. The decipherer never looks at
cipher ids themselves (they are random under the key): each cipher token is encoded by key-independent features

- its **frequency rank** in everything the attacker observed (rank 0 = most frequent cipher id; ties broken by
  cipher id, i.e. at random under the key), bucketed past ``max_rank``;
- its **recurrence index** in the window: the order in which distinct cipher ids first appear (0, 1, 0, 2, ...),
  which carries the repetition pattern (isomorphs) of the plaintext;

and a small bidirectional transformer maps the feature sequence to plaintext ids (per position; a substitution
keeps lengths). Training data: the attacker's public text, enciphered with random permutations the attacker
samples itself, rank-encoded over "documents" of the same size as what it observed of the victim (ranks depend on
sample size). Output classes: the ``pool`` most frequent plaintext tokens of the attacker's corpus plus "other"
(no guess); that candidate pool is reported with every number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .base import (AttackResult, AttackTarget, Budget, PrivateData, built_from_seed, has_tokenizer, register,
                   score_predictions)


def frequency_ranks(sequences: Sequence[Sequence[int]]) -> dict[int, int]:
    """Cipher id -> rank by count over all ``sequences`` (0 = most frequent; ties by id)."""
    ids, counts = np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]), return_counts=True)
    order = np.lexsort((ids, -counts))
    return {int(ids[j]): r for r, j in enumerate(order)}


def recurrence_index(seq: Sequence[int], cap: int) -> np.ndarray:
    """Order of first appearance of each symbol within ``seq`` (capped): the key-independent repetition pattern."""
    first: dict[int, int] = {}
    out = np.empty(len(seq), dtype=np.int64)
    for j, s in enumerate(seq):
        out[j] = first.setdefault(int(s), len(first))
    return np.minimum(out, cap - 1)


def encode_cipher(sequences: Sequence[Sequence[int]], max_rank: int,
                  seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sequence cut into windows of ``seq_len``: (rank bucket, recurrence index) arrays. Ranks past
    ``max_rank`` share one bucket per log2-count class (so "seen twice" differs from "seen once")."""
    ranks = frequency_ranks(sequences)
    ids, counts = np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]), return_counts=True)
    count_of = dict(zip(ids.tolist(), counts.tolist()))
    out = []
    for s in sequences:
        r = np.array([ranks[int(c)] if ranks[int(c)] < max_rank else
                      max_rank + min(7, int(np.log2(count_of[int(c)]))) for c in s], dtype=np.int64)
        for a in range(0, len(s), seq_len):
            w = np.asarray(s[a:a + seq_len])
            out.append((r[a:a + seq_len], recurrence_index(w, seq_len)))
    return out


class Decipherer(torch.nn.Module):
    def __init__(self, n_rank: int, seq_len: int, n_out: int, width: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.rank = torch.nn.Embedding(n_rank, width)
        self.rec = torch.nn.Embedding(seq_len, width)
        self.pos = torch.nn.Embedding(seq_len, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, n_out)

    def forward(self, rank: torch.Tensor, rec: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        pos = self.pos(torch.arange(rank.shape[1], device=rank.device)).unsqueeze(0)
        return self.out(self.norm(self.enc(self.rank(rank) + self.rec(rec) + pos, src_key_padding_mask=pad)))


@dataclass
class SDAConfig:
    steps: int = 2000
    batch: int = 32
    seq_len: int = 64
    max_rank: int = 2048
    pool: int = 4096  # plaintext output classes: the attacker corpus's most frequent tokens (+ "other")
    episodes: int = 64  # enciphered training documents, each with a fresh attacker-sampled permutation
    prior_tokens: int = 400_000
    lr: float = 1e-3
    width: int = 128
    depth: int = 2

    @classmethod
    def for_budget(cls, budget: Budget, **kw: Any) -> "SDAConfig":
        s = budget.scale
        cfg = cls(steps=max(80, int(3000 * s)), episodes=max(4, int(96 * s)),
                  prior_tokens=max(20_000, int(800_000 * s)))
        return cfg if not kw else SDAConfig(**{**cfg.__dict__, **kw})


def _pad_batch(items: list[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, pad_rank: int):
    b = len(items)
    rank = torch.full((b, seq_len), pad_rank, dtype=torch.long)
    rec = torch.zeros((b, seq_len), dtype=torch.long)
    y = torch.full((b, seq_len), -100, dtype=torch.long)
    for i, (r, c, t) in enumerate(items):
        n = len(r)
        rank[i, :n], rec[i, :n] = torch.as_tensor(r), torch.as_tensor(c)
        if t is not None:
            y[i, :n] = torch.as_tensor(t)
    return rank, rec, y, rank == pad_rank


def build_training_set(prior: np.ndarray, doc_tokens: int, doc_lengths: Sequence[int], cfg: SDAConfig,
                       vocab: int, pool_ids: np.ndarray, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Episodes: a random stretch of the prior of ``doc_tokens`` tokens, cut into prompts with the victim's length
    profile, enciphered with a fresh random permutation, rank-encoded over the episode; targets = pool classes."""
    rng = np.random.default_rng(seed)
    cls_of = np.full(vocab, len(pool_ids), dtype=np.int64)  # "other"
    cls_of[pool_ids] = np.arange(len(pool_ids))
    doc_tokens = min(doc_tokens, len(prior))
    out = []
    for _ in range(cfg.episodes):
        start = int(rng.integers(0, len(prior) - doc_tokens + 1))
        plain = prior[start:start + doc_tokens]
        perm = rng.permutation(vocab)  # the attacker's own substitution key for this episode
        seqs, pos = [], 0
        while pos < len(plain):
            n = int(rng.choice(doc_lengths))
            seqs.append(plain[pos:pos + n])
            pos += n
        enc = encode_cipher([perm[s] for s in seqs], cfg.max_rank, cfg.seq_len)
        targets = [cls_of[s[a:a + cfg.seq_len]] for s in seqs for a in range(0, len(s), cfg.seq_len)]
        out.extend((r, c, t) for (r, c), t in zip(enc, targets))
    return out


def train_decipherer(train: list, cfg: SDAConfig, n_out: int, seed: int) -> tuple[Decipherer, float]:
    gen = torch.Generator().manual_seed(seed)
    pad_rank = cfg.max_rank + 8
    model = built_from_seed(seed, lambda: Decipherer(pad_rank + 1, cfg.seq_len, n_out, cfg.width, cfg.depth))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    loss = torch.tensor(0.0)
    for _ in range(cfg.steps):
        rows = torch.randint(len(train), (cfg.batch,), generator=gen).tolist()
        rank, rec, y, pad = _pad_batch([train[i] for i in rows], cfg.seq_len, pad_rank)
        logits = model(rank, rec, pad)
        loss = F.cross_entropy(logits.reshape(-1, n_out), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model.eval(), float(loss.detach())


def decipher(model: Decipherer, observed: Sequence[Sequence[int]], cfg: SDAConfig,
             pool_ids: np.ndarray) -> list[list[int]]:
    """Plaintext guesses for the observed cipher sequences (-1 where the model says "other")."""
    pad_rank = cfg.max_rank + 8
    enc = encode_cipher(observed, cfg.max_rank, cfg.seq_len)
    lookup = np.concatenate([pool_ids, [-1]])
    flat: list[int] = []
    with torch.no_grad():
        for a in range(0, len(enc), 64):
            items = [(r, c, None) for r, c in enc[a:a + 64]]
            rank, rec, _, pad = _pad_batch(items, cfg.seq_len, pad_rank)
            pred = model(rank, rec, pad).argmax(-1).numpy()
            for i, (r, _) in enumerate(enc[a:a + 64]):
                flat.extend(lookup[pred[i, :len(r)]].tolist())
    out, pos = [], 0
    for s in observed:
        out.append(flat[pos:pos + len(s)])
        pos += len(s)
    return out


def sda_attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0,
               prior_ids: np.ndarray | None = None, prior_name: str | None = None,
               cfg: SDAConfig | None = None) -> AttackResult:
    """Train on the attacker's prior (token ids; default: public corpora via the public tokenizer), decipher the
    victim's observed id sequences, score against the truth."""
    cfg = cfg or SDAConfig.for_budget(budget)
    vocab = int(target.key.vocab_size) if target.key is not None else target.vocab_size
    if prior_ids is None:
        from ..corpora import corpus, tokenize_texts

        texts = corpus("fortunes") + corpus("debian-reference")
        order = np.random.default_rng(seed).permutation(len(texts))
        prior_ids = tokenize_texts(target.tokenizer, [texts[i] for i in order], max_tokens=cfg.prior_tokens)
        prior_name = prior_name or "fortunes + debian-reference (public text, nothing about the victim's prompts)"
    prior_ids = np.asarray(prior_ids, dtype=np.int64)[: cfg.prior_tokens]
    observed = data.observed(target)
    n_obs = sum(len(s) for s in observed)
    ids, counts = np.unique(prior_ids, return_counts=True)
    pool_ids = ids[np.argsort(-counts, kind="stable")][: cfg.pool]
    train = build_training_set(prior_ids, n_obs, [len(s) for s in observed], cfg, vocab, pool_ids, seed)
    model, final_loss = train_decipherer(train, cfg, len(pool_ids) + 1, seed)
    predicted = decipher(model, observed, cfg, pool_ids)
    metrics = score_predictions(target, data, predicted, text_metrics=has_tokenizer(target))
    in_pool = np.isin(np.concatenate([np.asarray(t) for t in data.plain_ids]), pool_ids)
    metrics["truth_in_pool"] = float(in_pool.mean())
    metrics["final_train_loss"] = final_loss
    n_params = sum(p.numel() for p in model.parameters())
    return AttackResult(
        "sda", metrics["ttrsr"], metrics["piirsr"], metrics,
        budget={"budget": budget.name, "steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                "episodes": cfg.episodes, "episode_tokens": int(min(n_obs, len(prior_ids))),
                "prior_tokens": int(len(prior_ids)), "prior": prior_name or "given ids",
                "observed_tokens": int(n_obs), "max_rank": cfg.max_rank,
                "model": f"{cfg.depth}-layer encoder, width {cfg.width}, {n_params} parameters",
                "candidate_pool": f"{len(pool_ids)} most frequent prior tokens + 'other' (full vocabulary {vocab})"},
        uses="the victim's observed obfuscated id sequences only (frequency ranks over all of them and in-window "
             "recurrence); attacker's public text enciphered with its own random permutations; public tokenizer")


def sda_setting_attack(target: AttackTarget, data: PrivateData, setting: str, budget: Budget, seed: int = 0,
                       cfg: SDAConfig | None = None, tokens: int | None = None,
                       perturb: Callable[[np.ndarray], np.ndarray] | None = None) -> AttackResult:
    """SDA in one of the paper's knowledge settings (as TFMA): the attacker trains on the setting's prior corpus
    and observes the client's whole traffic, its private corpus (the budget's stream size) followed by the PII
    prompts, cut into prompt-sized sequences; the prompts are scored. Much more ciphertext than the prompts
    alone, so frequency ranks carry signal. ``perturb``: the client's online token perturbation (see
    ``frequency_streams``)."""
    from .frequency import frequency_streams, observed_prompts

    prior, observed_stream, truth, info = frequency_streams(target, data, setting, budget, seed, tokens, perturb)
    n_prompt = info["prompt_tokens"]
    lengths = [len(s) for s in data.plain_ids]
    rng = np.random.default_rng(seed)
    traffic, pos, cut = [], 0, len(observed_stream) - n_prompt
    while pos < cut:  # the private corpus as prompts with the victim's length profile
        n = int(rng.choice(lengths))
        traffic.append(observed_stream[pos:min(pos + n, cut)])
        pos += n
    prompts_obf = [s.tolist() for s in observed_prompts(observed_stream, data)]
    cfg = cfg or SDAConfig.for_budget(budget)
    prior = np.asarray(prior, dtype=np.int64)[: cfg.prior_tokens]
    ids, counts = np.unique(prior, return_counts=True)
    pool_ids = ids[np.argsort(-counts, kind="stable")][: cfg.pool]
    vocab = int(target.key.vocab_size) if target.key is not None else target.vocab_size
    n_obs = int(len(observed_stream))
    train = build_training_set(prior, n_obs, lengths, cfg, vocab, pool_ids, seed)
    model, final_loss = train_decipherer(train, cfg, len(pool_ids) + 1, seed)
    # ranks are over everything observed: decipher the traffic and the prompts together
    predicted = decipher(model, traffic + prompts_obf, cfg, pool_ids)
    metrics = score_predictions(target, data, predicted[len(traffic):], text_metrics=has_tokenizer(target))
    private_guess = np.concatenate([np.asarray(p) for p in predicted[:len(traffic)]]) if traffic else np.array([])
    metrics["private_stream_recovery"] = float((private_guess == truth[:cut]).mean()) if cut else None
    metrics["truth_in_pool"] = float(np.isin(truth[cut:], pool_ids).mean())
    metrics["final_train_loss"] = final_loss
    n_params = sum(p.numel() for p in model.parameters())
    return AttackResult(
        f"sda-{setting}", metrics["ttrsr"], metrics["piirsr"], metrics,
        budget={**info, "budget": budget.name, "steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                "episodes": cfg.episodes, "episode_tokens": int(min(n_obs, len(prior))),
                "observed_tokens": n_obs, "max_rank": cfg.max_rank, "seed": seed,
                "model": f"{cfg.depth}-layer encoder, width {cfg.width}, {n_params} parameters",
                "candidate_pool": f"{len(pool_ids)} most frequent prior tokens + 'other' (full vocabulary {vocab})"},
        uses=f"obfuscated token ids of the client's traffic (its private corpus and the prompts: ranks and "
             f"recurrence only); a public prior corpus ({setting}) enciphered with the attacker's own permutations; "
             "public tokenizer; no weights")


def _register_sda_setting(setting: str) -> None:
    def attack(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
        return sda_setting_attack(target, data, setting, budget, seed)

    attack.__doc__ = f"SDA with the {setting} prior, deciphering the client's whole observed traffic."
    register(f"sda-{setting}")(attack)


for _setting in ("zero-knowledge", "domain-aware", "distribution-aware"):
    _register_sda_setting(_setting)


@register("sda")
def sda(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """SDA: transformer decipherer on frequency-rank/recurrence-encoded cipher ids, trained on self-enciphered
    public text."""
    return sda_attack(target, data, budget, seed)
