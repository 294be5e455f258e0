"""report.html: one self-contained page (inline CSS and SVG, no script, nothing fetched) for a person deciding
whether to trust a deployment. The verdict comes first, then the plot, the table, fidelity, and provenance.

Measured context: when the package holds ``measured_context.json`` (answers, measured by the project, to questions
such as "my model is a private fine-tune" or "only logs leak"), its sections are shown too. Minimal schema::

    {"sections": [{"title": str, "text": str, "source": str}]}

The file is generated (``python -m benchmarks render-docs``) from ``docs/audit-context.md``, whose figures are
rendered from ``benchmarks/results``: nothing in it is typed by hand. Paragraphs of ``text`` are separated by a
blank line. A section may add ``"table": {"columns": [str, ...], "rows": [[cell, ...], ...]}`` for its figures, and
``"id": "log-reader"`` to be shown under "The log reader" instead. A missing file shows nothing; an unreadable one
says so in the page.
"""
from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any, Sequence

from . import frontier as frontier_mod
from .plan import BUDGETS, ID_STREAM, PROVIDER
from .verdict import below_maximum

CONTEXT_FILE = "measured_context.json"
LEVEL_COLOURS = {"reads": "#b3261e", "reads_most": "#d9480f", "reads_part": "#b7791f", "little": "#4a5568",
                 "unknown": "#6b7280"}
LEVEL_WORDS = {"reads": "can read your prompts", "reads_most": "can read most of your prompts",
               "reads_part": "can read part of your prompts", "little": "little recovered (not proof of safety)",
               "unknown": "unknown"}
