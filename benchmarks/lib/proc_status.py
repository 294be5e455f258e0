"""This process's memory as the kernel counts it (/proc/self/status). VmHWM belongs to this process image (reset by
exec), where ru_maxrss would inherit the parent's high-water mark. Self-contained (stdlib only): the children run
by path under another revision's source import it as a top-level module."""
from __future__ import annotations


def status_kib(field: str = "VmHWM") -> int:
    """A /proc/self/status field in KiB (VmHWM: peak RSS, VmRSS: current RSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
