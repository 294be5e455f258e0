"""Block-quantized FP8 checkpoints (the DeepSeek-V3 and Qwen3-FP8 release format) in and out, and the check of what
a tensor-parallel engine can split."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import aloepri
from aloepri.obfuscation.checkpoint import open_checkpoint
from aloepri.obfuscation.fp8 import (FP8_MAX, BlockFp8, dequantize_blockwise, fake_quantize,
                                     parse_quantization_config, quantize_blockwise)
from aloepri.obfuscation.sharding import ShardLayout, layout_of, tensor_parallel_problems
from cli_helpers import entries, obfuscate_args, one_error_line, run_cli
from test_equivalence import _max_logit_error, load64
from aloepri.testing.tiny import build_tiny, dequantized_copy, to_fp8_release

# tiny checkpoints in the release format; blocks that leave partial edge blocks (48 = 32 + 16 columns)
PARTIAL = {"qwen3": (16, 32), "qwen3_moe": (8, 32), "deepseek_v3": (8, 32)}


@pytest.fixture(scope="module")
def fp8_source(tiny_dir, tmp_path_factory):
    """Factory: (FP8 checkpoint, its float64 dequantization) of a tiny architecture; DeepSeek with an MTP layer."""
    cache = {}

    def make(arch, block=None):
        block = block or PARTIAL[arch]
        if (arch, block) not in cache:
            work = tmp_path_factory.mktemp(f"fp8-{arch}")
            src = to_fp8_release(tiny_dir(arch), work / "fp8", block, mtp=arch.startswith("deepseek"))
            cache[arch, block] = (src, dequantized_copy(src, work / "dequantized"))
        return cache[arch, block]

    return make


def _obfuscate(src, work, preset="exact", dtype=None, **overrides):
    aloepri.obfuscate(src, work / "out", work / "key.json", aloepri.resolve_params(preset, **overrides), seed=7,
                      allow_weak_seed=True, progress=False, dtype=dtype)
    return work / "out", aloepri.load_key(work / "key.json")


# --- the pure functions -------------------------------------------------------------------------------------------

def test_dequantize_is_the_per_block_product_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(37, 45, generator=g) * 50).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.1  # blocks of 16 x 32: 16 + 16 + 5 rows, 32 + 13 columns
    w = dequantize_blockwise(q, s, (16, 32))
    for i in range(37):
        for j in range(0, 45, 7):
            assert w[i, j] == q[i, j].float() * s[i // 16, j // 32]
    assert w.dtype == torch.float32 and dequantize_blockwise(q, s, (16, 32), torch.float64).dtype == torch.float64


def test_quantize_uses_the_full_range_per_block_and_round_trips():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g, dtype=torch.float64)
    w[:128, :128] *= 1000  # one block much larger than the rest: its scale must not leak into its neighbours
    w[256:, 128:] = 0  # an all-zero partial block
    q, s = quantize_blockwise(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (3, 2)
    assert s[2, 1] > 0 and q[256:, 128:].float().abs().max() == 0
    assert torch.isclose(q[:128, :128].float().abs().max(), torch.tensor(FP8_MAX))  # amax maps onto 448
    back = dequantize_blockwise(q, s, (128, 128), torch.float64)
    scale = s.double().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, an absolute 2^-10 * scale for subnormals
    assert ((back - w).abs() <= w.abs() * 2.0 ** -4 + scale * 2.0 ** -9).all()
    assert torch.equal(quantize_blockwise(back, (128, 128))[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fake_quantize(w, (128, 128)), back)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 4}, "quantization method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "FP8 format 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "per-tensor FP8 is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive integers"),
])
def test_quantization_configs_aloepri_cannot_read_are_refused(qc, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config({"quantization_config": qc})
    assert parse_quantization_config({}) is None
    assert parse_quantization_config({"quantization_config": BlockFp8((128, 128)).config()}).block == (128, 128)


# --- FP8 in: `exact` equals the dequantized plaintext --------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_exact_reproduces_the_dequantized_plaintext(arch, fp8_source, tmp_path):
    src, plain_dir = fp8_source(arch)
    out, key = _obfuscate(src, tmp_path, dtype="float64")
    err = _max_logit_error(load64(plain_dir, arch), load64(out, arch), key, 13, seed=3)
    assert err <= 1e-9, err


def test_the_multi_token_prediction_layer_is_dropped_and_declared(fp8_source, tmp_path):
    src, _ = fp8_source("deepseek_v3")
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert any(k.startswith(f"model.layers.{n}.") for k in load_file(str(src / "model.safetensors")))
    out, _ = _obfuscate(src, tmp_path, "exact", dtype="float64", h=0)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith(f"model.layers.{n}.") for k in index)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


# --- FP8 out ------------------------------------------------------------------------------------------------------

class _IdentityKey:  # compares two plaintext models with _max_logit_error
    permutation = np.arange(96)

    @staticmethod
    def encode_ids(ids):
        return ids


_IDENTITY = _IdentityKey()

# blocks that divide every tiny width, so the stock transformers FP8 loader (which refuses partial blocks) loads it
WHOLE = {"qwen3": (16, 16), "deepseek_v3": (4, 4)}


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_fp8_output_round_trip(arch, fp8_source, tiny_dir, tmp_path):
    """An FP8 source gives an FP8 output by default: quantized linear weights with scales of the right shape, the
    rest bfloat16, a quantization_config the stock FP8 loader reads; its logits stay close to the plaintext's."""
    src, plain_dir = fp8_source(arch, WHOLE[arch])
    out, key = _obfuscate(src, tmp_path, "exact", h=0)
    cfg = json.loads((out / "config.json").read_text())
    fmt = parse_quantization_config(cfg)
    assert fmt is not None and fmt.block == WHOLE[arch] and cfg["quantization_config"]["activation_scheme"] == "dynamic"
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    quantized = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert quantized and all(k.endswith(".weight") for k in quantized)
    for k in quantized:
        assert tuple(tensors[k[:-len("weight")] + "weight_scale_inv"].shape) == fmt.scale_shape(tensors[k].shape), k
    unquantized = [k for k, t in tensors.items() if t.dtype not in (torch.float8_e4m3fn, torch.float32)]
    assert all(tensors[k].dtype == torch.bfloat16 for k in unquantized)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    if arch == "deepseek_v3":  # routers and their score bias stay unquantized, as in the release
        assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in quantized

    dequantized = load64(dequantized_copy(out, tmp_path / "deq"), arch)
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # transformers' FP8 loader
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(stock(ids).logits.double(), dequantized(ids).logits, atol=1e-4)

    # Re-quantizing the mixed weights costs about what quantizing cost the plaintext release itself (measured
    # 0.5-1.2x on these models, over keys and h): compare against the float64 original the release was made from.
    plain = load64(plain_dir, arch)
    err = _max_logit_error(plain, dequantized, key, 11, seed=5)
    release_err = _max_logit_error(load64(tiny_dir(arch), arch), plain, _IDENTITY, 11, seed=5)
    assert 1e-6 < err < 2 * release_err, (err, release_err)


