"""Safety of every user-facing path: the secret comes from the OS CSPRNG and stays in the key file (mode 0600,
never inside the server directory, no trace in the server artifact); every bad input or fault is one clear line
with exit code 2 (a clear exception in the API) and leaves nothing behind; a killed run does not block its rerun.

Every case goes through the real CLI (``aloepri.cli.main`` in process; one subprocess run for what ``ps`` shows,
and killed subprocesses for the crash cases) or the Python API.
"""
import errno
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aloepri
from aloepri import CheckpointError, KeyMismatchError, UnsupportedArchitectureError
from aloepri.cli import main
from aloepri.obfuscation.keymat import derive_rng
from aloepri.storage.staging import owner_tag
from cli_helpers import entries, obfuscate_args, one_error_line, run_cli

SRC_DIR = str(Path(aloepri.__file__).resolve().parents[1])
EXACT = aloepri.resolve_params("exact")


# ---------------------------------------------------------------------------------------------------------------
# 1. key secrecy


def _seed_search(server_dir: Path, limit: int) -> list[int]:
    """A seed search from the server directory alone: every seed below ``limit`` whose vocabulary
    permutation sends the plaintext special ids (public: the source model's config) to the published ones."""
    gen = json.loads((server_dir / "generation_config.json").read_text())
    n = json.loads((server_dir / "config.json").read_text())["vocab_size"]
    plain = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # the tiny source model's
    found = []
    for s in range(limit):
        perm = derive_rng(s, "vocab").permutation(n)
        if all(int(perm[plain[k]]) == gen[k] for k in plain):
            found.append(s)
    return found


def test_seed_search_from_server_files_fails_on_a_default_key(tiny_dir, tmp_path, capsys):
    src = tiny_dir("llama")
    # control: the search does find a short seed (so it can fail)
    assert main(obfuscate_args(src, tmp_path / "weak", tmp_path / "weak.key", "--seed", "4242",
                               "--allow-weak-seed")) == 0
    weak = aloepri.load_key(tmp_path / "weak.key")
    found = _seed_search(tmp_path / "weak", 10_000)
    assert 4242 in found
    assert any(list(derive_rng(s, "vocab").permutation(weak.vocab_size)) == weak.vocab_permutation for s in found)
    # the default: no --seed
    assert main(obfuscate_args(src, tmp_path / "out", tmp_path / "k.key")) == 0
    key = aloepri.load_key(tmp_path / "k.key")
    assert key.seed.bit_length() > 192  # 256 random bits; fewer than 193 has probability 2**-64
    candidates = _seed_search(tmp_path / "out", 10_000)  # special ids match by chance about once in 860k seeds
    regenerated = [s for s in candidates
                   if list(derive_rng(s, "vocab").permutation(key.vocab_size)) == key.vocab_permutation]
    assert regenerated == []


def test_two_runs_without_seed_give_different_keys(tiny_dir, tmp_path, capsys):
    src = tiny_dir("qwen2")
    for name in "ab":
        assert main(obfuscate_args(src, tmp_path / name, tmp_path / f"{name}.key")) == 0
    a, b = aloepri.load_key(tmp_path / "a.key"), aloepri.load_key(tmp_path / "b.key")
    assert a.seed != b.seed and a.vocab_permutation != b.vocab_permutation
    assert a.model_fingerprint != b.model_fingerprint
    # the seed is stored as a decimal string (JSON readers with 53-bit numbers keep it exact)
    raw = json.loads((tmp_path / "a.key").read_text())
    assert raw["seed"] == str(a.seed)
    # nothing on the server side depends on the secret except the permuted ids it must know (EOS, BOS, PAD)
    assert entries(tmp_path / "a") == entries(tmp_path / "b")
    assert json.loads((tmp_path / "a" / "aloepri_model.json").read_text()).keys() == {
        "format", "version", "model_fingerprint", "fingerprint_tensors", "hidden_size", "source_architecture"}


