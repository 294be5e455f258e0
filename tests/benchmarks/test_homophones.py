"""The homophonic-vocabulary measurement (benchmarks/experiments/defence_homophonic.py): its scheme, grouping and
scoring helpers on toy data, so the numbers in docs/defences.md rest on code that is checked. (The defence itself was not
built: docs/defences.md "Homophonic vocabulary" says why.)"""
from __future__ import annotations

import numpy as np
import pytest

from aloepri.attacks.frequency import tfma_match
from benchmarks.experiments import defence_homophonic as hp


def test_flat_allocation_spends_the_budget_in_proportion_to_frequency():
    counts = np.array([1000, 500, 100, 10, 1, 0, 0, 0])
    k = hp.flat_allocation(counts, total_ids=40)
    assert k.min() >= 1 and k.sum() <= 40 and k.sum() >= 36
    assert list(k) == sorted(k, reverse=True)  # more frequent -> more copies
    per_copy = counts[:3] / k[:3]
    assert per_copy.max() / per_copy.min() < 1.3  # the frequent ids end up with near-equal counts


def test_encode_uses_every_copy_and_only_the_tokens_own():
    hom = hp.Homophones(np.array([1, 2, 4]), seed=0)
    assert hom.n_server == 7 and sorted(hom.owner.tolist()) == [0, 1, 1, 2, 2, 2, 2]
    x = np.repeat(np.arange(3), 4000)
    sent = hom.encode(x, np.random.default_rng(0))
    assert np.array_equal(hom.owner[sent], x)  # the client maps back by the owner table
    for t, k in enumerate([1, 2, 4]):
        ids, counts = np.unique(sent[x == t], return_counts=True)
        assert len(ids) == k and counts.min() > 4000 / k * 0.9  # uniform over the token's copies


def test_identical_rows_recover_the_scheme_exactly_and_a_wrong_grouping_is_scored_as_such():
    hom = hp.Homophones(np.array([2, 3, 1]), seed=1)
    token_rows = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    labels = hp.group_identical_rows(token_rows[hom.owner])  # duplicated head rows
    assert hp.grouping_quality(labels, hom) == {"groups": 3, "tokens": 3, "server_ids_in_exact_groups": 1.0}
    merged = np.zeros(hom.n_server, dtype=np.int64)  # everything in one group: nothing exact
    assert hp.grouping_quality(merged, hom)["server_ids_in_exact_groups"] == 0.0
    split = np.arange(hom.n_server)  # every id alone: only the single-copy token is exact
    assert hp.grouping_quality(split, hom)["server_ids_in_exact_groups"] == pytest.approx(1 / 6)


def test_nearest_sibling_rate_sees_copies_through_small_noise_only():
    rng = np.random.default_rng(0)
    hom = hp.Homophones(np.full(200, 2), seed=2)
    base = rng.standard_normal((200, 16)).astype(np.float32)
    small = base[hom.owner] + 0.05 * rng.standard_normal((400, 16)).astype(np.float32)
    large = base[hom.owner] + 5.0 * rng.standard_normal((400, 16)).astype(np.float32)
    assert hp.nearest_sibling_rate(small, hom, 100, 0)["nearest_is_sibling_cosine"] == 1.0
    assert hp.nearest_sibling_rate(large, hom, 100, 0)["nearest_is_sibling_cosine"] < 0.3


def test_group_aware_tfma_undoes_homophones_and_naive_tfma_does_not():
    rng = np.random.default_rng(0)
    vocab = 50
    p = 1.0 / np.arange(1, vocab + 1) ** 1.2
    prior = rng.choice(vocab, size=50_000, p=p / p.sum())
    truth = rng.choice(vocab, size=50_000, p=p / p.sum())
    hom = hp.Homophones(np.full(vocab, 4), seed=3)
    observed = hom.encode(truth, rng)
    groups = hp.group_identical_rows(rng.standard_normal((vocab, 3))[hom.owner])
    naive = tfma_match(observed, prior, hom.n_server).obf_to_plain[observed]
    grouped = tfma_match(groups[observed], prior, vocab).obf_to_plain[groups[observed]]
    baseline = tfma_match(truth, prior, vocab).obf_to_plain[truth]  # no homophones (identity key)
    assert np.mean(grouped == truth) == pytest.approx(np.mean(baseline == truth), abs=0.02)
    assert np.mean(grouped == truth) > 0.5 > np.mean(naive == truth)


def test_traffic_profiles_group_copies_without_any_weights():
    rng = np.random.default_rng(0)
    vocab = 40
    follow = rng.dirichlet(np.full(vocab, 0.05), size=vocab)  # a peaked bigram language
    x = [0]
    for _ in range(30_000):
        x.append(rng.choice(vocab, p=follow[x[-1]]))
    hom = hp.Homophones(np.full(vocab, 2), seed=4)
    observed = hom.encode(np.asarray(x), rng)
    labels = hp.traffic_groups(observed, hom.n_server)
    assert hp.grouping_quality(labels, hom, observed)["server_ids_in_exact_groups"] > 0.8
    assert hp.traffic_nearest_sibling(observed, hom, 500, 0)["nearest_is_sibling_token_weighted"] > 0.8
