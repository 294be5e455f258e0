"""`aloepri audit` on SmolLM2-135M-Instruct obfuscated with the lossless setting (the exact transforms, h = 0, the
four massive-activation dimensions kept out of the key's mixing: no noise), recorded as one entry ``report`` (the
audit's report.json, with local paths reduced to file names).

The done-criterion of the audit: on this setting it must report >= 90% of prompt tokens recovered (the behavioural
attack and weight matching read the prompts there), and < 90% only where its attacks truly fail. ``existing``
(a report directory written by `aloepri audit` on that setting) records an audit already run instead.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore


@dataclass(frozen=True)
class Settings:
    budget: str = "ci"
    threads: int = 1
    existing: str = ""  # a report directory of `aloepri audit` to record instead of running one


def shorten_paths(report: dict) -> dict:
    """Local paths -> their last component (the record is read on other machines)."""
    out = json.loads(json.dumps(report))
    for k, v in out["inputs"].items():
        out["inputs"][k] = Path(v).name
    out["parameters"]["source"] = Path(out["parameters"]["source"]).name
    if out.get("command"):
        out["command"] = " ".join(Path(w).name if w.startswith("/") else w for w in out["command"].split())
    return out


def run(s: Settings, store: ResultStore) -> None:
    if store.has("report"):
        return
    if s.existing:
        report = json.loads((Path(s.existing) / "report.json").read_text())
    else:
        import aloepri
        from aloepri.audit import run_audit

        from ..lib.models import model_path

        src = model_path("smollm2")
        with tempfile.TemporaryDirectory(prefix="audit-smollm2-") as work:
            w = Path(work)
            aloepri.obfuscate(src, w / "server", w / "client.key", aloepri.resolve_params("exact", h=0, outlier_dims=4),
                              progress=False)
            report = run_audit(src, w / "server", w / "client.key", s.budget, w / "report", threads=s.threads,
                               command=f"aloepri audit {src.name} --obfuscated server --key client.key "
                                       f"--budget {s.budget} --out report").data
    params = report["parameters"]["params"]
    if not (params["h"] == 0 and params["alpha_e"] == 0 and params["alpha_h"] == 0 and params["outlier_dims"] == 4):
        raise ValueError(f"not the lossless setting: {params}")
    store.put("report", shorten_paths(report))
    print(f"worst {report['worst_prompt_token_recovery']} ({report['worst_attack']}), {report['time']['seconds']} s")


def report(store: ResultStore) -> str:
    r = store.get("report")
    if r is None:
        return "(no audit stored)"
    lines = [r["verdict"]["headline"], "",
             f"budget {r['budget']}, complete {r['complete']}, {r['time']['seconds']:.0f} s; command: `{r['command']}`",
             "", "| attack | observer | status | TTRSR (%) | PIIRSR (%) | seconds |", "|---|---|---|---|---|---|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    for a in r["attacks"]:
        lines.append(f"| {a['name']} | {a['observer']} | {a['status']} | {pct(a.get('ttrsr'))} | "
                     f"{pct(a.get('piirsr'))} | {a.get('seconds') or '-'} |")
    return "\n".join(lines)


SUMMARY = "`aloepri audit` on SmolLM2 obfuscated losslessly: it must report the prompts as read (~20 min at ci)"
CONFIGS = {"ci": Settings()}
NOTES = "CPU; obfuscates with a fresh random seed each run, as a user would"
