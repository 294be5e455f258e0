"""`aloepri audit`: the report's schema and bounds, the verdict's honesty rules, input validation, the page in a
real headless browser, and (slow) the lossless setting on SmolLM2.

Positive control: on a lossless obfuscation (exact transforms) the audit must find the prompts readable (the
weight and behavioural attacks recover them on tiny models and on SmolLM2). Honesty controls: an attack forced to
skip or to fail is reported as not run, the figure becomes a lower bound, and no wording ever says "safe".
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import aloepri
from aloepri.attacks import REGISTRY
from aloepri.attacks.base import AttackResult
from aloepri.audit import run_audit
from aloepri.audit import frontier as frontier_mod
from aloepri.audit.html import load_context, render_html
from aloepri.audit.plan import ID_STREAM, PROVIDER, PlannedAttack
from aloepri.audit.verdict import observer_verdict, verdicts
from aloepri.cli import main

SAFE = re.compile(r"\bsafe\b", re.IGNORECASE)  # "safety" (in "cannot be read as safety") is allowed


@pytest.fixture(scope="module")
def lossless(tiny_dir, tmp_path_factory):
    """A tiny Llama obfuscated losslessly (exact transforms, no noise) and a second key of another obfuscation."""
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("audit")
    aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params("exact", h=16), seed=7,
                      progress=False, allow_weak_seed=True)
    aloepri.obfuscate(src, work / "other", work / "other.key", aloepri.resolve_params("exact", h=16), seed=8,
                      progress=False, allow_weak_seed=True)
    return src, work


@pytest.fixture(scope="module")
def ci_report(lossless):
    src, work = lossless
    return run_audit(src, work / "server", work / "client.key", "ci", work / "report", prompts=4, progress=False)


def test_ci_audit_report_schema_and_bounds(ci_report, lossless):
    _, work = lossless
    data = json.loads((work / "report" / "report.json").read_text())
    assert data == json.loads(json.dumps(ci_report.data, default=str))
    for k in ("worst_prompt_token_recovery", "worst_attack", "verdict", "attacks", "fidelity", "parameters",
              "versions", "git", "machine", "time", "budget", "private_prompts"):
        assert k in data, k
    assert data["budget"] == "ci" and data["complete"] is True and data["time"]["finished"]
    assert set(data["versions"]) >= {"aloepri", "torch", "transformers"}
    assert data["versions"]["torch"] and data["versions"]["transformers"]
    ran = [a for a in data["attacks"] if a["status"] == "ran"]
    assert ran, "no attack ran"
    for a in data["attacks"]:
        assert a["status"] in ("ran", "skipped", "failed")
        assert a["observer"] in (ID_STREAM, PROVIDER)
        if a["status"] == "ran":
            assert 0.0 <= a["ttrsr"] <= 1.0 and a["tokens_scored"] > 0
        else:
            assert a.get("reason") or a.get("error")
    worst = data["worst_prompt_token_recovery"]
    assert 0.0 <= worst <= 1.0
    assert worst == max(a["ttrsr"] for a in ran)
    assert data["worst_attack"] in {a["name"] for a in ran if a["ttrsr"] == worst}
    # the key's secret never reaches the report
    assert "seed" not in data["parameters"] and "vocab_permutation" not in json.dumps(data)
    assert data["fidelity"]["status"] == "ran" and data["fidelity"]["top1_agreement"] > 0.99  # lossless


def test_lossless_setting_is_reported_readable(ci_report):
    """Positive control: nothing hides the prompts of a lossless obfuscation from the provider."""
    assert ci_report.worst_prompt_token_recovery >= 0.9
    p = ci_report.verdict[PROVIDER]
    assert p["level"] == "reads" and "can read your prompts" in p["text"]
    # the tiny model ships no tokenizer: the frequency attacks cannot run, so the id stream is unknown
    assert ci_report.verdict[ID_STREAM]["level"] == "unknown"
    assert all(not SAFE.search(v["text"]) for v in (ci_report.verdict[PROVIDER], ci_report.verdict[ID_STREAM]))


def test_html_is_self_contained_and_says_what_did_not_run(lossless, ci_report):
    _, work = lossless
    page = (work / "report" / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page and "<style>" in page
    for fetch in ("<script", "<link", "<img", "<iframe", "src=", "url(", "@import"):
        assert fetch not in page.lower(), fetch
    # the only URL is the SVG namespace, which is a name, not a fetch
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}
    assert page.index("Who can read your prompts") < page.index("<svg") < page.index("<table")
    assert "not run" in page
    # a figure below 100% with attacks not run is "a lower bound"; at 100% they "could not raise" it (per observer)
    for o in (ci_report.verdict[PROVIDER], ci_report.verdict[ID_STREAM]):
        if o["recovery"] is not None and o["not_run"]:
            assert ("lower bound" in o["text"]) == (o["recovery"] < 0.9995), o["text"]
    verdict_part = page[:page.index("<h2>Recovery against accuracy")]  # the measured context may say it too
    assert ("lower bound" in verdict_part) == any(o["recovery"] is not None and o["not_run"] and o["recovery"] < 0.9995
                                          for o in (ci_report.verdict[PROVIDER], ci_report.verdict[ID_STREAM]))
    assert not SAFE.search(re.sub(r"<[^>]+>", " ", page))


class _Fake:
    """Registered attacks with fixed outcomes (monkeypatched into the registry)."""

    @staticmethod
    def low(target, data, budget, seed=0):
        return AttackResult("fake-low", 0.02, None, {"tokens_scored": 10}, uses="nothing")

    @staticmethod
    def broken(target, data, budget, seed=0):
        raise RuntimeError("simulated crash")


def test_forced_skip_and_failure_are_not_run_and_never_safe(lossless, tmp_path, monkeypatch):
    src, work = lossless
    monkeypatch.setitem(REGISTRY, "fake-low", _Fake.low)
    monkeypatch.setitem(REGISTRY, "fake-broken", _Fake.broken)
    plan = (PlannedAttack("fake-low", PROVIDER, ("ci",)),
            PlannedAttack("fake-broken", PROVIDER, ("ci",)),
            PlannedAttack("vma", PROVIDER, ("full",)),  # forced outside the budget
            PlannedAttack("tfma", ID_STREAM, ("full",)))
    rep = run_audit(src, work / "server", work / "client.key", "ci", tmp_path / "r", prompts=2, progress=False,
                    plan=plan)
    by = {a["name"]: a for a in rep.attacks}
    assert by["fake-low"]["status"] == "ran" and by["fake-low"]["ttrsr"] == 0.02
    assert by["fake-broken"]["status"] == "failed" and "simulated crash" in by["fake-broken"]["error"]
    assert by["vma"]["status"] == "skipped" and "budget" in by["vma"]["reason"]
    p, s = rep.verdict[PROVIDER], rep.verdict[ID_STREAM]
    assert p["level"] == "little" and p["lower_bound"]
    assert "lower bound" in p["text"] and "cannot be read as safety" in p["text"]
    assert {n.split(":")[0] for n in p["not_run"]} == {"fake-broken", "vma", "tfma"}
    assert s["level"] == "unknown" and s["recovery"] is None
    for v in (p, s, {"text": rep.verdict["headline"]}):
        assert not SAFE.search(v["text"])
    page = rep.html_path.read_text()
    assert page.count("not run") >= 2 and "failed" in page and "simulated crash" in page


def test_a_stopped_audit_leaves_an_honest_partial_report(lossless, tmp_path, monkeypatch):
    """Killed midway (here: interrupted in its second attack), the audit has already written what it measured,
    with the attacks it did not reach as not run, the figure a lower bound."""
    src, work = lossless

    def interrupted(target, data, budget, seed=0):
        raise KeyboardInterrupt

    monkeypatch.setitem(REGISTRY, "fake-low", _Fake.low)
    monkeypatch.setitem(REGISTRY, "fake-interrupted", interrupted)
    plan = (PlannedAttack("fake-low", PROVIDER, ("ci",)), PlannedAttack("fake-interrupted", PROVIDER, ("ci",)))
    with pytest.raises(KeyboardInterrupt):
        run_audit(src, work / "server", work / "client.key", "ci", tmp_path / "r", prompts=2, progress=False,
                  plan=plan)
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["complete"] is False and data["time"]["finished"] is None
    by = {a["name"]: a for a in data["attacks"]}
    assert by["fake-low"]["status"] == "ran" and by["fake-interrupted"]["status"] == "skipped"
    assert data["verdict"][PROVIDER]["lower_bound"] and "lower bound" in data["verdict"][PROVIDER]["text"]
    assert any("partial" in w for w in data["warnings"])
    assert "partial" in (tmp_path / "r" / "report.html").read_text()


def test_an_attack_that_cannot_change_the_verdict_is_not_run(lossless, tmp_path, monkeypatch):
    """Once an observer reads 100%, the attacks that count only against it are not run (listed with the reason);
    an id-stream attack still runs while the log reader's own figure is below 100%. --all-attacks runs them."""
    src, work = lossless
    calls = []

    def fixed(name, ttrsr):
        def attack(target, data, budget, seed=0):
            calls.append(name)
            return AttackResult(name, ttrsr, None, {"tokens_scored": 10}, uses="nothing")
        return attack

    for name, ttrsr in (("fake-full", 1.0), ("fake-provider", 0.5), ("fake-log", 0.3), ("fake-log-full", 1.0),
                        ("fake-log-after", 0.2)):
        monkeypatch.setitem(REGISTRY, name, fixed(name, ttrsr))
    plan = (PlannedAttack("fake-full", PROVIDER, ("ci",)), PlannedAttack("fake-provider", PROVIDER, ("ci",)),
            PlannedAttack("fake-log", ID_STREAM, ("ci",)), PlannedAttack("fake-log-full", ID_STREAM, ("ci",)),
            PlannedAttack("fake-log-after", ID_STREAM, ("ci",)))
    rep = run_audit(src, work / "server", work / "client.key", "ci", tmp_path / "r", prompts=2, progress=False,
                    plan=plan)
    assert calls == ["fake-full", "fake-log", "fake-log-full"]
    by = {a["name"]: a for a in rep.attacks}
    for skipped in ("fake-provider", "fake-log-after"):
        assert by[skipped]["status"] == "skipped" and by[skipped]["why"] == "not needed"
        assert "100%" in by[skipped]["reason"] and "--all-attacks" in by[skipped]["reason"]
    p, s = rep.verdict[PROVIDER], rep.verdict[ID_STREAM]
    assert (p["recovery"], s["recovery"]) == (1.0, 1.0)
    assert "could not raise this figure" in p["text"] and "lower bound" not in p["text"]
    assert "lower bound" not in rep.verdict["headline"]

    calls.clear()
    run_audit(src, work / "server", work / "client.key", "ci", tmp_path / "all", prompts=2, progress=False,
              plan=plan, all_attacks=True)
    assert calls == [a.name for a in plan]


