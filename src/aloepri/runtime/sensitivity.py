"""Sensitivity statistics of the public plaintext model on a public corpus, for the sensitivity-shaped noise
(``noise_shape="fisher"``; the maths: aloepri.obfuscation.noise; the measurement: docs/defences.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..corpora import corpus, tokenize_texts
from ..obfuscation.noise import FISHER_RIDGE, shaped_noise_factor
from .inference import load_plain_model
from .modules import ModelModules
from .probe import forward_hooks
from .tokenizer import load_hf_tokenizer

Tensor = torch.Tensor

CALIBRATION_CORPUS = "debian-reference"  # public; NOT the frequency attacks' private corpus (python-docs)
CALIBRATION_SEQS = 16  # 2,048 positions: ~1-2 min on 2 busy cores for SmolLM2
CALIBRATION_LENGTH = 128


def calibration_ids(tokenizer, n_seqs: int = CALIBRATION_SEQS, length: int = CALIBRATION_LENGTH,
                    corpus_name: str = CALIBRATION_CORPUS) -> Tensor:
    """(n_seqs, length) token ids: consecutive windows of a public corpus (deterministic, no secret)."""
    ids = tokenize_texts(tokenizer, corpus(corpus_name), max_tokens=n_seqs * length)
    if len(ids) < n_seqs * length:
        raise ValueError(f"corpus {corpus_name} has only {len(ids)} tokens; need {n_seqs * length}")
    return torch.from_numpy(ids.reshape(n_seqs, length))


def sensitivity_statistics(model, ids: Tensor, batch: int = 4) -> tuple[Tensor, Tensor]:
    """(S_embed, S_head), each (d, d) float64, of a Hugging Face causal LM on ``ids`` (n, L); see module doc."""
    mods = ModelModules(model)
    embed = mods.embed
    d = embed.weight.shape[1]
    s_e = torch.zeros(d, d, dtype=torch.float64)
    s_h = torch.zeros(d, d, dtype=torch.float64)
    seen: list[Tensor] = []
    n_pos = 0
    # the final norm's output is what the head reads
    with forward_hooks([("final_norm", mods.final_norm)], lambda _name, out: seen.append(out.detach())):
        for start in range(0, ids.shape[0], batch):
            x = ids[start : start + batch]
            inputs = embed(x).detach().requires_grad_(True)
            logits = model(inputs_embeds=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(),
                                                     reduction="sum")
            loss.backward()
            g = inputs.grad.detach().flatten(0, 1).to(torch.float64)
            z = seen.pop().flatten(0, 1).to(torch.float64)
            s_e += g.T @ g
            s_h += z.T @ z
            n_pos += g.shape[0]
            model.zero_grad(set_to_none=True)
    return s_e / n_pos, s_h / n_pos


_FACTOR_CACHE: dict[tuple[str, int, float], tuple[Tensor, Tensor]] = {}


def fisher_noise_factors(src: str | Path, ridge: float = FISHER_RIDGE,
                         ids: Sequence[Sequence[int]] | None = None) -> tuple[Tensor, Tensor]:
    """(F_embed, F_head) for the public plaintext checkpoint ``src``, from the public calibration corpus.

    Cached per process for the default corpus (a sweep obfuscates the same source many times)."""
    cache_key = (str(Path(src).resolve()), Path(src).stat().st_mtime_ns, float(ridge))
    if ids is None and cache_key in _FACTOR_CACHE:
        return _FACTOR_CACHE[cache_key]
    model = load_plain_model(src)
    if ids is None:
        tokenizer = load_hf_tokenizer(Path(src))
        if tokenizer is None:
            raise ValueError(f"noise_shape 'fisher' needs the source's tokenizer (none found for {src})")
        ids_t = calibration_ids(tokenizer)
    else:
        ids_t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    s_e, s_h = sensitivity_statistics(model, ids_t)
    del model
    factors = shaped_noise_factor(s_e, ridge), shaped_noise_factor(s_h, ridge)
    if ids is None:
        _FACTOR_CACHE[cache_key] = factors
    return factors
