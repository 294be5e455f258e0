"""Tiny random-weight float64 checkpoints of every supported architecture, built with stock classes."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=False,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, attention_bias=True,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None,
                                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, attention_bias=False,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def build_tiny(arch: str, directory: Path, seed: int = 0) -> Path:
    import transformers

    cfg_name, model_name, extra = TINY_ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**TINY_COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights so fusing them is really tested
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory
