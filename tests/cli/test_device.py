"""``--device`` for verify / eval / attack and the Python API (aloepri.storage.devices).

On a machine without an accelerator: an explicit ``device="cpu"`` gives exactly the default results (fidelity,
perplexity, the VMA and behavioural attacks), a bad or absent device is one line and exit 2 on every command, and on
a tiny model the behavioural attack's probe batch changes nothing but the speed (batch 1 == batch N, same recovered
mapping; on a real vocabulary float32 rounding can flip a near-tie, docs/performance.md). With
CUDA present, the same runs on the GPU agree with the CPU (skipped otherwise).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackTarget, Budget, PrivateData
from aloepri.attacks.behavioural import run_behavioural
from aloepri.cli import main
from aloepri.eval.fidelity import perplexity_pair
from aloepri.eval.fidelity import compare
from aloepri.runtime.inference import load_obfuscated_model, load_plain_model
from aloepri.storage.devices import DeviceError, resolve_device
from attack_helpers import IdTokenizer  # the tiny models ship no tokenizer: text metrics need a stand-in

TEMPLATE = ([1, 10, 11, 12], [13, 14, 15])  # stand-in chat template (the tiny models ship no tokenizer)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _data(vocab: int, seed: int = 0) -> PrivateData:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(16, vocab, size=12).tolist() for _ in range(4)]
    return PrivateData([""] * 4, ids, [[j % 3 == 0 for j in range(12)] for _ in ids])


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, size=10).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def deployments(tiny_dir, tmp_path_factory):
    """The tiny Llama obfuscated without noise and with noise (explicit parameters: near-ties are likelier under
    noise, so that is where a batch-dependent result would show)."""
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("device")
    out = {}
    for name, params in {"exact": aloepri.resolve_params("exact", h=16),
                         "noisy": aloepri.resolve_params("exact", h=16, alpha_e=0.1, alpha_h=0.05)}.items():
        aloepri.obfuscate(src, work / name, work / f"{name}.key", params, seed=7, progress=False,
                          allow_weak_seed=True)
        out[name] = (src, work / name, work / f"{name}.key")
    return out


# --- resolving the device ------------------------------------------------------------------------------------------


def test_resolve_device_accepts_cpu_and_refuses_nonsense():
    assert resolve_device(None) == resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("gpu", "cuda:x", "", "meta"):
        with pytest.raises(DeviceError) as err:
            resolve_device(bad)
        assert "\n" not in str(err.value) and "cpu" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the absent-device message cannot be shown")
def test_absent_cuda_is_refused_with_the_reason():
    with pytest.raises(DeviceError, match="not available on this machine"):
        resolve_device("cuda")


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_every_device_command_refuses_a_bogus_device_in_one_line(deployments, tmp_path, capsys):
    src, out, key = deployments["exact"]
    commands = {
        "verify": ["verify", str(src), str(out), "--key", str(key), "--no-tokenizer"],
        "eval fidelity": ["eval", "fidelity", str(src), str(out), "--key", str(key)],
        "eval humaneval": ["eval", "humaneval", str(src), "--subset", "1"],
        "attack": ["attack", "vma", "--plain", str(src), "--obfuscated", str(out), "--key", str(key),
                   "--report-dir", str(tmp_path / "r")],
    }
    for name, argv in commands.items():
        err = _one_line_exit_2(capsys, argv + ["--device", "bogus"])
        assert err.startswith(f"aloepri {argv[0]}: error: unknown device 'bogus'"), (name, err)
    assert not (tmp_path / "r").exists()  # refused before anything ran


def test_attack_refuses_a_nonpositive_batch(deployments, tmp_path, capsys):
    src, out, key = deployments["exact"]
    err = _one_line_exit_2(capsys, ["attack", "behavioural", "--plain", str(src), "--obfuscated", str(out), "--key",
                                    str(key), "--batch", "0", "--report-dir", str(tmp_path / "r")])
    assert "--batch" in err


# --- explicit cpu == default -------------------------------------------------------------------------------------


def test_compare_and_perplexity_explicit_cpu_equal_default(deployments):
    src, out, key_path = deployments["noisy"]
    key = aloepri.load_key(key_path)
    plain, obf = load_plain_model(src), load_obfuscated_model(out)
    prompts = _prompts(key.vocab_size)
    default = compare(plain, obf, key, prompts, greedy_tokens=4).to_dict()
    explicit = compare(plain, obf, key, prompts, greedy_tokens=4, device="cpu").to_dict()
    assert explicit == default
    assert 0 < default["max_logit_error"] < 10 and default["positions"] == 30  # noise: a real, nonzero error
    assert perplexity_pair(plain, obf, key, prompts, device="cpu") == perplexity_pair(plain, obf, key, prompts)


def test_verify_cli_explicit_cpu_equals_default(deployments, capsys):
    src, out, key = deployments["noisy"]
    argv = ["verify", str(src), str(out), "--key", str(key), "--no-tokenizer", "--prompts", "2", "--greedy-tokens",
            "3"]
    assert main(argv) == 0
    default = capsys.readouterr().out
    assert main(argv + ["--device", "cpu"]) == 0
    assert capsys.readouterr().out == default


def test_attacks_explicit_cpu_equal_default(deployments):
    src, out, key = deployments["noisy"]
    data = _data(96)
    ci = Budget.named("ci")
    default, explicit = AttackTarget(src, out, key), AttackTarget(src, out, key, device="cpu")
    default.tokenizer = explicit.tokenizer = IdTokenizer(96)
    for name in ("vma", "isa_anchor"):
        a = REGISTRY[name](default, data, ci, 0)
        b = REGISTRY[name](explicit, data, ci, 0)
        assert a.budget["device"] == b.budget["device"] == "cpu"
        assert (a.ttrsr, a.piirsr) == (b.ttrsr, b.piirsr), name
    default, explicit = AttackTarget(src, out, key), AttackTarget(src, out, key, device="cpu")  # no tokenizer
    ra, oa = run_behavioural(default, data, ci, 0, template=TEMPLATE)
    rb, ob = run_behavioural(explicit, data, ci, 0, template=TEMPLATE)
    assert np.array_equal(oa.mapping, ob.mapping) and ra.ttrsr == rb.ttrsr


def test_attack_without_device_support_runs_on_the_cpu_target(deployments):
    src, out, key = deployments["exact"]
    target = AttackTarget(src, out, key)
    target.tokenizer = IdTokenizer(96)
    assert target.on("cpu") is target and not getattr(REGISTRY["nn"], "on_device")
    assert REGISTRY["behavioural"].on_device and REGISTRY["vma"].on_device
    res = REGISTRY["nn"](target, _data(96), Budget.named("ci"), 0)
    assert res.budget["device"] == "cpu"


# --- batching ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["exact", "noisy"])
def test_behavioural_batch_one_equals_batch_n(deployments, name):
    """The same recovered mapping and TTRSR with 1, 5 (not dividing the sequence counts) and 64 sequences per
    forward pass."""
    src, out, key = deployments[name]
    target, data = AttackTarget(src, out, key), _data(96)
    sizes: list[int] = []  # sequences per forward pass of the plaintext model
    target.plain_model.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                 with_kwargs=True)
    runs = {}
    for batch in (1, 5, 64):
        budget = Budget.named("ci")
        budget.batch = batch
        sizes.clear()
        res, outcome = run_behavioural(target, data, budget, 0, template=TEMPLATE)
        assert res.budget["batch"] == res.budget["gen_batch"] == res.budget["rerank_batch"] == batch
        # the batch is what the model really gets (the ci budget's first profile round has 32 sequences)
        assert max(sizes) == min(batch, 32), (batch, sorted(set(sizes)))
        runs[batch] = (res, outcome)
    res1, out1 = runs[1]
    assert res1.metrics["vocab_recovery"] > 0.5  # the attack works here, so equality is not between two failures
    for batch in (5, 64):
        res, outcome = runs[batch]
        assert np.array_equal(outcome.mapping, out1.mapping), batch
        assert np.array_equal(outcome.confident, out1.confident), batch
        assert (res.ttrsr, res.piirsr) == (res1.ttrsr, res1.piirsr)


# --- CUDA parity (a GPU machine only) ----------------------------------------------------------------------------


@CUDA
def test_cuda_fidelity_matches_cpu(deployments):
    src, out, key_path = deployments["noisy"]
    key = aloepri.load_key(key_path)
    prompts = _prompts(key.vocab_size)
    cpu = compare(load_plain_model(src), load_obfuscated_model(out), key, prompts, greedy_tokens=4)
    gpu = compare(load_plain_model(src), load_obfuscated_model(out), key, prompts, greedy_tokens=4, device="cuda")
    assert gpu.top1_agreement == cpu.top1_agreement and gpu.positions == cpu.positions
    assert abs(gpu.mean_kl - cpu.mean_kl) <= 1e-4 + 1e-3 * cpu.mean_kl
    assert abs(gpu.max_logit_error - cpu.max_logit_error) <= 1e-3


@CUDA
def test_cuda_attacks_match_cpu(deployments):
    src, out, key = deployments["exact"]
    data, ci = _data(96), Budget.named("ci")
    cpu, gpu = AttackTarget(src, out, key), AttackTarget(src, out, key, device="cuda")
    cpu.tokenizer = gpu.tokenizer = gpu.on("cpu").tokenizer = IdTokenizer(96)
    assert gpu.plain_model.device.type == "cuda"
    for name in ("vma", "isa_anchor", "nn"):
        a, b = REGISTRY[name](cpu, data, ci, 0), REGISTRY[name](gpu, data, ci, 0)
        assert b.budget["device"] == ("cuda:0" if REGISTRY[name].on_device else "cpu")
        assert abs(a.ttrsr - b.ttrsr) <= 0.02, (name, a.ttrsr, b.ttrsr)
    cpu, gpu = AttackTarget(src, out, key), AttackTarget(src, out, key, device="cuda")  # no tokenizer
    ra, _ = run_behavioural(cpu, data, ci, 0, template=TEMPLATE)
    rb, _ = run_behavioural(gpu, data, ci, 0, template=TEMPLATE)
    assert abs(ra.metrics["vocab_recovery"] - rb.metrics["vocab_recovery"]) <= 0.02
