"""Crash-safe staging of outputs: temporary siblings tagged with their owner, found and removed by a rerun.

Every temporary output (model directory, key file, GGUF file) is a hidden sibling of its destination named
``.<name>.<owner>.<random><suffix>`` where ``<owner>`` identifies the writing process (host, pid and the pid's
start time, so a recycled pid is not mistaken for the writer). A later run for the same destination removes the
siblings whose owner is gone (a SIGKILL, a power cut) and leaves those of a live process alone, reporting them.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

_TAG_PREFIX = "aloepri-"


class DestinationError(ValueError):
    """An output location that cannot be written (checked before any work)."""


def _host_id() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> str:
    """The process start time in clock ticks since boot (Linux), or "0" where /proc is unavailable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before ")" may contain spaces


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{_TAG_PREFIX}{_host_id()}-{pid}-{_start_time(pid)}"


def _owner_alive(tag: str) -> bool | None:
    """True/False for a tag of this host; None when another host (or an unreadable tag) wrote it."""
    try:
        host, pid, start = tag[len(_TAG_PREFIX):].split("-")
        pid_int = int(pid)
    except ValueError:
        return None
    if host != _host_id():
        return None
    try:
        os.kill(pid_int, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start == "0" or _start_time(pid_int) == start


def staging_prefix(target: Path) -> str:
    return f".{target.name}.{owner_tag()}."


def _siblings(target: Path, suffix: str) -> list[tuple[Path, bool | None]]:
    """Temporary siblings of ``target`` ending in ``suffix``, each with whether its writer is alive."""
    parent = target.parent
    if not parent.is_dir():
        return []
    head = f".{target.name}."
    found = []
    for p in sorted(parent.iterdir()):
        if p.name.startswith(head) and p.name.endswith(suffix) and len(p.name) > len(head) + len(suffix):
            tag = p.name[len(head):].split(".", 1)[0]
            # an untagged sibling (an older aloepri) has an unknown writer: reported, never removed
            found.append((p, _owner_alive(tag) if tag.startswith(_TAG_PREFIX) else None))
    return found


def dead_siblings(target: Path, suffix: str) -> list[Path]:
    return [p for p, alive in _siblings(target, suffix) if alive is False]


def clean_stale(target: Path, suffix: str, what: str) -> list[Path]:
    """Remove the temporary siblings of ``target`` ending in ``suffix`` whose writer is dead; report (stderr)
    the ones of a live or unknown writer. Returns the removed paths."""
    removed = []
    for p, alive in _siblings(target, suffix):
        if alive is False:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
            print(f"aloepri: removed {p}, a {what} left by an interrupted run", file=sys.stderr)
        else:
            who = "a running process" if alive else "another host, an older aloepri or an unknown writer"
            print(f"aloepri: left {p} alone: a {what} of {who}; delete it if no aloepri run is active",
                  file=sys.stderr)
    return removed


def make_staging_dir(target: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=staging_prefix(target), suffix=".partial", dir=target.parent))


def make_staging_file(target: Path, suffix: str) -> tuple[int, Path]:
    """A new temporary file next to ``target`` (mode 0600 from creation): (open fd, path)."""
    fd, name = tempfile.mkstemp(prefix=staging_prefix(target), suffix=suffix, dir=target.parent)
    return fd, Path(name)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text output whole or not at all: a staged sibling, given ordinary modes, renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_staging_file(path, ".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        give_ordinary_modes(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def current_umask() -> int:
    """The process umask (Python can only read it by setting it; it is set back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def give_ordinary_modes(path: Path) -> None:
    """Give a finished public output (a server checkpoint, a GGUF file) the modes of an ordinary file or checkpoint:
    directories 0777 and files 0666, less the umask (0755 and 0644 under the usual 022). Staging creates them 0700
    and 0600 (mkdtemp, mkstemp), which only the key file should keep; some writers then keep that mode and some
    do not, so every entry is set here."""
    mask = current_umask()
    path = Path(path)
    if path.is_dir():
        for entry in path.rglob("*"):
            if not entry.is_symlink():
                os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def check_writable_destination(path: Path, what: str) -> None:
    """Fail before any work if ``path`` could not be created: its nearest existing ancestor must be a writable
    directory (probed by creating and removing a file, which also catches read-only mounts when run as root)."""
    path = Path(path).absolute()
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DestinationError(f"cannot write the {what} {path}: {ancestor} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".aloepri-write-probe.", dir=ancestor)
    except OSError as e:
        raise DestinationError(f"cannot write the {what} {path}: {ancestor} is not writable ({e.strerror}); "
                               "choose another location") from None
    os.close(fd)
    os.unlink(probe)
