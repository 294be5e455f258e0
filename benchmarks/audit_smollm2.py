"""`aloepri audit` on SmolLM2-135M-Instruct obfuscated with the lossless setting (the exact transforms, h = 0, the
four massive-activation dimensions kept out of the key's mixing: no noise), recorded in
results/audit_smollm2_<budget>.json (the audit's report.json, with local paths reduced to file names).

The done-criterion of the audit: on this setting it must report >= 90% of prompt tokens recovered (the behavioural
attack and weight matching read the prompts there), and < 90% only where its attacks truly fail.

Run:  OMP_NUM_THREADS=1 nice -n 10 python benchmarks/audit_smollm2.py [--budget ci]
      python benchmarks/audit_smollm2.py --existing REPORT_DIR   (record an audit already run on that setting)
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def shorten_paths(report: dict) -> dict:
    """Local paths -> their last component (the record is read on other machines)."""
    out = json.loads(json.dumps(report))
    for k, v in out["inputs"].items():
        out["inputs"][k] = Path(v).name
    out["parameters"]["source"] = Path(out["parameters"]["source"]).name
    if out.get("command"):
        out["command"] = " ".join(Path(w).name if w.startswith("/") else w for w in out["command"].split())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="ci", choices=["ci", "small", "full"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--existing", default=None, help="a report directory written by `aloepri audit`")
    a = ap.parse_args()
    if a.existing:
        report = json.loads((Path(a.existing) / "report.json").read_text())
    else:
        import aloepri
        from aloepri.audit import run_audit
        from aloepri.models import smollm2_gguf

        src = smollm2_gguf()
        with tempfile.TemporaryDirectory(prefix="audit-smollm2-") as work:
            w = Path(work)
            aloepri.obfuscate(src, w / "server", w / "client.key", aloepri.resolve_params("exact", h=0, outlier_dims=4),
                              progress=False)
            report = run_audit(src, w / "server", w / "client.key", a.budget, w / "report", threads=a.threads,
                               command=f"aloepri audit {src.name} --obfuscated server --key client.key "
                                       f"--budget {a.budget} --out report").data
    params = report["parameters"]["params"]
    if not (params["h"] == 0 and params["alpha_e"] == 0 and params["alpha_h"] == 0 and params["outlier_dims"] == 4):
        raise SystemExit(f"not the lossless setting: {params}")
    out = RESULTS / f"audit_smollm2_{report['budget']}.json"
    out.write_text(json.dumps(shorten_paths(report), indent=2) + "\n")
    print(f"wrote {out}: worst {report['worst_prompt_token_recovery']} ({report['worst_attack']}), "
          f"{report['time']['seconds']} s")


if __name__ == "__main__":
    main()