def test_short_seed_is_refused_unless_asked_for(tiny_dir, tmp_path, capsys):
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key",
                                             "--seed", "31337"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "fewer than 128" in line and "--allow-weak-seed" in line and "31337" not in line
    assert entries(tmp_path) == []
    with pytest.raises(ValueError, match="allow_weak_seed=True"):
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", EXACT, seed=7, progress=False)
    for bad in (-1, 1.5, True, "7"):
        with pytest.raises(ValueError, match="non-negative integer"):
            aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", EXACT, seed=bad,
                              allow_weak_seed=True, progress=False)
    assert entries(tmp_path) == []
    # a full-entropy seed given explicitly is accepted and reproduces the key
    seed = 2**200 + 12345
    for name in "ab":
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / name, tmp_path / f"{name}.key", EXACT, seed=seed,
                          progress=False)
    assert aloepri.load_key(tmp_path / "a.key").vocab_permutation == aloepri.load_key(tmp_path / "b.key").vocab_permutation


def test_old_keys_with_a_numeric_seed_still_load(tiny_dir, tmp_path):
    aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", EXACT, seed=5, allow_weak_seed=True,
                      progress=False)
    raw = json.loads((tmp_path / "k.key").read_text())
    raw["seed"] = 5  # how version-1 keys were written before the seed became a string
    (tmp_path / "old.key").write_text(json.dumps(raw))
    old = aloepri.load_key(tmp_path / "old.key")
    assert old.seed == 5 and old.vocab_permutation == aloepri.load_key(tmp_path / "k.key").vocab_permutation
    aloepri.check_key_matches(old, tmp_path / "out")


def _descendants(pid: int) -> set[int]:
    children = {pid}
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = proc_stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) in children:
            children.add(int(proc_stat.parent.name))
    return children


def test_the_seed_appears_only_in_the_key_file(tiny_dir, tmp_path):
    """A real `aloepri obfuscate` process: what `ps` shows of it and of anything it starts, its output, the
    server directory (names and bytes) and its GGUF export hold no trace of the seed."""
    out, key_path = tmp_path / "server", tmp_path / "client" / "k.key"
    env = {**os.environ, "PYTHONPATH": SRC_DIR, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "aloepri.cli", *obfuscate_args(tiny_dir("llama"), out, key_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    while proc.poll() is None:  # sample the command lines of the process tree while it runs
        for pid in _descendants(proc.pid):
            for name in ("cmdline", "environ"):
                try:
                    seen.add(Path(f"/proc/{pid}/{name}").read_bytes())
                except OSError:
                    pass
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    assert seen
    seed = aloepri.load_key(key_path).seed
    secrets_as_text = [str(seed).encode(), f"{seed:x}".encode(), f"{seed:X}".encode()]
    from aloepri.export.gguf import export_gguf

    export_gguf(out, tmp_path / "m.gguf", "f32")
    blobs = list(seen) + [stdout.encode(), stderr.encode(), (tmp_path / "m.gguf").read_bytes()]
    for f in out.rglob("*"):
        blobs.append(f.name.encode())
        if f.is_file():
            blobs.append(f.read_bytes())
    for blob in blobs:
        for text in secrets_as_text:
            assert text not in blob
    assert key_path.read_text().count(str(seed)) == 1


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_server_files_get_ordinary_modes_and_the_key_alone_0600(tiny_dir, tmp_path, umask):
    """The artifact is a public checkpoint: directories 0777 and files 0666 less the umask, every shard alike
    (staging makes them 0700/0600 and safetensors' writer keeps that mode on some files), also the exported GGUF;
    only the key is 0600."""
    from aloepri.export.gguf import export_gguf

    old = os.umask(umask)
    try:
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False, max_shard_bytes=4096)
        export_gguf(tmp_path / "out", tmp_path / "m.gguf", "f32")
    finally:
        os.umask(old)
    entries = [tmp_path / "out", *(tmp_path / "out").rglob("*")]
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 2  # several shards, each checked
    modes = {e.relative_to(tmp_path).as_posix(): stat.S_IMODE(e.stat().st_mode) for e in entries}
    assert modes == {k: (0o777 if (tmp_path / k).is_dir() else 0o666) & ~umask for k in modes}
    assert stat.S_IMODE((tmp_path / "m.gguf").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "key.json").stat().st_mode) == 0o600


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


# ---------------------------------------------------------------------------------------------------------------
# 2. parameters


@pytest.mark.parametrize("flags, message", [
    (["--alpha-e", "nan"], "alpha_e must be a finite number"),
    (["--alpha-h", "inf"], "alpha_h must be a finite number"),
    (["--lam=-inf"], "lam must be a finite number"),
    (["--gamma", "0"], "gamma must be > 0"),
    (["--qk-scale-range", "1e300"], "qk_scale_range must be <= 1000"),
    (["--h", "7"], "h must be an even integer"),
    (["--h", "1000000"], "h must be an even integer in [0, 32768]"),
    (["--h", "-2"], "h must be an even integer in [0, 32768]"),
    (["--outlier-dims", "65"], "outlier_dims must be an integer in [0, 64]"),
    (["--max-shard-gb", "0"], "--max-shard-gb must be > 0"),
    (["--max-shard-gb", "-1"], "--max-shard-gb must be > 0"),
    (["--max-shard-gb", "nan"], "--max-shard-gb must be a finite number"),
    (["--max-shard-gb", "inf"], "--max-shard-gb must be a finite number"),
])
def test_bad_parameter_values_are_refused(tiny_dir, tmp_path, capsys, flags, message):
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", *flags))
    assert rc == 2 and message in one_error_line(err, "obfuscate")
    assert entries(tmp_path) == []


@pytest.mark.parametrize("flags", [["--head-permutation", "maybe"], ["--shared-c", "2"], ["--h", "8.0"],
                                   ["--beta", "x"]])
def test_unparsable_values_are_refused_by_the_parser(tiny_dir, tmp_path, capsys, flags):
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", *flags))
    assert rc == 2 and f"argument {flags[0]}:" in one_error_line(err, "obfuscate")
    assert entries(tmp_path) == []


def test_booleans_accept_only_real_spellings(tiny_dir, tmp_path, capsys):
    from aloepri.cli import parse_bool

    assert [parse_bool(s) for s in ("true", "On", "1", "yes", "false", "OFF", "0", "no")] == [True] * 4 + [False] * 4
    assert main(obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", "--head-permutation",
                               "off")) == 0
    assert json.loads((tmp_path / "k.key").read_text())["params"]["head_permutation"] is False


