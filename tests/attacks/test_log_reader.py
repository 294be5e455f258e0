"""The log reader at scale (aloepri.attacks.log_reader): positive control (reference text of the traffic's own
language recovers most of it), negative controls (a reference of another language with the same statistics under
other token ids; a random mapping) near chance, the blocked scores equal the dense ones, anchors, 1:1, warm start."""
import numpy as np
import pytest

from aloepri.attacks import log_reader
from aloepri.attacks.log_reader import CandidateModel, decipher_logs, lm_successors, log_likelihood, top_scores
from aloepri.attacks.stream_decipher import ObservedStream, adjacency

from test_attacks_stream import VOCAB, markov_text, zipf_chain

PREFIX, SUFFIX = [390, 391, 392], [393, 394]


@pytest.fixture(scope="module")
def traffic():
    chain = zipf_chain(0)
    plain = [np.concatenate([PREFIX, s, SUFFIX]) for s in markov_text(chain, 60, 60, 1)]
    perm = np.random.default_rng(5).permutation(VOCAB)
    return chain, plain, [perm[p] for p in plain], perm


def recovery(obf_to_plain, observed, plain) -> float:
    return float(np.mean(obf_to_plain[np.concatenate(observed)] == np.concatenate(plain)))


def test_positive_control_same_language_reference_recovers_most(traffic):
    chain, plain, observed, _ = traffic
    res = decipher_logs(observed, VOCAB, markov_text(chain, 200, 100, 2), PREFIX, SUFFIX, anneal_steps=100,
                        seed=0)
    assert recovery(res.obf_to_plain, observed, plain) > 0.85
    # the traffic's own text as reference: nearly everything
    own = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, anneal_steps=100, seed=0)
    assert recovery(own.obf_to_plain, observed, plain) > 0.95


def test_negative_controls_relabelled_language_and_random_mapping(traffic):
    chain, plain, observed, _ = traffic
    q = np.random.default_rng(8).permutation(VOCAB)  # the same statistics under other token ids
    other = [q[s] for s in markov_text(chain, 200, 100, 3)]
    res = decipher_logs(observed, VOCAB, other, anneal_steps=50, seed=0)
    assert recovery(res.obf_to_plain, observed, plain) < 0.05
    assert recovery(np.random.default_rng(9).permutation(VOCAB), observed, plain) < 0.05


def test_blocked_scores_equal_one_block(traffic, monkeypatch):
    chain, plain, observed, _ = traffic
    stream = ObservedStream.of(observed)
    model = CandidateModel(markov_text(chain, 50, 100, 2), np.arange(VOCAB), VOCAB)
    left, right = adjacency(stream)
    m = np.random.default_rng(0).permutation(VOCAB)[:len(stream.cipher_ids)]
    belief = log_reader.onehot(m, VOCAB)
    whole = top_scores(model, left, right, belief, stream.counts.astype(float), 1000, 5)
    monkeypatch.setattr(log_reader, "BLOCK_ELEMENTS", 3 * VOCAB)  # three rows per block
    blocked = top_scores(model, left, right, belief, stream.counts.astype(float), 1000, 5)
    np.testing.assert_allclose(np.sort(whole[1], axis=1), np.sort(blocked[1], axis=1), rtol=1e-5)


def test_anchors_one_to_one_and_the_likelier_start_kept(traffic):
    chain, plain, observed, perm = traffic
    ref = markov_text(chain, 100, 100, 2)
    truth = {int(perm[p]): int(p) for p in np.unique(np.concatenate(plain))}
    res = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, init=truth, anneal_steps=20, seed=1)
    for p in PREFIX + SUFFIX:
        assert res.obf_to_plain[perm[p]] == p
    seen = np.unique(np.concatenate(observed))
    g = res.obf_to_plain[seen]
    assert (g >= 0).all() and len(np.unique(g)) == len(g)
    lls = {e["stage"]: e["log_likelihood"] for e in res.trace}
    kept = max(lls[k] for k in lls if k.endswith("annealing"))
    assert lls["kept"] == kept
    # warm-started from the truth, the observer keeps a map at least as likely as where it started
    assert kept >= lls["warm start"] - 1e-6
    warm_only = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, init=truth, anneal_steps=20, seed=1, fresh=False)
    assert [e["stage"] for e in warm_only.trace][0] == "warm start"
    assert "matching" not in [e["stage"] for e in warm_only.trace]


