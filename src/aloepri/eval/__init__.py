"""Accuracy evaluation and privacy accounting for obfuscated models.

- fidelity:         prompt fidelity (top-1, KL, max logit error, greedy match) and perplexity on real text
- humaneval:        HumanEval pass@1 with sandboxed execution, plaintext vs obfuscated
- lm_eval_adapter:  lm-evaluation-harness model ``aloepri`` (optional extra ``lm-eval``)
- privacy:          the paper's RmDP epsilon (Theorem in "Security Analysis")
- tuning:           parameter search over attacks and fidelity (``aloepri tune``)

Submodules are imported on use (torch/transformers/lm-eval are heavy).
"""
