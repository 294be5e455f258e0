import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Factory: a tiny random float64 checkpoint of the named architecture (built once per session)."""
    cache = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}") / "src")
        return cache[arch]

    return make


@contextlib.contextmanager
def rmsnorm_in_input_dtype():
    """Stock HF RMSNorm upcasts to float32 (downcasting float64); compute in the input dtype instead, so a
    float64 equivalence test measures the obfuscation, not float32 rounding."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    classes = [modeling_llama.LlamaRMSNorm, modeling_mistral.MistralRMSNorm, modeling_qwen2.Qwen2RMSNorm,
               modeling_qwen3.Qwen3RMSNorm]

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    saved = [c.forward for c in classes]
    for c in classes:
        c.forward = forward
    try:
        yield
    finally:
        for c, f in zip(classes, saved):
            c.forward = f


def smollm2_or_skip():
    from aloepri.models import ModelNotInstalledError, smollm2_gguf

    try:
        return smollm2_gguf()
    except ModelNotInstalledError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_exact(tmp_path_factory):
    """SmolLM2 obfuscated once per test session with the exact preset: (source gguf, server dir, key path).
    Tests must treat it as read-only."""
    import aloepri

    smol = smollm2_or_skip()
    work = tmp_path_factory.mktemp("smollm2-exact")
    aloepri.obfuscate(smol, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=2026,
                      progress=False)
    return smol, work / "server", work / "client.key"
