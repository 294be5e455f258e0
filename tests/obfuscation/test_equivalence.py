"""Equivalence beyond the per-architecture check (tests/test_arch_conformance.py): other presets and options, tiny
random float64 models, stock classes."""
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import aloepri
from conftest import rmsnorm_in_input_dtype
from aloepri.testing.tiny import MOE_ARCHS


def _restore_float64(model, path: Path) -> None:
    """transformers >= 5.24 keeps MoE router weights (and DeepSeek-V3's score bias) in float32 whatever dtype is
    asked for; reload such tensors from the float64 checkpoint, or the float32 rounding of the router would hide
    the obfuscation's own float64 error."""
    from safetensors.torch import load_file

    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name, t in tensors.items():
        if t.dtype != torch.float64 and t.is_floating_point() and name in stored:
            t.data = stored[name].to(torch.float64)


def load64(path, arch):
    """float64 through the stock class; MoE experts with the eager kernel (the grouped-mm one has no float64),
    RoPE frequencies recomputed in float64 (stock code computes them in float32, which would hide the obfuscation's
    own error below float32 rounding of theta^x -- relevant where head padding changes theta)."""
    extra = {"experts_implementation": "eager"} if arch in MOE_ARCHS else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **extra).eval()
    _restore_float64(model, Path(path))
    rope = model.model.rotary_emb
    params = model.config.rope_parameters or {}
    if params.get("rope_type", "default") == "default":
        dim = 2 * rope.inv_freq.numel()
        rope.inv_freq = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        rope.original_inv_freq = rope.inv_freq
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _max_logit_error(plain, obf, key, length: int, seed: int) -> float:
    """Largest |plaintext logit - obfuscated logit mapped back| over 2 random id sequences of ``length``."""
    ids = torch.randint(0, plain.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    obf_ids = torch.tensor([key.encode_ids(r) for r in ids.tolist()])
    with rmsnorm_in_input_dtype():
        return float((_logits(plain, ids) - _logits(obf, obf_ids)[..., torch.from_numpy(key.permutation)]).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_obfuscated_weights_are_not_the_plain_weights(arch, tiny_dir, obfuscated):
    """Sanity against a no-op pipeline: every stored matrix differs from any permutation of the original."""
    out, key = obfuscated(arch)
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir(arch), dtype=torch.float64)
    obf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    e_p = plain.model.embed_tokens.weight.detach()
    e_o = obf.model.embed_tokens.weight.detach()[torch.from_numpy(key.permutation)]
    assert e_o.shape[1] > e_p.shape[1]
    # exact preset: the embedding is an isometric image (norms kept up to the global scale), never the identity
    ratio = e_o.norm(dim=1) / e_p.norm(dim=1)
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-9)
    assert not torch.allclose(e_o[:, : e_p.shape[1]], e_p * ratio[0])


@pytest.mark.parametrize("arch", ["llama_bias", "qwen2", "qwen3", "qwen2_moe", "deepseek_v3"])
def test_noisy_presets_stay_close_and_load(arch, tiny_dir, obfuscated):
    """noisy/paper presets are approximations: they must load and keep the logits correlated."""
    out, key = obfuscated(arch, preset="noisy")
    plain, obf = load64(tiny_dir(arch), arch), load64(out, arch)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    lp = _logits(plain, ids)
    lo = _logits(obf, torch.tensor([key.encode_ids(r) for r in ids.tolist()]))[..., torch.from_numpy(key.permutation)]
    corr = np.corrcoef(lp.flatten().numpy(), lo.flatten().numpy())[0, 1]
    assert 0.5 < corr < 0.999999, corr  # close but not exact: the noise is really there