def test_no_provider_attack_ran_means_unknown(lossless, tmp_path, monkeypatch):
    src, work = lossless
    monkeypatch.setitem(REGISTRY, "fake-broken", _Fake.broken)
    rep = run_audit(src, work / "server", work / "client.key", "ci", tmp_path / "r", prompts=2, progress=False,
                    plan=(PlannedAttack("fake-broken", PROVIDER, ("ci",)),))
    assert rep.worst_prompt_token_recovery is None
    assert rep.verdict[PROVIDER]["level"] == "unknown"
    assert rep.verdict["headline"].startswith("Unknown")


def test_a_wrong_plaintext_model_is_flagged(lossless, tmp_path):
    """Given another model as PLAIN, the attacks recover little: the report must say the figure may be understated
    rather than let it pass as protection."""
    from aloepri.testing.tiny import build_tiny

    src, work = lossless
    wrong = build_tiny("llama", tmp_path / "wrong-model", seed=99)
    rep = run_audit(wrong, work / "server", work / "client.key", "ci", tmp_path / "r", prompts=2, progress=False,
                    plan=(PlannedAttack("gate-ia", PROVIDER, ("ci",)),))
    assert rep.data["fidelity"]["top1_agreement"] < 0.5
    assert any("not the one that was obfuscated" in w for w in rep.data["warnings"])
    assert any("made from" in w for w in rep.data["warnings"])
    assert "understate" in rep.html_path.read_text()


