"""Results of one (experiment, config): ``benchmarks/results/<experiment>/<config>.json``.

Several processes may write one file (parallel seeds, a killed run resumed): every write is read-merge-write
under an exclusive ``flock`` on a sibling lock file, and lands by an atomic rename, so a killed run leaves the
previous complete file. Each run appends its provenance (command, commit, versions, machine, time, settings);
every entry records which run wrote it.

A file written with other settings than the config now has is refused (SettingsMismatchError) instead of
silently mixing results: rerun with ``--fresh`` or save under another config name.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .provenance import now, provenance

RESULTS = Path(__file__).resolve().parents[1] / "results"
FORMAT = 1


class UsageError(ValueError):
    """A bad command line or state the user must fix: reported in one line, exit 2."""


class SettingsMismatchError(UsageError):
    pass


class ResultStore:
    def __init__(self, experiment: str, config: str, settings: dict | None = None, root: Path | None = None):
        self.experiment = experiment
        self.config = config
        self.settings = settings
        self.path = (root or RESULTS) / experiment / f"{config}.json"
        self.run_index: int | None = None
        self.figure_dir: Path | None = None  # where reports draw their figures; None: beside the results

    # ---- reading
    def load(self) -> dict:
        if not self.path.exists():
            return {"format": FORMAT, "experiment": self.experiment, "config": self.config,
                    "settings": self.settings, "runs": [], "entries": {}}
        data = json.loads(self.path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{self.path}: not a results file of format {FORMAT}")
        return data

    def entries(self) -> dict[str, dict]:
        """The stored values as they were put (without the store's own ``run`` and ``written`` fields)."""
        return {k: _value(v) for k, v in self.load()["entries"].items()}

    def written_by(self, key: str) -> dict | None:
        """The run record (provenance) of the run that wrote ``key``."""
        data = self.load()
        entry = data["entries"].get(key)
        return data["runs"][entry["run"]] if isinstance(entry, dict) and entry.get("run") is not None else None

    def has(self, key: str) -> bool:
        return key in self.load()["entries"]

    def get(self, key: str) -> dict | None:
        return self.entries().get(key)

    # ---- writing
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f".{self.config}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self.load()
            yield data
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.config}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=False)
                    f.write("\n")
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    def begin(self, argv: list[str] | None = None, fresh: bool = False) -> int:
        """Record this run's provenance; refuse a file written with other settings unless ``fresh``."""
        with self._locked() as data:
            if fresh:
                data.update(settings=self.settings, runs=[], entries={})
            elif data["runs"] and self.settings is not None and data.get("settings") != self.settings:
                raise SettingsMismatchError(
                    f"{self.path} holds results of other settings ({_diff(data.get('settings'), self.settings)}); "
                    f"rerun with --fresh to replace them, or --save-as NAME to keep both")
            data["settings"] = self.settings
            data["runs"].append(provenance(argv, self.settings))
            self.run_index = len(data["runs"]) - 1
        return self.run_index

    def abandon(self) -> None:
        """Take back this run's record when it stored nothing (a run that failed before its first result), and the
        file with it when no other run is left in it."""
        if self.run_index is None:
            return
        with self._locked() as data:
            used = any(e.get("run") == self.run_index for e in data["entries"].values() if isinstance(e, dict))
            if not used and self.run_index == len(data["runs"]) - 1:
                data["runs"].pop()
        if not self.load()["runs"] and not self.load()["entries"]:
            self.path.unlink(missing_ok=True)
        self.run_index = None

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Store one finished unit of work (resumable runs skip keys that ``has``). On disk the entry also holds two
        fields of the store's own, ``run`` (index into the file's run records) and ``written`` (UTC time);
        ``entries()`` gives the value without them."""
        if not isinstance(value, dict):
            raise TypeError("a result entry is a dict")
        with self._locked() as data:
            data["entries"][key] = {**value, "run": self.run_index, "written": now()}

    def update(self, key: str, **fields: Any) -> None:
        """Merge fields into an entry (a run that fills one entry in steps)."""
        with self._locked() as data:
            entry = data["entries"].setdefault(key, {})
            entry.update(fields, run=self.run_index, written=now())

    def figure_path(self, suffix: str = ".png") -> Path:
        folder = self.figure_dir or self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        return folder / self.path.with_suffix(suffix).name


_OWN_FIELDS = ("run", "written")


def _value(entry):
    return {k: v for k, v in entry.items() if k not in _OWN_FIELDS} if isinstance(entry, dict) else entry


def _diff(old: dict | None, new: dict | None) -> str:
    old, new = old or {}, new or {}
    keys = sorted(set(old) | set(new))
    changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(changed[:6]) + (" ..." if len(changed) > 6 else "")


def import_legacy(experiment: str, config: str, entries: dict[str, dict], command: str, note: str = "",
                  root: Path | None = None) -> Path:
    """Write results measured before this store existed as ``<experiment>/<config>.json``: their run record says
    so (no commit, versions or machine were saved then) and quotes the command that produced them."""
    store = ResultStore(experiment, config, settings=None, root=root)
    if store.path.exists():
        raise FileExistsError(f"{store.path} exists")
    with store._locked() as data:
        data["runs"] = [{"legacy": True, "command": command, "note": note or
                         "written before the experiment system: no commit, versions or machine were recorded"}]
        data["entries"] = {k: {**(v if isinstance(v, dict) else {"value": v}), "run": 0} for k, v in entries.items()}
    return store.path