def test_no_head_permutation_or_scaling_still_exact(tiny_dir, obfuscated):
    out, key = obfuscated("llama", head_permutation=False, qk_scale_range=1.0, ffn_scale_range=1.0)
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), dtype=torch.float64).eval()
    obf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    with rmsnorm_in_input_dtype():
        err = (_logits(plain, ids) - _logits(obf, torch.tensor([key.encode_ids(ids[0].tolist())]))[..., torch.from_numpy(key.permutation)]).abs().max()
    assert err <= 1e-9


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_outlier_dims_stay_exact_and_unmixed(arch, tiny_dir, obfuscated):
    """outlier_dims: still exact, and each kept residual dimension reaches the server as one (scaled, signed)
    coordinate of the obfuscated embedding instead of being spread over all of them."""
    from aloepri.obfuscation.checkpoint import open_checkpoint
    from aloepri.obfuscation.pipeline import massive_activation_dims
    from aloepri.obfuscation.transforms import KEPT_NORM_WEIGHT_MAX

    out, key = obfuscated(arch, outlier_dims=3)
    plain, obf = load64(tiny_dir(arch), arch), load64(out, arch)
    err = _max_logit_error(plain, obf, key, 11, seed=4)
    assert err <= 1e-9, err

    src = open_checkpoint(tiny_dir(arch))
    kept = massive_activation_dims(src, plain.config.num_hidden_layers, 3)
    e_p = plain.model.embed_tokens.weight.detach()
    e_o = obf.model.embed_tokens.weight.detach()[torch.from_numpy(key.permutation)]
    scale = (e_o.norm(dim=1) / e_p.norm(dim=1))[0]
    for i in kept:  # column i of the plaintext embedding appears, up to sign and the scale, as one column
        col = e_p[:, i] * scale
        assert min(min((e_o[:, j] - col).abs().max(), (e_o[:, j] + col).abs().max())
                   for j in range(e_o.shape[1])) < 1e-9, i
    other = next(i for i in range(e_p.shape[1]) if i not in kept)
    col = e_p[:, other] * scale
    assert min((e_o[:, j] - col).abs().max() for j in range(e_o.shape[1])) > 1e-3  # the rest is mixed

    # A kept dimension's RMSNorm weight stays on the server's norm at its coordinate (kappa * w_i, clipped to
    # +-kappa * KEPT_NORM_WEIGHT_MAX), as 8-bit activation rounding needs; elsewhere the server's norm is kappa.
    for layer_p, layer_o in zip(plain.model.layers, obf.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            w_p, w_o = getattr(layer_p, name).weight.detach(), getattr(layer_o, name).weight.detach()
            kappa = w_o.median()
            assert int(((w_o - kappa).abs() > 1e-12).sum()) <= len(kept)
            for i in kept:
                col = e_p[:, i:i + 1] * scale
                j = int(torch.minimum((e_o - col).abs().amax(0), (e_o + col).abs().amax(0)).argmin())
                on_server = float(w_p[i].clamp(-KEPT_NORM_WEIGHT_MAX, KEPT_NORM_WEIGHT_MAX))
                assert abs(float(w_o[j]) - float(kappa) * on_server) < 1e-9, (name, i)


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_default_preset_is_exact(arch, tiny_dir, obfuscated):
    """`default` (what the CLI and the API use when no preset is named) reproduces plaintext logits: no noise, no
    lambda, no RoPE block permutation, no expansion. A default that brings back an approximate mechanism fails here."""
    assert aloepri.resolve_params().is_exact and aloepri.resolve_params() == aloepri.resolve_params("default")
    out, key = obfuscated(arch, preset="default")
    plain, obf = load64(tiny_dir(arch), arch), load64(out, arch)
    assert obf.config.hidden_size == plain.config.hidden_size  # h = 0: the width is unchanged
    err = _max_logit_error(plain, obf, key, 13, seed=6)
    assert err <= 1e-9, err


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe"])
def test_noisy_is_exact_but_for_its_noise(arch, tiny_dir, obfuscated):
    """`noisy` is the exact transforms plus embedding/head noise: lambda 0, beta 1 and h 0 were each measured to
    stop no attack and to cost accuracy (docs/serving.md "bf16", docs/expansion.md). With its noise set to zero it
    must reproduce plaintext logits; a preset that brings back an approximate mechanism fails here."""
    out, key = obfuscated(arch, preset="noisy", alpha_e=0.0, alpha_h=0.0)  # C/E are empty at h = 0
    err = _max_logit_error(load64(tiny_dir(arch), arch), load64(out, arch), key, 13, seed=6)
    assert err <= 1e-9, err


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe", "deepseek_v3"])
def test_no_expansion_h0_stays_exact(arch, tiny_dir, obfuscated):
    """h = 0 (the `default` and `noisy` presets: the expansion was measured to buy nothing, docs/expansion.md): the
    hidden width stays d and the logits are still exact."""
    out, key = obfuscated(arch, h=0)
    plain, obf = load64(tiny_dir(arch), arch), load64(out, arch)
    assert obf.config.hidden_size == plain.config.hidden_size == key.hidden_size
    err = _max_logit_error(plain, obf, key, 13, seed=5)
    assert err <= 1e-9, err