def test_lm_successors_are_a_distribution_over_candidates(tmp_path):
    import torch

    from aloepri.runtime.inference import load_plain_model
    from aloepri.testing.tiny import build_tiny

    model = load_plain_model(build_tiny("llama", tmp_path / "tiny", vocab_size=VOCAB))
    cols = np.arange(0, VOCAB, 3)
    torch.manual_seed(0)
    nxt = lm_successors(model, cols, top=8, batch=50)
    assert nxt.shape == (len(cols), len(cols)) and (nxt.getnnz(axis=1) <= 8).all() and nxt.nnz > 0
    assert (np.asarray(nxt.sum(axis=1)).ravel() <= 1 + 1e-5).all()
    # the observer with the model: it reads the 50 most frequent candidates; the map stays 1:1
    chain = zipf_chain(0)
    plain = [np.concatenate([PREFIX, s, SUFFIX]) for s in markov_text(chain, 10, 40, 1)]
    observed = [np.random.default_rng(5).permutation(VOCAB)[p] for p in plain]
    res = decipher_logs(observed, VOCAB, markov_text(chain, 50, 100, 2), PREFIX, SUFFIX, lm=model, lm_candidates=50,
                        anneal_steps=20)
    g = res.obf_to_plain[np.unique(np.concatenate(observed))]
    assert (g >= 0).all() and len(np.unique(g)) == len(g)


def test_log_likelihood_prefers_the_true_map_with_its_own_text(traffic):
    chain, plain, observed, perm = traffic
    stream = ObservedStream.of(observed)
    model = CandidateModel(plain, np.arange(VOCAB), VOCAB)
    pairs = adjacency(stream)[0].tocoo()
    inv = np.argsort(perm)
    true_m = inv[stream.cipher_ids]
    shuffled = np.random.default_rng(1).permutation(true_m)
    n = int(stream.counts.sum())
    assert log_likelihood(model, pairs, true_m, n) > log_likelihood(model, pairs, shuffled, n)


@pytest.mark.slow
def test_audit_traffic_holds_the_clients_prompts_and_the_curve_grows_to_the_volume(monkeypatch):
    """The audit's log reader: the client's prompts inside public PII-like traffic of the stated volume, through
    the key; the curve's points rise to that volume and the figure is scored on the client's prompts."""
    from aloepri.attacks.base import Budget
    from aloepri.attacks.behavioural import chat_template_ids
    from aloepri.attacks.data import private_prompts
    from aloepri.attacks.log_reader import audit_traffic, curve_volumes, run_log_reader
    from aloepri.models import ModelNotInstalledError, resolve_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    try:
        tok = load_hf_tokenizer(resolve_model("smollm2"))
    except (ModelNotInstalledError, OSError) as e:
        pytest.skip(str(e))
    data = private_prompts(tok, 4, 0)
    reqs, pii, user = audit_traffic(tok, data.plain_ids, data.pii_mask, 2_500, 0)
    pre, post = chat_template_ids(tok)
    assert sum(len(r) for r in reqs) >= 2_500 - 200
    bodies = [list(r[len(pre):len(r) - len(post)]) for r in reqs]
    for ids in data.plain_ids:  # every private prompt is in the logs, once
        assert bodies.count(list(ids)) == 1
    assert all(len(r) == len(p) == len(u) for r, p, u in zip(reqs, pii, user))
    assert curve_volumes(2_500) == [1_000, 2_500] and curve_volumes(20_000)[-1] == 20_000

    class Target:  # the key's side: a permutation of the vocabulary
        tokenizer = tok
        perm = np.random.default_rng(3).permutation(len(tok))

        def true_permutation(self):
            return self.perm

        def obfuscate_ids(self, ids):
            return self.perm[np.asarray(ids, np.int64)].tolist()

    from aloepri.attacks import stream_decipher

    # a small public text keeps the test fast: the attacker's own PII-like prompts (another Faker seed)
    own = [np.asarray(p) for p in private_prompts(tok, 150, 7).plain_ids]
    monkeypatch.setattr(stream_decipher, "public_reference", lambda tokenizer, n: own)
    budget = Budget.named("ci")
    budget.traffic_tokens = 2_500
    res = run_log_reader(Target(), data, budget, seed=0)
    curve = res.metrics["curve"]
    assert len(curve) == 2 and [p["tokens"] >= v for p, v in zip(curve, (1_000, 2_500))] == [True, True]
    assert curve[0]["tokens"] < curve[1]["tokens"] == res.metrics["tokens_observed"]
    for p in curve:
        assert 0.0 <= p["prompt_token_recovery"] <= 1.0 and 0.0 <= p["pii_token_recovery"] <= 1.0
    assert 0.0 <= res.ttrsr <= 1.0
    # the digits are read as a unit there: SmolLM2 has the ten as single tokens
    from aloepri.attacks.log_reader import tokenizer_digits

    digits = tokenizer_digits(tok)
    assert digits is not None and len(set(digits)) == 10 and tok.decode(digits) == "0123456789"


