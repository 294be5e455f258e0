"""GGUF export and the neutral server tokenizer, checked on a real engine (llama.cpp via llama-cpp-python).

llama.cpp contexts always get n_threads=1/2 explicitly and, where logits are compared, an f32 KV cache (the
default f16 cache alone moves logits by ~1e-2).
"""
import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import aloepri
from aloepri.export.gguf import GGUFExportError, export_gguf, plaintext_reference_dir
from aloepri.obfuscation.transforms import deinterleave_rope_rows, interleave_rope_rows
from aloepri.obfuscation.server_tokenizer import (
    SPACE_MARK,
    build_hf_tokenizer,
    ids_to_neutral_text,
    neutral_symbol,
    neutral_text_to_ids,
)
from conftest import rmsnorm_in_input_dtype, smollm2_or_skip

try:
    import llama_cpp
except ImportError:  # the export and the HF tokenizer are still tested; the engine checks need llama-cpp-python
    llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed")

EXACT = aloepri.resolve_params("exact")
F32_KV = 0  # GGML_TYPE_F32
# texts that engines treat as end-of-turn / special when they find them in a vocabulary
PLAINTEXT_SPECIALS = ["<|im_end|>", "<|endoftext|>", "<|im_start|>", "</s>", "<s>", "<|eot_id|>", "<|end|>",
                      "<end_of_turn>", "<|end_of_text|>", "<eos>", "<unk>", "[EOS]", "<EOT>"]


def _llama(path, **kw):
    kw.setdefault("n_ctx", 128)
    return llama_cpp.Llama(str(path), n_threads=kw.pop("n_threads", 1), verbose=False, **kw)


def _eog_ids(m):
    return [i for i in range(m.n_vocab()) if llama_cpp.llama_vocab_is_eog(m._model.vocab, i)]


def _force(token):
    """A logits processor that makes `token` the only choice (greedy sampling then picks it)."""
    def proc(_ids, scores):
        out = np.full_like(scores, -1e30)
        out[token] = 0.0
        return out

    return llama_cpp.LogitsProcessorList([proc])


def _gguf_tokens(path):
    r = gguf.GGUFReader(str(path))
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    return tokens, types


@pytest.fixture(scope="module")
def obf(tiny_dir, tmp_path_factory):
    cache = {}

    def make(arch, seed=11):
        if (arch, seed) not in cache:
            work = tmp_path_factory.mktemp(f"gguf-{arch}")
            aloepri.obfuscate(tiny_dir(arch), work / "out", work / "key.json", EXACT, seed=seed,
                              allow_weak_seed=True, progress=False)
            cache[arch, seed] = (work / "out", aloepri.load_key(work / "key.json"), work)
        return cache[arch, seed]

    return make


