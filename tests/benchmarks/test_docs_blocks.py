"""The docs' report blocks (benchmarks/lib/docs.py): each equals its rendering from the stored results."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import all_experiments
from benchmarks.lib.docs import MarkerError, Renderer, Spec, default_files, parse_blocks, render_docs, rewrite, tables

REPO = Path(__file__).resolve().parents[2]


def test_every_report_block_in_the_docs_matches_the_store():
    files = default_files()
    assert any(parse_blocks(f.read_text(), str(f)) for f in files), "no report block in the docs"
    stale = render_docs(files, check=True)
    assert not stale, "stale report blocks (run `python -m benchmarks render-docs`):\n" + "\n".join(stale)


def test_every_block_names_an_experiment_that_lists_the_file_in_its_docs():
    experiments = all_experiments()
    missing = []
    for f in default_files():
        rel = str(f.relative_to(REPO))
        for b in parse_blocks(f.read_text(), rel):
            if rel not in experiments[b.spec.experiment].docs:
                missing.append(f"{rel}:{b.open_line + 1}: {b.spec.experiment}")
    assert not missing, f"add these files to the experiments' DOCS: {missing}"


def _stored() -> tuple[str, str]:
    """Some stored (experiment, config) whose report has a table."""
    with Renderer() as render:
        for exp in all_experiments().values():
            for cfg in exp.config_names:
                if exp.store(cfg).path.exists() and tables(render.report(exp.name, cfg)):
                    return exp.name, cfg
    pytest.skip("no stored results with a table")


def test_spec_parsing():
    assert Spec.parse("exp --config c") == Spec("exp", "c")
    assert Spec.parse("exp --config c --table 2") == Spec("exp", "c", 2)
    assert str(Spec("exp", "c", 2)) == "exp --config c --table 2"
    assert Spec.parse("exp --config a,b").configs == ["a", "b"]
    for bad, says in [("--config c", "names no experiment"), ("exp", "no --config"), ("exp --config", "expected"),
                      ("exp --config c --table 0", "whole number"),
                      ("exp --config a,", "empty name"), ("exp --config c --other x", "expected")]:
        with pytest.raises(ValueError, match=says):
            Spec.parse(bad)


def test_malformed_markers_are_named_by_file_and_line():
    unclosed = "text\n<!-- benchmarks:report e --config c -->\n| a |\n"
    with pytest.raises(MarkerError, match=r"doc.md:2: .*not closed"):
        parse_blocks(unclosed, "doc.md")
    nested = "<!-- benchmarks:report e --config c -->\n<!-- benchmarks:report e --config d -->\n"
    with pytest.raises(MarkerError, match=r"doc.md:2: .*inside the one opened at line 1"):
        parse_blocks(nested, "doc.md")
    with pytest.raises(MarkerError, match=r"doc.md:1: .*closes no block"):
        parse_blocks("<!-- /benchmarks:report -->\n", "doc.md")
    with pytest.raises(MarkerError, match=r"doc.md:1: not a report marker"):
        parse_blocks("<!-- benchmarks:reprot e --config c -->\n", "doc.md")
    with pytest.raises(MarkerError, match=r"doc.md:1: report block .*no --config"):
        parse_blocks("<!-- benchmarks:report e -->\n<!-- /benchmarks:report -->\n", "doc.md")


def test_rewrite_replaces_only_block_bodies_and_reports_the_stale_ones():
    text = ("# t\n<!-- benchmarks:report e --config a -->\nold\n<!-- /benchmarks:report -->\nprose\n"
            "<!-- benchmarks:report e --config b --table 1 -->\n<!-- /benchmarks:report -->\nend\n")
    new, stale = rewrite(text, lambda s: f"body of {s}")
    assert new == ("# t\n<!-- benchmarks:report e --config a -->\nbody of e --config a\n<!-- /benchmarks:report -->\n"
                   "prose\n<!-- benchmarks:report e --config b --table 1 -->\nbody of e --config b --table 1\n"
                   "<!-- /benchmarks:report -->\nend\n")
    assert [b.spec.config for b in stale] == ["a", "b"]
    again, stale = rewrite(new, lambda s: f"body of {s}")
    assert again == new and stale == []


def test_unknown_experiment_config_or_table_is_a_clear_error():
    name, cfg = _stored()
    for spec, says in [(f"no_such_experiment --config {cfg}", "no experiment 'no_such_experiment'"),
                       (f"{name} --config no-such-config", f"{name} has no config 'no-such-config'"),
                       (f"{name} --config {cfg} --table 999", "--table 999, but the report has")]:
        text = f"<!-- benchmarks:report {spec} -->\n<!-- /benchmarks:report -->\n"
        with Renderer() as render, pytest.raises(MarkerError, match=rf"doc.md:1: .*{says}"):
            rewrite(text, render, "doc.md")


def test_check_mode_lists_stale_blocks_without_writing(tmp_path):
    name, cfg = _stored()
    doc = tmp_path / "doc.md"
    stale_text = f"# x\n<!-- benchmarks:report {name} --config {cfg} --table 1 -->\n| stale |\n<!-- /benchmarks:report -->\n"
    doc.write_text(stale_text)
    stale = render_docs([doc], check=True)
    assert len(stale) == 1 and stale[0].endswith(f"doc.md:2: {name} --config {cfg} --table 1"), stale
    assert doc.read_text() == stale_text
    cli = [sys.executable, "-m", "benchmarks", "render-docs", "--check", str(doc)]
    run = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 1 and f"doc.md:2: {name} --config {cfg} --table 1: stale" in run.stdout, run
    assert doc.read_text() == stale_text
    assert render_docs([doc]) and doc.read_text() != stale_text
    with Renderer() as render:
        assert tables(render.report(name, cfg))[0] in doc.read_text()
    assert render_docs([doc], check=True) == []
    run = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run


def test_several_configs_merge_into_one_table_under_their_common_header():
    name, cfg = _stored()
    with Renderer() as render:
        one = render(Spec(name, cfg, 1)).split("\n")
        merged = render(Spec(name, f"{cfg},{cfg}")).split("\n")
    assert merged == one + one[2:]


def test_docs_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import os

    from aloepri.storage import staging

    doc = tmp_path / "doc.md"
    doc.write_text("old\n")
    monkeypatch.setattr(staging.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        staging.write_text_atomic(doc, "new\n")
    assert doc.read_text() == "old\n" and os.listdir(tmp_path) == ["doc.md"]
    monkeypatch.undo()
    staging.write_text_atomic(doc, "new\n")
    assert doc.read_text() == "new\n" and os.listdir(tmp_path) == ["doc.md"]
    assert doc.stat().st_mode & 0o777 == 0o666 & ~staging.current_umask()


# --- inline figures and the generated audit context ----------------------------------------------------------

from benchmarks.lib.docs import (CONTEXT_SOURCE, INLINE, FigSpec, context_sections, format_values,  # noqa: E402
                                 render_generated)


def test_inline_figure_spec_and_formats():
    spec = FigSpec.parse("exp --config a,b --entry k/1 --field x.y --fmt pct --agg max")
    assert spec == FigSpec("exp", ("a", "b"), ("k/1",), "x.y", "pct", "max")
    for bad, says in [("exp --config c --entry e", "no --field"), ("exp --config c --entry e --field f --fmt pc",
                                                                    "not one of"),
                      ("--config c", "names no experiment"), ("exp --config c, --entry e --field f", "empty")]:
        with pytest.raises(ValueError, match=says):
            FigSpec.parse(bad)
    assert format_values([0.167, 0.24], "pct", "range") == "16.7-24.0%"
    assert format_values([0.5, 0.5004], "pct", "range") == "50.0%"
    assert format_values([0.2, 0.9], "pct0", "max") == "90%"
    assert format_values([90.0, 150.0], "min", "range") == "1.5-2.5 min"


def test_inline_figures_are_rewritten_and_a_hand_edit_is_stale():
    text = "a <!-- fig e --config c --entry k --field v --fmt pct -->12.0%<!-- /fig --> b\n"
    new, stale = rewrite(text, lambda s: "", "doc.md", lambda f: "12.0%")
    assert new == text and stale == []
    new, stale = rewrite(text, lambda s: "", "doc.md", lambda f: "13.5%")
    assert "-->13.5%<!-- /fig -->" in new and len(stale) == 1 and stale[0].open_line == 0
    with pytest.raises(MarkerError, match=r"doc.md:1: an inline figure"):
        rewrite("x <!-- fig e --config c --entry k --field v -->1\n", lambda s: "", "doc.md", lambda f: "1")


def test_editing_one_rendered_figure_in_the_readme_by_hand_fails_the_check(tmp_path):
    """The real README against the real store: one figure typed over is caught, and so is a stored result
    that changed without a re-render (the same comparison, seen from the store's side)."""
    readme = (REPO / "README.md").read_text()
    m = next(INLINE.finditer(readme), None)
    assert m is not None, "the README renders its figures from the store: it has inline figures"
    assert render_docs([REPO / "README.md"], check=True) == []
    edited = tmp_path / "README.md"
    typed = "12.3%" if m["body"] != "12.3%" else "45.6%"  # a figure other than the stored one
    edited.write_text(readme[:m.start("body")] + typed + readme[m.end("body"):])
    stale = render_docs([edited], check=True)
    assert len(stale) == 1 and "fig " + m["spec"].split(" --fmt")[0].split(" --agg")[0] in stale[0]


def test_the_audit_context_in_the_package_is_rendered_from_its_source():
    assert render_generated(check=True) == [], "run `python -m benchmarks render-docs`"
    sections = context_sections(CONTEXT_SOURCE.read_text())["sections"]
    assert sections and all(s["title"] and s["text"] and s["source"] for s in sections)
    assert not any("<!--" in s["text"] for s in sections)
