"""DP-Forward baseline (Du et al., "DP-Forward: Fine-tuning and Inference on Language Models with Differential
Privacy in Forward Pass", ACM CCS 2023): the client runs the embedding layer (and optionally the first decoder
layers), adds Gaussian noise to the resulting states, and sends the noisy matrix to the server.

Mechanism implemented here (token-level local DP, DP-Forward's TokLDP):
- every row (one token's state) is clipped to L2 norm ``clip_norm`` = C; replacing one token then moves the matrix
  by at most Delta = 2C in Frobenius norm;
- i.i.d. Gaussian noise N(0, sigma^2) on every entry, sigma from (eps, delta, Delta) by the *analytic* Gaussian
  mechanism of Balle & Wang (ICML 2018), the exact calibration (smallest sigma whose privacy profile meets delta).
  Du et al.'s analytic matrix-variate Gaussian mechanism (aMGM) allows non-identity row/column covariances; with
  identity covariances it is this mechanism. We use identity covariances (a simplification, stated in the docs).
At layer 0 the default C is the largest embedding-row norm, so clipping never changes an input and the guarantee
is exact.

``paper_setting``: the AloePri paper's appendix runs DP-Forward with the noise after the first decoder layer,
"sensitivity 1" and *no* normalisation of the hidden states (to keep Qwen accurate). Without clipping the real
sensitivity is unbounded, so that configuration has no DP guarantee; we reproduce it as stated and label it so.

Attacks (the server sees the noisy states and knows the mechanism and sigma):
- ``nn``: nearest plaintext state of a single token (at layer 0: the embedding table) to each noisy row,
  Euclidean, nothing fitted.
- ``ima``: the project's learned inversion (aloepri.attacks.ima.train_inversion_model, the paper's IMA
  after Kugler et al.): trained on the attacker's own public corpus passed through the same public mechanism
  with its own noise, then applied to the victim's noisy states.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from ..runtime.modules import ModelModules
from ..runtime.probe import batched_states, forward_hooks, layer_states, module_output
from .token_substitution import _check_eps, fresh_seed


# --- analytic Gaussian mechanism ---------------------------------------------------------------------------------


def gaussian_delta(eps: float, sigma: float, sensitivity: float) -> float:
    """Exact privacy profile of the Gaussian mechanism (Balle & Wang 2018, Theorem 8): the smallest delta with
    which N(f(x), sigma^2 I) is (eps, delta)-DP for an L2 sensitivity ``sensitivity``."""
    from scipy.special import log_ndtr, ndtr

    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    # e^eps * Phi(-a - b) in log space: e^eps overflows long before the product does
    return float(ndtr(a - b) - math.exp(eps + log_ndtr(-a - b)))


def analytic_gaussian_sigma(eps: float, delta: float, sensitivity: float = 1.0, tol: float = 1e-12) -> float:
    """Smallest sigma with ``gaussian_delta(eps, sigma, sensitivity) <= delta`` (bisection; delta is decreasing)."""
    eps = _check_eps(eps)
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if not sensitivity > 0:
        raise ValueError(f"sensitivity must be > 0, got {sensitivity}")
    lo, hi = 1e-12 * sensitivity, sensitivity
    while gaussian_delta(eps, hi, sensitivity) > delta:
        hi *= 2
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if gaussian_delta(eps, mid, sensitivity) <= delta else (mid, hi)
    return hi


def classical_gaussian_sigma(eps: float, delta: float, sensitivity: float = 1.0) -> float:
    """Dwork & Roth's sigma = Delta sqrt(2 ln(1.25/delta)) / eps (valid for eps < 1; an upper bound on the analytic)."""
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / eps