@pytest.mark.parametrize("overrides, message", [
    (dict(alpha_e=float("nan")), "alpha_e must be a finite number"),
    (dict(alpha_h=float("inf")), "alpha_h must be a finite number"),
    (dict(head_permutation="maybe"), "head_permutation must be true or false"),
    (dict(head_permutation=1), "head_permutation must be true or false"),
    (dict(h=128.0), "h must be an integer"),
    (dict(h=True), "h must be an integer"),
    (dict(alpha_e="0.1"), "alpha_e must be a number"),
    (dict(noise_shape="round"), "noise_shape must be one of"),
    (dict(beta=0), "beta must be >= 1"),
])
def test_api_validates_like_the_cli(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        aloepri.resolve_params("default", **overrides)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        aloepri.ObfuscationParams(**overrides)


def test_preset_files_are_validated_and_named(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "presets" / "bad.json"
    bad.parent.mkdir()
    for body, message in [('{"params": {"alpha_e": NaN}}', "alpha_e must be a finite number"),
                          ('{"params": {"head_permutation": "maybe"}}', "head_permutation must be true or false"),
                          ('{"params": {"alpah_e": 0.1}}', "unknown parameter"),
                          ("[1, 2]", "expected a JSON object"),
                          ("{not json", "not a JSON preset")]:
        bad.write_text(body)
        rc, err = run_cli(capsys, ["obfuscate", tiny_dir("llama"), tmp_path / "out", "--key-out", tmp_path / "k.key",
                                   "--preset-file", bad, "--quiet"])
        line = one_error_line(err, "obfuscate")
        assert rc == 2 and message in line and str(bad) in line, line
    assert entries(tmp_path) == ["presets"]


def test_no_nan_or_infinity_can_reach_a_key_file(tmp_path):
    key = aloepri.KeyFile(vocab_permutation=[1, 0], model_fingerprint="f", params={"alpha_e": math.nan}, seed=3,
                          h_effective=2, hidden_size=4, source="s", architecture="llama")
    with pytest.raises(ValueError, match="JSON compliant"):
        key.to_json()
    from aloepri.keyfile import write_key

    with pytest.raises(ValueError):
        write_key(key, tmp_path / "k.key")
    assert entries(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# 3. sources, keys and the key <-> model binding (Python API)


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
    src = tmp_path / "src"
    shutil.copytree(tiny_dir("llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "key.json").exists()
    assert entries(tmp_path) == ["src"]  # no partial directory left behind


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
    assert entries(tmp_path) == ["sharded"]


def test_missing_index_entry_is_refused(tiny_dir, tmp_path):
    src, index = _sharded_copy(tiny_dir, tmp_path)
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", EXACT, seed=1,
                          allow_weak_seed=True, progress=False)
    assert entries(tmp_path) == ["sharded"]


def test_sharded_source_gives_same_model_as_single_file(tiny_dir, tmp_path):
    src, _ = _sharded_copy(tiny_dir, tmp_path)
    a = aloepri.obfuscate(src, tmp_path / "a", tmp_path / "a.key", EXACT, seed=9, allow_weak_seed=True, progress=False)
    b = aloepri.obfuscate(tiny_dir("qwen2"), tmp_path / "b", tmp_path / "b.key", EXACT, seed=9,
                          allow_weak_seed=True, progress=False)
    assert a.fingerprint == b.fingerprint  # same seed, same weights -> same artifact, whatever the sharding


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


# ---------------------------------------------------------------------------------------------------------------
# 4. crash safety


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


_CRASH_CHILD = r"""
import os, signal, sys
from aloepri import resolve_params
from aloepri.obfuscation import checkpoint, pipeline

scenario, src, out, key = sys.argv[1:5]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if scenario == "midway":  # killed while writing the layers (a few shards are on disk)
    real, calls = pipeline._obfuscate_layer, []
    def layer(*a, **k):
        calls.append(1)
        return die() if len(calls) == 2 else real(*a, **k)
    pipeline._obfuscate_layer = layer
elif scenario == "before-commit":  # the key is staged, the model complete but not renamed into place
    checkpoint.AtomicOutputDir.commit = die
elif scenario == "before-key":  # the model is in place, the key still staged
    pipeline.publish_key = die
pipeline.obfuscate(src, out, key, resolve_params("exact"), max_shard_bytes=20_000, progress=False)
"""

_SCENARIOS = ("midway", "before-commit", "before-key")


@pytest.fixture(scope="module")
def crashed_runs(tiny_dir, tmp_path_factory):
    """One SIGKILLed obfuscation per scenario (run side by side), each in its own directory."""
    root = tmp_path_factory.mktemp("crashes")
    env = {**os.environ, "PYTHONPATH": SRC_DIR, "OMP_NUM_THREADS": "1"}
    procs = {}
    for sc in _SCENARIOS:
        (root / sc).mkdir()
        args = [sc, str(tiny_dir("llama")), str(root / sc / "out"), str(root / sc / "keys" / "k.key")]
        procs[sc] = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, *args], env=env, stderr=subprocess.PIPE,
                                     text=True)
    for sc, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == -signal.SIGKILL, (sc, p.returncode, err)
    return root


def test_rerun_after_a_kill_midway_removes_the_partial_output(tiny_dir, crashed_runs, capsys):
    d = crashed_runs / "midway"
    partial = [p for p in d.iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1 and any(partial[0].glob("*.safetensors"))  # what the kill left
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), d / "out", d / "keys" / "k.key"))
    assert rc == 0, err
    assert f"removed {partial[0]}" in err
    assert entries(d) == ["keys", "out"] and entries(d / "keys") == ["k.key"]
    aloepri.check_key_matches(aloepri.load_key(d / "keys" / "k.key"), d / "out")


def test_rerun_after_a_kill_before_commit_is_not_blocked_by_a_key(tiny_dir, crashed_runs, capsys):
    d = crashed_runs / "before-commit"
    staged = list((d / "keys").iterdir())
    assert not (d / "out").exists() and not (d / "keys" / "k.key").exists()  # no orphan key in place
    assert len(staged) == 1 and staged[0].name.endswith(".tmp") and (staged[0].stat().st_mode & 0o777) == 0o600
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), d / "out", d / "keys" / "k.key"))
    assert rc == 0, err
    assert "staged key left by an interrupted run" in err and "partial output left by an interrupted run" in err
    assert entries(d) == ["keys", "out"] and entries(d / "keys") == ["k.key"]
    aloepri.check_key_matches(aloepri.load_key(d / "keys" / "k.key"), d / "out")