def _entry(name, observer, status="ran", ttrsr=None, **kw):
    return {"name": name, "observer": observer, "status": status, "ttrsr": ttrsr, "applicable": True, **kw}


def test_verdict_wording_follows_the_numbers():
    for rec, level, words in ((0.95, "reads", "can read your prompts"), (0.6, "reads_most", "most"),
                              (0.2, "reads_part", "part"), (0.05, "little", "not a guarantee")):
        v = observer_verdict(PROVIDER, [_entry("a", PROVIDER, ttrsr=rec)])
        assert v.level == level and words in v.text and not v.lower_bound
    # the provider also sees the id stream: a frequency attack's figure counts against it
    v = verdicts([_entry("a", PROVIDER, ttrsr=0.1), _entry("f", ID_STREAM, ttrsr=0.97)])
    assert v[PROVIDER].recovery == 0.97 and v[PROVIDER].attack == "f" and v[ID_STREAM].recovery == 0.97
    # an attack that does not apply (routing leak on a dense model) leaves nothing unmeasured
    v = observer_verdict(PROVIDER, [_entry("a", PROVIDER, ttrsr=0.3),
                                    _entry("r", PROVIDER, "skipped", reason="does not apply", applicable=False)])
    assert not v.lower_bound
    v = observer_verdict(ID_STREAM, [_entry("a", PROVIDER, ttrsr=0.99)])
    assert v.level == "unknown"


