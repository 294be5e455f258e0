"""The paper's RmDP epsilon (aloepri.eval.privacy) for SmolLM2-135M and Qwen2.5-Coder-0.5B, per preset and eps_1.

    OMP_NUM_THREADS=1 python benchmarks/privacy_budget.py   # writes benchmarks/results/privacy_budget.json
"""
import json, math, torch
torch.set_num_threads(1)
import aloepri
from aloepri.models import smollm2_gguf, qwen25_coder_05b_gguf
from aloepri.eval.privacy import load_vocab_matrices, budget_from_matrices
out = {}
for name, src in [("SmolLM2-135M", smollm2_gguf()), ("Qwen2.5-Coder-0.5B", qwen25_coder_05b_gguf())]:
    we, wh = load_vocab_matrices(src)
    for preset in ["exact", "noisy", "paper"]:
        p = aloepri.resolve_params(preset)
        for eps1 in [math.inf, 1.0, 10.0]:
            b = budget_from_matrices(we, wh, p.alpha_e, p.alpha_h, eps1)
            out[f"{name}|{preset}|{eps1}"] = b.to_dict()
            print(name, preset, eps1, f"l_e={b.lambda_e[0]:.2f},{b.lambda_e[1]:.2f} l_h={b.lambda_h[0]:.2f},{b.lambda_h[1]:.2f} sig_e={b.sigma_e:.4g} sig_h={b.sigma_h:.4g} eps_e={b.eps_e:.4g} eps_h={b.eps_h:.4g} eps_2={b.eps_2:.4g} eps={b.eps:.6g}", flush=True)
json.dump(out, open(str(__import__("pathlib").Path(__file__).parent / "results" / "privacy_budget.json"), "w"), indent=1)
