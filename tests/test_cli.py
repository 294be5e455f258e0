import json
import os
import stat

from aloepri.cli import main


def test_obfuscate_then_verify_tiny_without_tokenizer(tiny_dir, tmp_path, capsys):
    out, key = tmp_path / "server", tmp_path / "client.key"
    rc = main(["obfuscate", str(tiny_dir("qwen2")), str(out), "--key-out", str(key), "--preset", "exact",
               "--seed", "11", "--allow-weak-seed", "--h", "8", "--quiet"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["h"] >= 8 and info["h"] % 2 == 0 and (48 + 2 * info["h"]) % 6 == 0
    assert info["hidden_size"] == 48 + 2 * info["h"]
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert json.loads(key.read_text())["params"]["h"] == 8  # requested value kept; effective value beside it
    rc = main(["verify", str(tiny_dir("qwen2")), str(out), "--key", str(key), "--no-tokenizer", "--prompts", "3",
               "--greedy-tokens", "5"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top1_agreement"] == 1.0 and report["greedy_match_rate"] == 1.0
    assert report["max_logit_error"] < 1e-4


def test_overrides_change_the_artifact(tiny_dir, tmp_path, capsys):
    args = lambda name, extra: ["obfuscate", str(tiny_dir("llama")), str(tmp_path / name), "--key-out",  # noqa: E731
                                str(tmp_path / f"{name}.key"), "--seed", "3", "--allow-weak-seed", "--preset", "exact",
                                "--quiet"] + extra
    assert main(args("a", [])) == 0
    assert main(args("b", ["--alpha-e", "0.5"])) == 0
    ka = json.loads((tmp_path / "a.key").read_text())
    kb = json.loads((tmp_path / "b.key").read_text())
    assert ka["params"]["alpha_e"] == 0.0 and kb["params"]["alpha_e"] == 0.5
    assert ka["model_fingerprint"] != kb["model_fingerprint"]
    assert ka["vocab_permutation"] == kb["vocab_permutation"]  # same seed, same permutation; noise differs
