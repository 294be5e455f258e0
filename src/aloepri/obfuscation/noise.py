"""Sensitivity-shaped embedding/head noise (noise_shape="fisher"; docs/defences.md "Sensitivity-shaped noise").

The isotropic noise of the paper spends its energy equally in every direction of the d-dimensional embedding/head
space. The model reads some directions far more than others, so the same energy placed where the model is least
sensitive costs less accuracy. Here the noise of every vocabulary row is drawn from N(0, C) with

    C  proportional to  (S / mean_eig(S) + FISHER_RIDGE * I)^-1,    trace(C) = d   (times alpha * std(W) as usual)

where S is a d x d sensitivity matrix measured on the PUBLIC plaintext model and a PUBLIC corpus:
  embedding  S_e = E[g g^T], g = d(loss)/d(input embedding) at each position (empirical Fisher of a shared
             perturbation of the input embedding);
  head       S_h = E[z z^T], z = the final RMSNorm output: a head row perturbed by n changes that token's logit
             by z . n, so E[(z . n)^2] = n^T S_h n.
C is the same for every row and depends on public data only, so the shaping carries no information about the
vocabulary permutation (the attacker can compute C too; docs/defences.md discusses what that buys him).

The maths (``shaped_noise_factor``) is pure tensor-in/tensor-out; measuring S needs the public model and a
corpus, which live in higher layers: ``aloepri.runtime.sensitivity.fisher_noise_factors(src)`` computes the factors
that ``obfuscate(..., noise_factors=...)`` takes (the CLI does it for ``--noise-shape fisher``).
Measured and NOT recommended: at equal accuracy it helps weight matching's victims a little and the behavioural
attacker more (docs/defences.md).
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor

# Ridge on the normalised sensitivity spectrum: without it all the energy would go to the one least-read direction
# (where a second-order estimate from a finite corpus is least reliable). Measured choice: docs/defences.md.
FISHER_RIDGE = 0.01


def shaped_noise_factor(sensitivity: Tensor, ridge: float = FISHER_RIDGE) -> Tensor:
    """F (d, d) such that noise = z @ F.T (z ~ N(0, I)) has covariance F F^T = c (S/mean + ridge I)^-1 with
    trace d, i.e. the same total energy as unit isotropic noise. ``sensitivity`` is symmetric PSD (d, d)."""
    if sensitivity.ndim != 2 or sensitivity.shape[0] != sensitivity.shape[1]:
        raise ValueError(f"sensitivity must be a square matrix, got shape {tuple(sensitivity.shape)}")
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0, got {ridge}")
    s = sensitivity.to(torch.float64)
    eig, vec = torch.linalg.eigh((s + s.T) / 2)
    eig = eig.clamp_min(0)
    mean = float(eig.mean())
    if not mean > 0:
        raise ValueError("sensitivity matrix is zero: nothing to shape the noise by")
    weight = 1.0 / (eig / mean + ridge)
    weight = weight * (s.shape[0] / weight.sum())  # trace(F F^T) = d
    return vec * weight.sqrt()[None, :]


def noise_cost(sensitivity: Tensor, factor: Tensor | None) -> float:
    """E[n^T S n] for n = z @ F.T (F = None: unit isotropic noise): the second-order cost of the noise."""
    s = sensitivity.to(torch.float64)
    return float(torch.trace(s)) if factor is None else float(torch.trace(factor.T.to(torch.float64) @ s @ factor))
