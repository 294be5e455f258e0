"""Every registered architecture (archs.SPECS, read here, so a new spec is covered the moment it is registered):
it has a tiny model, the exact preset reproduces its plaintext logits through the stock class, and its GGUF export
(where the spec has one) reads back through aloepri's own GGUF reader as the very tensors of the obfuscated
directory; a spec without one refuses the export.

Tiny random float64 models (aloepri.testing.tiny); equivalence at float64 (norms computed in the input dtype) and
against the float32 rounding floor of the stock classes."""
import json

import pytest
import torch

import aloepri
from aloepri.export.gguf import GGUFExportError, export_gguf
from aloepri.obfuscation.archs import GGUF_ARCHS, LINEAR_ROLES, SPECS, spec_for_hf
from aloepri.obfuscation.checkpoint import open_checkpoint
from aloepri.testing.tiny import TINY_ARCHS, tiny_variants
from conftest import rmsnorm_in_input_dtype
from test_equivalence import _logits, load64

# (spec, tiny variant) for every spec; None where a spec has no tiny model, so that case fails instead of vanishing
CASES = [(name, variant) for name, spec in sorted(SPECS.items()) for variant in (tiny_variants(spec) or [None])]
GGUF_CASES = [(name, variant) for name, variant in CASES if SPECS[name].gguf_export is not None]
NO_GGUF_CASES = [(name, variant) for name, variant in CASES if SPECS[name].gguf_export is None]


def _ids(cases):
    return [f"{name}-{variant}" for name, variant in cases]


def test_every_tiny_model_is_a_registered_architecture():
    covered = {v for _, v in CASES}
    assert set(TINY_ARCHS) <= covered, set(TINY_ARCHS) - covered


@pytest.mark.parametrize("spec_name,variant", CASES, ids=_ids(CASES))
def test_exact_preset_reproduces_logits(spec_name, variant, tiny_dir, obfuscated):
    assert variant is not None, f"{spec_name} has no tiny model: add one to aloepri/testing/tiny.py TINY_ARCHS"
    spec = SPECS[spec_name]
    assert spec_for_hf(json.loads((tiny_dir(variant) / "config.json").read_text())["architectures"]) is spec
    out, key = obfuscated(variant)
    plain, obf = load64(tiny_dir(variant), variant), load64(out, variant)
    assert type(obf).__name__ == spec.output_architecture  # loads with the stock class, no custom code
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_size"] == key.hidden_size
    assert cfg["hidden_size"] > plain.config.hidden_size and cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    # every norm weight is a constant vector but at kept coordinates, and a random tiny model has no residual
    # dimension large enough for the exact preset's measured rule to keep (test_equivalence keeps some by count)
    for name, p in obf.named_parameters():
        if name.endswith("layernorm.weight") or name == spec.hf_names.of("final_norm"):  # incl. MLA q_a/kv_a norms
            assert int((p != p.median()).sum()) == 0, name

    ids = torch.randint(0, plain.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    obf_ids = torch.tensor([key.encode_ids(r) for r in ids.tolist()])
    perm = torch.from_numpy(key.permutation)
    with rmsnorm_in_input_dtype():
        exact_err = (_logits(plain, ids) - _logits(obf, obf_ids)[..., perm]).abs().max().item()
    assert exact_err <= 1e-9, exact_err

    # With the stock float32 RMSNorm the error is float32 rounding: no larger than what that rounding does
    # to the plaintext model itself.
    stock_plain = _logits(plain, ids)
    with rmsnorm_in_input_dtype():
        floor = (stock_plain - _logits(plain, ids)).abs().max().item()
    stock_err = (stock_plain - _logits(obf, obf_ids)[..., perm]).abs().max().item()
    assert stock_err <= max(20 * floor, 1e-6), (stock_err, floor)


@pytest.mark.parametrize("spec_name,variant", GGUF_CASES, ids=_ids(GGUF_CASES))
def test_gguf_export_reads_back_as_the_obfuscated_tensors(spec_name, variant, obfuscated, tmp_path):
    """f32 export, then aloepri's GGUF reader (the one that reads GGUF sources): every tensor comes back exactly
    under its role, q/k rows in Hugging Face order again. Catches a wrong name, a missing or extra tensor, and a
    q/k row layout the reader does not undo (the llama.cpp logits check is tests/test_gguf_export.py)."""
    spec = SPECS[spec_name]
    out, _ = obfuscated(variant)
    res = export_gguf(out, tmp_path / "m.gguf", "f32")
    assert res.arch == spec.gguf_export
    obf, back = open_checkpoint(out), open_checkpoint(tmp_path / "m.gguf")
    try:
        assert spec.gguf_export in back.spec.gguf_architectures  # read back by the spec of the arch it declares
        assert back.num_layers == obf.num_layers and not back.tied_embeddings
        pairs = [(r, None, "weight") for r in ("embed", "head", "final_norm")]
        for i in range(obf.num_layers):
            for role in obf.attention_roles(i) + obf.mlp_roles(i):
                parts = ("weight", "bias") if role in LINEAR_ROLES else ("weight",)
                pairs += [(role, i, part) for part in parts if obf.has(role, i, part)]
        stored = []
        for role, layer, part in pairs:
            want = obf.get(role, layer, part, dtype=torch.float32)
            if not back.has(role, layer, part):  # only a zero o bias, dropped where llama.cpp's graph has none
                assert (role, part) == ("o", "bias") and not GGUF_ARCHS[spec.gguf_export].o_bias, (role, layer)
                assert not want.any()
                continue
            assert torch.equal(back.get(role, layer, part, dtype=torch.float32), want), (role, layer, part)
            stored.append(back.name_of(role, layer, part))
        assert back.tensor_names() == set(stored)  # nothing else was written
    finally:
        obf.close()
        back.close()


@pytest.mark.parametrize("spec_name,variant", NO_GGUF_CASES, ids=_ids(NO_GGUF_CASES))
def test_gguf_export_is_refused_without_a_target(spec_name, variant, obfuscated, tmp_path):
    out, _ = obfuscated(variant)
    with pytest.raises(GGUFExportError, match="GGUF export supports"):
        export_gguf(out, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
