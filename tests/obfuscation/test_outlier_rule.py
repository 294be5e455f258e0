"""The presets' kept dimensions (outlier_rms: measured on the public model, obfuscation/residual.py) and the one
output-precision rule of the Python API and the CLI (pipeline.default_output_dtype)."""
import json

import pytest
import torch

import aloepri
from aloepri.obfuscation import residual
from aloepri.obfuscation.params import ObfuscationParams
from aloepri.testing.tiny import build_tiny
from test_equivalence import _max_logit_error, load64

MASSIVE = 5  # the residual dimension the planted model writes its massive activation to


def _planted(directory):
    """A tiny Llama whose embedding writes a value ~100x the others into residual dimension MASSIVE."""
    src = build_tiny("llama", directory)
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"][:, MASSIVE] = 40.0
    save_file(tensors, path, metadata={"format": "pt"})
    return src


def test_the_presets_keep_the_dimensions_measured_above_the_threshold(tmp_path):
    src = _planted(tmp_path / "src")
    res = aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("exact"), seed=3,
                            allow_weak_seed=True, progress=False)
    assert res.kept_dims == (MASSIVE,) and res.kept_dims_rule == "measured"
    key = aloepri.load_key(tmp_path / "key.json")
    assert _max_logit_error(load64(src, "llama"), load64(tmp_path / "out", "llama"), key, 9, seed=2) <= 1e-9
    # the unplanted model keeps nothing: no dimension stands out
    plain = build_tiny("llama", tmp_path / "plain")
    res = aloepri.obfuscate(plain, tmp_path / "out2", tmp_path / "key2.json", aloepri.resolve_params("exact"), seed=3,
                            allow_weak_seed=True, progress=False)
    assert res.kept_dims == () and res.kept_dims_rule == "measured"


def test_the_weights_choose_where_the_public_model_cannot_be_run(tmp_path, monkeypatch):
    src = _planted(tmp_path / "src")
    monkeypatch.setattr(residual, "MEASURE_MAX_BYTES", 1000)  # the model counts as too big to measure
    res = aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("default"), seed=3,
                            allow_weak_seed=True, progress=False)
    assert len(res.kept_dims) == residual.FALLBACK_COUNT and res.kept_dims_rule.startswith("weights (the model is")
    # within the limit but not in memory: refused, with the way out (a machine never changes which rule applies)
    import aloepri.obfuscation.pipeline as pipeline

    monkeypatch.setattr(residual, "MEASURE_MAX_BYTES", 16 << 30)
    with pytest.raises(ValueError, match="--outlier-dims 4"):
        residual.kept_dims(pipeline.open_checkpoint(src), 16.0, 64, 1000, lambda: ())


def test_dims_above_takes_the_largest_over_the_threshold_up_to_the_limit():
    rms = torch.tensor([1.0, 1.0, 50.0, 1.0, 20.0, 1.0, 15.0, 1.0], dtype=torch.float64)
    assert residual.dims_above(rms, 16.0, 8) == (2, 4)
    assert residual.dims_above(rms, 16.0, 1) == (2,)
    assert residual.dims_above(rms, 100.0, 8) == ()


def test_a_count_and_a_threshold_are_two_rules_one_replaces_the_other():
    assert aloepri.resolve_params("default").outlier_rms > 0 and aloepri.resolve_params("default").outlier_dims == 0
    by_count = aloepri.resolve_params("default", outlier_dims=8)
    assert (by_count.outlier_dims, by_count.outlier_rms) == (8, 0.0)
    mixed = aloepri.resolve_params("exact", outlier_dims=0)
    assert (mixed.outlier_dims, mixed.outlier_rms) == (0, 0.0)
    with pytest.raises(ValueError, match="two rules"):
        ObfuscationParams(outlier_dims=2, outlier_rms=16.0)
    with pytest.raises(ValueError, match="outlier_rms"):
        ObfuscationParams(outlier_rms=0.5)
    # a key written before outlier_rms existed still loads, with its count
    assert ObfuscationParams.from_dict({"outlier_dims": 4}).outlier_rms == 0.0


def test_the_python_api_writes_what_the_cli_writes_from_a_quantized_gguf(tmp_path):
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir

    src = build_tiny("llama", tmp_path / "src", hidden_size=64, intermediate_size=96, num_attention_heads=8)
    reference = plaintext_reference_dir(src, tmp_path / "plain")  # rows of 64 and 96: whole q8_0 blocks
    export_gguf(reference, tmp_path / "q8_0.gguf", "q8_0")
    assert aloepri.serving_dtype(tmp_path / "q8_0.gguf") == "bfloat16"
    assert aloepri.serving_dtype(src) == "float64"  # a float source keeps its own precision
    aloepri.obfuscate(tmp_path / "q8_0.gguf", tmp_path / "out", tmp_path / "key.json", seed=3, allow_weak_seed=True,
                      progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