def test_rerun_after_a_kill_before_the_key_rename_recovers_the_key(tiny_dir, crashed_runs, capsys):
    d = crashed_runs / "before-key"
    assert (d / "out" / "aloepri_model.json").is_file() and not (d / "keys" / "k.key").exists()
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), d / "out", d / "keys" / "k.key"))
    assert "recovered the key" in err
    assert rc == 2 and "belongs to the model already in" in one_error_line(err, "obfuscate")
    assert entries(d / "keys") == ["k.key"]
    aloepri.check_key_matches(aloepri.load_key(d / "keys" / "k.key"), d / "out")


def test_the_partial_output_of_a_live_run_is_left_alone(tiny_dir, tmp_path, capsys):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = tmp_path / f".out.{owner_tag(sleeper.pid)}.abc123.partial"
        live.mkdir()
        (live / "model-00001.safetensors").write_bytes(b"in progress")
        legacy = tmp_path / ".out.x1y2z3.partial"  # an older aloepri's: no owner in the name
        legacy.mkdir()
        rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key"))
        assert rc == 0 and f"left {live} alone" in err and "running process" in err
        assert f"left {legacy} alone" in err and "older aloepri" in err and legacy.is_dir()
        assert (live / "model-00001.safetensors").read_bytes() == b"in progress"
    finally:
        sleeper.kill()
        sleeper.wait()
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", "--force"))
    assert rc == 0 and f"removed {live}" in err and not live.exists()


def test_an_orphan_key_is_reported_clearly(tiny_dir, tmp_path, capsys):
    """A key whose model is not at the output (an older version's interrupted run, or a key reused for a new
    output): refused with what to do, nothing else touched; --force replaces it."""
    aloepri.obfuscate(tiny_dir("llama"), tmp_path / "old", tmp_path / "k.key", EXACT, progress=False)
    shutil.rmtree(tmp_path / "old")
    before = (tmp_path / "k.key").read_bytes()
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "is not in" in line and "output is missing" in line and "--force" in line
    assert entries(tmp_path) == ["k.key"] and (tmp_path / "k.key").read_bytes() == before
    assert main(obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", "--force")) == 0
    aloepri.check_key_matches(aloepri.load_key(tmp_path / "k.key"), tmp_path / "out")


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory nobody can create files in: chmod for a normal user; /sys (sysfs) when running as root."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d
    try:
        fd = os.open("/sys/.aloepri-probe", os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError:
        return Path("/sys")
    os.close(fd)
    os.unlink("/sys/.aloepri-probe")
    pytest.skip("no read-only directory available to root here")


@pytest.mark.parametrize("which", ["out", "key"])
def test_every_destination_is_checked_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch, which):
    from aloepri.obfuscation import pipeline

    def not_reached(*a, **k):
        raise AssertionError("the source was opened before the destinations were checked")

    monkeypatch.setattr(pipeline, "open_checkpoint", not_reached)
    ro = _read_only_dir(tmp_path)
    out = ro / "server" if which == "out" else tmp_path / "out"
    key = ro / "keys" / "k.key" if which == "key" else tmp_path / "k.key"
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), out, key))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "not writable" in line and ("key file" if which == "key" else "output directory") in line
    assert [p for p in tmp_path.iterdir() if p.name != "ro"] == []
    # a path through a regular file
    (tmp_path / "file").write_text("x")
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "file" / "k.key"))
    assert rc == 2 and "is not a directory" in one_error_line(err, "obfuscate")


