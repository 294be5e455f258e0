"""The obfuscation's device argument: the CPU path is the default and byte for byte the same when named; the
secrets never depend on the device; a device that cannot run is refused up front in one line."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

import aloepri
from aloepri.cli import main
from aloepri.obfuscation import pipeline
from aloepri.obfuscation.checkpoint import open_checkpoint
from aloepri.obfuscation.params import resolve_params


def _tensor_bytes(model_dir: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            out[name] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3_moe"])
def test_explicit_cpu_is_byte_identical_to_the_default(tiny_dir, tmp_path, arch):
    params = resolve_params("default")  # noisy in some releases, lossless in others: both paths must agree
    kw = dict(seed=7, allow_weak_seed=True, progress=False, dtype="float32")
    a = aloepri.obfuscate(tiny_dir(arch), tmp_path / "a", tmp_path / "a.key", params, **kw)
    b = aloepri.obfuscate(tiny_dir(arch), tmp_path / "b", tmp_path / "b.key", params, device="cpu", **kw)
    c = aloepri.obfuscate(tiny_dir(arch), tmp_path / "c", tmp_path / "c.key", params, device=torch.device("cpu"), **kw)
    assert a.fingerprint == b.fingerprint == c.fingerprint
    ta, tb, tc = _tensor_bytes(a.output_dir), _tensor_bytes(b.output_dir), _tensor_bytes(c.output_dir)
    assert ta.keys() == tb.keys() == tc.keys() and len(ta) > 10
    assert all(ta[k] == tb[k] == tc[k] for k in ta)


def _secrets_of(plan) -> list[np.ndarray]:
    s, shape = plan.secrets, plan.shape
    att = s.attention(0)
    perm, scale = s.mlp(0)
    return [plan.vocab_perm, np.array([plan.kappa]), s.writer_P("embed"), s.reader_Q("head"), s.reader_Q("q", 0),
            s.writer_P("o", 0), np.asarray(att.kv_order), *att.q_maps, *att.vo_mix, perm, scale,
            np.array([shape.d, s.hidden_size])]


def test_secrets_do_not_depend_on_the_device(tiny_dir):
    """The plan draws every secret on the CPU (numpy, from the seed's labelled streams) before the device is used:
    a plan for a device this machine may not have holds the same secrets as the CPU plan, all numpy arrays."""
    params = resolve_params("exact")
    plans = []
    for device in (torch.device("cpu"), torch.device("cuda", 0)):  # the plan only records the device
        with contextlib.closing(open_checkpoint(tiny_dir("llama"))) as source:
            plans.append(pipeline.plan_obfuscation(source, params, seed=2**200 + 5, device=device))
    cpu, other = (_secrets_of(p) for p in plans)
    assert plans[1].device.type == "cuda"
    assert all(isinstance(x, np.ndarray) for x in cpu + other)
    assert all(np.array_equal(x, y) for x, y in zip(cpu, other))


def test_products_follow_the_device_argument(tiny_dir, tmp_path, monkeypatch):
    """Every weight product sees its weights on the plan's device (the CPU here), and every output reaches the
    writer on the CPU."""
    from aloepri.obfuscation import transforms

    seen = []
    real = transforms.transform_reader_input

    def spy(weight, norm_weight, Q):
        seen.append(weight.device)
        return real(weight, norm_weight, Q)

    monkeypatch.setattr(transforms, "transform_reader_input", spy)
    import aloepri.obfuscation.blocks as blocks

    monkeypatch.setattr(blocks, "transform_reader_input", spy)
    aloepri.obfuscate(tiny_dir("qwen3_moe"), tmp_path / "o", tmp_path / "k.key", resolve_params("exact"), seed=3,
                      allow_weak_seed=True, progress=False, device="cpu")
    assert seen and all(d == torch.device("cpu") for d in seen)


@pytest.mark.parametrize("device, expect", [("nonsense", "unknown device"), ("tpu", "unknown device"),
                                            ("cuda:99", "cuda")])
def test_bad_device_is_one_line_exit_2(tiny_dir, tmp_path, capsys, device, expect):
    if device.startswith("cuda") and torch.cuda.device_count() > 99:
        pytest.skip("a machine with 100 CUDA devices")
    try:
        rc = main(["obfuscate", str(tiny_dir("llama")), str(tmp_path / "out"), "--key-out", str(tmp_path / "k.key"),
                   "--preset", "exact", "--quiet", "--device", device])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("aloepri obfuscate: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert expect in lines[0] and "cpu" in lines[0]  # what was wrong, and what to use instead
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_api_refuses_a_bad_device_before_any_work(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="device"):
        aloepri.obfuscate(tiny_dir("llama"), tmp_path / "o", tmp_path / "k.key", resolve_params("exact"), seed=1,
                          allow_weak_seed=True, progress=False, device="not-a-device")
    assert list(tmp_path.iterdir()) == []