def test_at_least_only_below_100_percent():
    from aloepri.audit.html import at_least
    from aloepri.audit.verdict import headline

    missing = _entry("b", PROVIDER, "skipped", reason="outside the 'ci' budget", why="outside the 'ci' budget")
    full = verdicts([_entry("a", PROVIDER, ttrsr=1.0), missing])
    assert full[PROVIDER].lower_bound  # still recorded: an attack did not run
    assert "lower bound" not in full[PROVIDER].text and "could not raise" in full[PROVIDER].text
    assert "lower bound" not in headline(full) and not at_least(full[PROVIDER].to_dict())
    part = verdicts([_entry("a", PROVIDER, ttrsr=0.42), missing])
    assert "42.0% is a lower bound" in part[PROVIDER].text and "lower bound" in headline(part)
    assert at_least(part[PROVIDER].to_dict())


def test_points_at_the_same_place_are_spread_and_shaped_apart():
    from aloepri.audit.html import MARKER_SHAPES, spread

    assert spread([10.0, 10.0, 10.0, 200.0]) == [-14.0, 0.0, 14.0, 0.0]
    assert spread([10.0, 50.0]) == [0.0, 0.0]
    assert len(set(MARKER_SHAPES)) == 4


def test_cli_refuses_bad_inputs_with_one_line(lossless, tmp_path, capsys):
    src, work = lossless
    base = [str(src), "--obfuscated", str(work / "server"), "--out", str(tmp_path / "r"), "--quiet"]
    cases = {
        "key of another model": base + ["--key", str(work / "other.key")],
        "missing key": base + ["--key", str(tmp_path / "nope.key")],
        "unknown budget": base + ["--key", str(work / "client.key"), "--budget", "huge"],
        "missing model": [str(tmp_path / "none.gguf")] + base[1:] + ["--key", str(work / "client.key")],
        "bad prompts": base + ["--key", str(work / "client.key"), "--prompts", "0"],
    }
    for what, argv in cases.items():
        assert main(["audit"] + argv) == 2, what
        err = capsys.readouterr().err.strip()
        assert err.startswith("aloepri audit: error:") and "\n" not in err, (what, err)
        assert "Traceback" not in err
    assert not (tmp_path / "r" / "report.json").exists()