def clip_rows(states: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Scale every row (last dimension) down to L2 norm <= clip_norm."""
    norms = states.norm(dim=-1, keepdim=True)
    return states * (clip_norm / norms.clamp_min(1e-12)).clamp(max=1.0)


# --- the mechanism -----------------------------------------------------------------------------------------------


@dataclass
class DPForward:
    """Gaussian noise on the states after ``layer`` decoder layers (0 = embedding output)."""

    eps: float
    delta: float
    layer: int = 0
    clip_norm: float | None = None  # None: no clipping (paper_setting only; no DP guarantee)
    sensitivity: float = 1.0
    name = "dp-forward"

    def __post_init__(self):
        self.eps = _check_eps(self.eps)
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")
        self.sigma = analytic_gaussian_sigma(self.eps, self.delta, self.sensitivity)

    @classmethod
    def tok_ldp(cls, model, eps: float, delta: float = 1e-5, layer: int = 0,
                clip_norm: float | None = None) -> "DPForward":
        """Token-level LDP: rows clipped to C, sensitivity 2C. Default C at layer 0: the largest embedding-row norm
        (clipping is then the identity); deeper layers need an explicit C."""
        if clip_norm is None:
            if layer != 0:
                raise ValueError("a layer > 0 needs an explicit clip_norm (row norms there are input-dependent)")
            clip_norm = float(model.get_input_embeddings().weight.detach().float().norm(dim=1).max())
        return cls(eps, delta, layer, float(clip_norm), 2.0 * float(clip_norm))

    @classmethod
    def paper_setting(cls, eps: float = 5.0, delta: float = 1e-5, layer: int = 1) -> "DPForward":
        """The AloePri paper's configuration: sensitivity 1, states not clipped (no DP guarantee)."""
        return cls(eps, delta, layer, None, 1.0)

    @property
    def guarantee(self) -> str:
        if self.clip_norm is None:
            return "none (states not clipped: the sensitivity of 1 is assumed, not enforced)"
        return f"({self.eps:g}, {self.delta:g})-DP per token (TokLDP, rows clipped to {self.clip_norm:.4g})"

    def privatize(self, states: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Clip (if configured) and add the calibrated noise; pure, shape-preserving."""
        x = states if self.clip_norm is None else clip_rows(states, self.clip_norm)
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.dtype)
        return x + self.sigma * noise

    def describe(self) -> dict:
        return {"method": self.name, "eps": self.eps, "delta": self.delta, "layer": self.layer,
                "clip_norm": self.clip_norm, "sensitivity": self.sensitivity, "sigma": self.sigma,
                "calibration": "analytic Gaussian (Balle & Wang 2018), i.i.d. entries", "guarantee": self.guarantee}


@contextmanager
def noisy_prefill(model, mech: DPForward, seed: int | None = None) -> Iterator[dict]:
    """Within the block, every forward pass over more than one position (a prompt: prefill) has its states after
    ``mech.layer`` layers privatised; single-position decode steps (tokens the server generated itself) are left
    alone. Numerically this is the split deployment: the client runs layers < mech.layer on the prompt and
    sends noisy states; the server continues. Yields a dict counting the privatised calls."""
    g = torch.Generator().manual_seed(fresh_seed() if seed is None else int(seed))
    stats = {"calls": 0}

    def privatize(_name, out):
        h = module_output(out)
        if h.shape[-2] <= 1:
            return None
        stats["calls"] += 1
        noisy = mech.privatize(h, g)
        return (noisy, *out[1:]) if isinstance(out, tuple) else noisy

    with forward_hooks([("state", ModelModules(model).state_module(mech.layer))], privatize):
        yield stats


@torch.no_grad()
def observed_states(model, mech: DPForward, ids_list: list[list[int]], seed: int | None = None
                    ) -> list[torch.Tensor]:
    """What the server receives for each prompt: (n, d) noisy states after ``mech.layer`` layers."""
    g = torch.Generator().manual_seed(fresh_seed() if seed is None else int(seed))
    return [mech.privatize(layer_states(model, mech.layer, input_ids=torch.tensor([ids])).float()[0], g)
            for ids in ids_list]


# --- attacks -----------------------------------------------------------------------------------------------------


@torch.no_grad()
def nn_inversion(noisy: list[torch.Tensor], table: torch.Tensor, block: int = 256) -> list[list[int]]:
    """Nearest row of ``table`` (Euclidean) to each noisy state."""
    out = []
    for x in noisy:
        out.append(torch.cat([torch.cdist(x[i:i + block], table).argmin(1) for i in range(0, len(x), block)])
                   .tolist())
    return out


def ima_inversion(model, mech: DPForward, noisy: list[torch.Tensor], train_stream, cfg, seed: int
                  ) -> tuple[list[list[int]], dict]:
    """The project's IMA (aloepri.attacks.ima) trained on the attacker's corpus privatised by the same
    public mechanism with the attacker's own noise; returns per-position guesses and training facts."""
    import torch.nn.functional as F

    from ..attacks.ima import train_inversion_model

    n_chunks = len(train_stream) // cfg.seq_len
    if n_chunks < 2:
        raise ValueError(f"attacker corpus too small: {len(train_stream)} tokens for seq_len {cfg.seq_len}")
    chunks = torch.as_tensor(train_stream[: n_chunks * cfg.seq_len].reshape(n_chunks, cfg.seq_len), dtype=torch.long)
    clean = batched_states(model, mech.layer, chunks)
    g = torch.Generator().manual_seed(int(seed) + 1)
    views = [mech.privatize(clean, g) for _ in range(max(1, cfg.keys))]  # fresh noise draws, like fresh keys
    plain_emb = model.get_input_embeddings().weight.detach()
    inv, final_loss = train_inversion_model(views, chunks, plain_emb, cfg, seed)
    table = F.normalize(plain_emb.float(), dim=-1)
    with torch.no_grad():
        guesses = [(F.normalize(inv(x.unsqueeze(0))[0], dim=-1) @ table.T).argmax(-1).tolist() for x in noisy]
    n_params = sum(p.numel() for p in inv.parameters())
    return guesses, {"final_train_loss": final_loss, "steps": cfg.steps, "train_tokens": int(n_chunks * cfg.seq_len),
                     "noise_draws": len(views), "model": f"{cfg.depth}-layer encoder, width {cfg.width}, "
                                                          f"{n_params} parameters"}
