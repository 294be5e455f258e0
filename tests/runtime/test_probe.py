"""The module view by role (runtime.modules) and the forward-pass probes (runtime.probe) on tiny random models."""
from __future__ import annotations

import pytest
import torch

from aloepri.runtime.inference import load_plain_model
from aloepri.runtime.modules import ModelModules
from aloepri.runtime.probe import forward_hooks, layer_states, residual_streams, single_token_states


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_plain_model(tiny_dir("llama"), torch.float64)


def test_roles_name_the_transformers_modules(llama):
    mods = ModelModules(llama)
    block = llama.model.layers[1]
    layer = mods.layer(1)
    assert mods.embed is llama.model.embed_tokens and mods.final_norm is llama.model.norm
    assert mods.head is llama.lm_head and len(mods) == llama.config.num_hidden_layers
    assert layer.q is block.self_attn.q_proj and layer.o is block.self_attn.o_proj
    assert layer.attn_norm is block.input_layernorm and layer.ffn_norm is block.post_attention_layernorm
    assert layer.gate is block.mlp.gate_proj and layer.down is block.mlp.down_proj
    assert layer.q_norm is None and layer.router is None  # Llama: no per-head norms, a dense feed-forward
    assert mods.state_module(0) is mods.embed and mods.state_module(2) is llama.model.layers[1]
    with pytest.raises(ValueError, match="out of range"):
        mods.state_module(len(mods) + 1)


def test_moe_and_qk_norm_roles(tiny_dir):
    qwen3_moe = load_plain_model(tiny_dir("qwen3_moe"), torch.float64)
    layer = ModelModules(qwen3_moe).layer(0)
    assert layer.router is qwen3_moe.model.layers[0].mlp.gate and layer.gate is None
    assert layer.q_norm is qwen3_moe.model.layers[0].self_attn.q_norm


def test_a_model_without_the_decoder_layout_is_refused():
    with pytest.raises(TypeError, match="Linear: expected a decoder-only causal LM"):
        ModelModules(torch.nn.Linear(2, 2))


def test_forward_hooks_replace_outputs_and_are_removed_even_on_error():
    lin = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    with forward_hooks([("lin", lin)], lambda name, out: torch.zeros_like(out)):
        assert torch.equal(lin(x), torch.zeros(1, 2))
    assert not torch.equal(lin(x), torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="boom"):
        with forward_hooks([("lin", lin)], lambda name, out: None):
            raise RuntimeError("boom")
    assert not lin._forward_hooks


def test_layer_states_agree_with_the_full_forward(llama):
    ids = torch.tensor([[3, 5, 7, 9], [1, 2, 4, 8]])
    streams = residual_streams(llama, ids)
    full = llama(input_ids=ids, output_hidden_states=True).hidden_states
    for i in range(len(streams)):  # the last entry of hidden_states is after the final norm: compare before it
        assert torch.allclose(layer_states(llama, i, input_ids=ids), streams[i])
        if i < len(streams) - 1:
            assert torch.allclose(streams[i], full[i])
    alone = single_token_states(llama, 1, batch=7)  # batches that do not divide the vocabulary
    assert torch.allclose(alone[5].double(), layer_states(llama, 1, input_ids=torch.tensor([[5]]))[0, 0], atol=1e-6)
    assert len(alone) == llama.config.vocab_size


def test_residual_streams_survive_an_earlier_attention_run(tiny_dir):
    """The attention ISA runs the first layer alone with eager attention; transformers 5 then recorded hidden
    states of that one layer only, forever after, and a state map fitted later failed. residual_streams reads
    every layer whatever ran before. (A model of its own: the run under test must not touch the shared one.)"""
    model = load_plain_model(tiny_dir("llama"), torch.float64)
    ids = torch.tensor([[3, 5, 7, 9]])
    layer_states(model, 1, input_ids=ids, attentions=True)
    states = residual_streams(model, ids)
    assert len(states) == model.config.num_hidden_layers + 1
    full = model(input_ids=ids, output_hidden_states=False).logits
    normed = model.model.norm(states[-1])
    assert torch.allclose(model.lm_head(normed), full)
