"""Resumable result files: one JSON file of ``{key: entry}`` that a long command writes as it goes (each setting
of a sweep, each prompt of a fidelity run), so a stopped run keeps what it measured and a rerun with the same file
skips it. Several processes can share a file: every read-modify-write holds an exclusive lock, and a key is claimed
before it is computed, so two workers split a sweep. Writes are atomic (a reader never sees half a file)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["ResultStore"]


class ResultStore:
    """One JSON file of {key: entry}; entries are {"status": "running"|"done", ...}. Safe for parallel workers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.path.with_suffix(self.path.suffix + ".lock")

    @contextlib.contextmanager
    def _locked(self):
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(self.path.read_text()) if self.path.exists() else {}
                yield data
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
                os.replace(tmp, self.path)  # readers never see a half-written file
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def load(self) -> dict[str, Any]:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def claim(self, key: str, info: dict[str, Any], redo: bool = False) -> bool:
        """True if this process should compute ``key``: not done (or done but ``redo``: the caller found the
        stored entry insufficient) and not running in a live process."""
        with self._locked() as data:
            entry = data.get(key)
            if entry and entry.get("status") == "done" and not redo:
                return False
            if entry and entry.get("status") == "running" and _alive(entry.get("pid")) and entry.get("pid") != os.getpid():
                return False
            data[key] = {**info, "status": "running", "pid": os.getpid(), "started": time.time()}
            return True

    def put(self, key: str, entry: dict[str, Any]) -> None:
        with self._locked() as data:
            data[key] = {**entry, "status": "done"}

    def release(self, key: str) -> None:
        with self._locked() as data:
            if data.get(key, {}).get("status") == "running":
                del data[key]


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False
