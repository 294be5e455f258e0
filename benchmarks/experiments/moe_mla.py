"""MoE and MLA: fidelity per preset, routing agreement, the paper's router normalisation, and memory with many
experts.

No MoE or MLA checkpoint with real weights is available offline here, so fidelity is measured on random-weight
models of each architecture (aloepri.testing.tiny configs, widened: d=256, vocab 2048, 3-4 layers), float32
through the stock classes; real-weight fidelity of the shared machinery is SmolLM2's (docs/design.md).

One config per part: fidelity, ablation, normalize (the paper's router normalisation), memory (many experts).
The tiny models are built in a temporary directory per run, so their obfuscations are not cached
(benchmarks.lib.targets keys on the source file's identity, new every run).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.provenance import REPO
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
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def fidelity(arch: str, preset: str, work: Path, seed: int = 5) -> dict:
    import torch

    import aloepri
    from aloepri.testing.tiny import MOE_ARCHS, build_tiny  # moved there from tests/tiny_models.py

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
    with torch.no_grad():
        return _compare(arch in MOE_ARCHS, plain, obf, ids, oids, perm, key)


def _compare(moe: bool, plain, obf, ids, oids, perm, key) -> dict:
    import numpy as np
    import torch

    from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts

    lp = plain(ids).logits
    lo = obf(oids).logits[..., perm]
    kl = torch.nn.functional.kl_div(lo.log_softmax(-1), lp.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    same = [float("nan")]
    if moe:
        rp = routing_decisions(plain, ids)
        ro = to_plain_experts(routing_decisions(obf, oids), expert_orders(key, obf.config))
        same = [float((rp[i] == ro[i]).all(dim=-1).float().mean()) for i in rp]
    return {"top1_agreement": float((lp.argmax(-1) == lo.argmax(-1)).float().mean()), "mean_kl": float(kl.mean()),
            "max_logit_error": float((lp - lo).abs().max()), "logit_scale": float(lp.abs().max()),
            "routing_agreement_per_layer": same, "routing_agreement": float(np.mean(same)),
            "positions": int(ids.numel()), "hidden_size_out": int(obf.config.hidden_size)}


def normalisation(arch: str, spread: float, work: Path) -> dict:
    """Fraction of (token, layer) expert sets that change with the paper's router normalisation, when the router
    rows' norms have a log-normal spread ``spread`` (0 = the random init's own, nearly equal norms)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    import aloepri
    from aloepri.obfuscation.routing import expert_orders, routing_decisions, to_plain_experts
    from aloepri.testing.tiny import build_tiny

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
        with torch.no_grad():
            rp = routing_decisions(plain, ids)
            ro = to_plain_experts(routing_decisions(obf, oids), expert_orders(key, obf.config))
            lp, lo = plain(ids).logits, obf(oids).logits[..., torch.from_numpy(key.permutation)]
        res["normalized" if normalize else "exact"] = {
            "changed_expert_sets": float(np.mean([float((rp[i] != ro[i]).any(dim=-1).float().mean()) for i in rp])),
            "top1_agreement": float((lp.argmax(-1) == lo.argmax(-1)).float().mean()),
        }
    return res


def many_expert_checkpoint(directory: Path, layers: int, experts: int, d: int = 512, f: int = 128) -> Path:
    """Qwen3-MoE with many tiny experts, bf16, one shard per layer, written layer by layer."""
    import torch
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
    """Obfuscate (`noisy`) in a fresh process, whose peak RSS is then the obfuscation's own."""
    with tempfile.TemporaryDirectory() as work:
        src = many_expert_checkpoint(Path(work) / "src", layers, experts)
        proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.obfuscate_child", str(src), work, "noisy",
                               str(threads)], capture_output=True, text=True, check=True, cwd=REPO)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(layers=layers, experts=experts)
    return r


@dataclass(frozen=True)
class Settings:
    part: str = "fidelity"  # fidelity (presets and ablations) | normalize | memory
    archs: tuple[str, ...] = ()  # empty: the dense controls and every MoE/MLA architecture
    presets: tuple[str, ...] = PRESETS  # fidelity: presets or PRESET_VARIANTS
    spreads: tuple[float, ...] = (0.0, 0.25, 0.5)  # normalize: router row-norm spreads
    shapes: tuple[str, ...] = ("L2xE128", "L8xE128", "L8xE32")  # memory: LAYERSxEEXPERTS
    threads: int = 1


def _shape(text: str) -> tuple[int, int]:
    layers, sep, experts = text.partition("xE")
    if not (text.startswith("L") and sep and layers[1:].isdigit() and experts.isdigit()):
        raise UsageError(f"moe_mla: shape {text!r} is not LAYERSxEEXPERTS (e.g. L8xE128)")
    return int(layers[1:]), int(experts)