def test_fp8_output_from_an_unquantized_source_uses_release_blocks(tmp_path, capsys):
    """--dtype fp8 on a float checkpoint: 128 x 128 blocks, read back by aloepri's own reader; refused with the
    reason where the widths do not hold whole blocks in the engines' fused projections."""
    src = build_tiny("llama", tmp_path / "src", hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=32, intermediate_size=256)
    out, _ = _obfuscate(src, tmp_path, "exact", dtype="fp8", h=0)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    back = open_checkpoint(out)
    assert back.fp8.block == (128, 128) and back.get("q", 0).dtype == torch.float64
    rc, err = run_cli(capsys, ["export-gguf", out, "--outfile", tmp_path / "m.gguf", "--quiet"])
    assert rc == 2 and "FP8 block-quantized weights" in one_error_line(err, "export-gguf")

    narrow = build_tiny("llama", tmp_path / "narrow")  # q 48, k 16, gate 80 rows: no whole 128-row block
    rc, err = run_cli(capsys, obfuscate_args(narrow, tmp_path / "out2", tmp_path / "k2.key", "--dtype", "fp8"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "q projection output (fused with k and v) 48 per GPU is not a multiple of the FP8 block's " \
        "128 rows" in line and "unquantized --dtype" in line
    assert not (tmp_path / "out2").exists()


# --- bad FP8 inputs: one line, nothing written ---------------------------------------------------------------------

def _broken_copy(fp8_source, tmp_path, drop=None, **quant):
    src, _ = fp8_source("qwen3")
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    if drop:
        tensors = load_file(str(bad / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(bad / "model.safetensors"))
    cfg = json.loads((bad / "config.json").read_text())
    if quant.pop("no_config", False):
        del cfg["quantization_config"]
    cfg.get("quantization_config", {}).update(quant)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("change, message", [
    ({"drop": "model.layers.1.mlp.down_proj.weight_scale_inv"},
     "FP8 tensor model.layers.1.mlp.down_proj.weight has no model.layers.1.mlp.down_proj.weight_scale_inv"),
    ({"weight_block_size": [16, 16]}, "has a scale of shape [3, 2], but blocks of [16, 16]"),
    ({"quant_method": "gptq"}, "quantization method 'gptq' is not supported"),
    ({"no_config": True}, "config.json has no quantization_config"),
])
def test_bad_fp8_checkpoints_are_one_clear_line(fp8_source, tmp_path, capsys, change, message):
    bad = _broken_copy(fp8_source, tmp_path, **change)
    rc, err = run_cli(capsys, obfuscate_args(bad, tmp_path / "out", tmp_path / "k.key"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and message in line, line
    assert entries(tmp_path) == ["src"]


# --- tensor parallelism -------------------------------------------------------------------------------------------

# published configurations (config.json of the Hugging Face releases)
LLAMA31_8B = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, ffn={"dense": 14336})
QWEN25_05B = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, ffn={"dense": 4864})
SMOLLM2_135M = dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64, ffn={"dense": 1536})
DEEPSEEK_V3 = dict(num_attention_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, ffn={"dense": 18432, "expert": 2048, "shared expert": 2048})


def _layout(mla=False, **cfg):
    ffn = cfg.pop("ffn")
    return layout_of(cfg, mla, cfg.get("head_dim") or 0, ffn)


@pytest.mark.parametrize("cfg, mla, tp, fp8, problem", [
    (LLAMA31_8B, False, 8, True, None),
    (LLAMA31_8B, False, 16, False, None),  # 8 key/value heads replicated onto 16 GPUs
    (LLAMA31_8B, False, 3, False, "32 attention heads do not split over 3 GPUs"),
    (QWEN25_05B, False, 1, True, None),
    (QWEN25_05B, False, 2, False, None),
    (QWEN25_05B, False, 2, True, "q projection output (fused with k and v) 448 per GPU is not a multiple"),
    (QWEN25_05B, False, 4, False, "14 attention heads do not split over 4 GPUs"),
    (SMOLLM2_135M, False, 1, True, "q projection output (fused with k and v) 576 per GPU is not a multiple of the FP8 block's 128 rows"),
    (SMOLLM2_135M, False, 3, False, None),
    (DEEPSEEK_V3, True, 8, True, None),
    (DEEPSEEK_V3, True, 32, False, None),
    (DEEPSEEK_V3, True, 32, True, "expert gate projection output (fused with up) 64 per GPU is not a multiple"),
])
def test_tensor_parallel_rules_on_published_shapes(cfg, mla, tp, fp8, problem):
    problems = tensor_parallel_problems(_layout(mla, **dict(cfg)), tp, (128, 128) if fp8 else None)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_key_value_heads_must_split_or_replicate_evenly():
    layout = ShardLayout(num_heads=12, num_kv_heads=6, head_dim=64, ffn={"dense": 1536})
    assert tensor_parallel_problems(layout, 3) == [] and tensor_parallel_problems(layout, 12) == []
    assert "6 key/value heads neither split over 4 GPUs" in tensor_parallel_problems(layout, 4)[0]


def test_tp_refusal_is_one_line_before_any_work(tiny_dir, tmp_path, capsys):
    rc, err = run_cli(capsys, obfuscate_args(tiny_dir("qwen3"), tmp_path / "out", tmp_path / "k.key", "--tp", "4"))
    line = one_error_line(err, "obfuscate")
    assert rc == 2 and "6 attention heads do not split over 4 GPUs" in line
    assert entries(tmp_path) == []


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe", "deepseek_v3"])
def test_the_output_keeps_the_source_head_counts_and_widths(arch, tiny_dir, tmp_path):
    """The expansion d + 2h touches only the hidden width, which engines never split (and, where heads are padded,
    is rounded to a multiple of the head count): the output shards wherever its source does."""
    out, _ = _obfuscate(tiny_dir(arch), tmp_path, "exact")
    aloepri.obfuscate(tiny_dir(arch), tmp_path / "tp2", tmp_path / "tp2.key", aloepri.resolve_params("exact"),
                      seed=7, allow_weak_seed=True, progress=False, tp=2)
    src = json.loads((tiny_dir(arch) / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
              "shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "v_head_dim"):
        assert cfg.get(k) == src.get(k), k
    assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0


def test_obfuscating_to_fp8_says_what_the_precision_costs(fp8_source, tmp_path, capsys):
    """An FP8 output (the FP8 source's own precision) is announced with its measured cost, and the preset's banner
    no longer promises plaintext logits; a float output keeps that promise."""
    src, _ = fp8_source("qwen3")
    rc, err = run_cli(capsys, obfuscate_args(src, tmp_path / "fp8", tmp_path / "fp8.key", "--preset", "default",
                                             "--allow-weak-seed", "--seed", "3"))
    assert rc == 0 and "logits are NOT the plaintext's" in err and "1.3-1.6x" in err
    assert "reproduces plaintext logits" not in err
    rc, err = run_cli(capsys, obfuscate_args(src, tmp_path / "f32", tmp_path / "f32.key", "--preset", "default",
                                             "--allow-weak-seed", "--seed", "3", "--dtype", "float32"))
    assert rc == 0 and "reproduces plaintext logits" in err and "NOT the plaintext's" not in err
