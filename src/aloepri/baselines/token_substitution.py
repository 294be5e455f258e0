"""Token-substitution baselines of the paper's Table 1: SANTEXT, SANTEXT+ and RANTEXT.

The client replaces each private token x by a token y drawn from a distribution that favours tokens whose
embedding is close to x's, and sends the resulting *plaintext* to the server. The attacker reads it directly, so
every token that survives (y == x) is exposed; that is the paper's TTRSR "(Direct obs.)" for these methods.

Embedding: the served model's own input-embedding rows (``model.get_input_embeddings().weight``), raw (not
normalised, as SANTEXT uses raw word vectors) unless ``normalize=True``. Distances are Euclidean. Because the
distance scale is the embedding's, an epsilon does not transfer between models (docs/baselines.md).

SANTEXT (Yue et al., "Differential Privacy for Text Analytics via Natural Text Sanitization", Findings of ACL
2021): p(y | x) proportional to exp(-eps/2 * d(x, y)) over the whole vocabulary. By the triangle inequality
|d(x, y) - d(x', y)| <= d(x, x'), and the normaliser moves by the same factor, so for every output y
p(y | x) / p(y | x') <= exp(eps * d(x, x')): eps * d-metric local DP (tests/baselines/test_baselines.py checks the
bound on the computed distributions).

SANTEXT+ (same paper): a sensitive-token set V_S (Yue et al.: the rarest w fraction of words) is always
sanitised; every other token is kept with probability 1 - p and sanitised with probability p, by the same
exponential mechanism over the whole vocabulary. (Written from memory of the paper: whether SANTEXT+ restricts
the outputs to the non-sensitive set is not reproduced here; see docs/baselines.md.)

RANTEXT (Tong et al., "InferDPT: Privacy-preserving Inference for Black-box Large Language Models", arXiv
2310.12214, 2023; IEEE TDSC 2025), written from memory of the paper, with these choices stated:
  1. random adjacency list: the client adds Laplace noise eta (i.i.d. per coordinate, scale Delta_phi / eps with
     Delta_phi the widest per-coordinate range of the embedding table) to e_x; the candidate set is every token
     at least as close to e_x as the noisy point: C(x) = {y : d(e_x, e_y) <= ||eta||}. x itself is always in C(x).
  2. exponential mechanism inside C(x) on the utility u(x, y) = -d(e_x, e_y) / max_z d(e_x, e_z) (range 1):
     p(y | x, C) proportional to exp(eps * u(x, y) / 2).
The candidate set depends on x, so the per-set bound of step 2 is not by itself a DP guarantee for the whole
mechanism; the test checks step 2's bound for a fixed set and step 1's threshold law, not InferDPT's theorem.

Randomness: a torch.Generator. Callers pass a seed only for reproducible experiments; ``fresh_seed()`` draws one
from the OS CSPRNG otherwise.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch


def fresh_seed() -> int:
    return secrets.randbits(63)


def _check_eps(eps: float) -> float:
    eps = float(eps)
    if not eps > 0 or eps != eps or eps == float("inf"):
        raise ValueError(f"eps must be a positive finite number, got {eps}")
    return eps


def embedding_table(model_or_matrix, normalize: bool = False) -> torch.Tensor:
    """(vocab, d) float32 input-embedding rows of a model (or a matrix given directly), optionally unit-norm."""
    emb = model_or_matrix.get_input_embeddings().weight if hasattr(model_or_matrix, "get_input_embeddings") \
        else torch.as_tensor(model_or_matrix)
    emb = emb.detach().to(torch.float32)
    return emb / emb.norm(dim=-1, keepdim=True).clamp_min(1e-12) if normalize else emb


def distances_from(emb: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(len(tokens), vocab) Euclidean distances of the tokens' rows to every row (exact zero on the diagonal)."""
    d = torch.cdist(emb[tokens], emb)
    d[torch.arange(len(tokens)), tokens] = 0.0  # cdist's matmul path leaves ~1e-3 on the diagonal
    return d


