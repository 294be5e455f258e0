"""Report blocks in the docs: Markdown between two markers is what ``python -m benchmarks report`` renders.

    <!-- benchmarks:report EXPERIMENT --config CONFIG [--table N] -->
    ...the report of that stored config (with --table N: only its N-th table, counting from 1)...
    <!-- /benchmarks:report -->

``--config A,B`` renders one table from several configs: the rows of each config's N-th table (default the first)
under their common header, in the order given.

A figure inside a sentence is an inline marker, one stored value (or the range of several) formatted::

    <!-- fig EXPERIMENT --config C[,C2...] --entry KEY[,KEY2...] --field PATH [--fmt FMT] [--agg range|min|max] -->36.9%<!-- /fig -->

``PATH`` is dotted into the entry (``by_stream_frequency.stream_rank_1-100.recovery``); ``FMT`` one of ``FORMATS``.
Several configs or entries give every (config, entry) value: ``--agg range`` (default) prints ``lo-hi`` (one figure
when they format alike), ``min`` / ``max`` one of them. On GitHub the markers are invisible comments.

``render-docs`` rewrites every block and inline figure from the results store; ``render-docs --check`` lists those
that differ from it. Figures a report draws go to a temporary folder, so rendering writes nothing but the docs (and
the generated files of ``GENERATED``: the audit's measured context, rendered into the package).
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
INLINE = re.compile(r"<!-- fig (?P<spec>[^<>]*?) -->(?P<body>[^<]*)<!-- /fig -->")
INLINE_START = re.compile(r"<!-- */?fig\b")


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


def _percent(digits: int) -> Callable[[float], str]:
    return lambda v: f"{100 * v:.{digits}f}%"


FORMATS: dict[str, Callable[[float], str]] = {
    "pct": _percent(1), "pct0": _percent(0), "pct2": _percent(2),  # a fraction shown as a percentage
    "f0": lambda v: f"{v:.0f}", "f1": lambda v: f"{v:.1f}", "f2": lambda v: f"{v:.2f}", "f3": lambda v: f"{v:.3f}",
    "f4": lambda v: f"{v:.4f}", "sci": lambda v: f"{v:.1e}", "int": lambda v: f"{round(v):,}",
    "min": lambda v: f"{v / 60:.1f} min",  # seconds shown in minutes
    "gib": lambda v: f"{v:.1f} GiB",
}
UNITS = ("%", " min", " GiB")


@dataclass(frozen=True)
class FigSpec:
    """One inline figure: stored values of ``field`` in ``entries`` of ``configs``, formatted."""
    experiment: str
    configs: tuple[str, ...]
    entries: tuple[str, ...]
    field: str
    fmt: str = "f3"
    agg: str = "range"

    @classmethod
    def parse(cls, text: str) -> FigSpec:
        words = shlex.split(text)
        if not words or words[0].startswith("-"):
            raise ValueError("names no experiment")
        options, rest = {}, words[1:]
        while rest:
            flag = rest.pop(0)
            if flag not in ("--config", "--entry", "--field", "--fmt", "--agg") or not rest or flag in options:
                raise ValueError(f"expected `EXPERIMENT --config C --entry KEY --field PATH [--fmt F] [--agg A]`, "
                                 f"got {text!r}")
            options[flag] = rest.pop(0)
        for need in ("--config", "--entry", "--field"):
            if need not in options:
                raise ValueError(f"{text!r} names no {need}")
        fmt, agg = options.get("--fmt", "f3"), options.get("--agg", "range")
        if fmt not in FORMATS:
            raise ValueError(f"--fmt {fmt!r} is not one of {', '.join(FORMATS)}")
        if agg not in ("range", "min", "max"):
            raise ValueError(f"--agg {agg!r} is not one of range, min, max")
        configs, entries = tuple(options["--config"].split(",")), tuple(options["--entry"].split(","))
        if not all(configs) or not all(entries):
            raise ValueError(f"{text!r} has an empty config or entry name")
        return cls(words[0], configs, entries, options["--field"], fmt, agg)

    def __str__(self) -> str:
        return (f"fig {self.experiment} --config {','.join(self.configs)} --entry {','.join(self.entries)} "
                f"--field {self.field}")


def format_values(values: list[float], fmt: str, agg: str) -> str:
    """``values`` as one figure (``agg`` min / max, or range: ``lo-hi``, the unit written once)."""
    show = FORMATS[fmt]
    if agg == "min":
        return show(min(values))
    if agg == "max":
        return show(max(values))
    lo, hi = show(min(values)), show(max(values))
    if lo == hi:
        return lo
    for unit in UNITS:
        if lo.endswith(unit) and hi.endswith(unit):
            lo = lo[: -len(unit)]
    return f"{lo}-{hi}"


def _dig(entry: Any, path: str, where: str) -> float:
    value = entry
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            raise UsageError(f"{where}: no field {path!r} (stops at {part!r})")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where}: field {path!r} is {value!r}, not a number")
    return float(value)


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

    def entries(self, experiment: str, config: str) -> dict[str, dict]:
        exp = get_experiment(experiment)
        if config not in (*exp.config_names, *exp.legacy_configs):
            raise UsageError(f"{experiment} has no config {config!r}")
        store = ResultStore(exp.name, config, root=self.root)
        if not store.path.exists():
            raise UsageError(f"{experiment} / {config}: no stored results ({store.path})")
        return store.entries()

    def value(self, experiment: str, config: str, entry: str, path: str) -> float:
        where = f"{experiment} / {config} / {entry}"
        entries = self.entries(experiment, config)
        if entry not in entries:
            raise UsageError(f"{where}: no such stored entry")
        return _dig(entries[entry], path, where)

    def figure(self, spec: FigSpec) -> str:
        values = [self.value(spec.experiment, c, e, spec.field) for c in spec.configs for e in spec.entries]
        return format_values(values, spec.fmt, spec.agg)

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


@dataclass(frozen=True)
class InlineFig:
    spec: FigSpec
    open_line: int  # 0-based index of its line
    body: str


def _inline_figures(line: str, i: int, where: str) -> list[tuple[re.Match, FigSpec]]:
    found = list(INLINE.finditer(line))
    if len(INLINE_START.findall(line)) != 2 * len(found):
        raise MarkerError(f"{where}:{i + 1}: an inline figure is not of the form `<!-- fig SPEC -->VALUE<!-- /fig -->`")
    out = []
    for m in found:
        try:
            out.append((m, FigSpec.parse(m["spec"])))
        except ValueError as e:
            raise MarkerError(f"{where}:{i + 1}: inline figure {e}") from None
    return out


def _rewrite_inline(line: str, i: int, figure: Callable[[FigSpec], str], where: str) -> tuple[str, list[InlineFig]]:
    out, stale, done = [], [], 0
    for m, spec in _inline_figures(line, i, where):
        try:
            fresh = figure(spec)
        except UsageError as e:
            raise MarkerError(f"{where}:{i + 1}: {e}") from None
        out += [line[done:m.start("body")], fresh]
        done = m.end("body")
        if fresh != m["body"]:
            stale.append(InlineFig(spec, i, m["body"]))
    return "".join(out) + line[done:], stale


def rewrite(text: str, render: Callable[[Spec], str], where: str = "<text>",
            figure: Callable[[FigSpec], str] | None = None) -> tuple[str, list[Block | InlineFig]]:
    """``text`` with every block's body replaced by its rendering and every inline figure by its value (``figure``;
    None: inline figures are left as they are), and the blocks and figures that changed."""
    lines = text.split("\n")
    out, stale, done = [], [], 0

    def prose(upto: int) -> None:
        for i in range(done, upto):
            line = lines[i]
            if figure is not None and "<!-- " in line:
                line, changed = _rewrite_inline(line, i, figure, where)
                stale.extend(changed)
            out.append(line)

    for block in parse_blocks(text, where):
        try:
            fresh = render(block.spec).split("\n")
        except UsageError as e:
            raise MarkerError(f"{where}:{block.open_line + 1}: {e}") from None
        prose(block.open_line + 1)
        out += fresh
        done = block.close_line
        if tuple(fresh) != block.body:
            stale.append(block)
    prose(len(lines))
    return "\n".join(out), stale


def default_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "guide").glob("*.md"))]


def render_docs(files: Iterable[Path], check: bool = False, root: Path | None = None) -> list[str]:
    """Render every block of ``files`` (writing the files whose blocks changed unless ``check``); returns
    ``FILE:LINE: SPEC`` for each block that was stale."""
    stale = []
    with Renderer(root) as render:
        for path in files:
            text = path.read_text()
            where = os.path.relpath(path)
            new, changed = rewrite(text, render, where, render.figure)
            stale += [f"{where}:{b.open_line + 1}: {b.spec}" for b in changed]
            if changed and not check:
                write_text_atomic(path, new)
    return stale


# --- files generated from rendered docs ------------------------------------------------------------------------

CONTEXT_SOURCE = REPO / "docs" / "audit-context.md"
CONTEXT_TARGET = REPO / "src" / "aloepri" / "audit" / "measured_context.json"


def _plain(text: str) -> str:
    """Markdown prose as the audit page shows it: inline figures' markers, links' targets and emphasis dropped."""
    text = INLINE.sub(lambda m: m["body"], text)
    text = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text)
    return text.replace("**", "").replace("`", "")


def _cells(row: str) -> list[str]:
    return [_plain(c.strip()) for c in row.strip().strip("|").split("|")]


def context_sections(markdown: str) -> dict:
    """The audit page's measured context from its rendered Markdown source: one section per ``## `` heading, its
    paragraphs as text, its first table as the section's table, and its ``Source:`` line as the source."""
    sections, current = [], None
    for part in re.split(r"^## ", markdown, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        title, anchor = re.match(r"(.*?)\s*(?:\{#([\w-]+)\})?\s*$", title).groups()
        current = {"title": _plain(title), "text": "", "source": ""}
        if anchor:
            current["id"] = anchor
        paragraphs, table = [], None
        for chunk in re.split(r"\n\s*\n", body):
            lines = [ln for ln in chunk.strip().split("\n") if ln.strip() and not OPEN.match(ln) and not CLOSE.match(ln)]
            if not lines:
                continue
            if lines[0].lstrip().startswith("|"):
                rows = [_cells(ln) for ln in lines if not re.match(r"^\s*\|[\s:|-]+\|\s*$", ln)]
                table = table or {"columns": rows[0], "rows": rows[1:]}
            elif lines[0].startswith("Source:"):
                current["source"] = _plain(" ".join(lines)[len("Source:"):].strip())
            else:
                paragraphs.append(_plain(" ".join(ln.strip() for ln in lines)))
        current["text"] = "\n\n".join(paragraphs)
        if table:
            current["table"] = table
        sections.append(current)
    return {"generated_from": str(CONTEXT_SOURCE.relative_to(REPO)), "sections": sections}


def render_generated(check: bool = False) -> list[str]:
    """Write (or with ``check``, compare) the files generated from rendered docs; returns the stale ones. Run after
    the docs themselves are rendered: the context's source is read as it is on disk."""
    import json

    fresh = json.dumps(context_sections(CONTEXT_SOURCE.read_text()), indent=1, ensure_ascii=False) + "\n"
    old = CONTEXT_TARGET.read_text() if CONTEXT_TARGET.exists() else None
    if fresh == old:
        return []
    if not check:
        write_text_atomic(CONTEXT_TARGET, fresh)
    return [f"{os.path.relpath(CONTEXT_TARGET)}: differs from the rendering of {os.path.relpath(CONTEXT_SOURCE)}"]