def test_qk_permutation_is_the_inverse_of_the_reader():
    rng = np.random.default_rng(0)
    for shape, heads in (((6 * 8, 20), 6), ((2 * 16,), 2)):
        w = rng.standard_normal(shape)
        p = interleave_rope_rows(w, heads)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(deinterleave_rope_rows(p, heads), w)
        np.testing.assert_array_equal(interleave_rope_rows(torch.from_numpy(w), heads).numpy(), p)  # torch too
        # adjacent RoPE pairs: row 2i+1 of a head is HF row i + head_dim/2
        hd = shape[0] // heads
        np.testing.assert_array_equal(p[1], w[hd // 2])


def _reference_and_yardstick(out, ids):
    """float64 logits of the obfuscated model (norms in float64 too), and the error stock float32 transformers
    makes on it: the rounding floor any float32 engine can be held to."""
    o64 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    o32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad(), rmsnorm_in_input_dtype():
        ref = o64(torch.tensor([ids])).logits[0].numpy()
    with torch.no_grad():
        hf32 = o32(torch.tensor([ids])).logits[0].double().numpy()
    return ref, np.abs(hf32 - ref).max()


def _llama_logits(path, ids):
    m = _llama(path, logits_all=True, type_k=F32_KV, type_v=F32_KV)
    m.eval(ids)
    return np.array(m.scores[: len(ids)], dtype=np.float64)


@needs_llama_cpp
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama_bias"])
def test_f32_gguf_reproduces_transformers_logits(arch, obf, tmp_path):
    out, key, _ = obf(arch)
    res = export_gguf(out, tmp_path / "m.gguf", "f32")
    assert res.arch == ("qwen3" if arch == "qwen3" else "llama")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_attention_heads"] * cfg["head_dim"] != cfg["hidden_size"]  # the case llama.cpp must honour
    plain = torch.randint(0, cfg["vocab_size"], (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = key.encode_ids(plain)
    ref, floor = _reference_and_yardstick(out, ids)
    err = np.abs(_llama_logits(tmp_path / "m.gguf", ids) - ref).max()
    print(f"{arch}: llama.cpp f32 vs float64 reference {err:.2e}; transformers float32 {floor:.2e}")
    assert err <= 3 * floor + 1e-6, (err, floor)
    if arch == "qwen2":  # q/k/v biases exported (o bias too: zero)
        names = {t.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names


@needs_llama_cpp
def test_without_rope_pair_permutation_the_logits_are_wrong(obf, tmp_path, monkeypatch):
    """Control: the comparison above does detect a wrong q/k row layout."""
    out, key, _ = obf("llama")
    ids = key.encode_ids(list(range(3, 27)))
    ref, floor = _reference_and_yardstick(out, ids)
    monkeypatch.setattr("aloepri.export.gguf.interleave_rope_rows", lambda w, n: w)
    export_gguf(out, tmp_path / "bad.gguf", "f32")
    err = np.abs(_llama_logits(tmp_path / "bad.gguf", ids) - ref).max()
    assert err > 100 * (3 * floor + 1e-6), err


def _tiny32(directory):
    """A tiny Llama whose every row length is a multiple of 32 after the expansion (d=64, h=128: D=320)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def obf32(tmp_path_factory):
    work = tmp_path_factory.mktemp("gguf-q")
    # exact with 4 kept dimensions (a random tiny model has no dimension the presets' measured rule keeps): q8_0
    # fails here if the kept dimensions' RMSNorm weights are folded into the readers instead of staying on the
    # server's norm (llama.cpp's 8-bit activation rounding then exceeds the weight rounding this test compares it
    # with; transforms.split_norm_weight)
    aloepri.obfuscate(_tiny32(work / "src"), work / "out", work / "key.json", EXACT.replace(outlier_dims=4), seed=5,
                      allow_weak_seed=True, progress=False)
    return work / "out", aloepri.load_key(work / "key.json")


def _dequantized_reference(out, ids, qtype):
    """float64 logits of the obfuscated model holding exactly the weights the GGUF stores (f16-rounded or
    quantized and dequantized by gguf's reference quantizer; row permutations commute with row-wise blocks)."""
    Q = gguf.GGMLQuantizationType
    mat = {"f16": Q.F16, "q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q4_0": Q.Q4_0}[qtype]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2:
                continue
            t = Q.Q8_0 if mat in (Q.Q4_0, Q.Q5_0) and ("embed" in name or "lm_head" in name) else mat
            a = p.float().numpy()
            a = a.astype(np.float16).astype(np.float32) if t == Q.F16 else gguf.dequantize(gguf.quantize(a, t), t)
            p.copy_(torch.from_numpy(a.reshape(p.shape)))
        with rmsnorm_in_input_dtype():
            return model(torch.tensor([ids])).logits[0].numpy()


@needs_llama_cpp
@pytest.mark.parametrize("qtype", ["f16", "q8_0", "q5_0", "q4_0"])
def test_reduced_precision_types(qtype, obf32, tmp_path):
    out, key = obf32
    res = export_gguf(out, tmp_path / "m.gguf", qtype)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == qtype.upper() and kinds["blk.0.attn_norm.weight"] == "F32"
    assert kinds["token_embd.weight"] == kinds["output.weight"] == ("F16" if qtype == "f16" else "Q8_0")
    # stored q rows are the HF rows, RoPE-pair permuted, quantized exactly as gguf's reference quantizer does
    from safetensors import safe_open

    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / idx["model.layers.1.self_attn.q_proj.weight"]), framework="pt") as f:
        wq = f.get_tensor("model.layers.1.self_attn.q_proj.weight").float().numpy()
    t = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    got = gguf.dequantize(t.data, t.tensor_type).reshape(wq.shape)
    want = interleave_rope_rows(wq, 4)
    qt = t.tensor_type
    want = want.astype(np.float16).astype(np.float32) if qtype == "f16" else gguf.dequantize(gguf.quantize(want, qt), qt)
    np.testing.assert_array_equal(got, want)
    # llama.cpp computes that model: its logits are closer to the float64 model with the stored (rounded)
    # weights than rounding the weights moved that model away from the exact one. (The gap that remains is
    # llama.cpp rounding activations to the weight's vec-dot type; the obfuscated v/o maps amplify both.)
    ids = key.encode_ids(list(range(4, 28)))
    ref, _ = _reference_and_yardstick(out, ids)
    qref = _dequantized_reference(out, ids, qtype)
    got = _llama_logits(tmp_path / "m.gguf", ids)
    scale = np.abs(ref).max()
    engine_err, rounding_err = np.abs(got - qref).max() / scale, np.abs(qref - ref).max() / scale
    print(f"{qtype}: {res.bytes_written} bytes; weight rounding moves logits by {rounding_err:.2e}, llama.cpp is "
          f"{engine_err:.2e} from the rounded model (relative to max |logit|)")
    assert engine_err < rounding_err


@needs_llama_cpp
def test_k_quant_is_made_by_llama_cpp_from_the_f32_export(obf32, tmp_path):
    """q4_k_m: llama.cpp's quantizer requantizes the f32 export (tensors whose rows are not a multiple of 256 fall
    back to its own choice); the file is smaller than q8_0, llama.cpp serves it close to the f32 file, the
    fingerprint survives, and no staging file is left."""
    out, key = obf32
    f32 = export_gguf(out, tmp_path / "f32.gguf", "f32")
    q8 = export_gguf(out, tmp_path / "q8.gguf", "q8_0")
    res = export_gguf(out, tmp_path / "k.gguf", "q4_k_m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f32.gguf", "k.gguf", "q8.gguf"]
    assert res.bytes_written == (tmp_path / "k.gguf").stat().st_size < q8.bytes_written < f32.bytes_written
    assert (tmp_path / "k.gguf").stat().st_mode & 0o077 == (tmp_path / "f32.gguf").stat().st_mode & 0o077
    reader = gguf.GGUFReader(str(tmp_path / "k.gguf"))
    fields = {name: f.parts[f.data[0]] for name, f in reader.fields.items() if f.data}
    assert int(fields["general.file_type"][0]) == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert "aloepri.model_fingerprint" in reader.fields
    ids = key.encode_ids(list(range(4, 28)))
    want, got = _llama_logits(tmp_path / "f32.gguf", ids), _llama_logits(tmp_path / "k.gguf", ids)
    assert np.corrcoef(want.ravel(), got.ravel())[0, 1] > 0.9
    assert not np.allclose(want, got)  # really requantized, not a copy of the f32 file


def test_k_quant_without_llama_cpp_is_one_clear_error(obf32, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kw):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(GGUFExportError, match="install llama-cpp-python"):
        export_gguf(obf32[0], tmp_path / "k.gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == []


def test_quantization_needs_block_multiples(obf, tmp_path):
    out, _, _ = obf("llama")  # d=48: D=312 and intermediate 80 are not multiples of 32
    with pytest.raises(GGUFExportError, match="multiple of the 32"):
        export_gguf(out, tmp_path / "m.gguf", "q8_0")
    assert list(tmp_path.iterdir()) == []


def test_export_is_atomic_and_refuses_to_overwrite(obf, tmp_path, monkeypatch):
    out, _, _ = obf("llama")
    target = tmp_path / "m.gguf"
    calls = {"n": 0}
    from aloepri.export import gguf as gguf_export

    real_get = gguf_export._Reader.get

    def failing_get(self, name):
        calls["n"] += 1
        if calls["n"] == 6:
            raise OSError("disk went away")
        return real_get(self, name)

    monkeypatch.setattr(gguf_export._Reader, "get", failing_get)
    with pytest.raises(OSError, match="disk went away"):
        export_gguf(out, target, "f32")
    assert list(tmp_path.iterdir()) == []  # no file, no partial file
    monkeypatch.undo()
    export_gguf(out, target, "f32")
    with pytest.raises(FileExistsError):
        export_gguf(out, target, "f32")
    export_gguf(out, target, "f16", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_cli_export_gguf(obf, tmp_path, capsys):
    from aloepri.cli import main

    out, _, _ = obf("qwen2")
    assert main(["export-gguf", str(out), "--outfile", str(tmp_path / "q.gguf"), "--type", "f16", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arch"] == "llama" and report["type"] == "f16" and (tmp_path / "q.gguf").is_file()
    assert main(["export-gguf", str(out), "--outfile", str(tmp_path / "q.gguf")]) == 2  # exists: clear error
    assert "already exists" in capsys.readouterr().err


# ---------------------------------------------------------------- neutral tokenizer: round trip and stopping


def _text_mode_ids(key):
    V, eos = key.vocab_size, key.obfuscated_eos_ids()
    rng = np.random.default_rng(1)
    return rng.integers(0, V, 200).tolist() + eos + list(range(V)) + eos + [eos[0], eos[0], 0, 10, V - 1]


def test_text_mode_round_trips_through_the_hf_tokenizer(obf):
    out, key, _ = obf("qwen2")
    ids, eos = _text_mode_ids(key), key.obfuscated_eos_ids()
    text = ids_to_neutral_text(ids)
    assert neutral_text_to_ids(text) == ids
    tok = AutoTokenizer.from_pretrained(out)  # what vLLM / SGLang / transformers load
    assert tok(text)["input_ids"] == ids and tok(text, add_special_tokens=True)["input_ids"] == ids
    assert tok(" \n ".join(text.split()) + "\n")["input_ids"] == ids
    assert tok.decode(ids) == text
    assert neutral_text_to_ids(tok.decode(ids, skip_special_tokens=True)) == [i for i in ids if i not in eos]


@needs_llama_cpp
def test_text_mode_round_trips_through_llama_cpp(obf, tmp_path):
    out, key, _ = obf("qwen2")
    export_gguf(out, tmp_path / "m.gguf", "f32")
    ids, eos = _text_mode_ids(key), key.obfuscated_eos_ids()
    text = ids_to_neutral_text(ids)
    # special tokens parsed, as llama-server and llama-cpp-python do for text prompts
    m = _llama(tmp_path / "m.gguf", vocab_only=True)
    assert m.tokenize(text.encode(), add_bos=False, special=True) == ids
    assert m.tokenize(("  " + text.replace(" ", "   ") + " ").encode(), add_bos=False, special=True) == ids
    assert neutral_text_to_ids(m.detokenize(ids, special=True).decode()) == ids
    assert neutral_text_to_ids(m.detokenize(ids).decode()) == [i for i in ids if i not in eos]


@needs_llama_cpp
def test_only_the_permuted_eos_stops_llama_cpp(obf, tmp_path):
    out, key, _ = obf("llama")
    export_gguf(out, tmp_path / "m.gguf", "f32")
    m = _llama(tmp_path / "m.gguf")
    eos = key.obfuscated_eos_ids()
    assert _eog_ids(m) == sorted(eos)
    tokens, types = _gguf_tokens(tmp_path / "m.gguf")
    assert not set(tokens) & set(PLAINTEXT_SPECIALS)
    assert [j for j, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted(eos)
    prompt = key.encode_ids([5, 9, 11, 4])
    plain_specials = {v for v in key.special_tokens.values() if isinstance(v, int)}  # bos/eos/pad ids
    for target in sorted((plain_specials | set(range(6))) - set(eos)):
        r = m.create_completion(prompt, max_tokens=3, temperature=0.0, logits_processor=_force(target))
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3, target
    for target in eos:
        r = m.create_completion(prompt, max_tokens=3, temperature=0.0, logits_processor=_force(target))
        assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 0
    # plaintext special texts in a text prompt are no EOS either
    for s in PLAINTEXT_SPECIALS:
        assert not set(m.tokenize(s.encode(), add_bos=False, special=True)) & set(eos), s


class _ForceHF:
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, -1e30)
        out[:, self.token] = 0.0
        return out


def test_only_the_permuted_eos_stops_transformers(obf):
    out, key, _ = obf("llama")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    eos = key.obfuscated_eos_ids()
    assert tok.eos_token_id == eos[0] and sorted(tok.all_special_ids) == sorted(eos)
    assert not set(tok.get_vocab()) & set(PLAINTEXT_SPECIALS)
    for s in PLAINTEXT_SPECIALS:
        assert not set(tok(s)["input_ids"]) & set(eos), s
    prompt = torch.tensor([key.encode_ids([5, 9, 11, 4])])
    from transformers import LogitsProcessorList

    plain_specials = sorted({v for v in key.special_tokens.values() if isinstance(v, int)})
    for target in plain_specials + eos:
        g = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                           logits_processor=LogitsProcessorList([_ForceHF(target)]))[0, prompt.shape[1]:].tolist()
        assert g == ([target] if target in eos else [target] * 3), target


def test_neutral_tokenizer_reveals_nothing_of_the_permutation(obf, tmp_path):
    """Everything the tokenizers hold is a function of public data only: the vocabulary size and the EOS ids
    (which generation_config.json publishes and the server sees anyway). Two keys of the same model give the
    same vocabulary; the files equal what is built from (V, EOS) alone."""
    (out_a, key_a, _), (out_b, key_b, _) = obf("llama", seed=11), obf("llama", seed=12)
    assert key_a.obfuscated_eos_ids() != key_b.obfuscated_eos_ids()  # different secrets
    V = key_a.vocab_size
    for out, key in ((out_a, key_a), (out_b, key_b)):
        vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
        assert vocab == {neutral_symbol(j): j for j in range(V)}
        eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
        assert (out / "tokenizer.json").read_text() == build_hf_tokenizer(V, [eos]).to_str()
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        assert cfg["eos_token"] == neutral_symbol(eos) and "unk_token" not in cfg
    ta, ya = _gguf_tokens(export_gguf(out_a, tmp_path / "a.gguf", "f32").outfile)
    tb, yb = _gguf_tokens(export_gguf(out_b, tmp_path / "b.gguf", "f32").outfile)
    special = set(key_a.obfuscated_eos_ids()) | set(key_b.obfuscated_eos_ids())
    assert all(ta[j] == tb[j] == SPACE_MARK + neutral_symbol(j) for j in range(V) if j not in special)
    assert all(ya[j] == yb[j] == gguf.TokenType.NORMAL for j in range(V) if j not in special)


# ---------------------------------------------------------------- real weights: SmolLM2 on llama.cpp


@pytest.fixture(scope="module")
def smol_export(smollm2_exact, tmp_path_factory):
    smol, server_dir, key_path = smollm2_exact
    work = tmp_path_factory.mktemp("smol-gguf")
    obf_gguf = export_gguf(server_dir, work / "obf.gguf", "f32").outfile
    plain_gguf = export_gguf(plaintext_reference_dir(smol, work / "plain"), work / "plain.gguf", "f32").outfile
    return smol, server_dir, aloepri.load_key(key_path), obf_gguf, plain_gguf


def _greedy_ids(m, prompt, max_tokens=40):
    out = []
    for t in m.generate(prompt, top_k=1, temp=0.0, reset=True):
        if llama_cpp.llama_vocab_is_eog(m._model.vocab, t) or len(out) >= max_tokens:
            return out, len(out) < max_tokens
        out.append(t)


def _chat_ids(tok, question):
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@needs_llama_cpp
def test_smollm2_greedy_chat_through_llama_cpp_matches_plaintext(smol_export):
    from aloepri.runtime.inference import load_tokenizer

    smol, out, key, obf_gguf, plain_gguf = smol_export
    tok = load_tokenizer(key, smol)
    obf = _llama(obf_gguf, n_threads=2)
    # (1) against the plaintext GGUF as shipped (Q4_1; llama.cpp also rounds activations to 8 bits for it)
    ids = _chat_ids(tok, "What is the capital of France? Answer in one sentence.")
    plain_reply, plain_stopped = _greedy_ids(_llama(smol, n_threads=2), ids)
    server_reply, obf_stopped = _greedy_ids(obf, key.encode_ids(ids))
    assert key.decode_ids(server_reply) == plain_reply and obf_stopped and plain_stopped
    assert "Paris" in tok.decode(plain_reply)
    # (2) against the same plaintext weights in the same precision (f32) on the same engine: no rounding of the
    # plaintext run can flip a near-tie, so equality must hold for any prompt
    ids2 = _chat_ids(tok, "What is the capital of France?")
    plain_reply2, plain_stopped2 = _greedy_ids(_llama(plain_gguf, n_threads=2), ids2)
    server_reply2, obf_stopped2 = _greedy_ids(obf, key.encode_ids(ids2))
    assert key.decode_ids(server_reply2) == plain_reply2 and obf_stopped2 == plain_stopped2
    # (3) text mode through the engine's own tokenizer: neutral text in, neutral text out, same answer
    r = obf.create_completion(ids_to_neutral_text(key.encode_ids(ids)), max_tokens=40, temperature=0.0)
    assert r["choices"][0]["finish_reason"] == "stop"
    assert key.decode_ids(neutral_text_to_ids(r["choices"][0]["text"])) == plain_reply
    # (4) stopping: the plaintext special tokens' texts are nowhere in the vocabulary, their ids do not stop,
    # only the permuted EOS does
    tokens, _ = _gguf_tokens(obf_gguf)
    plain_specials = set(tok.all_special_tokens) | {str(t) for t in tok.added_tokens_decoder.values()}
    assert plain_specials and not set(tokens) & plain_specials
    assert _eog_ids(obf) == key.obfuscated_eos_ids()
    for target in sorted(set(tok.all_special_ids) - set(key.obfuscated_eos_ids())):
        r = obf.create_completion(key.encode_ids(ids), max_tokens=2, temperature=0.0, logits_processor=_force(target))
        assert r["choices"][0]["finish_reason"] == "length", target


@needs_llama_cpp
def test_llama3_rope_scaling_is_exported(tmp_path):
    """Llama 3's frequency-dependent RoPE scaling goes into rope_freqs.weight (all three bands exercised)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_parameters=rope)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "src")
    aloepri.obfuscate(tmp_path / "src", tmp_path / "out", tmp_path / "key.json", EXACT, seed=3,
                      allow_weak_seed=True, progress=False)
    key = aloepri.load_key(tmp_path / "key.json")
    export_gguf(tmp_path / "out", tmp_path / "m.gguf", "f32")
    ids = key.encode_ids(torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(4)).tolist())
    ref, floor = _reference_and_yardstick(tmp_path / "out", ids)
    err = np.abs(_llama_logits(tmp_path / "m.gguf", ids) - ref).max()
    assert err <= 3 * floor + 1e-6, (err, floor)
    # control: without the factors llama.cpp computes another model
    from aloepri.export import gguf as gguf_export

    real = gguf_export._rope_metadata
    gguf_export._rope_metadata = lambda cfg, hd: (real(cfg, hd)[0], None)
    try:
        export_gguf(tmp_path / "out", tmp_path / "unscaled.gguf", "f32")
    finally:
        gguf_export._rope_metadata = real
    assert np.abs(_llama_logits(tmp_path / "unscaled.gguf", ids) - ref).max() > 100 * (3 * floor + 1e-6)


def test_plaintext_reference_of_qwen2_declares_zero_o_bias(tiny_dir, tmp_path):
    """Qwen2 written as Llama with attention_bias: Llama also declares o_proj.bias, so the reference directory must
    hold it (zeros), or vLLM runs an uninitialised bias (it then generated token 0 on every step)."""
    from safetensors.torch import load_file

    ref = plaintext_reference_dir(tiny_dir("qwen2"), tmp_path / "ref")
    cfg = json.loads((ref / "config.json").read_text())
    sd = load_file(str(ref / "model.safetensors"))
    assert cfg["attention_bias"] is True and cfg["model_type"] == "llama"
    for i in range(cfg["num_hidden_layers"]):
        assert torch.equal(sd[f"model.layers.{i}.self_attn.o_proj.bias"], torch.zeros(cfg["hidden_size"]))
        assert f"model.layers.{i}.self_attn.q_proj.bias" in sd
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2"), dtype=torch.float32).eval()
    as_llama = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, as_llama(ids).logits, atol=1e-4)