@dataclass
class TokenSubstitution:
    """Shared driver: an embedding table and a budget, per-token output distributions (``distributions``) and
    sampling at given positions."""

    emb: torch.Tensor
    eps: float
    normalize: bool = False
    name = "token-substitution"

    def __post_init__(self):
        self.eps = _check_eps(self.eps)

    @classmethod
    def from_model(cls, model, eps: float, normalize: bool = False, **kw):
        return cls(embedding_table(model, normalize), eps, normalize, **kw)

    def _description(self) -> dict:
        return {"method": self.name, "eps": self.eps, "distance": "euclidean",
                "embedding": "model input embedding" + (" (unit-normalised)" if self.normalize else " (raw rows)")}

    def distributions(self, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def perturb(self, ids: Sequence[int], positions: Sequence[int] | None = None, seed: int | None = None,
                block: int = 64) -> list[int]:
        """``ids`` with the tokens at ``positions`` (default all) replaced by draws of the mechanism."""
        g = torch.Generator().manual_seed(fresh_seed() if seed is None else int(seed))
        out = list(int(i) for i in ids)
        pos = list(range(len(out)) if positions is None else positions)
        for start in range(0, len(pos), block):  # blocks bound the (block, vocab) distance matrix
            chunk = pos[start:start + block]
            if not chunk:
                continue
            probs = self.distributions(torch.tensor([out[i] for i in chunk]), g)
            draws = torch.multinomial(probs, 1, generator=g)[:, 0].tolist()
            for i, y in zip(chunk, draws):
                out[i] = int(y)
        return out

    def describe(self) -> dict:
        raise NotImplementedError


@dataclass
class SanText(TokenSubstitution):
    """SANTEXT: p(y | x) proportional to exp(-eps/2 * ||e_x - e_y||) over the whole vocabulary."""

    name = "santext"

    def log_weights(self, tokens: torch.Tensor) -> torch.Tensor:
        return -0.5 * self.eps * distances_from(self.emb, tokens)

    def distributions(self, tokens: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.softmax(self.log_weights(tokens), dim=1)

    def describe(self) -> dict:
        return {**self._description(), "candidates": "whole vocabulary"}


@dataclass
class SanTextPlus(SanText):
    """SANTEXT+: sensitive tokens always sanitised; the others kept with probability 1 - p."""

    sensitive: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # (vocab,) bool
    p: float = 0.3
    name = "santext+"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must lie in [0, 1], got {self.p}")
        if self.sensitive.shape != (self.emb.shape[0],):
            raise ValueError(f"sensitive mask must have shape ({self.emb.shape[0]},), got {tuple(self.sensitive.shape)}")

    @staticmethod
    def rarest(counts: torch.Tensor, w: float = 0.9) -> torch.Tensor:
        """Sensitive set of Yue et al.: the w fraction of the vocabulary with the lowest corpus counts."""
        order = torch.argsort(torch.as_tensor(counts, dtype=torch.float64), stable=True)
        mask = torch.zeros(len(order), dtype=torch.bool)
        mask[order[: int(round(w * len(order)))]] = True
        return mask

    def distributions(self, tokens: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        em = super().distributions(tokens)
        keep = torch.zeros_like(em)
        keep[torch.arange(len(tokens)), tokens] = 1.0
        p_sanitise = torch.where(self.sensitive[tokens], 1.0, self.p).unsqueeze(1)
        return p_sanitise * em + (1 - p_sanitise) * keep

    def describe(self) -> dict:
        return {**super().describe(), "method": self.name, "p": self.p,
                "sensitive_fraction": float(self.sensitive.float().mean())}


@dataclass
class RanText(TokenSubstitution):
    """RANTEXT: exponential mechanism inside a random adjacency list (see the module docstring)."""

    name = "rantext"

    def __post_init__(self):
        super().__post_init__()
        self.coord_range = float((self.emb.max(0).values - self.emb.min(0).values).max())

    @property
    def laplace_scale(self) -> float:
        return self.coord_range / self.eps

    def thresholds(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """||eta|| for n independent Laplace vectors (the adjacency radius of n tokens)."""
        u = torch.rand(n, self.emb.shape[1], generator=generator, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)
        eta = self.laplace_scale * torch.where(u < 0.5, torch.log(2 * u), -torch.log(2 * (1 - u)))
        return eta.norm(dim=1).to(torch.float32)

    def within_set(self, d: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
        """Exponential mechanism over the members: p proportional to exp(-eps/2 * d / max d)."""
        util = -d / d.max(dim=1, keepdim=True).values.clamp_min(1e-12)
        logits = (0.5 * self.eps * util).masked_fill(~member, float("-inf"))
        return torch.softmax(logits, dim=1)

    def distributions(self, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        d = distances_from(self.emb, tokens)
        member = d <= self.thresholds(len(tokens), generator).unsqueeze(1)
        member[torch.arange(len(tokens)), tokens] = True
        return self.within_set(d, member)

    def describe(self) -> dict:
        return {**self._description(), "adjacency": f"d <= ||Laplace(scale {self.laplace_scale:.4g})^d||",
                "within_set": "exp(-eps/2 * d / max d)"}
