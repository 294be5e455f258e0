"""VMA streamed from the checkpoints (the weights it uses, one layer at a time) against VMA on the loaded models, and
`aloepri attack` on a checkpoint without a tokenizer.

The streamed path must give the same numbers bit for bit (the same float32 weights, the same products), read only
the tensors VMA uses, and still fail where it should: a changed tensor changes its source's signatures, a
different public model defeats the matching, an architecture mismatch or an unknown architecture is refused.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import aloepri
from aloepri.attacks.base import AttackTarget, Budget
from aloepri.attacks.vma import ALL_PRODUCTS, CheckpointWeights, run_vma, source_signatures
from aloepri.obfuscation.checkpoint import SafetensorsCheckpoint
from aloepri.testing.tiny import build_tiny
from attack_helpers import random_private_data

CI = Budget.named("ci")


def _targets(src, out, key):
    """(a target whose models are never loaded: streamed, a target with both models loaded: in memory)."""
    streamed = AttackTarget(src, out, key)
    loaded = AttackTarget(src, out, key)
    loaded.plain_model, loaded.obf_model  # noqa: B018 - loads them
    return streamed, loaded


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2_moe"])
def test_streamed_sources_equal_the_loaded_models(tiny_dir, obfuscated, arch):
    """Every weight combination (embed.head, embed.qk, embed.gate/up, down.head, embed.router) of every layer:
    tied plaintext head (llama, qwen2, qwen3) against an untied obfuscated one, Qwen2's q/k biases (not read),
    Qwen3's q/k norms (no bilinear form), MoE routers."""
    out, _ = obfuscated(arch)
    streamed, loaded = _targets(tiny_dir(arch), out, out.parent / "key.json")
    layers = list(range(loaded.plain_model.config.num_hidden_layers))
    queries = np.arange(0, 96, 3)
    names_s, cand_s, qry_s = source_signatures(streamed, ALL_PRODUCTS, layers, layers, 128, queries)
    names_m, cand_m, qry_m = source_signatures(loaded, ALL_PRODUCTS, layers, layers, 128, queries)
    assert "plain_model" not in streamed.__dict__ and "obf_model" not in streamed.__dict__
    assert names_s == names_m and len(names_s) >= 5
    assert ("embed.qk@0" in names_s) == (arch != "qwen3")
    assert any(n.startswith("embed.router") for n in names_s) == (arch == "qwen2_moe")
    for name, a, b, c, d in zip(names_s, cand_s, cand_m, qry_s, qry_m):
        assert torch.equal(a, b) and torch.equal(c, d), name


@pytest.mark.parametrize("attack", ["vma", "gate-ia", "attn-ia", "attn-ia-sorted", "nn"])
def test_every_weight_attack_streamed_is_the_in_memory_attack(tiny_dir, obfuscated, attack):
    """The weight attacks read the same weights streamed and loaded: the same figures, and no model loaded."""
    from aloepri.attacks import REGISTRY

    out, _ = obfuscated("llama", h=16, head_permutation=False)  # Attn-IA's positive control: no head permutation
    streamed, loaded = _targets(tiny_dir("llama"), out, out.parent / "key.json")
    data = random_private_data(96)
    a, b = REGISTRY[attack](streamed, data, CI, 0), REGISTRY[attack](loaded, data, CI, 0)
    assert "error" not in a.metrics and a.metrics == b.metrics
    assert "plain_model" not in streamed.__dict__ and "obf_model" not in streamed.__dict__
    if attack != "nn":  # nn reads the embedding rows, which the key mixes: it fails here by design
        assert a.metrics["vocab_recovery_sampled"] >= 0.9


def test_ridge_rows_streamed_equal_the_loaded_models(tiny_dir, obfuscated):
    """The embedding and head rows the ridge attacks and the composed attack match (a tied plaintext head is the
    embedding; the obfuscated head is its own), streamed, are the loaded models' rows."""
    from aloepri.attacks.frequency import row_spaces

    out, _ = obfuscated("llama")
    streamed, loaded = _targets(tiny_dir("llama"), out, out.parent / "key.json")
    a, b = row_spaces(streamed), row_spaces(loaded)
    assert "plain_model" not in streamed.__dict__ and "obf_model" not in streamed.__dict__
    for x, y in zip(a.obf + a.plain, b.obf + b.plain):
        assert x.dtype == y.dtype == np.float32 and np.array_equal(x, y)
    assert np.array_equal(a.plain[0], a.plain[1]) and not np.array_equal(a.obf[0], a.obf[1])


