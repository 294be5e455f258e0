import contextlib
from pathlib import Path

import pytest
import torch

import aloepri
from aloepri.obfuscation.archs import SPECS
from aloepri.testing.tiny import build_tiny



@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Factory: a tiny random float64 checkpoint of the named architecture (built once per session)."""
    cache = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}") / "src")
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def obfuscated(tiny_dir, tmp_path_factory):
    """Factory: a tiny model obfuscated with ``preset`` (and overrides), once per session: (output dir, key)."""
    cache = {}

    def make(arch, preset="exact", seed=7, **overrides):
        k = (arch, preset, seed, tuple(sorted(overrides.items())))
        if k not in cache:
            work = tmp_path_factory.mktemp(f"obf-{arch}")
            params = aloepri.resolve_params(preset, **overrides)
            aloepri.obfuscate(tiny_dir(arch), work / "out", work / "key.json", params, seed=seed,
                              allow_weak_seed=True, progress=False)
            cache[k] = (work / "out", aloepri.load_key(work / "key.json"))
        return cache[k]

    return make


_MODELING = tuple(SPECS)  # a spec's name is its transformers model type (transformers.models.<name>)


def _softmax_topk_router_forward(self, hidden_states):
    """Qwen2-MoE / Qwen3-MoE / Mixtral router in the input dtype (stock code upcasts to float32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def _deepseek_v3_router_forward(self, hidden_states):
    """DeepSeek-V3 sigmoid router with group-limited top-k, in the input dtype."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(scores.dtype)
    groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    gidx = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
    gmask = torch.zeros_like(groups).scatter_(1, gidx, 1)
    smask = gmask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~smask.bool(), float("-inf"))
    idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if self.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, w * self.routed_scaling_factor, idx


def _deepseek_v2_router_forward(self, hidden_states):
    """DeepSeek-V2 softmax router (greedy or group-limited greedy), in the input dtype."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = logits.softmax(dim=-1)
    if self.topk_method == "group_limited_greedy":
        groups = scores.view(-1, self.num_group, self.num_experts // self.num_group).max(dim=-1).values
        gidx = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(groups).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
        scores = scores.masked_fill(~smask.bool(), 0.0)
    w, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
    return logits, w * self.routed_scaling_factor, idx


def _complex_rope_in_input_dtype(xq, xk, freqs_cis):
    """DeepSeek-V2's complex-number RoPE without its float32 downcast."""
    def rot(x):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * freqs_cis.unsqueeze(1).to(xc.dtype)).flatten(3)
    return rot(xq), rot(xk)


@contextlib.contextmanager
def rmsnorm_in_input_dtype():
    """Stock HF RMSNorm (and MoE routers) upcast to float32, downcasting float64; compute in the input dtype
    instead, so a float64 equivalence test measures the obfuscation, not float32 rounding."""
    import importlib

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    patches = []
    for name in _MODELING:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for attr in dir(mod):
            cls = getattr(mod, attr)
            if not isinstance(cls, type) or cls.__module__ != mod.__name__:
                continue
            if attr.endswith("RMSNorm"):
                patches.append((cls, forward))
            elif attr in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter"):
                patches.append((cls, _softmax_topk_router_forward))
            elif attr == "DeepseekV3TopkRouter":
                patches.append((cls, _deepseek_v3_router_forward))
            elif attr == "DeepseekV2TopkRouter":
                patches.append((cls, _deepseek_v2_router_forward))
    saved = [(c, c.__dict__["forward"]) for c, _ in patches]
    for c, f in patches:
        c.forward = f
    v2 = importlib.import_module("transformers.models.deepseek_v2.modeling_deepseek_v2")
    saved_rope = v2.apply_rotary_emb
    v2.apply_rotary_emb = _complex_rope_in_input_dtype
    try:
        yield
    finally:
        for c, f in saved:
            c.forward = f
        v2.apply_rotary_emb = saved_rope


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
    # float32: the exact tests compare with plaintext float32 (a GGUF's default output is bfloat16)
    aloepri.obfuscate(smol, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=2026,
                      allow_weak_seed=True, dtype="float32",
                      progress=False)
    return smol, work / "server", work / "client.key"