def test_a_relative_source_is_stored_as_an_absolute_tokenizer_path(tiny_dir, tmp_path, monkeypatch):
    from aloepri.runtime.inference import load_tokenizer
    from aloepri.obfuscation.server_tokenizer import write_hf_tokenizer

    src = tmp_path / "models" / "src"
    shutil.copytree(tiny_dir("llama"), src)
    write_hf_tokenizer(src, 96, 2, 128)  # any tokenizer files: the test is about where the key points
    monkeypatch.chdir(tmp_path / "models")
    assert main(obfuscate_args("src", tmp_path / "out", tmp_path / "k.key")) == 0
    key = aloepri.load_key(tmp_path / "k.key")
    where = Path(key.tokenizer["pretrained_model_name_or_path"])
    assert where.is_absolute() and where == src.resolve() and Path(key.source) == src.resolve()
    monkeypatch.chdir(tmp_path)  # elsewhere, offline: the tokenizer still loads from disk
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_tokenizer(key).vocab_size == 96


def test_export_gguf_refuses_a_directory_aloepri_did_not_write(tiny_dir, tmp_path, capsys):
    rc, err = run_cli(capsys, ["export-gguf", tiny_dir("llama"), "--outfile", tmp_path / "m.gguf"])
    line = one_error_line(err, "export-gguf")
    assert rc == 2 and "was not written by aloepri" in line and "--allow-foreign" in line
    assert entries(tmp_path) == []
    assert main(["export-gguf", str(tiny_dir("llama")), "--outfile", str(tmp_path / "m.gguf"), "--allow-foreign",
                 "--quiet"]) == 0
    assert entries(tmp_path) == ["m.gguf"]


# ---------------------------------------------------------------------------------------------------------------
# 5. faults that used to be tracebacks


def _edited_copy(tiny_dir, tmp_path, **config) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_dir("llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("config, tensor", [({"hidden_size": 64}, "model.embed_tokens.weight"),
                                            ({"intermediate_size": 96}, "model.layers.0.mlp.gate_proj.weight"),
                                            ({"num_key_value_heads": 3}, "model.layers.0.self_attn.k_proj.weight")])
def test_config_weight_shape_mismatch(tiny_dir, tmp_path, capsys, config, tensor):
    src = _edited_copy(tiny_dir, tmp_path, **config)
    rc, err = run_cli(capsys, obfuscate_args(src, tmp_path / "out", tmp_path / "k.key"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and tensor in line and "config.json implies" in line
    assert entries(tmp_path) == ["src"]


def test_disk_full_while_writing(tiny_dir, tmp_path, capsys, monkeypatch):
    from aloepri.obfuscation import checkpoint

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / "model-00002.safetensors"))

    real = checkpoint.ShardedWriter._flush
    calls = []
    monkeypatch.setattr(checkpoint.ShardedWriter, "_flush",
                        lambda self: (calls.append(1), real(self) if len(calls) < 2 else full(self))[1])
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "keys" / "k.key",
                                             "--max-shard-gb", "2e-5"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "No space left on device" in line and "free some space" in line
    assert entries(tmp_path) == []  # no partial directory, no key, no staged key


def test_unreasonable_h_is_refused_before_sampling(tiny_dir, tmp_path, capsys, monkeypatch):
    from aloepri.obfuscation import pipeline

    def not_reached(*a, **k):
        raise AssertionError("secrets were sampled")

    monkeypatch.setattr(pipeline, "SecretSampler", not_reached)
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key", "--h", "30000"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "choose a smaller --h" in line and "GiB" in line
    assert entries(tmp_path) == []


def test_memory_error_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    from aloepri.obfuscation import pipeline

    def oom(*a, **k):
        raise MemoryError()

    monkeypatch.setattr(pipeline, "SecretSampler", oom)
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k.key"))
    assert rc == 2 and "out of memory" in one_error_line(err, "obfuscate")
    assert entries(tmp_path) == []


@pytest.fixture
def obfuscated(tiny_dir, tmp_path):
    out, key = tmp_path / "out", tmp_path / "k.key"
    aloepri.obfuscate(tiny_dir("llama"), out, key, EXACT, progress=False, max_shard_bytes=20_000)
    return out, key


def _verify(capsys, tiny_dir, out, key):
    return run_cli(capsys, ["verify", tiny_dir("llama"), out, "--key", key, "--no-tokenizer", "--prompts", "1",
                            "--greedy-tokens", "2"])