MARKER_SHAPES = ("circle", "square", "diamond", "triangle")
ATTACK_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                  "#bcbd22", "#7f7f7f")

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:960px;padding:24px;
color:#1a202c;line-height:1.45}
h1{font-size:1.6em;margin:0 0 4px}h2{font-size:1.2em;margin:28px 0 8px;border-bottom:1px solid #e2e8f0}
.sub{color:#4a5568;margin:0 0 16px}
.headline{font-size:1.25em;font-weight:600;padding:14px 16px;border-radius:6px;color:#fff}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-top:12px}
.card{flex:1 1 300px;border:2px solid;border-radius:6px;padding:10px 14px}
.card h3{margin:0 0 6px;font-size:1em}.badge{display:inline-block;color:#fff;border-radius:4px;padding:1px 8px;
font-size:.85em;font-weight:600}
.warn{background:#fff5f5;border-left:4px solid #b3261e;padding:8px 12px;margin-top:12px}
table{border-collapse:collapse;width:100%;font-size:.9em}th,td{border:1px solid #e2e8f0;padding:4px 6px;
text-align:left;vertical-align:top}th{background:#f7fafc}td.num{text-align:right;white-space:nowrap}
.notrun{color:#b3261e;font-weight:600}.small{font-size:.85em;color:#4a5568}
svg{max-width:100%;height:auto;background:#fff}
"""


def _pct(x: Any, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * float(x):.{digits}f}%"


def _num(x: Any, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(float(x))


# --- plot -----------------------------------------------------------------------------------------------------


def marker(shape: str, cx: float, cy: float, r: float, colour: str, body: str = "", hollow: bool = False) -> str:
    """One attack's point: a distinct shape per attack, so points at the same place stay tellable apart; hollow
    (outline only) for the log reader's attacks, filled for the provider's."""
    attrs = (f'fill="#fff" fill-opacity="0.6" stroke="{colour}" stroke-width="2"' if hollow else
             f'fill="{colour}" fill-opacity="0.85" stroke="#fff" stroke-width="1"')
    if shape == "circle":
        el = f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" {attrs}>'
        end = "</circle>"
    else:
        if shape == "square":
            pts = [(-r, -r), (r, -r), (r, r), (-r, r)]
        elif shape == "diamond":
            pts = [(0, -1.3 * r), (1.3 * r, 0), (0, 1.3 * r), (-1.3 * r, 0)]
        else:  # triangle
            pts = [(0, -1.3 * r), (1.2 * r, r), (-1.2 * r, r)]
        el = '<polygon points="' + " ".join(f"{cx + dx:.1f},{cy + dy:.1f}" for dx, dy in pts) + f'" {attrs}>'
        end = "</polygon>"
    return el + body + end


def spread(ys: Sequence[float], gap: float = 10.0, step: float = 14.0) -> list[float]:
    """Horizontal offsets (pixels) for points drawn at one x: points closer than ``gap`` vertically are placed
    side by side, centred on the x, instead of on top of each other."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    offsets, group = [0.0] * len(ys), []
    for i in order + [None]:
        if i is not None and (not group or ys[i] - ys[group[0]] < gap):
            group.append(i)
            continue
        for j, k in enumerate(group):
            offsets[k] = (j - (len(group) - 1) / 2) * step
        group = [i] if i is not None else []
    return offsets


def plot_svg(report: dict[str, Any], measured: dict[str, Any] | None = None) -> str:
    """Each attack's recovery (y) at this setting's accuracy (x), on the project's measured frontier for the same
    model when there is one. Hand-written SVG: no plotting library, no script, no fonts fetched."""
    measured = measured if measured is not None else frontier_mod.load_measured()
    w, h, left, right, top, bottom = 860, 440, 64, 330, 20, 56  # the legend's labels name observer and attack
    pw, ph = w - left - right, h - top - bottom

    def x(v: float) -> float:
        return left + pw * min(1.0, max(0.0, v))

    def y(v: float) -> float:
        return top + ph * (1 - min(1.0, max(0.0, v)))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="11" role="img" aria-label="recovery against accuracy">']
    for t in (0, 0.2, 0.4, 0.6, 0.8, 1.0):  # grid and ticks
        parts.append(f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{top + ph}" stroke="#edf2f7"/>')
        parts.append(f'<line x1="{left}" y1="{y(t):.1f}" x2="{left + pw}" y2="{y(t):.1f}" stroke="#edf2f7"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{t:.1f}</text>')
        parts.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{int(t * 100)}%</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#a0aec0"/>')
    parts.append(f'<line x1="{left}" y1="{y(0.9):.1f}" x2="{left + pw}" y2="{y(0.9):.1f}" stroke="#b3261e" '
                 'stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{left + 4}" y="{y(0.9) - 4:.1f}" fill="#b3261e">90%: prompts readable</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{h - 14}" text-anchor="middle">top-1 agreement with the plaintext '
                 'model (accuracy)</text>')
    parts.append(f'<text transform="translate(16 {top + ph / 2}) rotate(-90)" text-anchor="middle">private prompt '
                 'tokens recovered</text>')

    legend: list[str] = []
    names = [report["parameters"].get("source", ""), report["inputs"].get("plain", "")]
    model = frontier_mod.model_for(names, measured)
    if model:
        pts = measured["models"][model]["points"]
        for p in pts:
            parts.append(f'<circle cx="{x(p["top1"]):.1f}" cy="{y(p["recovery"]):.1f}" r="3" fill="#cbd5e0">'
                         f'<title>{escape(p["setting"])}: top-1 {p["top1"]:.3f}, {_pct(p["recovery"])} '
                         f'({escape(p["attack"])}, {escape(p["source"])})</title></circle>')
        front = frontier_mod.frontier(pts)
        path = " ".join(f"{'M' if i == 0 else 'L'}{x(p['top1']):.1f},{y(p['recovery']):.1f}"
                        for i, p in enumerate(front))
        parts.append(f'<path d="{path}" fill="none" stroke="#4a5568" stroke-width="1.5" stroke-dasharray="6 3"/>')
        legend.append(('<circle r="3" fill="#cbd5e0"/>', f"measured settings ({len(pts)})"))
        legend.append(('<line x1="-8" x2="8" stroke="#4a5568" stroke-dasharray="6 3" stroke-width="1.5"/>',
                       f"measured frontier ({model})"))
    fid = report.get("fidelity") or {}
    top1 = fid.get("top1_agreement")
    ran = [a for a in report["attacks"] if a["status"] == "ran"]
    if top1 is not None:
        # the provider's attacks first, then the log reader's; each legend row names the observer it counts
        # against, and the log reader's points are drawn hollow
        ran = sorted(ran, key=lambda a: a["observer"] != PROVIDER)
        offsets = spread([y(a["ttrsr"]) for a in ran])
        for i, (a, dx) in enumerate(zip(ran, offsets)):
            colour = ATTACK_COLOURS[i % len(ATTACK_COLOURS)]
            shape = MARKER_SHAPES[i % len(MARKER_SHAPES)]
            hollow = a["observer"] == ID_STREAM
            label = f"{OBSERVER_SHORT[a['observer']]}: {a['name']} {_pct(a['ttrsr'])}"
            parts.append(marker(shape, x(top1) + dx, y(a["ttrsr"]), 5, colour, f'<title>{escape(label)}</title>',
                                hollow))
            legend.append((marker(shape, 0, 0, 5, colour, "", hollow), label))
        worst = report.get("worst_prompt_token_recovery")
        if worst is not None:
            parts.append(f'<circle cx="{x(top1):.1f}" cy="{y(worst):.1f}" r="10" fill="none" stroke="#1a202c" '
                         'stroke-width="2"/>')
            legend.append(('<circle r="8" fill="none" stroke="#1a202c" stroke-width="2"/>', "this setting (worst)"))
    else:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle">fidelity not measured: '
                     'no accuracy to place this setting at</text>')
    for i, (icon, text) in enumerate(legend):
        ly = top + 10 + 18 * i
        parts.append(f'<g transform="translate({left + pw + 18} {ly})">{icon}</g>')
        parts.append(f'<text x="{left + pw + 32}" y="{ly + 4}">{escape(text)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# --- page -----------------------------------------------------------------------------------------------------


def load_context(path: Any = None) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(sections, problem): the measured context (the package's file, or ``path``); (None, None) when absent."""
    try:
        ref = path if path is not None else resources.files(__package__).joinpath(CONTEXT_FILE)
        if not ref.is_file():
            return None, None
        sections = json.loads(ref.read_text(encoding="utf-8"))["sections"]
        for s in sections:
            for k in ("title", "text", "source"):
                if not isinstance(s.get(k), str):
                    raise ValueError(f"a section has no string {k!r}")
        return sections, None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{CONTEXT_FILE} could not be read ({type(e).__name__}: {e})"


def at_least(o: dict[str, Any]) -> bool:
    """An observer's figure is shown as 'at least X%': some attack did not run and X is below 100%."""
    return bool(o["lower_bound"]) and o["recovery"] is not None and below_maximum(o["recovery"])


OBSERVER_SHORT = {PROVIDER: "provider", ID_STREAM: "log reader"}
# what a user can do about an attack that did not run, by its short reason (run.py's ``why``)
REMEDIES = {
    "not installed": "install what is missing",
    "failed": "see the table for why it failed",
    "not reached": "rerun the same command: the audit resumes where it stopped",
    "needs a tokenizer": "give a plaintext model that ships its tokenizer",
}


def advice_for(o: dict[str, Any], attacks: Sequence[dict[str, Any]]) -> str:
    """What to do about an observer's lower bound, from why its attacks did not run; '' when nothing applies (the
    figure is complete, or already 100%, which no attack can raise)."""
    if not at_least(o):
        return ""
    mine = [a for a in attacks if a["status"] != "ran" and a.get("applicable", True)
            and (o["observer"] == PROVIDER or a["observer"] == o["observer"])]
    steps: list[str] = []
    larger: dict[str, list[str]] = {}  # "--budget small" -> the attacks it would add
    for a in mine:
        why = a.get("why") or a["status"]
        if why.startswith("outside the") and "runs with " in (a.get("reason") or ""):
            larger.setdefault(a["reason"].split("runs with ")[-1].rstrip(")"), []).append(a["name"])
        elif REMEDIES.get(why) and REMEDIES[why] not in steps:
            steps.append(REMEDIES[why])
    order = {f"--budget {b}": i for i, b in enumerate(BUDGETS)}
    steps = [f"rerun with {flag} (adds {', '.join(names)})"
             for flag, names in sorted(larger.items(), key=lambda kv: order.get(kv[0], len(order)))] + steps
    who = OBSERVER_SHORT[o["observer"]]
    text = (f"The {who}'s {_pct(o['recovery'])} is a lower bound: {len(mine)} attack(s) counted against the {who} did "
            "not run (see the table).")
    if steps:
        text += " To measure it: " + "; ".join(steps) + "."
    if o["observer"] == ID_STREAM:
        text += " The log reader's figure also grows with the traffic it sees (see \"The log reader\" below)."
    return text


def _verdict_html(report: dict[str, Any]) -> str:
    v = report["verdict"]
    lead = v[PROVIDER]
    colour = LEVEL_COLOURS[lead["level"]]
    out = [f'<p class="headline" style="background:{colour}">{escape(v["headline"])}</p>', '<div class="cards">']
    for key in (PROVIDER, ID_STREAM):
        o = v[key]
        c = LEVEL_COLOURS[o["level"]]
        out.append(f'<div class="card" style="border-color:{c}"><h3>{escape(o["who"][0].upper() + o["who"][1:])}'
                   f'</h3><span class="badge" style="background:{c}">{escape(LEVEL_WORDS[o["level"]])}'
                   f'{" — at least " + _pct(o["recovery"]) if at_least(o) else ""}'
                   f'</span><p>{escape(o["text"])}</p></div>')
    out.append("</div>")
    for w in report.get("warnings") or []:
        out.append(f'<p class="warn">Check: {escape(w)}.</p>')
    for key in (PROVIDER, ID_STREAM):
        advice = advice_for(v[key], report["attacks"])
        if advice:
            out.append(f'<p class="warn">{escape(advice)}</p>')
    return "".join(out)


def _attack_rows(attacks: Sequence[dict[str, Any]]) -> str:
    rows = ["<tr><th>Attack</th><th>Observer</th><th>Prompt tokens recovered</th><th>PII tokens recovered</th>"
            "<th>Tokens scored</th><th>Time (s)</th><th>What it used, or why it did not run</th></tr>"]
    for a in sorted(attacks, key=lambda a: (a["status"] != "ran", -(a.get("ttrsr") or 0))):
        who = OBSERVER_SHORT[a["observer"]]
        if a["status"] == "ran":
            rows.append(f'<tr><td>{escape(a["name"])}</td><td>{who}</td><td class="num">{_pct(a["ttrsr"])}</td>'
                        f'<td class="num">{_pct(a.get("piirsr"))}</td><td class="num">{a.get("tokens_scored") or "–"}'
                        f'</td><td class="num">{_num(a.get("seconds"), "{:.0f}")}</td>'
                        f'<td class="small">{escape(a.get("uses") or "")}</td></tr>')
        else:
            label, cls = ("not run", "notrun") if a["status"] == "skipped" else ("failed", "notrun")
            if a["status"] == "skipped" and not a.get("applicable", True):
                label, cls = "does not apply", "small"  # nothing left unmeasured
            why = a.get("reason") or a.get("error") or ""
            rows.append(f'<tr><td>{escape(a["name"])}</td><td>{who}</td><td colspan="4" class="{cls}">'
                        f'{label}</td><td class="small">{escape(why)}</td></tr>')
    return "<table>" + "".join(rows) + "</table>"


def _fidelity_html(fid: dict[str, Any]) -> str:
    if fid.get("status") != "ran":
        why = fid.get("error") or fid.get("reason") or "unknown error"
        return f'<p class="notrun">Fidelity not measured: {escape(why)}</p>'
    rows = [("Top-1 agreement with the plaintext model", _num(fid.get("top1_agreement"))),
            ("Mean KL divergence (nats per position)", _num(fid.get("mean_kl"), "{:.4f}")),
            ("Greedy continuations identical", _pct(fid.get("greedy_match_rate"), 0)),
            ("Largest logit difference", _num(fid.get("max_logit_error"), "{:.3g}")),
            ("Prompts / positions / greedy tokens",
             f'{fid.get("prompts")} / {fid.get("positions")} / {fid.get("greedy_tokens")} ({escape(fid.get("prompt_kind", ""))})')]
    ref = fid.get("reference")
    if fid.get("verdict") and isinstance(ref, dict):
        rows.insert(0, ("Verdict", f'<b>{escape(fid["verdict"])}</b> <span class="small">({escape(fid.get("why", ""))})'
                                   "</span>"))
        rows.insert(4, ("Reference: " + escape(ref.get("what", "")),
                        f'top-1 {_num(ref.get("top1_agreement"))}, KL {_num(ref.get("mean_kl"), "{:.4f}")}, greedy '
                        f'{_pct(ref.get("greedy_match_rate"), 0)}'))
    corpus = fid.get("corpus")
    if corpus:
        ppl = corpus.get("perplexity", {})
        rows.append(("Perplexity plaintext / obfuscated",
                     f'{_num(ppl.get("plain"), "{:.3f}")} / {_num(ppl.get("obfuscated"), "{:.3f}")} '
                     f'({escape(corpus.get("provenance", ""))})'))
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _kv_table(d: dict[str, Any]) -> str:
    return "<table>" + "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(json.dumps(v, default=str))}</td></tr>"
                               for k, v in d.items()) + "</table>"


def _section_html(s: dict[str, Any], level: str = "h3") -> str:
    out = [f"<{level}>{escape(s['title'])}</{level}>"] if level else []
    out += [f"<p>{escape(par)}</p>" for par in s["text"].split("\n\n") if par.strip()]
    table = s.get("table")
    if isinstance(table, dict) and isinstance(table.get("columns"), list) and isinstance(table.get("rows"), list):
        head = "".join(f"<th>{escape(str(c))}</th>" for c in table["columns"])
        body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>"
                       for row in table["rows"] if isinstance(row, list))
        out.append(f"<table><tr>{head}</tr>{body}</table>")
    out.append(f'<p class="small">Source: {escape(s["source"])}</p>')
    return "".join(out)


LOG_READER_SECTION = "log-reader"  # the measured-context section shown under "The log reader"


def _log_reader_html(report: dict[str, Any], sections: list[dict[str, Any]] | None) -> str:
    """What the log reader read in this audit, at which volume, its curve against volume when the audit measured
    one, and what the project measured at larger volumes and with other reference text."""
    mine = [a for a in report["attacks"] if a["observer"] == ID_STREAM and a["status"] == "ran"
            and a.get("ttrsr") is not None]
    out = ["<h2>The log reader</h2>"]
    if mine:
        best = max(mine, key=lambda a: a["ttrsr"])
        volume = best.get("tokens_observed")
        out.append(f"<p>In this audit the strongest log-reader attack, {escape(best['name'])}, read "
                   f"{_pct(best['ttrsr'])} of the private prompt tokens and {_pct(best.get('piirsr'))} of the PII "
                   f"tokens, from {f'{volume:,}' if volume else 'the'} tokens of traffic: the volume this figure "
                   "assumes. A log reader who sees more traffic, or holds text like yours, reads more.</p>")
    else:
        out.append("<p>No log-reader attack ran in this audit: it says nothing about this observer.</p>")
    curve = report.get("log_reader_curve") or []
    if curve:
        rows = "".join(f'<tr><td class="num">{int(c["tokens"]):,}</td><td class="num">'
                       f'{_pct(c.get("prompt_token_recovery"))}</td><td class="num">{_pct(c.get("pii_token_recovery"))}'
                       f'</td></tr>' for c in curve)
        out.append("<p>Measured by this audit against the volume of traffic: your prompts among public PII-like "
                   "prompts in the chat template, permuted with your key, deciphered with public text as the "
                   "reader's reference, each volume warm-started from the last (<code>--traffic-tokens</code> "
                   "sets the largest):</p><table><tr><th>Tokens observed</th><th>User-text tokens read</th>"
                   f"<th>PII tokens read</th></tr>{rows}</table>")
    for s in sections or []:
        if s.get("id") == LOG_READER_SECTION:
            out.append(_section_html(s, ""))
    return "".join(out)


def _context_html(sections: list[dict[str, Any]] | None, problem: str | None) -> str:
    if problem:
        return f'<h2>Measured context</h2><p class="small">{escape(problem)}</p>'
    rest = [s for s in sections or [] if s.get("id") != LOG_READER_SECTION]
    if not rest:
        return ""
    return "<h2>Measured context</h2>" + "".join(_section_html(s) for s in rest)


def render_html(report: dict[str, Any], context_path: Any = None) -> str:
    """The page for a report.json dict; ``context_path`` replaces the package's measured context file."""
    measured = frontier_mod.load_measured()
    sections, problem = load_context(context_path)
    p = report["parameters"]
    presets = ", ".join(p.get("matches_presets") or []) or "custom"
    prov = {"budget": report["budget"], "private prompts": report["private_prompts"], "seed": report["seed"],
            "threads": report["threads"], "command": report.get("command"), "inputs": report["inputs"],
            "versions": report["versions"], "git": report["git"], "machine": report["machine"],
            "time": report["time"], "excluded attacks": report.get("excluded_attacks"),
            "measured frontier": measured.get("provenance")}
    title = f"aloepri audit — {escape(p.get('source', '').rsplit('/', 1)[-1] or report['inputs']['obfuscated'])}"
    body = [
        f"<h1>{title}</h1>",
        f'<p class="sub">Budget <b>{escape(report["budget"])}</b> · setting {escape(presets)} '
        f'(h = {p.get("h_effective")}) · {escape(report["time"]["finished"] or "partial report")}</p>',
        "<h2>Who can read your prompts</h2>", _verdict_html(report),
        "<h2>Recovery against accuracy</h2>", plot_svg(report, measured),
        '<p class="small">Each coloured point is one attack of this audit, at this setting\'s top-1 agreement '
        "(points at the same height are set side by side, each attack with its own shape); the legend names the "
        "observer each counts against: filled points are the provider's, hollow points the log reader's. Grey "
        "points are settings the project measured on the same model (highest recovery over the attacks run on "
        "each); the dashed line joins the ones no other setting beats on both axes. No point below the 90% line at "
        "useful accuracy means no measured setting hides the prompts from the provider there.</p>",
        "<h2>Attacks</h2>", _attack_rows(report["attacks"]),
        "<h2>Fidelity</h2>", _fidelity_html(report["fidelity"]),
        _log_reader_html(report, sections),
        _context_html(sections, problem),
        "<h2>Parameters</h2>", _kv_table({**p["params"], "h (effective)": p.get("h_effective"),
                                          "architecture": p.get("architecture"), "vocabulary": p.get("vocab_size"),
                                          "model fingerprint": p.get("model_fingerprint")}),
        "<h2>Provenance</h2>", _kv_table(prov),
    ]
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{title}</title><style>{CSS}</style></head><body>" + "".join(body) + "</body></html>\n")