# --- the observer with the public model reading whole requests (lm_refine: the model chooses, EM, digits) --------

class ChainLM:
    """A language model that knows the traffic's language exactly (its Markov chain): logits = log transitions."""

    def __init__(self, transitions):
        import torch

        self.logp = torch.log(torch.as_tensor(transitions, dtype=torch.float32))

    def __call__(self, input_ids, attention_mask=None, **_):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logp[input_ids])


def test_lm_read_equals_direct_scoring_padded_and_windowed(tmp_path):
    """Batched, right-padded and cut into windows, the model's reading is the same as each sequence run alone."""
    import torch

    from aloepri.attacks.log_reader import lm_read
    from aloepri.runtime.inference import load_plain_model
    from aloepri.testing.tiny import build_tiny

    model = load_plain_model(build_tiny("llama", tmp_path / "tiny", vocab_size=VOCAB))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, n) for n in (7, 30, 2, 19)]
    out = lm_read(model, seqs, top=5, batch_tokens=40)
    windowed = lm_read(model, seqs, top=5, max_len=10)
    for s, (actual, tops, vals), (w_actual, _, _) in zip(seqs, out, windowed):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.as_tensor(s)[None]).logits[0, :-1].float(), -1)
        np.testing.assert_allclose(actual, logp[torch.arange(len(s) - 1), torch.as_tensor(s[1:])].numpy(),
                                   atol=1e-4)
        np.testing.assert_allclose(vals, torch.topk(logp, 5, dim=-1).values.numpy(), atol=1e-4)
        assert tops.shape == (len(s) - 1, 5) and w_actual.shape == actual.shape
        # a window restarts the context: its first prediction differs, the ones within it are finite
        assert np.isfinite(w_actual).all()


def test_model_positive_control_own_text_and_keeps_what_it_rates_best(traffic):
    """The traffic's own text as reference and a model of its language: nearly everything; the kept map is the
    likeliest the model read (never below the start it chose)."""
    chain, plain, observed, _ = traffic
    res = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, anneal_steps=50, seed=0, lm=ChainLM(chain),
                        lm_bigram=False, lm_rounds=3)
    assert recovery(res.obf_to_plain, observed, plain) > 0.95
    reads = [e["model_ll"] for e in res.trace if e["stage"].startswith("model reads")]
    assert res.trace[-1]["stage"] == "kept (model)" and res.trace[-1]["model_ll"] >= max(reads) - 1e-9


def test_model_chooses_the_true_map_among_starts(traffic):
    """Given a random map and the true one as starts (no search), the model's likelihood picks the true one."""
    chain, plain, observed, perm = traffic
    seen = np.unique(np.concatenate(observed))
    inv = np.argsort(perm)
    truth = {int(c): int(inv[c]) for c in seen}
    rand = dict(zip(truth, np.random.default_rng(2).permutation(list(truth.values())).tolist()))
    res = decipher_logs(observed, VOCAB, markov_text(chain, 30, 60, 2), PREFIX, SUFFIX, init=rand, fresh=False,
                        block_rounds=0, anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=1,
                        extra_starts=[("truth", truth)])
    assert recovery(res.obf_to_plain, observed, plain) > 0.95
    # the same without the true map: the random start is not turned into a reading of the traffic
    assert recovery(rand_full(rand), observed, plain) < 0.05


