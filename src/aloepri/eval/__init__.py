"""Accuracy evaluation and privacy accounting for obfuscated models.

- fidelity:         prompt fidelity (top-1, KL, max logit error, greedy match) and perplexity on real text
- humaneval:        HumanEval pass@1 with sandboxed execution, plaintext vs obfuscated
- lm_eval_adapter:  lm-evaluation-harness model ``aloepri`` (optional extra ``lm-eval``)
- privacy:          the paper's RmDP epsilon (Theorem in "Security Analysis")
- perturb:          online exponential-mechanism token perturbation and its eps_1

Submodules are imported on use (torch/transformers/lm-eval are heavy).
"""
