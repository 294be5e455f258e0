"""Bad input and secret handling: clear errors, nothing half-written, no secret in the server artifact."""
import json
import os
import stat

import pytest

import aloepri
from aloepri import CheckpointError, KeyMismatchError, UnsupportedArchitectureError
from aloepri.cli import main as cli_main

EXACT = aloepri.resolve_params("exact")


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_key_mode_0600_and_outside_server_dir(tiny_dir, tmp_path):
    aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "client" / "key.json", EXACT, seed=1,
                      allow_weak_seed=True, progress=False)
    mode = stat.S_IMODE(os.stat(tmp_path / "client" / "key.json").st_mode)
    assert mode == 0o600
    with pytest.raises(ValueError, match="inside the server directory"):
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out2", tmp_path / "out2" / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert not (tmp_path / "out2").exists()


def test_server_artifact_holds_no_secret(tiny_dir, tmp_path):
    aloepri.obfuscate(tiny_dir("qwen2"), tmp_path / "out", tmp_path / "key.json", EXACT, seed=424242,
                      allow_weak_seed=True, progress=False)
    key = aloepri.load_key(tmp_path / "key.json")
    perm_text = json.dumps(key.vocab_permutation[:8])[1:-1]  # a run of the secret mapping as it is serialised
    for f in (tmp_path / "out").iterdir():
        data = f.read_bytes()
        assert b"vocab_permutation" not in data and b"424242" not in data, f.name
        assert perm_text.encode() not in data, f.name
        assert b'"seed"' not in data, f.name
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == key.obfuscated_eos_ids()[0] == key.vocab_permutation[2]


def test_fingerprint_mismatch_refused(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    aloepri.obfuscate(src, tmp_path / "a", tmp_path / "a.key", EXACT, seed=1, allow_weak_seed=True, progress=False)
    aloepri.obfuscate(src, tmp_path / "b", tmp_path / "b.key", EXACT, seed=2, allow_weak_seed=True, progress=False)
    key_a = aloepri.load_key(tmp_path / "a.key")
    aloepri.check_key_matches(key_a, tmp_path / "a")
    with pytest.raises(KeyMismatchError, match="does not belong"):
        aloepri.check_key_matches(key_a, tmp_path / "b")
    from aloepri.runtime.inference import PrivateModel

    with pytest.raises(KeyMismatchError):
        PrivateModel(tmp_path / "a.key", tmp_path / "b")


def test_unknown_architecture_is_a_clear_error(tiny_dir, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_dir("llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "key.json").exists()
    assert _siblings(tmp_path / "out") == ["src"]  # no partial directory left behind


def _sharded_copy(tiny_dir, tmp_path):
    """The tiny model re-saved as several shards with an index."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2")).save_pretrained(src, max_shard_size="20KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    return src, index


def test_truncated_shard_is_refused_and_nothing_written(tiny_dir, tmp_path):
    src, index = _sharded_copy(tiny_dir, tmp_path)
    shard = src / sorted(set(index["weight_map"].values()))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert _siblings(tmp_path / "out") == ["sharded"]


def test_missing_index_entry_is_refused(tiny_dir, tmp_path):
    src, index = _sharded_copy(tiny_dir, tmp_path)
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert _siblings(tmp_path / "out") == ["sharded"]


def test_sharded_source_gives_same_model_as_single_file(tiny_dir, tmp_path):
    src, _ = _sharded_copy(tiny_dir, tmp_path)
    a = aloepri.obfuscate(src, tmp_path / "a", tmp_path / "a.key", EXACT, seed=9, allow_weak_seed=True, progress=False)
    b = aloepri.obfuscate(tiny_dir("qwen2"), tmp_path / "b", tmp_path / "b.key", EXACT, seed=9,
                          allow_weak_seed=True, progress=False)
    assert a.fingerprint == b.fingerprint  # same seed, same weights -> same artifact, whatever the sharding


def test_failure_midway_leaves_no_partial_output(tiny_dir, tmp_path, monkeypatch):
    from aloepri.obfuscation import pipeline

    calls = {"n": 0}
    real = pipeline._obfuscate_layer

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "_obfuscate_layer", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "key.json").exists()
    assert [p for p in tmp_path.iterdir()] == []


def test_existing_output_needs_force(tiny_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_malformed_key_file(tmp_path):
    p = tmp_path / "k.json"
    p.write_text("{not json")
    with pytest.raises(aloepri.KeyFileError, match="not a JSON key file"):
        aloepri.load_key(p)
    p.write_text(json.dumps({"format": "aloepri-key", "version": 1, "vocab_permutation": [0, 0, 1]}))
    with pytest.raises(aloepri.KeyFileError, match="lacks"):
        aloepri.load_key(p)
    p.write_text(json.dumps({"format": "aloepri-key", "version": 1, "vocab_permutation": [0, 0, 1],
                             "model_fingerprint": "x", "params": {}, "seed": 1, "h_effective": 2, "hidden_size": 4,
                             "source": "s", "architecture": "llama"}))
    with pytest.raises(aloepri.KeyFileError, match="not a permutation"):
        aloepri.load_key(p)


def test_cli_reports_errors_without_traceback(tiny_dir, tmp_path, capsys):
    rc = cli_main(["obfuscate", str(tmp_path / "nope"), str(tmp_path / "out"), "--key-out", str(tmp_path / "k"),
                   "--seed", "1", "--allow-weak-seed", "--quiet"])
    assert rc == 2
    assert "no such file or directory" in capsys.readouterr().err
    rc = cli_main(["obfuscate", str(tiny_dir("llama")), str(tmp_path / "out"), "--key-out", str(tmp_path / "k"),
                   "--seed", "1", "--allow-weak-seed", "--preset", "exact", "--lam", "-1", "--quiet"])
    assert rc == 2 and "lam must be >= 0" in capsys.readouterr().err