def rand_full(mapping: dict) -> np.ndarray:
    out = np.full(VOCAB, -1, np.int64)
    out[list(mapping)] = list(mapping.values())
    return out


def test_model_negative_control_relabelled_language(traffic):
    """A model and a reference of another language with the same statistics under other ids: near chance."""
    chain, plain, observed, _ = traffic
    q = np.random.default_rng(8).permutation(VOCAB)
    inv = np.argsort(q)
    other_chain = chain[np.ix_(inv, inv)]  # P'(q[a] -> q[b]) = P(a -> b)
    other = [q[s] for s in markov_text(chain, 200, 100, 3)]
    res = decipher_logs(observed, VOCAB, other, anneal_steps=50, seed=0, lm=ChainLM(other_chain), lm_bigram=False,
                        lm_rounds=3, lm_options={"digits": list(range(10))})
    assert recovery(res.obf_to_plain, observed, plain) < 0.05
    g = res.obf_to_plain[np.unique(np.concatenate(observed))]
    assert len(np.unique(g[g >= 0])) == (g >= 0).sum()


def test_model_reading_sparse_scores_and_cover_sample():
    """The reading's per-row score of a candidate: its summed log-probability where the model ranked it in its top,
    the occurrence's floor elsewhere; the sample reads within its token budget, all requests when they fit."""
    from aloepri.attacks.log_reader import ModelReading, cover_sample

    chain = zipf_chain(0)
    rows = [np.asarray(s) % 50 for s in markov_text(chain, 6, 20, 4)]
    plain = np.arange(50) * 3
    index = np.full(VOCAB, 50, np.int64)
    index[plain] = np.arange(50)
    top = 8
    rd = ModelReading(ChainLM(chain), rows, plain, index, 50, top, 64)
    exact = np.zeros((50, 50))
    for r in rows:
        x = plain[r]
        for t in range(1, len(r)):
            lp = np.log(chain[x[t - 1]])
            floor = np.sort(lp)[-top]
            ranked = lp[plain] >= floor
            exact[r[t]] += np.where(ranked, lp[plain], floor)
    assert rd.positions == sum(len(r) - 1 for r in rows)
    score = rd.floor[:, None] + rd.bonus.toarray()
    seen = rd.occurrences > 0
    np.testing.assert_allclose(score[seen], exact[seen], rtol=1e-4, atol=1e-3)
    chosen = cover_sample(rows, 50, 60, cover=1, seed=0)
    assert 0 < sum(len(rows[i]) for i in chosen) <= 60
    assert cover_sample(rows, 50, None) == list(range(len(rows)))


def test_digits_unit_swaps_back_two_exchanged_digits(traffic):
    """Ten tokens taken as the 'digits': the truth with two of them exchanged; the digits' step, scored by a model
    of the language on windows, exchanges them back (and the kept map is one the model rates higher)."""
    chain, plain, observed, perm = traffic
    seen = np.unique(np.concatenate(observed))
    inv = np.argsort(perm)
    truth = {int(c): int(inv[c]) for c in seen}
    counts = np.bincount(np.concatenate(plain), minlength=VOCAB)
    digits = np.argsort(-counts)[5:15]  # frequent enough to be read in several contexts
    a, b = int(perm[digits[0]]), int(perm[digits[1]])
    swapped = dict(truth)
    swapped[a], swapped[b] = truth[b], truth[a]
    res = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=swapped, fresh=False, block_rounds=0,
                        anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0,
                        lm_options={"digits": digits.tolist()})
    assert res.obf_to_plain[a] == truth[a] and res.obf_to_plain[b] == truth[b]
    stages = [e["stage"] for e in res.trace]
    assert "digits: kept" in stages