@pytest.mark.parametrize("edit, message", [
    (lambda k: {**k, "vocab_permutation": "abc"}, "vocab_permutation is not a list of integers"),
    (lambda k: {**k, "vocab_permutation": [str(i) for i in k["vocab_permutation"]]},
     "vocab_permutation is not a list of integers"),
    (lambda k: {**k, "seed": "0x12"}, "seed is not a non-negative integer"),
    (lambda k: {**k, "hidden_size": "big"}, "hidden_size is not a non-negative integer"),
])
def test_malformed_key_fields_name_the_file(tiny_dir, obfuscated, tmp_path, capsys, edit, message):
    out, key = obfuscated
    bad = tmp_path / "bad.key"
    bad.write_text(json.dumps(edit(json.loads(key.read_text()))))
    rc, err = _verify(capsys, tiny_dir, out, bad)
    line = one_error_line(err, "verify")
    assert rc == 2 and message in line and str(bad) in line


def test_binary_key_file_names_the_file(tiny_dir, obfuscated, tmp_path, capsys):
    out, _ = obfuscated
    bad = tmp_path / "photo.key"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00" + bytes(range(256)))
    rc, err = _verify(capsys, tiny_dir, out, bad)
    line = one_error_line(err, "verify")
    assert rc == 2 and str(bad) in line and "binary content" in line


def test_key_of_the_right_model_but_wrong_vocabulary_length(tiny_dir, obfuscated, tmp_path, capsys, monkeypatch):
    import aloepri.eval.fidelity
    import aloepri.runtime.inference

    def not_reached(*a, **k):
        raise AssertionError("a model was loaded before the key was checked")

    monkeypatch.setattr(aloepri.runtime.inference, "load_plain_model", not_reached)
    out, key = obfuscated
    raw = json.loads(key.read_text())
    n = len(raw["vocab_permutation"])
    raw["vocab_permutation"] = [i for i in raw["vocab_permutation"] if i != n - 1]  # still a permutation, of n-1
    bad = tmp_path / "short.key"
    bad.write_text(json.dumps(raw))
    rc, err = _verify(capsys, tiny_dir, out, bad)
    line = one_error_line(err, "verify")
    assert rc == 2 and f"has {n - 1} entries" in line and f"vocab_size {n}" in line
    from aloepri.runtime.inference import PrivateModel

    with pytest.raises(aloepri.KeyMismatchError, match="vocab_size"):
        PrivateModel(bad, out)


def test_export_of_a_truncated_shard(obfuscated, tmp_path, capsys):
    out, _ = obfuscated
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    rc, err = run_cli(capsys, ["export-gguf", out, "--outfile", tmp_path / "gguf" / "m.gguf"])
    line = one_error_line(err, "export-gguf")
    assert rc == 2 and "truncated" in line and shards[1].name in line
    assert not (tmp_path / "gguf").exists()


def test_export_onto_a_directory_with_force(obfuscated, tmp_path, capsys):
    out, _ = obfuscated
    target = tmp_path / "existing"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    rc, err = run_cli(capsys, ["export-gguf", out, "--outfile", target, "--force"])
    assert rc == 2 and "is a directory" in one_error_line(err, "export-gguf")
    assert entries(target) == ["keep.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["existing", "k.key", "out"]


def test_cli_reports_errors_without_traceback(tiny_dir, tmp_path, capsys):
    rc, err = run_cli(capsys, obfuscate_args(tmp_path / "nope", tmp_path / "out", tmp_path / "k", "--seed", "1",
                                             "--allow-weak-seed"))
    assert rc == 2 and "no such file or directory" in one_error_line(err, "obfuscate")
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("llama"), tmp_path / "out", tmp_path / "k", "--seed", "1",
                                             "--allow-weak-seed", "--lam", "-1"))
    assert rc == 2 and "lam must be >= 0" in one_error_line(err, "obfuscate")
    assert entries(tmp_path) == []


def test_cli_error_messages_are_single_lines():
    from aloepri.cli import error_message

    assert error_message(OSError(errno.EROFS, "Read-only file system", "/mnt/x")) == (
        "cannot access /mnt/x: Read-only file system; choose a writable destination")
    assert error_message(ValueError("two\nlines")) == "two lines"
    assert "out of memory" in error_message(MemoryError())
