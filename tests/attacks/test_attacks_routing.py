"""MoE routing-leak attack (aloepri.attacks.routing_leak): pure parts, positive control, learned relabelling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, Budget, PrivateData
from aloepri.attacks.routing_leak import (assign_relabelling, cooccurrence_counts, decode_routing_leak, num_experts,
                                          observe_routing, relabelling_accuracy, run_routing_leak, score_candidates,
                                          token_accuracy)
from aloepri.obfuscation.routing import expert_orders, routing_decisions

LEARNED_MIN = 0.25  # measured 0.375 on this target and data (2 passes); chance is 1/96


def test_registered():
    assert "routing_leak" in REGISTRY and "routing_leak_oracle" in REGISTRY


def test_assignment_recovers_relabelling_from_cooccurrences():
    rng = np.random.default_rng(0)
    perm = rng.permutation(8)  # obfuscated slot -> plaintext expert
    plain = [np.sort(rng.choice(8, 2, replace=False)) for _ in range(40)]
    inv = np.argsort(perm)
    observed = [np.sort(inv[p]) for p in plain]
    assert (assign_relabelling(cooccurrence_counts(observed, plain, 8)) == perm).all()


def test_score_counts_matches_over_layers_and_later_positions():
    sets = {0: np.array([[[0, 1], [2, 3]], [[0, 5], [2, 3]], [[6, 7], [4, 5]]]),
            1: np.array([[[1, 2], [0, 1]], [[1, 2], [0, 1]], [[3, 4], [0, 1]]])}
    logp = {L: np.log(np.full((3, 8), 1 / 8)) for L in sets}
    observed = {0: np.array([[0, 1], [2, 3]]), 1: np.array([[1, 2], [0, 1]])}
    s = score_candidates(sets, logp, observed)
    assert np.argsort(-s).tolist() == [0, 1, 2]
    assert np.round(s).tolist() == [8, 7, 2]


def test_refuses_dense_models():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="mixture-of-experts"):
        num_experts(LlamaConfig(architectures=["LlamaForCausalLM"]))


@pytest.fixture(scope="module")
def weak_moe(tmp_path_factory):
    """The weak target: a tiny Qwen3-MoE with 32 experts (more distinctive routing), exact preset."""
    from aloepri.testing.tiny import build_tiny

    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("routing-weak")
    src = build_tiny("qwen3_moe", work / "src", num_experts=32)
    aloepri.obfuscate(src, work / "obf", work / "k.key", aloepri.resolve_params("exact"), seed=4,
                      allow_weak_seed=True, progress=False)
    return AttackTarget(src, work / "obf", work / "k.key")


def _prompts(n: int, length: int, vocab: int = 96, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


def test_positive_control_oracle_and_learned(weak_moe):
    """Positive control: >= 90% of private tokens from expert choices alone (oracle relabelling). The learned
    relabelling (bootstrapped from an 8-id known prefix, no key) must improve on the prefix-only bootstrap and
    decode far above chance (1/96)."""
    t = weak_moe
    prefix = _prompts(1, 8, seed=7)[0]
    plain = [prefix + p for p in _prompts(4, 12)]
    obf = [t.obfuscate_ids(p) for p in plain]
    observed = observe_routing(t.obf_model, obf)
    truth = {L: np.asarray(o) for L, o in expert_orders(t.key, t.obf_model.config).items()}
    oracle = decode_routing_leak(t.plain_model, obf, observed, 32, prefix, truth, max_passes=2)
    assert token_accuracy(oracle.predicted, plain, skip=8) >= 0.9
    learned = decode_routing_leak(t.plain_model, obf, observed, 32, prefix, None, max_passes=2)
    prefix_plain = {L: d.numpy() for L, d in routing_decisions(t.plain_model, torch.tensor([prefix])).items()}
    bootstrap = {L: assign_relabelling(cooccurrence_counts(observed[0][L][:8], prefix_plain[L], 32)) for L in truth}
    assert relabelling_accuracy(learned.relabelling, truth) > relabelling_accuracy(bootstrap, truth)
    assert token_accuracy(learned.predicted, plain, skip=8) >= LEARNED_MIN
    # the signal is the routing: a wrong relabelling decodes (almost) nothing
    wrong = {L: np.roll(v, 1) for L, v in truth.items()}
    bad = decode_routing_leak(t.plain_model, obf, observed, 32, prefix, wrong, max_passes=1)
    assert token_accuracy(bad.predicted, plain, skip=8) <= 0.3


def test_registered_wrapper_scores_without_tokenizer(weak_moe):
    ids = _prompts(2, 6, seed=3)
    data = PrivateData(["", ""], ids, [[False] * 6, [True] * 6])
    res = run_routing_leak(weak_moe, data, Budget.named("full"), seed=0, oracle=True)
    assert res.attack == "routing_leak_oracle" and "ORACLE" in res.uses
    assert res.budget["candidate_pool"] == "full vocabulary (96)" and res.budget["private_tokens"] == 12
    assert res.metrics["tokens_scored"] == 12 and res.metrics["pii_tokens_scored"] == 6
    assert "bleu4" not in res.metrics  # no tokenizer: token accuracy only
    assert 0.0 <= res.ttrsr <= 1.0