def test_streamed_vma_is_the_in_memory_attack_and_reads_only_its_tensors(tmp_path, monkeypatch):
    """The whole attack, streamed and in memory, gives the same result; streamed, it reads the embedding, the head,
    the final norm and the ffn weights of the layers its budget picks (ci: the first and last of 4), nothing else."""
    src = build_tiny("llama", tmp_path / "src", num_hidden_layers=4)
    aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("exact"), seed=3,
                      allow_weak_seed=True, progress=False)
    streamed, loaded = _targets(src, tmp_path / "out", tmp_path / "key.json")
    read = []
    stock = SafetensorsCheckpoint.get

    def recording(self, role, layer=None, *args, **kwargs):
        read.append((role, layer))
        return stock(self, role, layer, *args, **kwargs)

    data = random_private_data(96)
    ref = run_vma(loaded, data, CI, 0)
    monkeypatch.setattr(SafetensorsCheckpoint, "get", recording)
    res = run_vma(streamed, data, CI, 0)
    assert res.metrics == ref.metrics and res.budget == ref.budget
    assert res.metrics["vocab_recovery_sampled"] >= 0.9 and res.ttrsr >= 0.9  # the positive control
    assert {layer for _, layer in read} == {None, 0, 3}
    assert {role for role, _ in read} == {"embed", "head", "final_norm", "ffn_norm", "gate", "up", "down"}


def test_streamed_vma_fails_where_it_should(tiny_dir, obfuscated, tmp_path):
    """Negative checks: a changed tensor changes exactly its sources' signatures (the comparison above can fail);
    another public model of the same shape defeats the matching; a plaintext model of another architecture and a
    checkpoint of an unknown one are refused."""
    out, _ = obfuscated("llama")
    key = out.parent / "key.json"
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    from safetensors.torch import load_file, save_file

    for f in changed.glob("*.safetensors"):
        tensors = load_file(f)
        name = "model.layers.1.mlp.gate_proj.weight"
        if name in tensors:
            tensors[name] = tensors[name].clone()
            tensors[name][0, 0] += 1e-3
            save_file(tensors, f, metadata={"format": "pt"})
    q = np.arange(96)
    names, _, qry = source_signatures(AttackTarget(tiny_dir("llama"), out, key), ALL_PRODUCTS, [0, 1], [], 128, q)
    _, _, qry_changed = source_signatures(AttackTarget(tiny_dir("llama"), changed, key), ALL_PRODUCTS, [0, 1], [],
                                          128, q)
    differ = [n for n, a, b in zip(names, qry, qry_changed) if not torch.equal(a, b)]
    assert differ == ["embed.gate@1"]

    other = build_tiny("llama", tmp_path / "other", seed=99)  # same shapes, other weights
    wrong = run_vma(AttackTarget(other, out, key), random_private_data(96), CI, 0)
    assert wrong.metrics["vocab_recovery_sampled"] < 0.5 and wrong.ttrsr < 0.5

    with pytest.raises(ValueError, match="architecture mismatch"):
        source_signatures(AttackTarget(tiny_dir("qwen3"), out, key), ALL_PRODUCTS, [0, 1], [0], 128, q)
    unknown = tmp_path / "unknown"
    shutil.copytree(out, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        CheckpointWeights(unknown)
    with pytest.raises(ValueError, match="unsupported architecture"):
        run_vma(AttackTarget(tiny_dir("llama"), unknown, key), random_private_data(96), CI, 0)


def test_attack_cli_without_a_tokenizer(tiny_dir, obfuscated, tmp_path, capsys):
    """`aloepri attack` on a checkpoint that ships no tokenizer takes the audit's path (seeded random-id prompts,
    token-level scores); an attack that tokenizes text stops with one line and exit 2, naming it."""
    from aloepri.cli import main

    out, _ = obfuscated("llama")
    args = ["--plain", str(tiny_dir("llama")), "--obfuscated", str(out), "--key", str(out.parent / "key.json"),
            "--budget", "ci", "--quiet"]
    assert main(["attack", "vma", *args, "--report-dir", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "attack_report.json").read_text())
    (res,) = report["results"]
    assert res["attack"] == "vma" and res["ttrsr"] >= 0.9 and res["piirsr"] is None
    assert report["context"]["private_prompts"]["kind"].startswith("random token ids")
    # the behavioural attack (the positive control of the synthetic 8B audit): the requests are wrapped in a
    # stand-in template of fixed public ids, as a real model's are in its public chat template
    assert main(["attack", "behavioural", *args, "--report-dir", str(tmp_path / "c")]) == 0
    (res,) = json.loads((tmp_path / "c" / "attack_report.json").read_text())["results"]
    assert res["ttrsr"] >= 0.9 and "stand-in" in res["budget"]["anchors"]["template_kind"]
    assert res["budget"]["anchors"]["template_positions_paired"] >= 1
    capsys.readouterr()
    assert main(["attack", "tfma", *args, "--report-dir", str(tmp_path / "b")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("aloepri attack: error:")]
    assert len(err) == 1 and "tfma tokenizes text" in err[0] and "ships no tokenizer" in err[0]
