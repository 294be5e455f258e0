"""MoE and MLA: fidelity per preset, routing agreement, the paper's router normalisation, and memory with many
experts.

No MoE or MLA checkpoint with real weights is available offline here, so fidelity is measured on random-weight
models of each architecture (src/aloepri/testing/tiny.py configs, widened: d=256, vocab 2048, 3-4 layers), float32
through the stock classes; real-weight fidelity of the shared machinery is SmolLM2's (docs/design.md).

Usage: python benchmarks/moe_mla.py [--parts fidelity ablation normalize memory] [--threads 1]
Results: benchmarks/results/moe_mla.json (resumable: finished entries are skipped)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from aloepri.testing.tiny import MOE_ARCHS, build_tiny

RESULTS = Path(__file__).parent / "results" / "moe_mla.json"
# noisy+noiseless: every key-matrix mechanism of `noisy` without the embedding/head noise, to separate the
# (approximate) RMSNorm handling from the noise
PRESET_VARIANTS = {
    "noisy+noiseless": dict(alpha_e=0.0, alpha_h=0.0),
    # ablation of noisy+noiseless: which mechanism costs what
    "noisy+noiseless+beta1": dict(alpha_e=0.0, alpha_h=0.0, beta=1),
    "noisy+noiseless+lam0": dict(alpha_e=0.0, alpha_h=0.0, lam=0.0),
    "noisy+noiseless+noCE": dict(alpha_e=0.0, alpha_h=0.0, c_scale=0.0, e_scale=0.0),
}
PRESETS = ("exact", "noisy+noiseless", "noisy", "paper")
ABLATION = ("noisy+noiseless+beta1", "noisy+noiseless+lam0", "noisy+noiseless+noCE")
WIDE = dict(vocab_size=2048, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
            intermediate_size=512, max_position_embeddings=256)
WIDE_PER_ARCH = {  # MLA heads have their own dims; MoE sizes scaled with the width
    "llama": {}, "qwen3": {},  # dense controls: same width, same random init, same presets
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=16),
    "qwen3_moe": dict(moe_intermediate_size=64, num_experts=16),
    "mixtral": dict(intermediate_size=128, num_local_experts=8),
    "deepseek_v3": dict(num_key_value_heads=8, head_dim=None, moe_intermediate_size=64, n_routed_experts=16,
                        n_group=4, topk_group=2, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32),
    "deepseek_v3_noqlora": dict(num_key_value_heads=8, head_dim=None, moe_intermediate_size=64, n_routed_experts=8,
                                kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32),
    "deepseek_v2": dict(num_key_value_heads=8, head_dim=None, moe_intermediate_size=64, n_routed_experts=16,
                        n_group=4, topk_group=2, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32),
}


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def fidelity(arch: str, preset: str, work: Path, seed: int = 5) -> dict:
    import aloepri
    from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts

    src = work / f"{arch}-src"
    if not src.exists():
        build_tiny(arch, src, seed=0, **{**WIDE, **WIDE_PER_ARCH[arch]})
    out = work / f"{arch}-{preset}"
    params = aloepri.resolve_params(preset.split("+")[0], **PRESET_VARIANTS.get(preset, {}))
    aloepri.obfuscate(src, out, work / f"{arch}-{preset}.key", params, seed=seed, allow_weak_seed=True,
                      progress=False, overwrite=True)
    key = aloepri.load_key(work / f"{arch}-{preset}.key")
    plain, obf = _load(src), _load(out)
    ids = torch.randint(0, 2048, (8, 32), generator=torch.Generator().manual_seed(1))
    oids = torch.tensor([key.encode_ids(r) for r in ids.tolist()])
    perm = torch.from_numpy(key.permutation)
    lp = plain(ids).logits
    lo = obf(oids).logits[..., perm]
    kl = torch.nn.functional.kl_div(lo.log_softmax(-1), lp.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    same = [float("nan")]
    if arch in MOE_ARCHS:
        rp = routing_decisions(plain, ids)
        ro = to_plain_experts(routing_decisions(obf, oids), expert_orders(key, obf.config))
        same = [float((rp[i] == ro[i]).all(dim=-1).float().mean()) for i in rp]
    return {"top1_agreement": float((lp.argmax(-1) == lo.argmax(-1)).float().mean()), "mean_kl": float(kl.mean()),
            "max_logit_error": float((lp - lo).abs().max()), "logit_scale": float(lp.abs().max()),
            "routing_agreement_per_layer": same, "routing_agreement": float(np.mean(same)),
            "positions": int(ids.numel()), "hidden_size_out": int(obf.config.hidden_size)}


@torch.no_grad()
def normalisation(arch: str, spread: float, work: Path) -> dict:
    """Fraction of (token, layer) expert sets that change with the paper's router normalisation, when the router
    rows' norms have a log-normal spread ``spread`` (0 = the random init's own, nearly equal norms)."""
    import aloepri
    from safetensors.torch import load_file, save_file
    from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts

    src = work / f"{arch}-norm{spread}"
    if not src.exists():
        build_tiny(arch, src, seed=0, **{**WIDE, **WIDE_PER_ARCH[arch]})
        rng = np.random.default_rng(0)
        for f in src.glob("*.safetensors"):
            t = load_file(f)
            for name in t:
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    t[name] = t[name] * torch.from_numpy(np.exp(spread * rng.standard_normal(t[name].shape[0])))[:, None].to(t[name].dtype)
            save_file(t, f, metadata={"format": "pt"})
    res = {}
    for normalize in (False, True):
        out = work / f"{arch}-norm{spread}-{normalize}"
        aloepri.obfuscate(src, out, work / f"{out.name}.key", aloepri.resolve_params("exact", router_normalize=normalize),
                          seed=5, allow_weak_seed=True, progress=False, overwrite=True)
        key = aloepri.load_key(work / f"{out.name}.key")
        plain, obf = _load(src), _load(out)
        ids = torch.randint(0, 2048, (8, 32), generator=torch.Generator().manual_seed(1))
        oids = torch.tensor([key.encode_ids(r) for r in ids.tolist()])
        rp = routing_decisions(plain, ids)
        ro = to_plain_experts(routing_decisions(obf, oids), expert_orders(key, obf.config))
        lp, lo = plain(ids).logits, obf(oids).logits[..., torch.from_numpy(key.permutation)]
        res["normalized" if normalize else "exact"] = {
            "changed_expert_sets": float(np.mean([float((rp[i] != ro[i]).any(dim=-1).float().mean()) for i in rp])),
            "top1_agreement": float((lp.argmax(-1) == lo.argmax(-1)).float().mean()),
        }
    return res


MEMORY_CHILD = r"""
import json, sys, torch
from pathlib import Path
import aloepri
torch.set_num_threads(int(sys.argv[3]))
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
before = hwm()
r = aloepri.obfuscate(sys.argv[1], Path(sys.argv[2]) / "m", Path(sys.argv[2]) / "k.json", aloepri.resolve_params("noisy"),
                      seed=1, allow_weak_seed=True, progress=False)
