"""The models verify and eval load: a .gguf plaintext model is dequantized into the model tensor by tensor, and an
obfuscated checkpoint stored in another dtype is converted tensor by tensor, each with the weights and config
transformers' own loading gives, without its second copy."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from aloepri.export.gguf import export_gguf, plaintext_reference_dir
from aloepri.runtime.inference import gguf_model, load_plain_model
from aloepri.storage.sources import pretrained_kwargs
from conftest import smollm2_or_skip


def _same_model_as_transformers_loads(path):
    ours = load_plain_model(path)
    theirs = AutoModelForCausalLM.from_pretrained(**pretrained_kwargs(path), dtype=torch.float32).eval()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    assert [k for k in ours_sd if not torch.equal(ours_sd[k], theirs_sd[k])] == []
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    ours_cfg, theirs_cfg = ours.config.to_dict(), theirs.config.to_dict()
    theirs_cfg.pop("quantization_config")  # transformers notes where the weights came from; nothing else differs
    assert ours_cfg == theirs_cfg


def test_a_gguf_loads_as_transformers_loads_it(tiny_dir, tmp_path):
    reference = plaintext_reference_dir(tiny_dir("llama"), tmp_path / "plain")  # GGUF interleaves its q/k rows
    export_gguf(reference, tmp_path / "m.gguf", "f16")  # tiny rows do not fill a q8_0 block
    _same_model_as_transformers_loads(tmp_path / "m.gguf")


@pytest.mark.slow
def test_smollm2_loads_as_transformers_loads_it():
    _same_model_as_transformers_loads(smollm2_or_skip())


def test_a_gguf_that_leaves_a_weight_unset_is_refused(tiny_dir, tmp_path, monkeypatch):
    import aloepri.obfuscation.plain_model as inference

    reference = plaintext_reference_dir(tiny_dir("llama"), tmp_path / "plain")
    export_gguf(reference, tmp_path / "m.gguf", "f32")
    every_role = inference._gguf_tensor_roles
    monkeypatch.setattr(inference, "_gguf_tensor_roles", lambda ck: every_role(ck)[1:])  # the embedding left out
    with pytest.raises(ValueError, match="unset"):
        gguf_model(tmp_path / "m.gguf")


def test_a_gguf_whose_config_lacks_its_tensors_is_refused(tiny_dir, tmp_path):
    """Qwen2 exported as llama keeps its q/k/v biases, which transformers' llama config does not declare (its own
    loader drops them without a word)."""
    reference = plaintext_reference_dir(tiny_dir("qwen2"), tmp_path / "plain")
    export_gguf(reference, tmp_path / "m.gguf", "f32")
    with pytest.raises(ValueError, match="q_proj.bias"):
        gguf_model(tmp_path / "m.gguf")


def test_an_obfuscated_checkpoint_in_another_dtype_loads_as_transformers_loads_it(obfuscated):
    from aloepri.runtime.inference import load_obfuscated_model

    out, _ = obfuscated("qwen2")  # stored in float64 (the tiny source's dtype), loaded as float32: converted
    ours = load_obfuscated_model(out)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys() and all(v.dtype == torch.float32 for v in ours_sd.values())
    assert [k for k in ours_sd if not torch.equal(ours_sd[k], theirs_sd[k])] == []
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    assert ours.config.to_dict() == theirs.config.to_dict()
