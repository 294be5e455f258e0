"""A source config in the published layout, RoPE scaling under ``rope_scaling`` and the base under a top-level
``rope_theta`` (Llama-3.1, DeepSeek-V3), keeps both in the obfuscated model's config."""
from __future__ import annotations

import json

import torch

import aloepri
from aloepri.keyfile import load_key
from aloepri.obfuscation.params import resolve_params
from aloepri.testing.tiny import build_tiny


def test_rope_scaling_and_top_level_theta_survive(tmp_path):
    from transformers import AutoModelForCausalLM

    src = build_tiny("llama", tmp_path / "src", tie_word_embeddings=False, max_position_embeddings=256, head_dim=16,
                     num_attention_heads=3, num_key_value_heads=1)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32, "rope_type": "llama3"}
    (src / "config.json").write_text(json.dumps(cfg))
    res = aloepri.obfuscate(src, tmp_path / "out", tmp_path / "k.key", resolve_params("exact"), seed=1,
                            allow_weak_seed=True, progress=False, dtype="float64")
    rope = json.loads((res.output_dir / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0 and rope["factor"] == 8.0
    perm = torch.tensor(load_key(res.key_path).vocab_permutation)
    ids = torch.randint(0, 96, (1, 100), generator=torch.Generator().manual_seed(0))  # past original_max (32)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)(ids).logits
        obf = AutoModelForCausalLM.from_pretrained(res.output_dir, dtype=torch.float64)(perm[ids]).logits[..., perm]
    # transformers forms the RoPE tables in float32: ~1e-6 of the logits even in float64; the lost base gave 1.1
    assert float((plain - obf).abs().max()) < 1e-5 * float(plain.abs().max())
