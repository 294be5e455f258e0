"""Obfuscation parameters and named presets.

Every secret is derived from ``seed``; every knob below can be overridden from the API or the CLI.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ObfuscationParams:
    """Knobs of the AloePri obfuscation (paper notation in brackets).

    alpha_e, alpha_h   embedding / head noise multipliers [alpha_e, alpha_h]; noise std = alpha * std(W)
    lam                key-matrix coefficient [lambda]: B = U + lam * V (0 keeps B orthogonal)
    h                  expansion size [h]: the hidden width becomes d + 2h (rounded up so heads divide it)
    beta, gamma        RoPE block-permutation window and sampling sharpness [beta, gamma]; beta <= 1 disables
    c_scale            energy of the null-space block C relative to E (the paper leaves it open; 0 = no C)
    e_scale            multiplier on the paper's low-rank E (0 = no E; 1 = Algorithm 1 as written)
    shared_c           one C for every residual writer (True) or a fresh C per writer (the paper's literal
                       reading; it breaks RMSNorm on the attention-sink token, see docs/design.md)
    kappa_mode         how the constant RMSNorm weight is chosen: "isotropic" (closed form for Gaussian x)
                       or "embedding" (averaged over the model's own embedding rows)
    qk_scale_range     H_qk entries are log-uniform in [1/r, r]
    ffn_scale_range    H_ffn entries are log-uniform in [1/r, r]
    vo_mixing          U_vo per kv group: "conditioned" (orthogonal x log-uniform diagonal x orthogonal, condition
                       number <= vo_scale_range^2) or "gaussian" (the paper's N(0, 1/d_head): condition numbers in
                       the thousands, which breaks fp16/bf16/8-bit serving, see docs/design.md)
    vo_scale_range     singular values of a conditioned U_vo are log-uniform in [1/r, r]
    head_permutation   sample tau_kv and tau_group (exact, always on unless disabled for debugging)
    noise_shape        embedding/head noise: "isotropic" (the paper: alpha * std(W) everywhere), "column" (each
                       dimension's noise follows that column's own std) or "row" (each token's noise scaled by its
                       row norm over the mean) or "fisher" (covariance ~ inverse sensitivity of the public model on
                       a public corpus, obfuscation/noise.py); same total noise energy (docs/accuracy.md,
                       docs/defences.md measure them)
    router_normalize   MoE: scale every expert's router vector to unit norm before permuting (the paper's text).
                       It changes which experts are chosen (docs/moe-mla.md), so it is off: the exact variant
    outlier_dims       residual dimensions (the massive-activation ones, found from the public weights: largest
                       down_proj rows) that the key maps to one signed coordinate each at a random place instead of
                       mixing them into all, their RMSNorm weights left on the server's norm: keeps bf16 and
                       8-bit rounding of the residual stream as in plaintext (docs/serving.md, bf16; docs/
                       serving-gguf.md). The server then sees those few coordinates' values and norm weights, a
                       known property of the public model (docs/security.md, "Outlier dimensions"). 0 = mix all
    outlier_rms        the presets' rule instead of a count: keep every residual dimension whose RMS, measured on
                       the public model (obfuscation/residual.py: a fixed public input, every layer's output, every
                       position), is at least outlier_rms times the median dimension's (at most MAX_OUTLIER_DIMS,
                       the largest). For a model above 16 GiB in bfloat16, or an FP8 release, the 4 largest
                       feed-forward output rows instead. 0 = off; set either this or outlier_dims
    """

    alpha_e: float = 0.0
    alpha_h: float = 0.0
    lam: float = 0.0
    h: int = 128
    beta: int = 1
    gamma: float = 1e3
    c_scale: float = 0.0
    e_scale: float = 0.0
    shared_c: bool = True
    kappa_mode: str = "isotropic"
    qk_scale_range: float = 2.0
    ffn_scale_range: float = 2.0
    vo_mixing: str = "conditioned"
    vo_scale_range: float = 2.0
    head_permutation: bool = True
    router_normalize: bool = False
    noise_shape: str = "isotropic"
    outlier_dims: int = 0
    outlier_rms: float = 0.0

    def __post_init__(self) -> None:
        problems = [_field_type_problem(f.name, f.type, getattr(self, f.name)) for f in fields(self)]
        problems = [p for p in problems if p]
        if not problems:  # ranges only once every value has its type (NaN and inf were refused above)
            problems = _range_problems(self)
        if problems:
            raise ValueError("invalid obfuscation parameters: " + "; ".join(problems))
        for f in fields(self):  # numpy scalars and ints given for float knobs are stored as plain Python values
            if f.type in ("float", "int"):
                object.__setattr__(self, f.name, (float if f.type == "float" else int)(getattr(self, f.name)))

    @property
    def needs_noise_factors(self) -> bool:
        """Sensitivity-shaped noise is drawn: obfuscate() then needs ``noise_factors`` from the public model."""
        return self.noise_shape == "fisher" and (self.alpha_e > 0 or self.alpha_h > 0)

    @property
    def is_exact(self) -> bool:
        """True when the obfuscated model reproduces plaintext logits up to float rounding."""
        return (
            self.alpha_e == 0
            and self.alpha_h == 0
            and self.lam == 0
            and self.beta == 1
            and self.c_scale == 0
            and self.e_scale == 0
            and not self.router_normalize
        )

    def replace(self, **overrides: Any) -> "ObfuscationParams":
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; known: {[f.name for f in fields(self)]}")
        # outlier_dims and outlier_rms are two rules for the kept dimensions: giving one replaces the other
        # (`default` with outlier_dims=8 keeps the weights' top 8; with outlier_dims=0 it mixes every dimension)
        for given, other in (("outlier_dims", "outlier_rms"), ("outlier_rms", "outlier_dims")):
            if given in overrides and other not in overrides:
                overrides = {**overrides, other: 0}
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ObfuscationParams":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)} in preset/key; known: {sorted(known)}")
        return cls(**data)


# Upper bounds that are far beyond any useful setting but keep the arithmetic finite (exp(gamma * ...) in the
# block permutation, r**2 condition numbers) and refuse an expansion whose key matrices cannot fit in memory.
MAX_H = 1 << 15
MAX_SCALE_RANGE = 1e3
MAX_GAMMA = 1e6
MAX_NOISE = 1e3
MAX_OUTLIER_DIMS = 64  # a handful is what massive activations need; more would expose a real share of the state
_CHOICES = {"kappa_mode": ("isotropic", "embedding"), "noise_shape": ("isotropic", "column", "row", "fisher"),
            "vo_mixing": ("conditioned", "gaussian")}


def finite_number(name: str, value: Any, minimum: float | None = None, exclusive: bool = False,
                  maximum: float | None = None) -> float:
    """``value`` as a float if it is a real, finite number within the bounds; ValueError naming ``name`` if not.

    The single check used for every float parameter (dataclass, CLI-only options such as --max-shard-gb)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (x <= minimum if exclusive else x < minimum):
        raise ValueError(f"{name} must be {'>' if exclusive else '>='} {minimum:g}, got {value!r}")
    if maximum is not None and x > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return x


