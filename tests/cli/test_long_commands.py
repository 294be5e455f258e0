"""The long commands (verify, eval fidelity, attack, tune) keep what they measured when stopped and resume from it,
and their progress estimate says "finishing" rather than freezing on a figure the last step has outlived."""
from __future__ import annotations

import json

import numpy as np
import pytest

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, PrivateData
from aloepri.attacks.report import run_suite
from aloepri.cli import main
from aloepri.eval import fidelity
from aloepri.eval.tuning import ResultStore, sweep
from aloepri.progress import Progress, eta_text


@pytest.fixture(scope="module")
def deployment(tiny_dir, tmp_path_factory):
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("long")
    aloepri.obfuscate(src, work / "out", work / "key.json", aloepri.resolve_params("default"), seed=5,
                      progress=False, allow_weak_seed=True)
    return src, work / "out", work / "key.json"


def _stop_after(monkeypatch, owner, name: str, calls: int) -> list:
    """Make ``owner.name`` raise KeyboardInterrupt (a user's ^C) on call number ``calls + 1``; returns the log of
    calls made."""
    real, made = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        if len(made) == calls:
            raise KeyboardInterrupt
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return made


# --- the estimate ---------------------------------------------------------------------------------------------------


def test_eta_is_the_mean_step_less_the_current_steps_time():
    assert eta_text(2, 20.0, 3, 4.0) == "ETA 00:26"  # 10 s a step, 3 left, 4 s into the current one
    assert eta_text(0, 0.0, 3, 0.0) == "ETA ?"
    assert eta_text(0, 0.0, 3, 75.0) == "ETA ? (first step running 01:15)"
    assert eta_text(7, 70.0, 0, 0.0) == "done"


def test_a_step_that_outlasts_the_estimate_says_so_instead_of_freezing():
    # the audit's report: 7/8 "ETA 00:24" for 267 s; the last step is now "finishing", with its running time
    assert eta_text(7, 168.0, 1, 267.0) == "finishing (last step running 04:27)"
    assert eta_text(3, 30.0, 4, 100.0).startswith("ETA ? (this step is slower than the average")


def test_a_single_step_shows_its_running_time_and_stage_and_the_final_line_is_drawn_once(monkeypatch):
    import io
    import sys as _sys

    from aloepri.progress import stage

    assert eta_text(0, 0.0, 1, 75.0) == "running 01:15"  # one attack: no "ETA ?" for its whole run
    err = io.StringIO()
    monkeypatch.setattr(_sys, "stderr", err)
    with Progress(1, "attacks", unit="attack") as bar:
        bar.start("vma")
        stage("matching embeddings")
        assert "attacks: vma · matching embeddings" in err.getvalue()
        bar.advance()
    stage("after the bar closed")  # no bar open: nothing drawn, no error
    lines = [ln.strip() for ln in err.getvalue().replace("\r", "\n").split("\n") if ln.strip()]
    assert sum("1/1" in ln for ln in lines) == 1, lines
    assert "after the bar closed" not in err.getvalue()


def test_progress_counts_resumed_steps_but_not_their_time():
    bar = Progress(5, "x", enabled=False, done=2)
    bar.skip()
    bar.advance()
    assert bar.n == 4 and bar._n0 == 3  # only the advanced step enters the mean
    bar.close()


# --- verify and eval fidelity -----------------------------------------------------------------------------------


def test_a_stopped_verify_keeps_its_prompts_and_a_rerun_measures_only_the_rest(deployment, tmp_path, capsys,
                                                                              monkeypatch):
    src, out, key = deployment
    argv = ["verify", str(src), str(out), "--key", str(key), "--no-tokenizer", "--prompts", "5", "--greedy-tokens",
            "3", "--quiet"]
    assert main(argv) == 0
    uninterrupted = json.loads(capsys.readouterr().out)

    results = tmp_path / "verify.json"
    made = _stop_after(monkeypatch, fidelity.ModelPair, "measure", 2)
    with pytest.raises(KeyboardInterrupt):
        main(argv + ["--results", str(results)])
    assert len(json.loads(results.read_text())) == 2  # what it measured before the stop

    monkeypatch.undo()
    made = _stop_after(monkeypatch, fidelity.ModelPair, "measure", 99)
    assert main(argv + ["--results", str(results)]) == 0
    assert len(made) == 3  # only the prompts the first run did not reach
    assert json.loads(capsys.readouterr().out) == uninterrupted