def test_measured_frontier_package_data():
    m = frontier_mod.load_measured()
    assert m["provenance"]["derived_by"] == "python -m benchmarks run audit_frontier"
    assert frontier_mod.model_for(["/x/SmolLM2-135M-Instruct.Q4_1.gguf"], m) == "smollm2"
    assert frontier_mod.model_for(["/x/other.gguf"], m) is None
    pts = m["models"]["smollm2"]["points"]
    assert pts and all(0 <= p["top1"] <= 1 and 0 <= p["recovery"] <= 1 for p in pts)
    front = frontier_mod.frontier(pts)
    # along the frontier, less accuracy buys strictly less recovery, and no measured point beats it on both axes
    assert all(a["top1"] >= b["top1"] and a["recovery"] > b["recovery"] for a, b in zip(front, front[1:]))
    for f in front:
        assert not any(p["top1"] >= f["top1"] and p["recovery"] < f["recovery"] for p in pts)


def test_measured_context_section(ci_report, tmp_path):
    assert load_context(tmp_path / "absent.json") == (None, None)
    ctx = tmp_path / "ctx.json"
    ctx.write_text(json.dumps({"sections": [{"title": "Only logs leak", "text": "TFMA <recovers> 3%", "source":
                                             "docs/security.md", "table": {"columns": ["tokens", "TTRSR"],
                                                                           "rows": [["1000", "0.01"]]}}]}))
    page = render_html(ci_report.data, context_path=ctx)
    assert "Measured context" in page and "Only logs leak" in page and "TFMA &lt;recovers&gt; 3%" in page
    assert "<td>1000</td>" in page
    ctx.write_text("{not json")
    assert "could not be read" in render_html(ci_report.data, context_path=ctx)
    assert "Measured context" not in render_html(ci_report.data, context_path=tmp_path / "absent.json")


def test_the_packaged_context_is_the_rendering_of_its_source_and_shows_the_log_reader(ci_report):
    """The context the page shows is generated from docs/audit-context.md, whose figures come from the store
    (tests/benchmarks/test_docs_blocks.py checks that rendering); the log reader's section sits under its own
    heading with this audit's figure and the volume it assumes."""
    sections, problem = load_context()
    assert problem is None and sections
    assert any(s.get("id") == "log-reader" for s in sections)
    page = render_html(ci_report.data)
    log_part = page[page.index("<h2>The log reader</h2>"):]
    mine = [a for a in ci_report.data["attacks"] if a["observer"] == ID_STREAM and a["status"] == "ran"]
    if mine:
        best = max(mine, key=lambda a: a["ttrsr"])
        assert f"{100 * best['ttrsr']:.1f}%" in log_part and "the volume this figure assumes" in log_part
    # no sentence of the page says the log reader recovers little or that more traffic does not help
    text = re.sub(r"<[^>]+>", " ", page)
    assert "did not help" not in text and "recovered little in our measurement" not in text


def test_each_chart_point_names_its_observer():
    from aloepri.audit.html import plot_svg

    report = {"parameters": {"source": ""}, "inputs": {"plain": ""}, "fidelity": {"top1_agreement": 1.0},
              "worst_prompt_token_recovery": 1.0,
              "attacks": [_entry("vma", PROVIDER, ttrsr=1.0), _entry("stream-decipher", ID_STREAM, ttrsr=0.2)]}
    svg = plot_svg(report, {"models": {}})
    assert "provider: vma 100.0%" in svg and "log reader: stream-decipher 20.0%" in svg
    assert svg.count('fill="#fff" fill-opacity="0.6"') == 2  # the log reader's point and its legend icon are hollow


