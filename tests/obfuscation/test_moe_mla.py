"""MoE and MLA specifics beyond logit equality: identical expert selections, group-preserving expert
permutations, the paper's router normalisation, refusal of unsupported paths."""
import numpy as np
import pytest
import torch

import aloepri
from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts
from aloepri.obfuscation.secrets import expert_order
from conftest import rmsnorm_in_input_dtype
from test_equivalence import load64
from aloepri.testing.tiny import MOE_ARCHS


@pytest.fixture(scope="module")
def obfuscated_moe(tiny_dir, tmp_path_factory):
    cache = {}

    def make(arch, preset="exact", **overrides):
        k = (arch, preset, tuple(sorted(overrides.items())))
        if k not in cache:
            work = tmp_path_factory.mktemp(f"moe-{arch}")
            aloepri.obfuscate(tiny_dir(arch), work / "out", work / "key.json",
                              aloepri.resolve_params(preset, **overrides), seed=11, allow_weak_seed=True, progress=False)
            cache[k] = (work / "out", aloepri.load_key(work / "key.json"))
        return cache[k]

    return make


def _routing(arch, tiny_dir, out, key, ids):
    plain, obf = load64(tiny_dir(arch), arch), load64(out, arch)
    with rmsnorm_in_input_dtype():
        r_plain = routing_decisions(plain, ids)
        r_obf = routing_decisions(obf, torch.tensor([key.encode_ids(r) for r in ids.tolist()]))
    return r_plain, r_obf, obf.config


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_exact_preset_keeps_every_expert_selection(arch, tiny_dir, obfuscated_moe):
    out, key = obfuscated_moe(arch)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(5))
    r_plain, r_obf, cfg = _routing(arch, tiny_dir, out, key, ids)
    orders = expert_orders(key, cfg)
    assert set(r_plain) == set(r_obf) == set(orders) and r_plain  # every sparse layer, and only those
    mapped = to_plain_experts(r_obf, orders)
    for layer in r_plain:
        assert torch.equal(mapped[layer], r_plain[layer]), layer
        # the server's numbering is not the plaintext one (the permutation is not the identity)
        assert not np.array_equal(orders[layer], np.arange(len(orders[layer])))


def test_grouped_routing_permutes_whole_groups():
    order = expert_order(seed=3, layer=1, num_experts=16, groups=4)
    assert sorted(order) == list(range(16))
    for g in range(4):  # every new group holds exactly one old group
        assert len({int(e) // 4 for e in order[g * 4:(g + 1) * 4]}) == 1
    with pytest.raises(ValueError, match="groups"):
        expert_order(seed=3, layer=1, num_experts=10, groups=4)


@pytest.mark.parametrize("normalize", [False, True])
def test_router_logits_are_permuted_and_optionally_normalised(normalize):
    """Obfuscated router logits on the obfuscated state equal the plaintext logits of the expert in that slot;
    with the paper's normalisation they are divided by that expert's row norm, which changes the top-k."""
    from aloepri.obfuscation import keymat
    from aloepri.obfuscation.transforms import obfuscate_router

    rng = np.random.default_rng(0)
    d, h, n_exp = 24, 4, 8
    base = keymat.init_key_base(rng, d, h, lam=0.0, e_scale=0.0)
    P, Q = keymat.key_matrix(base, np.zeros((d, h))), keymat.inverse_key_matrix(base, keymat.sample_D(rng, base))
    W = torch.from_numpy(rng.standard_normal((n_exp, d)) * np.geomspace(0.3, 3.0, n_exp)[:, None])
    norm_w = torch.from_numpy(1 + 0.3 * rng.standard_normal(d))
    order = rng.permutation(n_exp)
    x = rng.standard_normal((200, d))
    obf = obfuscate_router(W, norm_w, Q, order, normalize=normalize)
    got = torch.from_numpy(x @ P) @ obf.T
    plain = (torch.from_numpy(x) * norm_w) @ W.T
    want = plain[:, order] / (W.norm(dim=1)[order] if normalize else 1.0)
    assert torch.allclose(got, want, atol=1e-10)
    top_plain = torch.sort(torch.topk(plain, 2).indices, dim=-1).values
    top_obf = torch.sort(torch.from_numpy(order)[torch.topk(got, 2).indices], dim=-1).values
    changed = (top_plain != top_obf).any(dim=-1).float().mean().item()
    assert (changed > 0.1) if normalize else (changed == 0.0), changed


def test_missing_expert_tensor_is_reported_before_writing(tiny_dir, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_dir("qwen3_moe"), src)
    f = next(src.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    if (src / "model.safetensors.index.json").exists():
        idx = json.loads((src / "model.safetensors.index.json").read_text())
        idx["weight_map"].pop("model.layers.1.mlp.experts.5.up_proj.weight", None)
        (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(aloepri.CheckpointError, match="experts.5.up_proj"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("exact"), seed=1,
                          allow_weak_seed=True,
                          progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "key.json").exists()


def test_qwen2_moe_heads_are_padded_for_engines_that_derive_head_dim(tiny_dir, obfuscated_moe):
    """vLLM/SGLang Qwen2-MoE compute head_dim = hidden_size // num_heads: the output must satisfy it exactly."""
    import json

    from safetensors.torch import load_file

    out, key = obfuscated_moe("qwen2_moe")
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((tiny_dir("qwen2_moe") / "config.json").read_text())
    padded = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["head_dim"] == padded and padded * cfg["num_attention_heads"] == cfg["hidden_size"]
    old = src["hidden_size"] // src["num_attention_heads"]
    assert padded > old
    assert cfg["rope_parameters"]["rope_theta"] == pytest.approx(src["rope_parameters"]["rope_theta"] ** (padded / old))
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(f))
    k = tensors["model.layers.0.self_attn.k_proj.weight"].reshape(cfg["num_key_value_heads"], padded, -1)
    pad = list(range(old // 2, padded // 2)) + list(range(padded // 2 + old // 2, padded))
    assert torch.count_nonzero(k[:, pad]) == 0 and torch.count_nonzero(k[:, : old // 2]) > 0


def test_head_padding_refuses_a_rope_base_beyond_float32(tiny_dir, tmp_path):
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_dir("mixtral"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 1e6  # 1e6 ** (52 / 8) = 1e39 > float32 max
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="smaller h"):
        aloepri.obfuscate(src, tmp_path / "out", tmp_path / "k.json", aloepri.resolve_params("exact"), seed=1,
                          allow_weak_seed=True,
                          progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "k.json").exists()
