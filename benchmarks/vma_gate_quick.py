"""A first privacy number next to the fidelity numbers: vocabulary matching on embed x gate products.

A quick check beside the full attack suite (aloepri.attacks). What the attacker uses: the public plaintext SmolLM2 and the
obfuscated weights, no key. For layer l, W~_e W~_gate^T = Pi (W_e + N) diag(w_l) W_gate,l^T Z_l: the key
matrices cancel (P Q = I), the FFN permutation Z_l only permutes columns, so sorting every row removes it. Both
sides fuse their own RMSNorm weight (the obfuscated model's is kappa, except at kept outlier dimensions).
Each obfuscated row is matched to the nearest sorted plaintext row (candidate pool: the FULL vocabulary),
distances summed over the first --layers layers (voting). Reported: fraction of sampled obfuscated ids whose
nearest plaintext token is the true one. Results: benchmarks/results/vma_gate_quick.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from aloepri import load_key, obfuscate, resolve_params
from aloepri.obfuscation.checkpoint import GGUFCheckpoint
from aloepri.models import smollm2_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import parse_variant  # noqa: E402


def sorted_rows(m: torch.Tensor) -> torch.Tensor:
    return torch.sort(m.float(), dim=1).values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="*", default=["exact", "noisy", "paper"],
                    help="presets, or variants LABEL=PRESET:key=value,... (benchmarks/variants.py)")
    ap.add_argument("--noisy-alpha-e", nargs="*", type=float, default=[0.3, 0.5],
                    help="extra runs: the noisy preset with these alpha_e values")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vma_gate_quick.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    src = smollm2_gguf()
    ck = GGUFCheckpoint(src)
    embed = ck.get("embed", dtype=torch.float32)
    plain = [sorted_rows(embed @ (ck.get("gate", l).float() * ck.get("ffn_norm", l).float()[None, :]).T)
             for l in range(a.layers)]
    out = {"model": src.name, "layers": a.layers, "queries": a.queries, "candidate_pool": embed.shape[0], "runs": {}}
    settings = [parse_variant(p) for p in a.presets]
    settings += [(f"noisy,alpha_e={x}", resolve_params("noisy", alpha_e=x)) for x in a.noisy_alpha_e]
    for preset, params in settings:
        with tempfile.TemporaryDirectory() as work:
            obfuscate(src, Path(work) / "m", Path(work) / "k.json", params, seed=a.seed, allow_weak_seed=True,
                      overwrite=True, progress=False)
            key = load_key(Path(work) / "k.json")
            index = json.loads((Path(work) / "m" / "model.safetensors.index.json").read_text())["weight_map"]

            def tensor(name):
                with safe_open(str(Path(work) / "m" / index[name]), "pt") as f:
                    return f.get_tensor(name).float()

            rng = np.random.default_rng(0)
            plain_ids = rng.choice(embed.shape[0], a.queries, replace=False)
            obf_ids = key.permutation[plain_ids]
            e_obf = tensor("model.embed_tokens.weight")[torch.from_numpy(obf_ids)]
            dist = torch.zeros(a.queries, embed.shape[0])
            for l in range(a.layers):
                # the server's own norm weight fused, as on the plaintext side: with outlier_dims > 0 the kept
                # dimensions keep theirs there (not in gate_proj); without it those columns are mis-scaled
                gate = tensor(f"model.layers.{l}.mlp.gate_proj.weight")
                gate = gate * tensor(f"model.layers.{l}.post_attention_layernorm.weight")[None, :]
                q = sorted_rows(e_obf @ gate.T)
                dist += torch.cdist(q, plain[l])
            guess = dist.argmin(dim=1).numpy()
            rate = float((guess == plain_ids).mean())
        out["runs"][preset] = {"recovered_fraction": rate, "params": params.to_dict()}
        print(f"{preset:22s} VMA(embed x gate, {a.layers} layers, full vocabulary pool): {rate:.3f} of "
              f"{a.queries} sampled tokens recovered", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
