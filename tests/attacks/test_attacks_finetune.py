"""The attacker's reference need not be the model that was obfuscated: a client obfuscates its private fine-tune,
the server holds only the public base model. ``AttackTarget(base, obfuscated_fine_tune, key)`` runs every attack
against the base while the key (ground truth) comes from the fine-tune's obfuscation.

Tiny random Llama; the "fine-tune" is the base with every weight moved by 5% of its own spread. The behavioural
attack must still recover the vocabulary through that drift; the negative control (an unrelated model as
reference) is in test_attacks_behavioural.py.
"""
from __future__ import annotations

import numpy as np
import torch

import aloepri
from aloepri.attacks.base import AttackTarget, Budget, PrivateData
from aloepri.attacks.behavioural import run_behavioural

TEMPLATE = ([1, 10, 11, 12], [13, 14, 15])  # stand-in chat template (the tiny models ship no tokenizer)


def _finetune_like(src, out, relative: float, seed: int = 0):
    """A copy of ``src`` with every floating weight moved by ``relative`` x its standard deviation (a stand-in for
    fine-tuning: same architecture, same vocabulary, weights drifted)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            spread = p.std() if p.numel() > 1 and float(p.std()) > 0 else p.abs().mean().clamp_min(1e-3)
            p.add_(relative * spread * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(out)
    return out


def test_base_model_reference_recovers_an_obfuscated_finetune(tiny_dir, tmp_path):
    base = tiny_dir("llama")
    tuned = _finetune_like(base, tmp_path / "tuned", 0.05)
    aloepri.obfuscate(tuned, tmp_path / "obf", tmp_path / "k.key", aloepri.resolve_params("exact", h=0, outlier_dims=4),
                      seed=7, allow_weak_seed=True, progress=False)
    target = AttackTarget(base, tmp_path / "obf", tmp_path / "k.key")  # the reference is the BASE, not the fine-tune
    rng = np.random.default_rng(0)
    ids = [rng.integers(16, 96, size=12).tolist() for _ in range(4)]
    data = PrivateData([""] * 4, ids, [[j % 3 == 0 for j in range(12)] for _ in ids])
    res, _ = run_behavioural(target, data, Budget.named("ci"), 0, template=TEMPLATE)
    from aloepri.runtime.inference import load_plain_model

    w_base = load_plain_model(base).model.embed_tokens.weight.detach()
    w_tuned = load_plain_model(tuned).model.embed_tokens.weight.detach()
    assert 0.01 < float((w_tuned - w_base).norm() / w_base.norm()) < 0.2  # the reference really differs
    assert res.metrics["vocab_recovery"] >= 0.9, res.metrics["trace"]
    assert res.ttrsr >= 0.9
