"""`aloepri audit`: the verdict for one obfuscated deployment. Fidelity and the strongest attacks of the suite
(aloepri.attacks) within a budget, written as report.json and a self-contained report.html.

    from aloepri.audit import run_audit
    report = run_audit("model.gguf", "server-model/", "client.key.json", budget="ci", out="audit/")
    report.worst_prompt_token_recovery   # the best attack's share of private prompt tokens recovered
"""
from __future__ import annotations

from .run import AuditInputError, AuditReport, run_audit, validate_inputs, write_report

__all__ = ["AuditInputError", "AuditReport", "run_audit", "validate_inputs", "write_report"]