print(json.dumps({"seconds": r.seconds, "output_mib": r.bytes_written / 2**20, "peak_rss_mib": hwm(), "imports_rss_mib": before}))
"""


def many_expert_checkpoint(directory: Path, layers: int, experts: int, d: int = 512, f: int = 128) -> Path:
    """Qwen3-MoE with many tiny experts, bf16, one shard per layer, written layer by layer."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    directory.mkdir(parents=True)
    heads, kv, dh, vocab = 8, 4, 64, 4096
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=dh, moe_intermediate_size=f, intermediate_size=4 * d,
                         num_experts=experts, num_experts_per_tok=8, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(directory)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)  # noqa: E731
    one = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weight_map = {}
    shards = [("model-embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, d), "lm_head.weight": rnd(vocab, d),
                                           "model.norm.weight": one(d)})]
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": one(d), p + "post_attention_layernorm.weight": one(d),
             p + "self_attn.q_proj.weight": rnd(heads * dh, d), p + "self_attn.k_proj.weight": rnd(kv * dh, d),
             p + "self_attn.v_proj.weight": rnd(kv * dh, d), p + "self_attn.o_proj.weight": rnd(d, heads * dh),
             p + "self_attn.q_norm.weight": one(dh), p + "self_attn.k_norm.weight": one(dh),
             p + "mlp.gate.weight": rnd(experts, d)}
        for e in range(experts):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = rnd(f, d)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = rnd(f, d)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = rnd(d, f)
        shards.append((f"model-layer{i:03d}.safetensors", t))
    for fname, tensors in shards:
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def memory(layers: int, experts: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        src = many_expert_checkpoint(Path(work) / "src", layers, experts)
        proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(src), work, str(threads)], capture_output=True,
                              text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(layers=layers, experts=experts)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="*", default=["fidelity", "ablation", "normalize", "memory"])
    ap.add_argument("--archs", nargs="*", default=["llama", "qwen3", *MOE_ARCHS])
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}

    def save():
        RESULTS.write_text(json.dumps(res, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "fidelity" in a.parts:
            for arch in a.archs:
                for preset in PRESETS:
                    k = f"{arch}/{preset}"
                    if k in res.setdefault("fidelity", {}):
                        continue
                    res["fidelity"][k] = r = fidelity(arch, preset, work)
                    print(f"fidelity {k}: top-1 {r['top1_agreement']:.3f} KL {r['mean_kl']:.4f} max err "
                          f"{r['max_logit_error']:.2e} routing {r['routing_agreement']:.3f}", flush=True)
                    save()
        if "ablation" in a.parts:
            for arch in ("llama", "deepseek_v3", "qwen3_moe"):
                for preset in ABLATION:
                    k = f"{arch}/{preset}"
                    if k in res.setdefault("fidelity", {}):
                        continue
                    res["fidelity"][k] = r = fidelity(arch, preset, work)
                    print(f"ablation {k}: top-1 {r['top1_agreement']:.3f} KL {r['mean_kl']:.4f}", flush=True)
                    save()
        if "normalize" in a.parts:
            for arch in ("mixtral", "qwen3_moe", "deepseek_v3"):
                for spread in (0.0, 0.25, 0.5):
                    k = f"{arch}/spread{spread}"
                    if k in res.setdefault("router_normalisation", {}):
                        continue
                    res["router_normalisation"][k] = r = normalisation(arch, spread, work)
                    print(f"normalisation {k}: {r}", flush=True)
                    save()
    if "memory" in a.parts:
        for layers, experts in ((2, 128), (8, 128), (8, 32)):
            k = f"L{layers}xE{experts}"
            if k in res.setdefault("memory", {}):
                continue
            res["memory"][k] = r = memory(layers, experts, a.threads)
            print(f"memory {k}: {r}", flush=True)
            save()
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
