"""`aloepri audit` on a real model obfuscated with the lossless setting (the exact transforms, h = 0, the four
massive-activation dimensions kept out of the key's mixing: no noise; the `default` preset), recorded as one entry
``report`` (the audit's report.json, with local paths reduced to file names): SmolLM2-135M-Instruct at `ci`
(config ``ci``) and Qwen2.5-Coder-1.5B-Instruct at `small`, the audit's default budget for a user (config
``qwen-coder-1.5b-small``). The report holds each step's peak RSS.

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
    model: str = "smollm2"
    # 0: obfuscate afresh with a random seed, as a user would; else the benchmarks' cached checkpoint of this seed
    # and output dtype (benchmarks.lib.targets: the 1.5B model takes 10 min to obfuscate)
    seed: int = 0
    dtype: str = ""


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

        src = model_path(s.model)
        params = aloepri.resolve_params("exact", h=0, outlier_dims=4)
        output = {"dtype": s.dtype} if s.dtype else {}
        with tempfile.TemporaryDirectory(prefix="audit-") as work:
            w = Path(work)
            if s.seed:
                from ..lib.targets import obfuscated

                t = obfuscated(src, params, s.seed, **output)
                server, key = t.model_dir, t.key_path
            else:
                server, key = w / "server", w / "client.key"
                aloepri.obfuscate(src, server, key, params, progress=False, **output)
            report = run_audit(src, server, key, s.budget, w / "report", threads=s.threads, progress=False,
                               log=print,
                               command=f"aloepri audit {src.name} --obfuscated server --key client.key "
                                       f"--budget {s.budget} --out report --threads {s.threads}").data
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
             "", "| attack | observer | status | TTRSR (%) | PIIRSR (%) | seconds | peak RSS (GiB) |",
             "|---|---|---|---|---|---|---|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    fid = r.get("fidelity", {})
    if fid.get("status") == "ran":
        lines.append(f"| (fidelity: top-1 {fid['top1_agreement']:.4f}) | - | ran | - | - | {fid.get('seconds', '-')} | "
                     f"{fid.get('peak_rss_gib') or '-'} |")
    for a in r["attacks"]:
        why = f" ({a['why']})" if a["status"] == "skipped" and a.get("why") else ""
        lines.append(f"| {a['name']} | {a['observer']} | {a['status']}{why} | {pct(a.get('ttrsr'))} | "
                     f"{pct(a.get('piirsr'))} | {a.get('seconds') or '-'} | "
                     f"{(a.get('attack_budget') or {}).get('peak_rss_gib') or '-'} |")
    return "\n".join(lines)


SUMMARY = ("`aloepri audit` on a real model obfuscated losslessly (SmolLM2 at ci, ~20 min; the 1.5B model at small): "
           "it must report the prompts as read")
CONFIGS = {"ci": Settings(),
           # the 1.5B model (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M) at the default budget, on the bfloat16 output
           # `aloepri obfuscate` writes from it (the cached `default` checkpoint of llamacpp_quantized)
           "qwen-coder-1.5b-small": Settings(budget="small", threads=2, model="qwen-coder-1.5b", seed=2026,
                                             dtype="bfloat16")}
DOCS = ("docs/audit.md",)
NOTES = "CPU; obfuscates with a fresh random seed each run, as a user would"
