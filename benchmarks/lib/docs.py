"""Report blocks in the docs: Markdown between two markers is what ``python -m benchmarks report`` renders.

    <!-- benchmarks:report EXPERIMENT --config CONFIG [--table N] -->
    ...the report of that stored config (with --table N: only its N-th table, counting from 1)...
    <!-- /benchmarks:report -->

``--config A,B`` renders one table from several configs: the rows of each config's N-th table (default the first)
under their common header, in the order given.

``render-docs`` rewrites every block from the results store; ``render-docs --check`` lists the blocks that differ
from it. Figures a report draws go to a temporary folder, so rendering writes nothing but the docs.
"""
from __future__ import annotations

import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from aloepri.storage.staging import write_text_atomic

from .registry import get_experiment
from .store import ResultStore, UsageError

REPO = Path(__file__).resolve().parents[2]
OPEN = re.compile(r"^<!-- benchmarks:report (?P<spec>.*?) -->\s*$")
CLOSE = re.compile(r"^<!-- /benchmarks:report -->\s*$")


class MarkerError(UsageError):
    """A malformed block (unclosed, nested, unknown experiment or config): named by file and line."""


@dataclass(frozen=True)
class Spec:
    experiment: str
    config: str  # one config, or several joined by commas (their tables merged)
    table: int | None = None  # 1-based index of one table of the report; None: the whole report

    @property
    def configs(self) -> list[str]:
        return self.config.split(",")

    @classmethod
    def parse(cls, text: str) -> Spec:
        words = shlex.split(text)
        if not words or words[0].startswith("-"):
            raise ValueError("names no experiment")
        experiment, options = words[0], {}
        rest = words[1:]
        while rest:
            flag = rest.pop(0)
            if flag not in ("--config", "--table") or not rest or flag in options:
                raise ValueError(f"expected `EXPERIMENT --config CONFIG [--table N]`, got {text!r}")
            options[flag] = rest.pop(0)
        if "--config" not in options:
            raise ValueError(f"{text!r} names no --config")
        if not all(options["--config"].split(",")):
            raise ValueError(f"--config {options['--config']!r} has an empty name")
        table = options.get("--table")
        if table is not None and not (table.isdigit() and int(table) >= 1):
            raise ValueError(f"--table takes a whole number from 1, got {table!r}")
        return cls(experiment, options["--config"], None if table is None else int(table))

    def __str__(self) -> str:
        return f"{self.experiment} --config {self.config}" + ("" if self.table is None else f" --table {self.table}")


@dataclass(frozen=True)
class Block:
    spec: Spec
    open_line: int  # 0-based index of the opening marker
    close_line: int  # 0-based index of the closing marker
    body: tuple[str, ...]


def parse_blocks(text: str, where: str = "<text>") -> list[Block]:
    lines = text.split("\n")
    blocks, start, spec = [], None, None
    for i, line in enumerate(lines):
        if OPEN.match(line):
            if start is not None:
                raise MarkerError(f"{where}:{i + 1}: a report block opens inside the one opened at line {start + 1}")
            try:
                spec = Spec.parse(OPEN.match(line)["spec"])
            except ValueError as e:
                raise MarkerError(f"{where}:{i + 1}: report block {e}") from None
            start = i
        elif CLOSE.match(line):
            if start is None:
                raise MarkerError(f"{where}:{i + 1}: `<!-- /benchmarks:report -->` closes no block")
            blocks.append(Block(spec, start, i, tuple(lines[start + 1:i])))
            start = None
        elif line.lstrip().startswith("<!-- benchmarks:") or line.lstrip().startswith("<!-- /benchmarks:"):
            raise MarkerError(f"{where}:{i + 1}: not a report marker: {line.strip()!r}")
    if start is not None:
        raise MarkerError(f"{where}:{start + 1}: report block `{spec}` is not closed by `<!-- /benchmarks:report -->`")
    return blocks


def tables(markdown: str) -> list[str]:
    """The Markdown tables of a text: each a maximal run of lines that start with ``|``."""
    found, current = [], []
    for line in markdown.split("\n"):
        if line.lstrip().startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current))
            current = []
    if current:
        found.append("\n".join(current))
    return found


class Renderer:
    """Renders specs from the store, each (experiment, config) report once."""

    def __init__(self, root: Path | None = None):
        self.root = root
        self._reports: dict[tuple[str, str], str] = {}
        self._figures = tempfile.TemporaryDirectory(prefix="benchmarks-render-")

    def close(self) -> None:
        self._figures.cleanup()

    def __enter__(self) -> Renderer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self, experiment: str, config: str) -> str:
        key = (experiment, config)
        if key not in self._reports:
            exp = get_experiment(experiment)
            if config not in (*exp.config_names, *exp.legacy_configs):
                raise UsageError(f"{experiment} has no config {config!r}; configs: "
                                 f"{', '.join((*exp.config_names, *exp.legacy_configs))}")
            store = ResultStore(exp.name, config, root=self.root)
            if not store.path.exists():
                raise UsageError(f"{experiment} / {config}: no stored results ({store.path})")
            store.figure_dir = Path(self._figures.name)
            self._reports[key] = exp.report(store).strip("\n")
        return self._reports[key]

    def table(self, experiment: str, config: str, n: int) -> str:
        found = tables(self.report(experiment, config))
        if n > len(found):
            raise UsageError(f"{experiment} / {config}: --table {n}, but the report has {len(found)} table(s)")
        return found[n - 1]

    def __call__(self, spec: Spec) -> str:
        if len(spec.configs) == 1:
            text = self.report(spec.experiment, spec.config)
            return text if spec.table is None else self.table(spec.experiment, spec.config, spec.table)
        parts = [self.table(spec.experiment, c, spec.table or 1).split("\n") for c in spec.configs]
        head = parts[0][:2]
        for config, part in zip(spec.configs, parts):
            if part[:2] != head:
                raise UsageError(f"{spec.experiment} / {config}: its table's header differs from "
                                 f"{spec.configs[0]}'s, so they cannot be merged")
        return "\n".join(head + [row for part in parts for row in part[2:]])


def rewrite(text: str, render: Callable[[Spec], str], where: str = "<text>") -> tuple[str, list[Block]]:
    """``text`` with every block's body replaced by its rendering, and the blocks whose body changed."""
    lines = text.split("\n")
    out, stale, done = [], [], 0
    for block in parse_blocks(text, where):
        try:
            fresh = render(block.spec).split("\n")
        except UsageError as e:
            raise MarkerError(f"{where}:{block.open_line + 1}: {e}") from None
        out += lines[done:block.open_line + 1] + fresh
        done = block.close_line
        if tuple(fresh) != block.body:
            stale.append(block)
    out += lines[done:]
    return "\n".join(out), stale


def default_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def render_docs(files: Iterable[Path], check: bool = False, root: Path | None = None) -> list[str]:
    """Render every block of ``files`` (writing the files whose blocks changed unless ``check``); returns
    ``FILE:LINE: SPEC`` for each block that was stale."""
    stale = []
    with Renderer(root) as render:
        for path in files:
            text = path.read_text()
            where = os.path.relpath(path)
            new, changed = rewrite(text, render, where)
            stale += [f"{where}:{b.open_line + 1}: {b.spec}" for b in changed]
            if changed and not check:
                write_text_atomic(path, new)
    return stale