def run(s: Settings, store: ResultStore) -> None:
    import torch

    torch.set_num_threads(s.threads)
    if s.part == "memory":
        for text in s.shapes:
            layers, experts = _shape(text)
            if not store.has(text):
                store.put(text, r := memory(layers, experts, s.threads))
                print(f"memory {text}: {r}", flush=True)
        return
    if s.part not in ("fidelity", "normalize"):
        raise UsageError(f"moe_mla: part must be fidelity, normalize or memory, not {s.part!r}")
    from aloepri.testing.tiny import MOE_ARCHS

    archs = s.archs or ("llama", "qwen3", *MOE_ARCHS)
    unknown = [a for a in archs if a not in WIDE_PER_ARCH]
    if unknown:
        raise UsageError(f"moe_mla: unknown arch(s) {unknown}; archs: {', '.join(WIDE_PER_ARCH)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in archs:
            for x in (s.presets if s.part == "fidelity" else s.spreads):
                k = f"{arch}|{x}"
                if store.has(k):
                    continue
                if s.part == "fidelity":
                    store.put(k, {"arch": arch, "preset": x, **(r := fidelity(arch, x, work))})
                    print(f"fidelity {k}: top-1 {r['top1_agreement']:.3f} KL {r['mean_kl']:.4f} max err "
                          f"{r['max_logit_error']:.2e} routing {r['routing_agreement']:.3f}", flush=True)
                else:
                    store.put(k, {"arch": arch, "spread": x, **(r := normalisation(arch, x, work))})
                    print(f"normalisation {k}: {r}", flush=True)


def _fidelity_table(entries: list[dict]) -> str:
    presets = list(dict.fromkeys(e["preset"] for e in entries))
    rows = ["| arch | " + " | ".join(presets) + " |", "|---" * (len(presets) + 1) + "|"]
    for arch in dict.fromkeys(e["arch"] for e in entries):
        cells = []
        for p in presets:
            e = next((e for e in entries if e["arch"] == arch and e["preset"] == p), None)
            if e is None:
                cells.append("-")
                continue
            cell = f"{e['top1_agreement']:.3f} / {e['mean_kl']:.3f}"
            r = e["routing_agreement"]
            cells.append(cell if r is None or r != r else f"{cell}, routing {r:.2f}")  # r != r: NaN, dense
        rows.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(store: ResultStore) -> str:
    entries = list(store.entries().items())
    fid = [e for _, e in entries if "preset" in e]
    norm = [e for _, e in entries if "spread" in e]
    mem = [(k, e) for k, e in entries if "peak_rss_mib" in e]
    out = []
    if fid:
        out.append("Cells: top-1 agreement / mean KL(plain || obf); MoE: fraction of expert sets equal to "
                   "plaintext's.\n")
        out.append(_fidelity_table(fid))
    if norm:
        out += ["| arch | row-norm spread | expert sets changed, exact variant | changed, normalised | "
                "top-1 agreement, normalised |", "|---|---|---|---|---|"]
        out += [f"| {e['arch']} | {e['spread']} | {e['exact']['changed_expert_sets']:.3f} | "
                f"{e['normalized']['changed_expert_sets']:.3f} | {e['normalized']['top1_agreement']:.3f} |"
                for e in norm]
    if mem:
        out += ["| layers x experts | output | peak RSS (imports alone) | wall |", "|---|---|---|---|"]
        out += [f"| {e['layers']} x {e['experts']} | {e['output_mib']:.0f} MiB | {e['peak_rss_mib']:.0f} MiB "
                f"({e['imports_rss_mib']:.0f} MiB) | {e['seconds']:.1f} s |" for _, e in mem]
    return "\n".join(out)


SUMMARY = ("MoE and MLA on random-weight models: fidelity and routing per preset, ablation, router normalisation, "
           "memory with many experts")
CONFIGS = {"fidelity": Settings(),
           "ablation": Settings(archs=("llama", "deepseek_v3", "qwen3_moe"), presets=ABLATION),
           "normalize": Settings(part="normalize", archs=("mixtral", "qwen3_moe", "deepseek_v3")),
           "memory": Settings(part="memory"),
           "smoke": Settings(part="memory", shapes=("L1xE4",))}
DOCS = ("docs/moe-mla.md",)
NOTES = ("fidelity: ~30 obfuscations of tiny models, minutes; memory: three checkpoints up to 1.2 GiB, a minute "
         "or two; fidelity/ablation/normalize need aloepri.testing.tiny")