def _field_type_problem(name: str, type_name: Any, value: Any) -> str | None:
    type_name = getattr(type_name, "__name__", type_name)
    if type_name == "bool" and not isinstance(value, bool):
        return f"{name} must be true or false, got {value!r}"
    if type_name == "int" and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        return f"{name} must be an integer, got {value!r}"
    if type_name == "float":
        try:
            finite_number(name, value)
        except ValueError as e:
            return str(e)
    if type_name == "str" and value not in _CHOICES.get(name, (value,)):
        return f"{name} must be one of {list(_CHOICES[name])}, got {value!r}"
    return None


def _range_problems(p: "ObfuscationParams") -> list[str]:
    bounds = {  # name: (minimum, exclusive, maximum)
        "alpha_e": (0.0, False, MAX_NOISE), "alpha_h": (0.0, False, MAX_NOISE), "lam": (0.0, False, MAX_NOISE),
        "gamma": (0.0, True, MAX_GAMMA), "c_scale": (0.0, False, MAX_NOISE), "e_scale": (0.0, False, MAX_NOISE),
        "qk_scale_range": (1.0, False, MAX_SCALE_RANGE), "ffn_scale_range": (1.0, False, MAX_SCALE_RANGE),
        "vo_scale_range": (1.0, False, MAX_SCALE_RANGE),
    }
    problems = []
    for name, (lo, exclusive, hi) in bounds.items():
        try:
            finite_number(name, getattr(p, name), lo, exclusive, hi)
        except ValueError as e:
            problems.append(str(e))
    if p.h < 0 or p.h % 2 or p.h > MAX_H:
        problems.append(f"h must be an even integer in [0, {MAX_H}] (got {p.h})")
    if not 0 <= p.outlier_dims <= MAX_OUTLIER_DIMS:
        problems.append(f"outlier_dims must be an integer in [0, {MAX_OUTLIER_DIMS}] (got {p.outlier_dims})")
    if p.outlier_rms != 0 and not 1 < p.outlier_rms <= MAX_SCALE_RANGE:
        problems.append(f"outlier_rms must be 0 (off) or in (1, {MAX_SCALE_RANGE:g}] (got {p.outlier_rms})")
    if p.outlier_dims and p.outlier_rms:
        problems.append("outlier_dims (a count) and outlier_rms (a threshold) are two rules for the same choice; "
                        "set one of them, the other to 0")
    if p.beta < 1:
        problems.append("beta must be >= 1 (1 disables block permutation)")
    return problems


