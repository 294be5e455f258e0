"""Behavioural attacks (aloepri.attacks.behavioural): the server runs the obfuscated and the public model.

Positive controls: >= 90% of the vocabulary on the `exact` preset and on a permutation-only target (tiny random
Llama, anchors from a stand-in chat template + the published special ids). Negative control: against an unrelated
model (same shapes, other weights) the same attack must stay near chance, so the tests cannot pass by reading the
key. The slow test runs the `ci` budget on SmolLM2-135M (`exact`).
"""
from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, Budget, PrivateData
from aloepri.attacks.behavioural import (Pairs, published_special_anchors, run_behavioural, template_anchors,
                                         wrap_requests)
from aloepri.attacks.nearest_neighbour import permutation_only_target
from attack_helpers import random_private_data

CI = Budget.named("ci")
TEMPLATE = ([1, 10, 11, 12], [13, 14, 15])  # stand-in chat template of the tiny models (they ship no tokenizer)


def _data(vocab: int, seed: int = 0) -> PrivateData:
    return random_private_data(vocab, seed, low=16)


@pytest.fixture(scope="module")
def targets(tiny_dir, tmp_path_factory):
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("behavioural")
    out = {}
    for name, params in {"exact": aloepri.resolve_params("exact", h=16),
                         "noisy": aloepri.resolve_params("noisy", h=16)}.items():
        aloepri.obfuscate(src, work / name, work / f"{name}.key", params, seed=7, progress=False,
                          allow_weak_seed=True)
        out[name] = AttackTarget(src, work / name, work / f"{name}.key")
    out["permutation-only"] = permutation_only_target(src, seed=3)
    return src, work, out


def test_registered():
    assert {"behavioural", "behavioural-composed"} <= set(REGISTRY)


def test_attack_help_lists_every_attack_with_a_description():
    from aloepri.attacks.cli import attack_listing

    lines = {ln.split()[0]: ln for ln in attack_listing().splitlines()[1:] if ln.strip()}
    assert set(REGISTRY) <= set(lines)
    assert all(len(ln.split()) > 2 for ln in lines.values())  # a name and a description


def test_template_anchors_pair_constant_positions():
    prefix, suffix = [5, 6, 7], [8, 9]
    perm = np.random.default_rng(0).permutation(50)
    requests = wrap_requests(prefix, suffix, [[20, 21], [30, 31, 32], [40]])
    observed = [perm[r].tolist() for r in requests]
    pairs = template_anchors(prefix, suffix, observed)
    assert sorted(pairs) == sorted((int(perm[p]), p) for p in prefix + suffix)
    # a boundary position that varies between requests is not paired
    observed[0][2] = 49
    assert (int(perm[7]), 7) not in template_anchors(prefix, suffix, observed)


def test_pairs_refuse_conflicts():
    p = Pairs(10)
    assert p.add(1, 2, "a") and p.add(1, 2, "b")
    assert not p.add(1, 3, "c") and not p.add(4, 2, "c")
    assert len(p) == 1


def test_published_special_anchors(targets):
    src, work, t = targets
    pairs = published_special_anchors(t["exact"].plain_model.config, work / "exact")
    perm = t["exact"].true_permutation()
    assert pairs and all(perm[p] == o for o, p in pairs)


@pytest.mark.parametrize("name", ["exact", "permutation-only"])
def test_positive_control(targets, name):
    _, _, t = targets
    res, out = run_behavioural(t[name], _data(96), CI, 0, template=TEMPLATE)
    assert res.metrics["vocab_recovery"] >= 0.9, res.metrics["trace"]
    assert res.ttrsr >= 0.9
    assert "no key" in res.uses


def test_negative_control_unrelated_model(targets, tiny_dir, tmp_path):
    """Same shapes, different weights: behaviour carries no information about the permutation -> near chance."""
    from aloepri.testing.tiny import build_tiny

    src, work, t = targets
    other = build_tiny("llama", tmp_path / "other", seed=99)
    aloepri.obfuscate(other, tmp_path / "obf", tmp_path / "k.key", aloepri.resolve_params("exact", h=16), seed=7,
                      allow_weak_seed=True, progress=False)
    victim = AttackTarget(src, tmp_path / "obf", tmp_path / "k.key")  # plaintext model is NOT the one obfuscated
    res, _ = run_behavioural(victim, _data(96), CI, 0, template=TEMPLATE)
    anchors = res.budget["anchors"]
    known = anchors["template_positions_paired"] + anchors["special_pairs"]
    # the anchors are right by construction (observed ids); everything else must be about chance
    assert res.metrics["vocab_recovery"] <= (known + 10) / 96


def test_composition_vma_pairs_then_ridge(targets):
    """VMA's unanimous pairs feed the behavioural attack as anchors; the ridge refinement keeps >= 90%."""
    from aloepri.attacks.behavioural import ridge_refine, vma_confident_pairs

    _, _, t = targets
    target = t["noisy"]
    vma_pairs = vma_confident_pairs(target, "ci", 0, 96)
    truth = np.argsort(target.true_permutation())
    assert vma_pairs and np.mean([truth[o] == p for o, p in vma_pairs]) >= 0.9
    res, out = run_behavioural(target, _data(96), CI, 0, template=TEMPLATE, extra_pairs=vma_pairs,
                               extra_source="vma")
    assert res.budget["anchors"]["extra_pairs"] > 0 and "vma pairs" in res.uses
    every = ridge_refine(target, out)
    assert np.mean(every == truth) >= 0.9
    # re-ranking only some ids gives them the guesses of the full re-ranking and leaves the others as they were
    # (a third of the confident ids made unsure and wrong, so that there is something to re-rank)
    confident, mapping = out.confident.copy(), out.mapping.copy()
    confident[np.flatnonzero(confident)[::3]] = False
    unsure = np.flatnonzero(~confident)
    mapping[unsure] = mapping[np.roll(unsure, 1)]
    weaker = dataclasses.replace(out, confident=confident, mapping=mapping)
    full, some = ridge_refine(target, weaker), unsure[::2]
    assert len(some) >= 10 and not np.array_equal(full[unsure], weaker.mapping[unsure])
    part = ridge_refine(target, weaker, query_ids=some)
    assert np.array_equal(part[some], full[some])
    rest = np.setdiff1d(np.arange(len(part)), some)
    assert np.array_equal(part[rest], weaker.mapping[rest])


@pytest.mark.slow
def test_smollm2_exact_ci_budget(tmp_path):
    from aloepri.attacks.cli import private_data
    from aloepri.models import smollm2_gguf

    src = smollm2_gguf()
    aloepri.obfuscate(src, tmp_path / "m", tmp_path / "k.key", aloepri.resolve_params("exact"), seed=5,
                      allow_weak_seed=True, progress=False)
    t = AttackTarget(src, tmp_path / "m", tmp_path / "k.key")
    torch.set_num_threads(2)
    res, _ = run_behavioural(t, private_data(t.tokenizer, 10, 0), CI, 0)
    assert res.budget["anchors"]["template_positions_paired"] >= 10
    assert res.ttrsr >= 0.9, res.metrics["trace"]
