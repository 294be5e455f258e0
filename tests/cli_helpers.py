"""Helpers for the tests that drive the `aloepri` command in process (cli/test_safety.py, obfuscation/test_fp8.py):
the obfuscate command line, its exit code and stderr, the one error line it must print."""
from __future__ import annotations

from pathlib import Path

from aloepri.cli import main


def obfuscate_args(src, out, key, *extra) -> list[str]:
    return ["obfuscate", str(src), str(out), "--key-out", str(key), "--preset", "exact", "--quiet", *extra]


def run_cli(capsys, argv) -> tuple[int, str]:
    """(exit code, stderr) of the in-process CLI; argparse errors exit through SystemExit."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def one_error_line(err: str, command: str) -> str:
    """The single `aloepri COMMAND: error: ...` line of ``err``; fails on none, several, or a traceback."""
    lines = [line for line in err.splitlines() if line.startswith(f"aloepri {command}: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def one_model_at_a_time(monkeypatch):
    """Patch the loaders so that loading the obfuscated model fails while the plaintext one is still alive."""
    import gc
    import weakref

    import aloepri.runtime.inference as inference

    live, load_plain, load_obf = [], inference.load_plain_model, inference.load_obfuscated_model

    def plain(*args, **kwargs):
        model = load_plain(*args, **kwargs)
        live.append(weakref.ref(model))
        return model

    def obfuscated(*args, **kwargs):
        gc.collect()
        assert live and all(ref() is None for ref in live), "the plaintext model is still in memory"
        return load_obf(*args, **kwargs)

    monkeypatch.setattr(inference, "load_plain_model", plain)
    monkeypatch.setattr(inference, "load_obfuscated_model", obfuscated)