def test_restarts_keep_the_likeliest_polished_start(traffic):
    """Other mean-field schedules (per-row temperatures among them), each polished by block moves: the fresh start
    is the likeliest of them under the observer's own bigram likelihood (never the key), and the search still
    recovers most of the traffic with a reference of its language."""
    chain, plain, observed, _ = traffic
    ref = markov_text(chain, 200, 100, 2)
    schedules = ({"temperatures": (2.0, 1.0, 0.5, 0.25), "mf_count_exponent": 0.5},
                 {"temperatures": (8.0, 4.0, 2.0, 1.0), "mf_iterations": 2, "damping": 0.5})
    res = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, restarts=schedules, anneal_steps=0, seed=0)
    lls = {e["stage"]: e["log_likelihood"] for e in res.trace}
    polished = [lls[f"restart {i}: block moves"] for i in range(len(schedules) + 1)]
    assert "restart 2: matching" in lls and "restart 1: mean-field T=0.25" in lls
    # block moves from the kept start only raise the likelihood: at least the best polished restart
    assert lls["fresh: block moves"] >= max(polished) - 1e-6
    assert recovery(res.obf_to_plain, observed, plain) > 0.85
    # without restarts the stages are the search's usual ones
    plain_run = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, anneal_steps=0, block_rounds=2, seed=0)
    assert not any(e["stage"].startswith("restart") for e in plain_run.trace)


def test_digits_unit_from_the_reference_puts_permuted_digits_back(traffic):
    """Ten tokens taken as the 'digits', all ten permuted in the truth's map: read as a unit by their place after the
    two preceding tokens in a reference of the traffic's language, they go back (positive control); with a
    reference whose 'digits' are relabelled among themselves, the step follows that reference instead (negative
    control: it reads the reference's structure, not the key). No other id moves."""
    chain, plain, observed, perm = traffic
    seen = np.unique(np.concatenate(observed))
    inv = np.argsort(perm)
    truth = {int(c): int(inv[c]) for c in seen}
    counts = np.bincount(np.concatenate(plain), minlength=VOCAB)
    counts[PREFIX + SUFFIX] = 0  # the template's tokens are anchors, not digits
    digits = np.argsort(-counts)[5:15]
    cyc = np.roll(digits, 3)  # every digit on another digit
    permuted = dict(truth)
    for d, e in zip(digits, cyc):
        permuted[int(perm[d])] = int(e)
    ref = markov_text(chain, 200, 100, 2)
    res = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, init=permuted, fresh=False, block_rounds=0,
                        anneal_steps=0, digits=digits.tolist())
    start = decipher_logs(observed, VOCAB, ref, PREFIX, SUFFIX, init=truth, fresh=False, block_rounds=0,
                          anneal_steps=0).obf_to_plain  # the truth as far as the candidates reach
    assert all(res.obf_to_plain[c] == start[c] for c in truth) and (start[perm[digits]] == digits).all()
    stage = next(e for e in res.trace if e["stage"] == "digits as a unit (reference)")
    assert stage["digit_score"] > stage["digit_score_before"]
    # the reference's digits relabelled among themselves: the step reads the relabelled structure
    relabel = np.arange(VOCAB)
    relabel[digits] = cyc
    other = decipher_logs(observed, VOCAB, [relabel[s] for s in ref], PREFIX, SUFFIX, init=truth, fresh=False,
                          block_rounds=0, anneal_steps=0, digits=digits.tolist())
    got = np.array([other.obf_to_plain[perm[d]] for d in digits])
    assert (got == digits).mean() < 0.2
    assert all(other.obf_to_plain[c] == start[c] for c, p in truth.items() if p not in set(digits.tolist()))


def test_digit_runs_positions_lengths_and_the_token_before():
    from aloepri.attacks.log_reader import digit_runs

    seq = np.array([7, 1, 2, 8, 3, 9, 4, 5, 6])
    is_digit = np.isin(seq, [1, 2, 3, 4, 5, 6])
    assert list(digit_runs(seq, is_digit)) == [(1, 2, 0, 7), (2, 2, 1, 7), (4, 1, 0, 8), (6, 3, 0, 9), (7, 3, 1, 9),
                                               (8, 3, 2, 9)]
    assert list(digit_runs(seq[1:3], is_digit[1:3]))[0] == (0, 2, 0, -1)  # a run at the start: no token before


def truth_and_frequent(traffic, k: int):
    """The observed ids, the true map (cipher id -> plaintext), and the cipher ids of k frequent words (not the
    template's)."""
    _, plain, observed, perm = traffic
    seen = np.unique(np.concatenate(observed))
    inv = np.argsort(perm)
    counts = np.bincount(np.concatenate(plain), minlength=VOCAB)
    counts[PREFIX + SUFFIX] = 0
    return seen, {int(c): int(inv[c]) for c in seen}, [int(perm[w]) for w in np.argsort(-counts)[3:3 + k]]


