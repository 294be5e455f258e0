"""Progress of the long commands (obfuscate, verify, eval fidelity, attack, audit, tune): on stderr, a count of
steps done, the elapsed time and an estimate of the time left, redrawn every second so that a long step shows it
is still running rather than a frozen estimate.

The estimate is the mean time of the steps done in this run times the steps left, less the time the current step
has already run. When the current step outlasts that estimate the bar says so ("finishing" on the last step)
instead of showing a figure that no longer means anything. Steps done by an earlier run (a resumed command) count
towards the total but not towards the mean.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

__all__ = ["Progress", "eta_text", "stage"]

_ACTIVE: list["Progress"] = []  # the bars open now, innermost last: where ``stage`` reports


def stage(what: str) -> None:
    """Name the stage of the step running now (``attacks: vma · matching embeddings``) on the innermost open bar; a
    long step with no count of its own (one attack of ``aloepri attack NAME``) then shows where it is. Nothing
    when no bar is open."""
    if _ACTIVE:
        _ACTIVE[-1].stage(what)


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def eta_text(done_here: int, seconds_done: float, left: int, current_running: float) -> str:
    """The estimate shown on the bar. ``done_here``: steps done in this run, in ``seconds_done``; ``left``: steps
    not done yet (the current one included); ``current_running``: how long the current step has run."""
    if left <= 0:
        return "done"
    if done_here == 0 and left == 1:  # the only step (one attack): its running time, no estimate to make
        return f"running {_clock(current_running)}"
    if done_here == 0:
        return f"ETA ? (first step running {_clock(current_running)})" if current_running >= 1 else "ETA ?"
    remaining = seconds_done / done_here * left - current_running
    if remaining > 0:
        return f"ETA {_clock(remaining)}"
    if left == 1:
        return f"finishing (last step running {_clock(current_running)})"
    return f"ETA ? (this step is slower than the average, running {_clock(current_running)})"


class Progress:
    """A count of ``total`` steps with an estimate of the time left, for ``with`` blocks::

        with Progress(len(items), "attacks", unit="attack") as bar:
            for item in items:
                bar.start(item.name)   # names the step running now
                ...
                bar.advance()
                bar.note(f"{item.name}: 12%")   # a line printed above the bar

    ``done``: steps an earlier run already completed (a resumed command). ``enabled=False`` prints nothing."""

    def __init__(self, total: int, desc: str, unit: str = "step", enabled: bool = True, done: int = 0):
        from tqdm.auto import tqdm

        self.total, self.desc, self.unit = total, desc, unit
        self.enabled = enabled
        self._n0 = self._n = done  # steps done before this run, steps done in all
        self._began = self._step_began = time.perf_counter()
        self._bar: Any = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._drawn: tuple | None = None  # (format, count, description) last drawn: never draw the same line twice
        if enabled:
            self._bar = tqdm(total=total, initial=done, desc=desc, unit=unit, dynamic_ncols=True,
                             bar_format=self._format("elapsed 00:00, ETA ?"))
            self._drawn = (self._bar.bar_format, self._bar.n, self._bar.desc)
            # every second on a terminal; into a log file only every minute, so the file stays readable
            interval = 1.0 if getattr(sys.stderr, "isatty", lambda: False)() else 60.0
            self._thread = threading.Thread(target=self._tick, args=(interval,), daemon=True)
            self._thread.start()
            _ACTIVE.append(self)
        self._step = ""

    @property
    def n(self) -> int:
        return self._n

    def _text(self) -> str:
        now = time.perf_counter()
        done_here = self._n - self._n0
        elapsed = now - self._began
        return (f"elapsed {_clock(elapsed)}, " +
                eta_text(done_here, self._step_began - self._began, self.total - self.n, now - self._step_began))

    def _format(self, text: str) -> str:
        """tqdm's bar_format with our own time text (tqdm's ETA assumes equal steps and freezes between them)."""
        return "{desc}: {n_fmt}/{total_fmt} " + self.unit + "s |{bar}| " + text.replace("{", "{{").replace("}", "}}")

    def _redraw(self) -> None:
        with self._lock:  # the ticking thread and the caller both redraw
            if self._bar is None:
                return
            self._bar.bar_format = self._format(self._text())
            state = (self._bar.bar_format, self._bar.n, self._bar.desc)
            # the final count is drawn once, by close(); a line equal to the last one is not drawn again (in a log
            # file every draw is a line of its own)
            if state != self._drawn and self._n < self.total:
                self._drawn = state
                self._bar.refresh()

    def _tick(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._redraw()

    def start(self, what: str) -> None:
        """Name the step that runs now (shown before the count)."""
        self._step = what
        if self._bar is not None:
            with self._lock:
                self._bar.set_description_str(f"{self.desc}: {what}" if what else self.desc, refresh=False)
            self._redraw()

    def stage(self, what: str) -> None:
        """Name the stage of the running step (after its name), with the time the stage began."""
        if self._bar is not None:
            step = f"{self._step} · {what}" if self._step else what
            with self._lock:
                self._bar.set_description_str(f"{self.desc}: {step}", refresh=False)
            self._redraw()

    def skip(self, n: int = 1) -> None:
        """Count ``n`` steps an earlier run already did (resumed): they add to the count, not to the mean time."""
        self._n0 += n
        self._count(n)

    def set_total(self, total: int) -> None:
        """Correct the number of steps once it is known (texts too short to measure, for instance)."""
        self.total = total
        if self._bar is not None:
            with self._lock:
                self._bar.total = total
            self._redraw()

    def advance(self, n: int = 1) -> None:
        self._step_began = time.perf_counter()
        self._count(n)

    def _count(self, n: int) -> None:
        self._n += n
        if self._bar is not None:
            with self._lock:
                self._bar.n = self._n  # not update(): that would draw once with the old text
            self._redraw()

    def note(self, line: str) -> None:
        """A line above the bar (nothing when the bar is off)."""
        if self._bar is not None:
            with self._lock:
                self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            with self._lock:
                self._bar.bar_format = self._format(self._text())
                self._bar.close()  # draws the final line, once
                self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
