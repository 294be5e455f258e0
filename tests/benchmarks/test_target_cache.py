"""The benchmark target cache (benchmarks/lib/targets.py): keyed on the format version and the parameters, bounded
by a size cap with least-recently-used eviction, shown and pruned by `python -m benchmarks cache`."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.lib import targets

REPO = Path(__file__).resolve().parents[2]


def _entry(path: Path, size: int, hours_ago: float) -> Path:
    path.mkdir(parents=True)
    (path / "data").write_bytes(b"\0" * size)
    when = time.time() - hours_ago * 3600
    (path / targets.USED).touch()
    os.utime(path / targets.USED, (when, when))
    return path


def test_prune_removes_the_least_recently_used_down_to_the_cap(tmp_path):
    old = _entry(tmp_path / "a-1", 1000, 10)
    middle = _entry(tmp_path / "b-2", 1000, 5)
    recent = _entry(tmp_path / "c-3", 1000, 0.1)  # in use, maybe: never evicted automatically
    quantized = tmp_path / "gguf" / "d-4-q8_0.gguf"  # a group's child is an entry of its own
    quantized.parent.mkdir()
    quantized.write_bytes(b"\0" * 1000)
    os.utime(quantized, (time.time() - 20 * 3600,) * 2)
    assert [e.path for e in targets.entries(tmp_path)] == [quantized, old, middle, recent]

    removed = targets.prune(2500, work=tmp_path)
    assert [e.path for e in removed] == [quantized, old] and middle.exists() and recent.exists()
    assert targets.prune(0, keep=(middle,), work=tmp_path) == [] and recent.exists()  # kept, recent
    assert [e.path for e in targets.prune(0, work=tmp_path, recent_seconds=0)] == [middle, recent]


def test_using_an_entry_makes_it_recent(tmp_path):
    a, b = _entry(tmp_path / "a-1", 10, 10), _entry(tmp_path / "b-2", 10, 5)
    targets.touch(a)
    assert [e.path for e in targets.entries(tmp_path)] == [b, a]


def test_the_cap_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(targets.CAP_ENV, raising=False)
    assert targets.cap_bytes() == int(targets.DEFAULT_CAP_GB * 1e9)
    monkeypatch.setenv(targets.CAP_ENV, "1.5")
    assert targets.cap_bytes() == 1_500_000_000
    for bad in ("x", "-1", "nan"):
        monkeypatch.setenv(targets.CAP_ENV, bad)
        with pytest.raises(ValueError, match=targets.CAP_ENV):
            targets.cap_bytes()


def test_the_key_is_the_format_version_and_the_parameters_not_the_code(tmp_path, monkeypatch):
    import aloepri

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    params = aloepri.resolve_params("default")
    key = targets.cache_key(src, params, 1)
    monkeypatch.setattr(targets, "FORMAT_VERSION", targets.FORMAT_VERSION + 1)
    assert targets.cache_key(src, params, 1) != key
    monkeypatch.undo()
    assert targets.cache_key(src, params, 1) == key


def test_the_cache_command_shows_and_prunes(tmp_path):
    _entry(tmp_path / "a-1", 2000, 10)
    _entry(tmp_path / "b-2", 2000, 0.1)
    env = {**os.environ, "ALOEPRI_BENCH_WORK": str(tmp_path)}

    def cache(*args):
        return subprocess.run([sys.executable, "-m", "benchmarks", "cache", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    shown = cache()
    assert shown.returncode == 0 and "2 entries" in shown.stdout and "a-1" in shown.stdout
    pruned = cache("--prune", "--max-gb", "0")
    assert pruned.returncode == 0 and "removed" in pruned.stdout and not (tmp_path / "a-1").exists()
    assert (tmp_path / "b-2").exists()  # used recently: kept unless --all
    assert cache("--prune", "--max-gb", "0", "--all").returncode == 0 and not (tmp_path / "b-2").exists()
    bad = cache("--prune", "--max-gb", "-1")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --max-gb")