# Every measured setting below leaves the prompt readable to a server that holds the public model: on SmolLM2-135M
# and Qwen2.5-Coder-0.5B the behavioural, isa_anchor and weight-matching attacks recover 100% of prompt tokens
# under `default`, `exact` and `noisy` (docs/security.md). What the key hides from such a server is the key itself;
# from an observer of the id stream who lacks the model, the plaintext of the stream (frequency attacks,
# docs/security.md).

# The presets' kept dimensions (outlier_rms): every residual dimension whose RMS, measured on the public model
# (obfuscation/residual.py), is at least 16x the median dimension's. On the fixed calibration input the measured
# dimensions fall into two groups with a gap around 16x on all three real models: SmolLM2-135M keeps 3 (303, 24,
# 24x; the next 11x), Qwen2.5-Coder-0.5B 2 (87, 33x; next 9x), Qwen2.5-Coder-1.5B 13 (202x down to 18.5x; next
# 13x). The fixed count of 4 chosen from the weights, the rule before, left a dimension at 185x (chat prompts) in
# the 1.5B's mixing and its bfloat16 KL at 6x plaintext bfloat16's (docs/accuracy.md, "Output precision").
# The serving figures quoted below were measured with that rule (outlier_dims=4).
OUTLIER_RMS = 16.0

# `default`: the exact transforms at h = 0 with the massive-activation dimensions kept out of the key's mixing.
# Logits equal plaintext's up to float rounding (SmolLM2, held-out prompts: docs/accuracy.md) and the served model
# has the plaintext model's shapes (`noisy`, with the same shapes, serves at 0.96-1.00x plaintext's time per token,
# docs/serving.md "Served cost"). Noise is left out because the noise measured on these models costs answers and
# stops no measured attack (see `noisy`).
DEFAULT = ObfuscationParams(h=0, outlier_rms=OUTLIER_RMS)

# `exact`: `default` with the hidden width expanded from d to d+2h at the paper's h = 128 (raised until the heads
# divide d+2h: 144 on SmolLM2). Logits match plaintext to float
# rounding. The expansion was measured to protect nothing (the hidden-state attack recovers 100% of prompt tokens
# at every h, docs/expansion.md) and costs (d+2h)/d per token; it stays for comparison with the paper.
# Its kept dimensions (then outlier_dims=4) keep the massive activations out of the key's mixing: bf16 on vLLM at plaintext
# bf16's own loss (KL 0.00135-0.00137 on three keys, 0.00198 on a fourth, vs plaintext 0.00147; 0.00213-0.00239
# without it; docs/serving.md "bf16") and llama.cpp q8_0 below plaintext q8_0's (0.86-0.91x; 1.45x without;
# docs/serving-gguf.md). On Qwen2.5-Coder-0.5B q8_0 (h=0) 1.18-1.53x plaintext's KL, two keys, once a kept
# dimension's norm weight is clipped to 1 on the server (7.7-9.3x before; 1.27-1.37x with outlier_dims=0;
# transforms.split_norm_weight).
EXACT = ObfuscationParams(outlier_rms=OUTLIER_RMS)