def test_model_moves_swap_back_an_exchanged_pair_and_keep_a_random_map_unread(traffic):
    """Moves of one or two ids judged by a model of the traffic's language: the truth with two frequent words
    exchanged goes back (a two-id move the model proposes and its likelihood accepts; a single-id move cannot undo
    it without a collision), and the model's likelihood of the kept map rises. Negative check: from a random map,
    with a model of another language (the same statistics under other ids), the moves read nothing of the
    traffic, and the map stays 1:1."""
    chain, plain, observed, perm = traffic
    seen, truth, (a, b) = truth_and_frequent(traffic, 2)
    swapped = dict(truth)
    swapped[a], swapped[b] = truth[b], truth[a]
    opts = {"move_evals": 30, "move_rounds": 3}
    res = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=swapped, fresh=False, block_rounds=0,
                        anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0, lm_options=opts)
    assert recovery(rand_full(swapped), observed, plain) < 0.95
    assert res.obf_to_plain[a] == truth[a] and res.obf_to_plain[b] == truth[b]
    assert recovery(res.obf_to_plain, observed, plain) > 0.99
    lls = [e["model_ll"] for e in res.trace if e["stage"].startswith("model moves")]
    assert len(lls) >= 2 and lls[-1] > lls[0]
    # the same two words kept where they are (as the digits are, with move_keep_digits): they stay exchanged
    kept = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=swapped, fresh=False, block_rounds=0,
                         anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0,
                         lm_options={**opts, "move_keep_digits": True, "digits": [truth[a], truth[b]],
                                     "digit_rounds": 0})
    assert kept.obf_to_plain[a] == truth[b] and kept.obf_to_plain[b] == truth[a]
    q = np.random.default_rng(8).permutation(VOCAB)
    qi = np.argsort(q)
    other_chain = chain[np.ix_(qi, qi)]
    rand = dict(zip(truth, np.random.default_rng(2).permutation(list(truth.values())).tolist()))
    neg = decipher_logs(observed, VOCAB, [q[s] for s in markov_text(chain, 50, 60, 3)], init=rand, fresh=False,
                        block_rounds=0, anneal_steps=0, lm=ChainLM(other_chain), lm_bigram=False, lm_rounds=0,
                        lm_options=opts)
    assert recovery(neg.obf_to_plain, observed, plain) < 0.05
    g = neg.obf_to_plain[seen]
    assert len(np.unique(g[g >= 0])) == (g >= 0).sum()


def test_model_moves_undo_a_cycle_of_three(traffic):
    """Three frequent words rotated (a reads as b's word, b as c's, c as a's): no swap of two undoes it, a cycle of
    three does, and one round of the moves finds it."""
    chain, plain, observed, perm = traffic
    _, truth, (x, y, z) = truth_and_frequent(traffic, 3)
    rotated = dict(truth)
    rotated[x], rotated[y], rotated[z] = truth[y], truth[z], truth[x]
    res = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=rotated, fresh=False, block_rounds=0,
                        anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0,
                        lm_options={"move_evals": 30, "move_rounds": 1})
    assert all(res.obf_to_plain[i] == truth[i] for i in (x, y, z))
    # without cycles of three (cycle_width 0) one round of swaps does not put it right
    two = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=rotated, fresh=False, block_rounds=0,
                        anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0,
                        lm_options={"move_evals": 30, "move_rounds": 1, "move_cycle_width": 0})
    assert recovery(two.obf_to_plain, observed, plain) < recovery(res.obf_to_plain, observed, plain)
    # ranked by the gain per occurrence, the same
    mean = decipher_logs(observed, VOCAB, plain, PREFIX, SUFFIX, init=rotated, fresh=False, block_rounds=0,
                         anneal_steps=0, lm=ChainLM(chain), lm_bigram=False, lm_rounds=0,
                         lm_options={"move_evals": 30, "move_rounds": 1, "move_rank": "mean"})
    assert all(mean.obf_to_plain[i] == truth[i] for i in (x, y, z))
