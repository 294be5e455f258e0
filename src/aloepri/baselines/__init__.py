"""The paper's Table 1 baselines in aloepri's harness: SANTEXT, SANTEXT+, RANTEXT, DP-Forward and SGT.

Mechanisms (pure, seeded with a torch.Generator) live in token_substitution.py, dp_forward.py and sgt.py (SGT's
noise generator is trained first, seeded); harness.py runs them through the same PII prompts, attacks, fidelity
numbers and HumanEval code as aloepri itself; cli.py is ``aloepri baseline``. Definitions, simplifications and measured numbers: docs/baselines.md.
"""
from .dp_forward import (DPForward, analytic_gaussian_sigma, classical_gaussian_sigma, clip_rows, gaussian_delta,
                         noisy_prefill)
from .sgt import SGT, SGTConfig, train_sgt
from .token_substitution import RanText, SanText, SanTextPlus, TokenSubstitution

__all__ = ["DPForward", "RanText", "SGT", "SGTConfig", "SanText", "SanTextPlus", "TokenSubstitution",
           "analytic_gaussian_sigma", "classical_gaussian_sigma", "clip_rows", "gaussian_delta", "noisy_prefill",
           "train_sgt"]
