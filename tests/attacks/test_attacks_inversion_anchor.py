"""isa_anchor: hidden-state ISA through a linear map fitted on anchor pairs. Positive control through the exact key
(any h), the map's exactness, and a negative control (wrong anchors give a useless map). Tiny random models."""
from __future__ import annotations

import numpy as np
import pytest

import aloepri
from aloepri.attacks.base import REGISTRY, AttackTarget, Budget, PrivateData
from aloepri.attacks.isa import AnchorMapConfig, ISAConfig, isa_anchor_attack

CI = Budget.named("ci")
PLAIN_ANCHORS = [0, 1, 2, 5, 7, 11]  # six known tokens, as a chat template and special ids would give


@pytest.fixture(scope="module")
def exact_h(tiny_dir, tmp_path_factory):
    cache = {}

    def make(h: int) -> AttackTarget:
        if h not in cache:
            src = tiny_dir("llama")
            work = tmp_path_factory.mktemp(f"anchor-h{h}")
            aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params("exact", h=h),
                              seed=11, allow_weak_seed=True, progress=False)
            cache[h] = AttackTarget(src, work / "server", work / "client.key")
        return cache[h]

    return make


def _prompts(n: int, length: int, vocab: int, seed: int) -> PrivateData:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, size=length).tolist() for _ in range(n)]
    return PrivateData(["-"] * n, ids, [[j % 4 == 0 for j in range(length)] for _ in range(n)])


def _anchors(target: AttackTarget, plain_ids) -> list[tuple[int, int]]:
    return [(int(target.key.permutation[p]), int(p)) for p in plain_ids]


# a 96-token vocabulary: the candidate list is exhaustive (a random tiny model's codebook ranks poorly, see
# test_attacks_inversion.py); this checks the map and the mechanics. SmolLM2 numbers: docs/expansion.md.
CFG = ISAConfig(layer=1, steps=0, refine_k=96, refine_sweeps=1, max_prompts=2, max_len=10)


@pytest.mark.parametrize("h", [2, 64])
def test_isa_anchor_positive_control_through_the_exact_key(exact_h, h):
    target = exact_h(h)
    assert target.obf_model.config.hidden_size > target.plain_model.config.hidden_size
    data = _prompts(2, 10, target.vocab_size, seed=3)
    res = isa_anchor_attack(target, data, CI, seed=0, cfg=CFG, anchors=_anchors(target, PLAIN_ANCHORS))
    assert res.attack == "isa_anchor" and "isa_anchor" in REGISTRY
    assert res.ttrsr >= 0.9, res.metrics
    assert res.metrics["map_relative_error_on_victim_states"] < 1e-3, res.metrics
    assert res.metrics["vocab_recovery_from_mapped_embedding"] >= 0.9, res.metrics
    m = res.budget["map"]
    assert m["anchor_pairs"] == len(PLAIN_ANCHORS) and m["obf_width"] == target.obf_model.config.hidden_size
    assert "no key" in res.uses


def test_isa_anchor_fails_with_wrong_anchors(exact_h):
    """Negative control: the same six obfuscated ids paired with the wrong plaintext tokens give a map that does
    not carry the victim's states (and recovers almost nothing)."""
    target = exact_h(2)
    data = _prompts(2, 10, target.vocab_size, seed=3)
    right = _anchors(target, PLAIN_ANCHORS)
    wrong = [(o, p) for (o, _), p in zip(right, PLAIN_ANCHORS[1:] + PLAIN_ANCHORS[:1])]
    res = isa_anchor_attack(target, data, CI, seed=0, cfg=CFG, anchors=wrong,
                            map_cfg=AnchorMapConfig(contexts=16, context_len=32))
    assert res.metrics["map_relative_error_on_victim_states"] > 0.1, res.metrics
    assert res.metrics["vocab_recovery_from_mapped_embedding"] < 0.5, res.metrics


def test_isa_anchor_needs_anchors(exact_h):
    target = exact_h(2)
    with pytest.raises(ValueError, match="anchor"):
        isa_anchor_attack(target, _prompts(1, 4, target.vocab_size, 1), CI, cfg=CFG, anchors=_anchors(target, [0]))


def testresidual_streams_survive_an_earlier_attention_run(tiny_dir):
    """The attention ISA runs the first layer alone with eager attention; transformers 5 then recorded hidden
    states of that one layer only, forever after, and a state map fitted later failed. residual_streams reads
    every layer whatever ran before."""
    import torch

    from aloepri.runtime.probe import layer_states, residual_streams
    from aloepri.runtime.inference import load_plain_model

    model = load_plain_model(tiny_dir("llama"), torch.float64)
    ids = torch.tensor([[3, 5, 7, 9]])
    layer_states(model, 1, input_ids=ids, attentions=True)
    states = residual_streams(model, ids)
    assert len(states) == model.config.num_hidden_layers + 1
    full = model(input_ids=ids, output_hidden_states=False).logits
    normed = model.model.norm(states[-1])
    assert torch.allclose(model.lm_head(normed), full)
