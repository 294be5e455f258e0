"""Id-stream decipherment (the observer of the logs): positive and negative controls on synthetic traffic, the
template anchors, the public-LM judge on a tiny model, and the audit's plan."""
import numpy as np
import pytest
import torch

from aloepri.attacks.base import REGISTRY
from aloepri.attacks.stream_decipher import LMScorer, ObservedStream, bigram_model, decipher_stream
from aloepri.audit.plan import ID_STREAM, OBSERVERS, PLAN
from aloepri.testing.tiny import build_tiny

VOCAB = 400


def markov_text(transitions: np.ndarray, n_seqs: int, length: int, seed: int) -> list[np.ndarray]:
    """Sequences from a first-order Markov chain (a language with strong context, like text)."""
    rng = np.random.default_rng(seed)
    cum = np.cumsum(transitions, axis=1)
    out = []
    for _ in range(n_seqs):
        s = [int(rng.integers(len(transitions)))]
        for u in rng.random(length - 1):
            s.append(int(min(np.searchsorted(cum[s[-1]], u), len(transitions) - 1)))
        out.append(np.asarray(s))
    return out


def zipf_chain(seed: int) -> np.ndarray:
    """Transitions with Zipf-like unigrams and a few strong successors per token."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    t = np.tile(base, (VOCAB, 1)) * 0.2
    for u in range(VOCAB):
        t[u, rng.choice(VOCAB, 4, replace=False, p=base / base.sum())] += rng.random(4) * 3
    return t / t.sum(axis=1, keepdims=True)


@pytest.fixture(scope="module")
def traffic():
    chain = zipf_chain(0)
    prefix, suffix = [390, 391, 392], [393, 394]
    plain = [np.concatenate([prefix, s, suffix]) for s in markov_text(chain, 60, 60, 1)]
    perm = np.random.default_rng(5).permutation(VOCAB)
    observed = [perm[p] for p in plain]
    return chain, prefix, suffix, plain, observed, perm


def recovery(obf_to_plain: np.ndarray, observed, plain) -> float:
    return float(np.mean(obf_to_plain[np.concatenate(observed)] == np.concatenate(plain)))


def test_positive_control_same_language_reference_recovers_most(traffic):
    chain, prefix, suffix, plain, observed, perm = traffic
    reference = markov_text(chain, 200, 100, 2)  # other text of the same language
    stages = {}

    def keep(entry, mapping):
        stages[entry["stage"]] = recovery(mapping, observed, plain)
        return {}

    res = decipher_stream(observed, VOCAB, reference, prefix, suffix, seed=0, progress=keep)
    rec = recovery(res.obf_to_plain, observed, plain)
    assert rec > 0.7, rec
    # the frequency seed alone is clearly worse: context is what reads the stream
    assert stages["frequency seed"] < rec - 0.2, stages


def test_negative_controls_other_language_and_random_mapping(traffic):
    chain, prefix, suffix, plain, observed, perm = traffic
    other = markov_text(zipf_chain(7)[np.random.default_rng(8).permutation(VOCAB)], 200, 100, 3)
    res = decipher_stream(observed, VOCAB, other, seed=0)  # no anchors either
    assert recovery(res.obf_to_plain, observed, plain) < 0.35
    random_guess = np.random.default_rng(9).permutation(VOCAB)
    assert recovery(random_guess, observed, plain) < 0.05


def test_template_anchors_are_known_pairs(traffic):
    chain, prefix, suffix, plain, observed, perm = traffic
    res = decipher_stream(observed, VOCAB, markov_text(chain, 20, 50, 4), prefix, suffix, temperatures=(),
                          anneal_steps=0)
    assert res.anchors == len(prefix) + len(suffix)
    for p in prefix + suffix:
        assert res.obf_to_plain[perm[p]] == p


def test_mapping_is_one_to_one(traffic):
    chain, prefix, suffix, plain, observed, perm = traffic
    res = decipher_stream(observed, VOCAB, markov_text(chain, 100, 100, 2), prefix, suffix, seed=1)
    seen = np.unique(np.concatenate(observed))
    guesses = res.obf_to_plain[seen]
    assert (guesses >= 0).all() and len(np.unique(guesses)) == len(guesses)


def test_public_lm_judge_keeps_the_likelier_mapping(tmp_path, traffic):
    """The LM stage runs on a real (tiny) causal LM and only ever replaces the mapping by one the LM finds
    likelier: the observer's choice uses no key."""
    from aloepri.runtime.inference import load_plain_model

    chain, prefix, suffix, plain, observed, perm = traffic
    src = build_tiny("llama", tmp_path / "tiny", vocab_size=VOCAB)
    model = load_plain_model(src)
    model.eval()
    torch.manual_seed(0)
    res = decipher_stream(observed[:20], VOCAB, markov_text(chain, 100, 100, 2), prefix, suffix,
                          lm=LMScorer(model, batch=4), lm_tokens=400, lm_judge_tokens=300, anneal_steps=50, seed=0)
    judged = [e for e in res.trace if "lm_loss" in e]
    assert judged and judged[0]["stage"].startswith("lm judge")
    best = judged[0]["lm_loss"]
    for e in judged[1:]:
        assert e.get("kept", False) == (e["lm_loss"] < best)
        best = min(best, e["lm_loss"])


def test_bigram_model_is_normalised():
    ref = markov_text(zipf_chain(0), 50, 80, 1)
    m = bigram_model(ref, VOCAB)
    logp = m.base[None, :] + m.lift.toarray()
    np.testing.assert_allclose(np.exp(logp[ref[0][:5]]).sum(axis=1), 1.0, atol=1e-9)


def test_observed_stream_rows_round_trip(traffic):
    *_, observed, perm = traffic
    s = ObservedStream.of(observed)
    for rows, obs in zip(s.rows, observed):
        np.testing.assert_array_equal(s.cipher_ids[rows], obs)


def test_audit_runs_the_log_reader_with_the_public_model():
    assert "public model" in OBSERVERS[ID_STREAM]
    planned = {a.name: a for a in PLAN}
    for name in ("stream-decipher", "stream-decipher-lm"):
        assert name in REGISTRY
        assert planned[name].observer == ID_STREAM and "ci" in planned[name].budgets


def test_model_free_restarts_keep_the_likeliest_mapping(traffic):
    from aloepri.attacks.stream_decipher import adjacency, stream_log_likelihood

    chain, prefix, suffix, plain, observed, perm = traffic
    reference = markov_text(chain, 100, 100, 2)
    res = decipher_stream(observed, VOCAB, reference, prefix, suffix, restarts=2, anneal_steps=40, seed=3)
    runs = [e for e in res.trace if "log_likelihood" in e]
    assert len(runs) == 3
    best = max(e["log_likelihood"] for e in runs)
    stream = ObservedStream.of(observed)
    final = stream_log_likelihood(bigram_model(reference, VOCAB), adjacency(stream)[0],
                                  res.obf_to_plain[stream.cipher_ids])
    assert final == pytest.approx(best, abs=0.1)