class CharIds:
    """Stand-in tokenizer for the tiny models (they ship none): one id per character."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [2 + ord(c) % 90 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True) -> list[int]:
        return [1] + self(messages[0]["content"])["input_ids"][:12]


def test_eval_fidelity_resumes_prompts_and_corpus_texts(deployment, tmp_path, monkeypatch):
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model

    src, out, key_path = deployment
    key = aloepri.load_key(key_path)
    plain, obf = load_plain_model(src), load_obfuscated_model(out)
    monkeypatch.setattr(fidelity, "corpus_texts", lambda name, n: ([f"{i} is a text" for i in range(n)], "t"))
    kw = dict(prompts=2, greedy_tokens=2, corpus_texts_n=3, max_tokens=8)
    whole = fidelity.fidelity_report(plain, obf, key, CharIds(), **kw)

    store = ResultStore(tmp_path / "fid.json")
    _stop_after(monkeypatch, fidelity.ModelPair, "measure", 3)  # both prompts and one corpus text
    with pytest.raises(KeyboardInterrupt):
        fidelity.fidelity_report(plain, obf, key, CharIds(), store=store, **kw)
    assert len(store.load()) == 3
    monkeypatch.undo()
    monkeypatch.setattr(fidelity, "corpus_texts", lambda name, n: ([f"{i} is a text" for i in range(n)], "t"))
    made = _stop_after(monkeypatch, fidelity.ModelPair, "measure", 99)
    with Progress(5, "fidelity", enabled=False) as bar:
        resumed = fidelity.fidelity_report(plain, obf, key, CharIds(), store=store, progress=bar, **kw)
        assert bar.n == 5 and bar._n0 == 3
    assert len(made) == 2 and resumed == whole


# --- attack ---------------------------------------------------------------------------------------------------------


def _private(vocab: int) -> PrivateData:
    rng = np.random.default_rng(0)
    ids = [rng.integers(16, vocab, size=10).tolist() for _ in range(3)]
    return PrivateData([""] * 3, ids, [[j % 3 == 0 for j in range(10)] for _ in ids])


def test_a_stopped_attack_run_leaves_a_report_and_a_rerun_skips_finished_attacks(deployment, tmp_path, monkeypatch):
    src, out, key = deployment
    target = AttackTarget(src, out, key)
    names = ["vma", "gate-ia", "nn"]
    context = {"run": {"plain": str(src), "budget": "ci"}}
    calls = []
    for name in names:
        real = REGISTRY[name]

        def counted(*args, _real=real, _name=name):
            calls.append(_name)
            if _name == "gate-ia" and len(calls) == 2:
                raise KeyboardInterrupt  # the user stops the run during the second attack
            return _real(*args)

        monkeypatch.setitem(REGISTRY, name, counted)
    with pytest.raises(KeyboardInterrupt):
        run_suite(target, _private(target.vocab_size), names, "ci", tmp_path, context, progress=False, log=None)
    partial = json.loads((tmp_path / "attack_report.json").read_text())
    assert [r["attack"] for r in partial["results"]] == ["vma"]
    assert partial["context"]["complete"] is False and partial["context"]["pending"] == ["gate-ia", "nn"]
    assert "Partial report" in (tmp_path / "attack_report.md").read_text()

    run_suite(target, _private(target.vocab_size), names, "ci", tmp_path, context, progress=False, log=None)
    assert calls == ["vma", "gate-ia", "gate-ia", "nn"]  # vma was not run again
    full = json.loads((tmp_path / "attack_report.json").read_text())
    assert [r["attack"] for r in full["results"]] == names and full["context"]["complete"] is True
    assert full["results"][0] == partial["results"][0]

    # another run (other budget) in the same directory starts afresh
    run_suite(target, _private(target.vocab_size), ["vma"], "ci", tmp_path, {"run": {"budget": "small"}},
              progress=False, log=None)
    assert calls[-1] == "vma"


# --- tune -----------------------------------------------------------------------------------------------------------


class FakeEvaluator:
    """The sweep's view of an evaluator, without models: each setting's figures from its alpha_e."""

    src = __import__("pathlib").Path("model")
    attacks, budget, fidelity_prompts, private_prompts = ("vma",), "ci", 2, 2

    def __init__(self, stop_at: float | None = None):
        self.stop_at, self.seen = stop_at, []

    def evaluate(self, params, seed, stage=lambda what: None):
        if params.alpha_e == self.stop_at:
            raise KeyboardInterrupt
        self.seen.append(params.alpha_e)
        stage("attack 1/1 vma")
        return {"params": params.to_dict(), "seed": seed, "max_ttrsr": 1 - params.alpha_e, "seconds": 0.0,
                "fidelity": {"top1_agreement": 1 - params.alpha_e / 2, "mean_kl": params.alpha_e}, "attacks": {}}


def test_a_stopped_tune_keeps_its_settings_and_resumes(tmp_path):
    settings = [aloepri.resolve_params("noisy", alpha_e=a) for a in (0.1, 0.2, 0.3)]
    store = ResultStore(tmp_path / "tune.json")
    first = FakeEvaluator(stop_at=0.3)
    with pytest.raises(KeyboardInterrupt):
        sweep(first, settings, store, progress=False)
    assert first.seen == [0.1, 0.2] and len(store.load()) == 2  # the interrupted setting is released
    second = FakeEvaluator()
    assert len(sweep(second, settings, store, progress=True)) == 3
    assert second.seen == [0.3]
