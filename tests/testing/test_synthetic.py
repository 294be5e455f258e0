"""Synthetic full-width checkpoints (aloepri.testing.synthetic) and the streaming safetensors writer under them."""
from __future__ import annotations

import json
import math

import pytest
import torch

from aloepri.storage.safetensors_dir import SafetensorsDir
from aloepri.storage.safetensors_stream import StreamedFile
from aloepri.testing.synthetic import FAMILIES, synthetic_config, tensor_shapes, write_synthetic_checkpoint

# parameter counts as the model cards and configs give them (embedding and head included; DeepSeek-V3.1 without
# its multi-token-prediction layer, which is not part of the main model)
PUBLISHED_PARAMS = {"llama-3.1-8b": 8_030_261_248, "qwen3-30b-a3b": 30_532_122_624}
PUBLISHED_BILLIONS = {"llama-3.1-70b": 70.6, "qwen2.5-14b": 14.7, "qwen3-32b": 32.8, "qwen3-235b-a22b": 235.0,
                      "deepseek-v3.1": 671.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_published_configs_give_the_published_sizes(family):
    n = sum(math.prod(s) for _, s in tensor_shapes(synthetic_config(family)))
    if family in PUBLISHED_PARAMS:
        assert n == PUBLISHED_PARAMS[family]
    else:
        assert abs(n / 1e9 - PUBLISHED_BILLIONS[family]) / PUBLISHED_BILLIONS[family] < 0.005, n


def test_config_reductions():
    cfg = synthetic_config("deepseek-v3.1", num_layers=4, vocab_size=1000, num_experts=16)
    assert (cfg["num_hidden_layers"], cfg["vocab_size"], cfg["n_routed_experts"]) == (4, 1000, 16)
    assert cfg["hidden_size"] == 7168 and cfg["moe_intermediate_size"] == 2048  # full width kept
    assert cfg["n_group"] == 8 and cfg["topk_group"] * 16 // 8 >= cfg["num_experts_per_tok"]
    with pytest.raises(ValueError, match="groups"):
        synthetic_config("deepseek-v3.1", num_experts=12)
    with pytest.raises(ValueError, match="no routed experts"):
        synthetic_config("llama-3.1-8b", num_experts=8)
    with pytest.raises(ValueError, match="unknown family"):
        synthetic_config("gpt-5")


def test_written_checkpoint_loads_with_stock_transformers(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    out = write_synthetic_checkpoint("qwen3-30b-a3b", tmp_path / "m", num_layers=1, vocab_size=256, num_experts=4,
                                     max_shard_bytes=20 << 20)
    cfg = synthetic_config("qwen3-30b-a3b", 1, 256, 4)
    tensors = SafetensorsDir(out)
    assert len(set(tensors.weight_map.values())) > 1  # sharded
    expected = dict(tensor_shapes(cfg))
    assert tensors.names() == set(expected)
    assert all(tensors.shape(n) == list(s) for n, s in expected.items())
    w = tensors.get("model.layers.0.mlp.experts.3.down_proj.weight")
    assert w.dtype == torch.bfloat16 and 0.015 < float(w.float().std()) < 0.025
    assert abs(float(tensors.get("model.norm.weight").float().mean()) - 1.0) < 0.05
    assert AutoConfig.from_pretrained(out).hidden_size == 2048
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()
    with pytest.raises(FileExistsError):
        write_synthetic_checkpoint("qwen3-30b-a3b", out, num_layers=1, vocab_size=256, num_experts=4)


def test_streamed_file_round_trip_and_refusals(tmp_path):
    from safetensors import safe_open

    a = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    b = torch.randn(5, 2).to(torch.bfloat16)
    f = StreamedFile(tmp_path / "x.safetensors", [("a", "float32", (4, 3)), ("b", "bfloat16", (5, 2))])
    f.write("a", a[:1])
    f.write("a", a[1:])
    f.write("b", b)
    f.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as g:
        assert torch.equal(g.get_tensor("a"), a) and torch.equal(g.get_tensor("b"), b)
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0
    assert json.loads(raw[8: 8 + int.from_bytes(raw[:8], "little")])["b"]["dtype"] == "BF16"

    f = StreamedFile(tmp_path / "y.safetensors", [("a", "float32", (4, 3)), ("b", "bfloat16", (5, 2))])
    with pytest.raises(ValueError, match="expected 'a'"):
        f.write("b", b)
    with pytest.raises(ValueError, match="more than its shape"):
        f.write("a", torch.zeros(5, 3))
    f.write("a", a)
    with pytest.raises(ValueError, match="before 'b' was complete"):
        f.close()


def test_fp8_checkpoint_is_the_release_format_the_reader_takes(tmp_path):
    """dtype="fp8": linear weights of the decoder layers in float8_e4m3fn with 128 x 128 float32 block scales, the
    embedding, head, norms and router in bf16, quantization_config declared: what open_checkpoint reads from an
    FP8 release (dequantized), so DeepSeek-V3.1's own format can be timed."""
    from aloepri.obfuscation.checkpoint import open_checkpoint
    from aloepri.obfuscation.fp8 import RELEASE_BLOCK

    out = write_synthetic_checkpoint("qwen3-30b-a3b", tmp_path / "m", num_layers=1, vocab_size=256, num_experts=4,
                                     dtype="fp8", max_shard_bytes=20 << 20)
    tensors = SafetensorsDir(out)
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert tensors.dtype(down) == "F8_E4M3" and tensors.shape(down) == [2048, 768]
    assert tensors.shape(down + "_scale_inv") == [16, 6]
    for unquantized in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                        "model.norm.weight"):
        assert tensors.dtype(unquantized) == "BF16"
        assert unquantized.replace("weight", "weight_scale_inv") not in tensors.names()
    source = open_checkpoint(out)
    source.validate()
    assert source.fp8 is not None and source.fp8.block == RELEASE_BLOCK
    w = source.get("expert_down", 0, expert=3, dtype=None)
    assert w.dtype == torch.float32 and 0.015 < float(w.std()) < 0.025
