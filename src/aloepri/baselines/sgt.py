"""SGT, the Stained Glass Transform (Roberts et al., 2025, "Learning ..." -- the AloePri paper's fourth Table 1
baseline, which the paper re-implemented because no code was released), reduced to what 2 CPU cores can train.

Mechanism: a small learned *noise generator* reads the client's input embeddings x (n, d) and outputs, per token,
a mean shift mu(x) and a diagonal standard deviation sigma(x); the client sends
    x' = x + mu(x) + sigma(x) * z,   z ~ N(0, I) drawn fresh per request,
and the server runs the unmodified model on x' (``inputs_embeds``). Numerically that is a forward hook on the
embedding layer, so the DP-Forward plumbing (``noisy_prefill``, ``observed_states``, NN and IMA inversions) applies
unchanged: an SGT has ``layer = 0`` and ``privatize(states, generator)``.

Training (``train_sgt``), the paper's four losses with its coefficients (1.0 / 3e-5 / 30 / 1.0):
- utility: KL(p_clean || p_noisy) of the frozen model's next-token distribution, mean per position;
- mutual information: an upper-bound proxy, the Gaussian channel's negative noise entropy relative to the
  embedding scale, sum over dimensions of -log(sigma / s) (s: the embedding table's entry std), mean per position;
  minimising it raises every coordinate's noise (Roberts et al. estimate the MI itself; see docs/baselines.md);
- absolute cosine: mean |cos(x, x')|, pushes the sent vector away from the clean direction;
- normalisation: mean ((||x'|| - ||x||) / ||x||)^2, keeps the sent norms where the model expects them.
The generator is a projection to ``width``, ``depth`` bidirectional transformer-encoder layers and two heads
(the paper: a 1.6B-parameter 2-layer Qwen2-architecture model; here tens of thousands of parameters).
Everything is seeded; ``save``/``load`` keep the trained parameters (a small file) with the training facts.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


# The AloePri paper's appendix: accuracy, MI, absolute-cosine and normalisation loss coefficients.
PAPER_COEFFICIENTS = (1.0, 3e-5, 30.0, 1.0)


@dataclass(frozen=True)
class SGTConfig:
    """Generator shape and training recipe (everything that decides the trained parameters)."""

    width: int = 32
    depth: int = 1
    heads: int = 4
    init_log_std: float = math.log(0.5)  # initial sigma, in units of the embedding entry std
    steps: int = 200
    batch: int = 4
    seq_len: int = 64
    lr: float = 3e-4  # the paper's learning rate
    coefficients: tuple[float, float, float, float] = PAPER_COEFFICIENTS  # utility, MI, |cos|, norm
    seed: int = 0

    def __post_init__(self):
        for name in ("width", "depth", "heads", "steps", "batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if len(self.coefficients) != 4 or any(c < 0 for c in self.coefficients):
            raise ValueError(f"coefficients must be 4 non-negative numbers, got {self.coefficients}")

    def digest(self) -> str:
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:12]


class NoiseGenerator(nn.Module):
    """(…, n, d) embeddings -> (mean shift, std), both (…, n, d), in the embedding's own units."""

    def __init__(self, d: int, scale: float, cfg: SGTConfig):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))
        self.inp = nn.Linear(d, cfg.width)
        layer = nn.TransformerEncoderLayer(cfg.width, cfg.heads, 2 * cfg.width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False)
        self.mean = nn.Linear(cfg.width, d)
        self.log_std = nn.Linear(cfg.width, d)
        nn.init.zeros_(self.mean.weight)  # start as plain isotropic noise: no shift
        nn.init.zeros_(self.mean.bias)
        nn.init.zeros_(self.log_std.weight)
        nn.init.constant_(self.log_std.bias, cfg.init_log_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        squeeze = x.dim() == 2
        h = self.body(self.inp((x.unsqueeze(0) if squeeze else x) / self.scale))
        mean, std = self.mean(h) * self.scale, self.log_std(h).clamp(-12, 6).exp() * self.scale
        return (mean[0], std[0]) if squeeze else (mean, std)


@dataclass
class SGT:
    """The trained mechanism in the baselines' interface (``layer``, ``privatize``, ``describe``)."""

    generator: NoiseGenerator
    config: SGTConfig
    facts: dict[str, Any] = field(default_factory=dict)
    layer = 0
    name = "sgt"

    def transform(self, states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """x + mu(x) + sigma(x) * z; differentiable in the generator's parameters (training)."""
        mean, std = self.generator(states.float())
        z = torch.randn(states.shape, generator=generator, dtype=torch.float32)
        return states.float() + mean + std * z

    @torch.no_grad()
    def privatize(self, states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.transform(states, generator).to(states.dtype)

    def describe(self) -> dict:
        n_params = sum(p.numel() for p in self.generator.parameters())
        return {"method": self.name, "eps": None, "layer": 0, "generator_parameters": n_params,
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.config).items()},
                "training": self.facts, "guarantee": "none (a learned obfuscation; no formal privacy bound)"}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"config": asdict(self.config), "d": int(self.generator.inp.in_features),
                    "state_dict": self.generator.state_dict(), "facts": self.facts}, tmp)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, model=None) -> "SGT":
        """Trained parameters from ``save``; with ``model``, refuse a generator built for another embedding width."""
        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
        cfg = blob["config"]
        cfg = SGTConfig(**{**cfg, "coefficients": tuple(cfg["coefficients"])})
        if model is not None:
            d = int(model.get_input_embeddings().weight.shape[1])
            if d != blob["d"]:
                raise ValueError(f"{path}: SGT generator for embedding width {blob['d']}, the model has {d}")
        gen = NoiseGenerator(blob["d"], 1.0, cfg)
        gen.load_state_dict(blob["state_dict"])
        return cls(gen.eval(), cfg, blob.get("facts", {}))


def embedding_scale(model) -> float:
    """Std of the input-embedding table's entries: the unit of the generator's outputs and of the MI proxy."""
    return float(model.get_input_embeddings().weight.detach().float().std())


def sgt_losses(model, mech: SGT, ids: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The four training losses (unweighted) on a batch of token ids (batch, n)."""
    emb = model.get_input_embeddings()
    with torch.no_grad():
        clean = emb(ids).float()
        clean_logp = F.log_softmax(model(inputs_embeds=clean).logits.float(), -1)
    mean, std = mech.generator(clean)
    z = torch.randn(clean.shape, generator=generator, dtype=torch.float32)
    noisy = clean + mean + std * z
    noisy_logp = F.log_softmax(model(inputs_embeds=noisy).logits.float(), -1)
    utility = F.kl_div(noisy_logp, clean_logp, log_target=True, reduction="none").sum(-1).mean()
    mi = (-torch.log(std / mech.generator.scale)).sum(-1).mean()
    cos = F.cosine_similarity(noisy, clean, dim=-1).abs().mean()
    clean_norm = clean.norm(dim=-1).clamp_min(1e-12)
    norm = (((noisy.norm(dim=-1) - clean_norm) / clean_norm) ** 2).mean()
    return {"utility": utility, "mi": mi, "abs_cos": cos, "norm": norm}


def train_sgt(model, stream, cfg: SGTConfig, log_every: int = 0) -> SGT:
    """Train a noise generator for the frozen ``model`` on the token stream (1-D ids: public text), seeded by
    ``cfg.seed``. Returns the mechanism with training facts (loss at the start and end, seconds)."""
    stream = torch.as_tensor(stream, dtype=torch.long).flatten()
    n_chunks = len(stream) // cfg.seq_len
    if n_chunks < cfg.batch:
        raise ValueError(f"training text too small: {len(stream)} tokens for {cfg.batch} x {cfg.seq_len}")
    chunks = stream[: n_chunks * cfg.seq_len].view(n_chunks, cfg.seq_len)
    torch.manual_seed(cfg.seed)  # generator initialisation
    d = int(model.get_input_embeddings().weight.shape[1])
    mech = SGT(NoiseGenerator(d, embedding_scale(model), cfg), cfg)
    frozen = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(mech.generator.parameters(), lr=cfg.lr, weight_decay=0.0)
    data_gen = torch.Generator().manual_seed(cfg.seed + 1)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 2)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    mech.generator.train()
    try:
        for step in range(cfg.steps):
            batch = chunks[torch.randint(0, n_chunks, (cfg.batch,), generator=data_gen)]
            parts = sgt_losses(model, mech, batch, noise_gen)
            total = sum(c * parts[k] for c, k in zip(cfg.coefficients, ("utility", "mi", "abs_cos", "norm")))
            opt.zero_grad()
            total.backward()
            opt.step()
            history.append({"total": total.item(), **{k: v.item() for k, v in parts.items()}})
            if log_every and (step % log_every == 0 or step == cfg.steps - 1):
                print(f"sgt step {step}: " + " ".join(f"{k} {v:.4g}" for k, v in history[-1].items()), flush=True)
    finally:
        for p, f in zip(model.parameters(), frozen):
            p.requires_grad_(f)
    mech.generator.eval()
    window = max(1, min(20, cfg.steps // 5))  # losses are noisy per batch: compare window means

    def mean_of(rows):
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}

    mech.facts = {"steps": cfg.steps, "train_tokens_seen": cfg.steps * cfg.batch * cfg.seq_len,
                  "chunks_available": n_chunks, "seconds": time.perf_counter() - t0,
                  "loss_first": mean_of(history[:window]), "loss_last": mean_of(history[-window:]),
                  "loss_window": window, "config_digest": cfg.digest()}
    return mech


def train_stream(tokenizer, n_tokens: int, seed: int, vocab: int):
    """Public training text for the generator, (ids, provenance): the ``python-docs`` corpus (aloepri.corpora;
    disjoint from the IMA attacker's fortunes + debian-reference and from the victim's PII prompts); without it the
    attacker's corpus, and without a tokenizer (tiny test models) Zipf-distributed random ids."""
    from types import SimpleNamespace

    import numpy as np

    from ..attacks.ima import attacker_token_stream

    if tokenizer is not None:
        from ..corpora import CorpusNotInstalledError, corpus, tokenize_texts

        try:
            texts = corpus("python-docs")
        except CorpusNotInstalledError:
            texts = []
        if texts:
            order = np.random.default_rng(seed).permutation(len(texts))
            return (tokenize_texts(tokenizer, [texts[i] for i in order], max_tokens=n_tokens),
                    "python-docs (aloepri.corpora.corpus)")
    return attacker_token_stream(SimpleNamespace(tokenizer=tokenizer), n_tokens, seed, vocab)


__all__ = ["NoiseGenerator", "PAPER_COEFFICIENTS", "SGT", "SGTConfig", "embedding_scale", "sgt_losses", "train_sgt",
           "train_stream"]