# `noisy`: `default` plus embedding/head noise 10x below the paper's (alpha_e=0.1, alpha_h=0.05), the largest
# noise measured on SmolLM2-135M that keeps top-1 agreement >= 0.9 (experiment fidelity_presets, docs/design.md
# "Presets"). Measured on SmolLM2: top-1 0.91, KL 0.055-0.059 on the 20 built-in prompts it was chosen on; top-1
# 0.81, KL 0.067, 2 of 24 greedy continuations unchanged on held-out prompts (docs/accuracy.md). It does not stop
# weight matching (benchmarks experiment vma_gate: 99.9%), the behavioural attack (100% of prompt tokens on SmolLM2
# and Qwen2.5-Coder-0.5B) or isa_anchor (100%). The paper's other non-exact mechanisms are off, each because it
# bought no measured protection and cost accuracy (docs/serving.md "bf16", docs/expansion.md): lam 0.1 and beta 8
# moved the attention ISA by a few points (77.8% with them, 76.4% without) and the behavioural attack and weight
# matching not at all, while bf16 on vLLM lost 1.42-1.91x plaintext bf16's loss with them and 0.96-1.11x without
# (four keys). With h=0 there is no C/E block, so c_scale and e_scale have nothing to fill.
NOISY = ObfuscationParams(alpha_e=0.1, alpha_h=0.05, lam=0.0, h=0, beta=1, gamma=1e3, c_scale=1.0, e_scale=1.0,
                          outlier_rms=OUTLIER_RMS)

# `paper`: the AloePri paper's Table "Privacy hyperparameter settings" (alpha_e=1.0, alpha_h=0.2, lambda=0.3,
# h=128, beta=8, gamma=1e3) with Algorithm 1's E and a shared C of the same energy. Tuned for >= 8B models: it
# destroys small models (measured numbers: docs/design.md, "Presets").
PAPER = ObfuscationParams(alpha_e=1.0, alpha_h=0.2, lam=0.3, h=128, beta=8, gamma=1e3, c_scale=1.0, e_scale=1.0)

PRESETS: dict[str, ObfuscationParams] = {"default": DEFAULT, "exact": EXACT, "noisy": NOISY, "paper": PAPER}

# What the CLI prints about each preset. No measured figure is typed here (figures go stale; the measured ones are
# rendered into the README and docs from benchmarks/results): each note says what the preset does and where the
# measurements are.
_NOT_PRIVATE = ("does NOT hide the prompt from a server that holds the public model: on every model measured, "
                "attacks that run or compare both models read the prompts (README, docs/security.md; `aloepri "
                "audit` measures it for yours)")

PRESET_NOTES = {
    "default": "reproduces plaintext logits (no noise, width unchanged); like every measured setting it "
    + _NOT_PRIVATE,
    "exact": "reproduces plaintext logits with the hidden width expanded from d to d+2h, h = 128 or the next "
    "value the heads divide (costs (d+2h)/d per token, protects nothing measurable); it " + _NOT_PRIVATE,
    "noisy": "default plus embedding/head noise 10x below the paper's: changes answers (docs/design.md, "
    "\"Presets\") and still " + _NOT_PRIVATE,
    "paper": "the AloePri paper's parameters, tuned for >= 8B models: breaks small models (docs/design.md, "
    "\"Presets\") and still " + _NOT_PRIVATE,
}


def resolve_params(preset: str | None = None, preset_file: str | Path | None = None, **overrides: Any) -> ObfuscationParams:
    """Preset name (or a JSON preset file written by a tuner) plus explicit overrides."""
    if preset_file is not None:
        base = load_preset_file(preset_file)
    else:
        name = preset or "default"
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        base = PRESETS[name]
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return base.replace(**overrides) if overrides else base


def load_preset_file(path: str | Path) -> ObfuscationParams:
    """A JSON preset ({"params": {...}} as a tuner writes it, or the bare mapping), validated like any override."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"preset file {path} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"preset file {path}: not a JSON preset ({e})") from None
    params = data.get("params", data) if isinstance(data, dict) else data
    if not isinstance(params, dict):
        raise ValueError(f"preset file {path}: expected a JSON object of parameters")
    try:
        return ObfuscationParams.from_dict(params)
    except ValueError as e:
        raise ValueError(f"preset file {path}: {e}") from None
