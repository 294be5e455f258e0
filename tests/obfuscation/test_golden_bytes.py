"""Golden bytes: a tiny model obfuscated with a fixed seed gives the recorded digest.

The benchmark cache (benchmarks/lib/targets.py) keys obfuscated models on FORMAT_VERSION and the parameters, not
on the code, so a refactoring or a docstring in aloepri/obfuscation reuses every cached target. The price: a change
that alters the bytes must say so. When this test fails because of a change you meant, bump FORMAT_VERSION in
benchmarks/lib/targets.py and record the new digest under the new version below (old versions stay, so a digest
is never reused); if you did not mean to change the output, the failure found a behaviour change.

The digest covers every tensor (name, dtype, shape, bytes) and the key's vocabulary permutation; config.json is
left out (it carries the transformers version). The output is float32 from float64 products, so BLAS threading
and kernel choice, which move float64 results in the last bits, do not move the stored bytes.
"""
import hashlib
import json

import torch

import aloepri
from benchmarks.lib.targets import FORMAT_VERSION
from test_outlier_rule import MASSIVE, _planted

# FORMAT_VERSION -> digest of the obfuscation below
GOLDEN = {
    2: "eec2840ba3855b666eaf0c6dd84b49a61978ad050785a90b90f96dfd6d920e59",
}


def obfuscation_digest(out, key) -> str:
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(key.vocab_permutation).encode())
    return h.hexdigest()


def test_a_fixed_seed_gives_the_recorded_bytes(tmp_path):
    src = _planted(tmp_path / "src")  # with a dimension the default preset keeps out of the mixing
    res = aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("default"),
                            seed=20261128, dtype="float32", allow_weak_seed=True, progress=False)
    assert res.kept_dims == (MASSIVE,)
    digest = obfuscation_digest(tmp_path / "out", aloepri.load_key(tmp_path / "key.json"))
    assert max(GOLDEN) == FORMAT_VERSION, (
        f"benchmarks.lib.targets.FORMAT_VERSION is {FORMAT_VERSION} but the newest recorded digest is for "
        f"{max(GOLDEN)}: record this run's digest {digest} under {FORMAT_VERSION}")
    assert len(set(GOLDEN.values())) == len(GOLDEN), "two format versions share a digest"
    assert digest == GOLDEN[FORMAT_VERSION], (
        f"the obfuscated bytes changed (digest {digest}, recorded {GOLDEN[FORMAT_VERSION]} for format version "
        f"{FORMAT_VERSION}). If the change is meant, bump FORMAT_VERSION in benchmarks/lib/targets.py (cached "
        "benchmark targets are then rebuilt) and record the digest under the new version here; if not, the "
        "obfuscation's output changed by accident")
