"""RmDP privacy accounting of the paper's Theorem (Section "Security Analysis", proof in the appendix).

Exactly as stated there, with Rényi order alpha = 2 and n the vocabulary size:

    eps_e = alpha (lambda_1(W_e)^2 + lambda_2(W_e)^2) / (4 sigma_e^2)        (Gaussian noise on W_e)
    eps_h = alpha (lambda_1(W_h)^2 + lambda_2(W_h)^2) / (4 sigma_h^2)        (Gaussian noise on W_h)
    eps_2 = pi^2 (eps_e + eps_h)        offline phase: (2, eps_2, d^2)-RsmDP for the secret permutation tau,
                                        d = permutation metric (pi^2: geodesic -> transposition metric)
    eps   = eps_1 - eps_1^2 / (4 (n-1) eps_2)   if eps_1 <= 2 (n-1) eps_2      (online token perturbation
          = (n-1) eps_2                         otherwise                        M_1 of budget eps_1, composed)

lambda_1 >= lambda_2 are the two largest singular values of the *plaintext* W_e (n x d) and W_h (n x d), and
sigma is the std of the noise aloepri adds: sigma = alpha_e * std(W_e) (resp. alpha_h * std(W_h)), the
convention of aloepri.obfuscation.transforms. Without online perturbation (eps_1 = inf) the "otherwise" branch applies:
eps = (n-1) eps_2. With no noise (exact preset) eps_2 = inf and there is no guarantee beyond eps_1.

Read the numbers as the paper's bound, not as a measured attack success: they are worst-case divergences per
unit of the permutation metric and are huge for real vocabularies (n-1 ~ 5e4..1.5e5).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

RENYI_ORDER = 2.0


def top_two_singular_values(weight, chunk_rows: int = 16384) -> tuple[float, float]:
    """lambda_1 >= lambda_2 of an (n, d) matrix, from the eigenvalues of its d x d Gram matrix in float64."""
    w = torch.as_tensor(weight)
    if w.ndim != 2 or min(w.shape) < 2:
        raise ValueError(f"need a 2-D matrix with at least 2 rows and columns, got shape {tuple(w.shape)}")
    gram = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
    for start in range(0, w.shape[0], chunk_rows):
        c = w[start:start + chunk_rows].to(torch.float64)
        gram += c.T @ c
    ev = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    return float(ev[-1]), float(ev[-2])


def matrix_std(weight, chunk_rows: int = 16384) -> float:
    """Sample std over all entries (float64, chunked), the sigma convention of aloepri.obfuscation.transforms."""
    w = torch.as_tensor(weight)
    total = total_sq = 0.0
    for start in range(0, w.shape[0], chunk_rows):
        c = w[start:start + chunk_rows].to(torch.float64)
        total += float(c.sum())
        total_sq += float((c * c).sum())
    n = w.numel()
    return math.sqrt(max(total_sq - total * total / n, 0.0) / (n - 1))


def gaussian_epsilon(lambda_1: float, lambda_2: float, sigma: float, alpha: float = RENYI_ORDER) -> float:
    """eps = alpha (lambda_1^2 + lambda_2^2) / (4 sigma^2); inf without noise."""
    if lambda_1 < lambda_2 or lambda_2 < 0:
        raise ValueError("need lambda_1 >= lambda_2 >= 0")
    if sigma < 0:
        raise ValueError("sigma must be >= 0")
    if sigma == 0:
        return math.inf
    return alpha * (lambda_1 ** 2 + lambda_2 ** 2) / (4.0 * sigma ** 2)


def offline_epsilon(eps_e: float, eps_h: float) -> float:
    """eps_2 = pi^2 (eps_e + eps_h): the offline phase in the permutation metric (Corollary)."""
    return math.pi ** 2 * (eps_e + eps_h)


def composed_epsilon(eps_1: float, eps_2: float, n: int) -> float:
    """The paper's composition of token perturbation (eps_1) with the obfuscated model (eps_2), vocabulary n."""
    if n < 2:
        raise ValueError("vocabulary size n must be >= 2")
    if eps_1 < 0 or eps_2 < 0:
        raise ValueError("eps_1 and eps_2 must be >= 0")
    if math.isinf(eps_2):
        return eps_1  # no noise: the model adds nothing, only M_1 protects (limit of the first branch)
    if eps_1 <= 2 * (n - 1) * eps_2:
        return eps_1 - eps_1 ** 2 / (4 * (n - 1) * eps_2)
    return (n - 1) * eps_2


