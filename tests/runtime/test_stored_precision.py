"""A bfloat16 checkpoint held as stored and computed in float32 gives the logits of the same checkpoint converted to
float32 at load time, bit for bit, at about half the memory: what lets the attacks and the audit hold the
obfuscated model beside the plaintext one."""
import pytest
import torch

import aloepri
from aloepri.runtime.inference import forward_cached, load_obfuscated_model
from aloepri.runtime.precision import StoredPrecisionLinear, held_bytes
from aloepri.testing.tiny import TINY_ARCHS


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_dir, tmp_path_factory):
    cache = {}

    def make(arch):
        if arch not in cache:
            work = tmp_path_factory.mktemp(f"bf16-{arch}")
            aloepri.obfuscate(tiny_dir(arch), work / "out", work / "key.json", aloepri.resolve_params("default"),
                              seed=3, dtype="bfloat16", allow_weak_seed=True, progress=False)
            cache[arch] = work / "out"
        return cache[arch]

    return make


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_held_as_stored_computes_the_logits_of_the_float32_copy(arch, bf16_checkpoint):
    out = bf16_checkpoint(arch)
    full = load_obfuscated_model(out)
    held = load_obfuscated_model(out, hold_stored=True)
    assert any(isinstance(m, StoredPrecisionLinear) for m in held.modules())
    assert all(p.dtype == torch.float32 for p in full.parameters())
    # fused MoE experts (one 3-D parameter per projection, not nn.Linear) are converted like the norms
    moe = any(p.dim() == 3 for p in full.parameters())
    assert held_bytes(held) < (0.9 if moe else 0.6) * held_bytes(full)
    ids = torch.randint(0, full.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = full(input_ids=ids).logits, held(input_ids=ids).logits
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b), (a - b).abs().max()
        (oa, ca), (ob, cb) = forward_cached(full, ids[:, :5]), forward_cached(held, ids[:, :5])
        oa, ob = forward_cached(full, ids[:, 5:6], ca)[0], forward_cached(held, ids[:, 5:6], cb)[0]
        assert torch.equal(oa.logits, ob.logits)


def test_a_float32_checkpoint_or_a_matching_dtype_is_loaded_as_before(obfuscated):
    out, _ = obfuscated("llama")  # stored in float64 (the tiny source's dtype): not a narrow float, converted
    held = load_obfuscated_model(out, hold_stored=True)
    assert not any(isinstance(m, StoredPrecisionLinear) for m in held.modules())
    assert all(p.dtype == torch.float32 for p in held.parameters())


def test_an_attack_target_holds_the_checkpoint_as_stored_when_asked_or_when_memory_is_short(bf16_checkpoint,
                                                                                          tiny_dir):
    from aloepri.attacks.base import AttackTarget, float32_copy_crowds

    out = bf16_checkpoint("llama")
    cpu = torch.device("cpu")
    assert float32_copy_crowds(out, cpu, share=1e-12) and not float32_copy_crowds(out, cpu, share=1e6)
    held = AttackTarget(tiny_dir("llama"), out, None, hold_stored=True)
    full = AttackTarget(tiny_dir("llama"), out, None, hold_stored=False)
    assert held.obfuscated_weights() is None  # not loaded yet
    _ = held.obf_model, full.obf_model
    assert held.obfuscated_weights() == "as stored (bfloat16, float32), computed in float32"
    assert full.obfuscated_weights() == "float32"