def test_advice_only_when_it_applies():
    from aloepri.audit.html import advice_for

    outside = _entry("behavioural", PROVIDER, "skipped", reason="outside the 'ci' budget (runs with --budget small)",
                     why="outside the 'ci' budget")
    absent = _entry("sda", ID_STREAM, "skipped", reason="not installed (scipy)", why="not installed")
    at_full = verdicts([_entry("vma", PROVIDER, ttrsr=1.0), outside, _entry("sd", ID_STREAM, ttrsr=0.2)])
    assert advice_for(at_full[PROVIDER].to_dict(), [outside]) == ""  # 100%: nothing can raise it
    assert advice_for(at_full[ID_STREAM].to_dict(), [outside]) == ""  # complete: every log-reader attack ran
    part = verdicts([_entry("vma", PROVIDER, ttrsr=0.4), outside, _entry("sd", ID_STREAM, ttrsr=0.2), absent])
    attacks = [outside, absent]
    says = advice_for(part[PROVIDER].to_dict(), attacks)
    assert "rerun with --budget small (adds behavioural)" in says and "install what is missing" in says
    says = advice_for(part[ID_STREAM].to_dict(), attacks)
    assert "install what is missing" in says and "--budget" not in says and "grows with the traffic" in says


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium): the "
                                             "report is not rendered in a real browser here")
def test_report_renders_in_headless_chromium(lossless, ci_report, tmp_path):
    from PIL import Image

    shot = tmp_path / "report.png"
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--host-resolver-rules=MAP * ~NOTFOUND",  # no network
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1400", f"--screenshot={shot}",
           ci_report.html_path.resolve().as_uri()]
    if os.geteuid() == 0:
        cmd.insert(1, "--no-sandbox")  # chromium refuses to run as root with its sandbox
    try:
        subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("chromium did not finish the screenshot in 120 s")
    assert shot.is_file(), "chromium wrote no screenshot"
    img = Image.open(shot).convert("RGB")
    assert img.size == (1000, 1400)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, the verdict banner and the plot, not a blank page
    # the verdict banner (the provider can read the prompts: red) is drawn near the top
    top = img.crop((0, 0, 1000, 400)).getcolors(maxcolors=1 << 20)
    assert any(c[1] == (0xb3, 0x26, 0x1e) and c[0] > 1000 for c in top)


@pytest.mark.slow
def test_smollm2_lossless_audit_reads_the_prompts(tmp_path):
    """The lossless setting (exact transforms, h = 0, outlier dimensions kept) on SmolLM2: the ci audit reports
    the prompts readable (>= 90% of prompt tokens). Only the two weight attacks run here (a minute or two); the
    whole ci plan, behavioural attacks included, is measured by `aloepri audit --budget ci` (minutes more)."""
    from conftest import smollm2_or_skip

    smol = smollm2_or_skip()
    aloepri.obfuscate(smol, tmp_path / "server", tmp_path / "client.key",
                      aloepri.resolve_params("exact", h=0, outlier_dims=4), seed=2027, allow_weak_seed=True,
                      progress=False, dtype="float32")
    plan = (PlannedAttack("gate-ia", PROVIDER, ("ci",)), PlannedAttack("vma", PROVIDER, ("ci",)))
    rep = run_audit(smol, tmp_path / "server", tmp_path / "client.key", "ci", tmp_path / "r", prompts=5,
                    progress=False, plan=plan)
    assert rep.data["fidelity"]["top1_agreement"] > 0.99
    assert rep.worst_prompt_token_recovery >= 0.9
    assert rep.verdict[PROVIDER]["level"] == "reads"


def test_the_docs_list_exactly_the_attacks_each_budget_runs():
    """docs/audit.md's budget table and the guide's `ci` list name the attacks plan.py runs (a doc that left the
    log reader's decipherers out of `ci` misled users once)."""
    from aloepri.audit.plan import PLAN

    repo = Path(__file__).resolve().parents[2]
    table = (repo / "docs" / "audit.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(ci|small|full)` \| (.*) \|$", table, re.M)}
    listed: set[str] = set()
    for budget in ("ci", "small", "full"):
        listed |= {w.strip() for w in re.sub(r"\(MoE only\)|`\w+` \+", "", rows[budget]).split(",")}
        planned = {p.name for p in PLAN if budget in p.budgets}
        assert listed == planned, (budget, listed ^ planned)
    guide = (repo / "docs" / "guide" / "audit.md").read_text()
    for p in PLAN:
        if "ci" in p.budgets:
            assert p.name in guide, p.name