@dataclass
class PrivacyBudget:
    vocab_size: int
    alpha: float  # Rényi order
    lambda_e: tuple[float, float]
    lambda_h: tuple[float, float]
    sigma_e: float
    sigma_h: float
    eps_e: float
    eps_h: float
    eps_2: float  # offline phase, (2, eps_2, d^2)-RsmDP in the permutation metric
    eps_1: float  # online token perturbation budget (inf = none)
    eps: float  # composed (2, eps, d)-RmDP

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


# Differential-privacy bounds are usually read as meaningful up to an epsilon of about 10 (the bound on a
# likelihood ratio is then e^10 or so); far above that a bound constrains nothing an attacker does.
MEANINGFUL_EPS = 10.0


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def explain(b: PrivacyBudget, alpha_e: float, alpha_h: float) -> str:
    """The budget in words: each figure, what eps bounds, and whether the bound means anything."""
    online = ("none (no online token perturbation; --eps1 or --eps-tok with --tokens sets one)"
              if math.isinf(b.eps_1) else _num(b.eps_1))
    lines = [
        f"RmDP privacy budget (the AloePri paper's Theorem, Renyi order {b.alpha:g}), vocabulary n = {b.vocab_size}",
        f"  noise: alpha_e {alpha_e:g} (embedding), alpha_h {alpha_h:g} (head)",
        f"  eps_e = {_num(b.eps_e)}, eps_h = {_num(b.eps_h)}  (from the embedding and head noise)",
        f"  eps_2 = {_num(b.eps_2)}  (offline phase: the obfuscated weights, per unit of permutation distance)",
        f"  eps_1 = {online}",
        f"  eps   = {_num(b.eps)}  (composed)",
        "",
        "What eps means: it bounds how far the server's view can move (a Renyi divergence) between two secret "
        "vocabulary permutations one swap apart; smaller is more private. Such a bound is usually read as "
        f"meaningful up to about eps = {MEANINGFUL_EPS:g}.",
    ]
    if math.isinf(b.eps):
        verdict = ("eps is inf: without noise (and without token perturbation) the theorem gives no guarantee at "
                   "all.")
    elif b.eps > MEANINGFUL_EPS:
        verdict = (f"eps = {_num(b.eps)} is far above that: this setting has no meaningful differential-privacy "
                   "guarantee (the bound holds, but it rules out nothing an attacker can do).")
    else:
        verdict = f"eps = {_num(b.eps)} is within that range: a meaningful bound in the theorem's sense."
    lines += [verdict, "The bound is not a measured attack: `aloepri audit` measures what attacks actually recover. "
              "--json prints these figures as JSON."]
    return "\n".join(lines)


def budget_from_matrices(w_e, w_h, alpha_e: float, alpha_h: float, eps_1: float = math.inf,
                         alpha: float = RENYI_ORDER) -> PrivacyBudget:
    """The Theorem's numbers for plaintext W_e, W_h and aloepri's noise multipliers alpha_e, alpha_h."""
    if alpha_e < 0 or alpha_h < 0:
        raise ValueError("alpha_e and alpha_h must be >= 0")
    w_e, w_h = torch.as_tensor(np.asarray(w_e)) if isinstance(w_e, np.ndarray) else w_e, \
        torch.as_tensor(np.asarray(w_h)) if isinstance(w_h, np.ndarray) else w_h
    if w_e.shape[0] != w_h.shape[0]:
        raise ValueError(f"W_e has {w_e.shape[0]} rows but W_h {w_h.shape[0]}: not the same vocabulary")
    le, lh = top_two_singular_values(w_e), top_two_singular_values(w_h)
    se, sh = alpha_e * matrix_std(w_e), alpha_h * matrix_std(w_h)
    eps_e, eps_h = gaussian_epsilon(*le, se, alpha), gaussian_epsilon(*lh, sh, alpha)
    eps_2 = offline_epsilon(eps_e, eps_h)
    n = int(w_e.shape[0])
    return PrivacyBudget(n, alpha, le, lh, se, sh, eps_e, eps_h, eps_2, eps_1, composed_epsilon(eps_1, eps_2, n))


def load_vocab_matrices(src: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Plaintext W_e and W_h (W_h = W_e when tied) of a checkpoint directory or .gguf file."""
    from ..obfuscation.checkpoint import open_checkpoint

    ck = open_checkpoint(src)
    try:
        w_e = ck.get("embed", dtype=torch.float32)
        w_h = w_e if ck.tied_embeddings else ck.get("head", dtype=torch.float32)
        return w_e, w_h
    finally:
        ck.close()


def privacy_budget(src: str | Path, alpha_e: float, alpha_h: float, eps_1: float = math.inf) -> PrivacyBudget:
    w_e, w_h = load_vocab_matrices(src)
    return budget_from_matrices(w_e, w_h, alpha_e, alpha_h, eps_1)
