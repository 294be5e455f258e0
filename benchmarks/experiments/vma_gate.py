"""A quick privacy number next to the fidelity numbers: vocabulary matching (VMA) on embed x gate products.

A quick check beside the full attack suite (aloepri.attacks). What the attacker uses: the public plaintext model
and the obfuscated weights, no key. For layer l, W~_e W~_gate^T = Pi (W_e + N) diag(w_l) W_gate,l^T Z_l: the key
matrices cancel (P Q = I), the FFN permutation Z_l only permutes columns, so sorting every row removes it. Both
sides fuse their own RMSNorm weight (the obfuscated model's is kappa, except at kept outlier dimensions).
Each obfuscated row is matched to the nearest sorted plaintext row (candidate pool: the FULL vocabulary),
distances summed over the first ``layers`` layers (voting). Reported: fraction of sampled obfuscated ids whose
nearest plaintext token is the true one.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    # presets or variants LABEL=PRESET:field=value,... (benchmarks.lib.variants)
    variants: tuple[str, ...] = ("exact", "noisy", "paper", "noisy:alpha_e=0.3", "noisy:alpha_e=0.5")
    layers: int = 4
    queries: int = 1000
    seed: int = 1234  # obfuscation seed
    threads: int = 2


def run(s: Settings, store: ResultStore) -> None:
    import numpy as np
    import torch

    from aloepri import load_key
    from aloepri.obfuscation.checkpoint import GGUFCheckpoint, open_checkpoint

    from ..lib.targets import obfuscated
    from ..lib.variants import parse_variant

    todo = [parse_variant(v) for v in s.variants]
    todo = [(label, params) for label, params in todo if not store.has(label)]
    if not todo:
        return
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    ck = GGUFCheckpoint(src)
    embed = ck.get("embed", dtype=torch.float32)

    def sorted_rows(m: torch.Tensor) -> torch.Tensor:
        return torch.sort(m.float(), dim=1).values

    plain = [sorted_rows(embed @ (ck.get("gate", l).float() * ck.get("ffn_norm", l).float()[None, :]).T)
             for l in range(s.layers)]
    for label, params in todo:
        target = obfuscated(src, params, s.seed)
        key = load_key(target.key_path)
        served = open_checkpoint(target.model_dir)

        def tensor(role, layer=None):
            return served.get(role, layer, dtype=torch.float32)

        rng = np.random.default_rng(0)
        plain_ids = rng.choice(embed.shape[0], s.queries, replace=False)
        obf_ids = key.permutation[plain_ids]
        e_obf = tensor("embed")[torch.from_numpy(obf_ids)]
        dist = torch.zeros(s.queries, embed.shape[0])
        for l in range(s.layers):
            # the server's own norm weight fused, as on the plaintext side: with outlier_dims > 0 the kept
            # dimensions keep theirs there (not in gate_proj); without it those columns are mis-scaled
            gate = tensor("gate", l) * tensor("ffn_norm", l)[None, :]
            dist += torch.cdist(sorted_rows(e_obf @ gate.T), plain[l])
        rate = float((dist.argmin(dim=1).numpy() == plain_ids).mean())
        store.put(label, {"recovered_fraction": rate, "params": params.to_dict(), "model": src.name,
                          "layers": s.layers, "queries": s.queries, "candidate_pool": int(embed.shape[0])})
        print(f"{label:22s} VMA(embed x gate, {s.layers} layers, full vocabulary pool): {rate:.3f} of "
              f"{s.queries} sampled tokens recovered", flush=True)


def report(store: ResultStore) -> str:
    rows = ["| variant | alpha_e / alpha_h | lam | h | beta | outlier_dims | recovered (sampled ids) |",
            "|---|---|---|---|---|---|---|"]
    for label, e in store.entries().items():
        p = e["params"]
        rows.append(f"| {label} | {p['alpha_e']:g} / {p['alpha_h']:g} | {p['lam']:g} | {p['h']} | {p['beta']} | "
                    f"{p['outlier_dims']} | {100 * e['recovered_fraction']:.1f}% of {e['queries']} "
                    f"({e['layers']} layers, pool {e['candidate_pool']:,}) |")
    return "\n".join(rows)


SUMMARY = "vocabulary matching on embed x gate products (weights only, no key) per preset (minutes per variant)"
CONFIGS = {"full": Settings(),
           # lambda 0 vs 0.1 with the RoPE block permutation (beta 8), the then-default's other mechanisms
           "lambda": Settings(variants=("exact", "noisy_beta8_lam0=noisy:beta=8",
                                        "noisy_beta8_lam01=noisy:lam=0.1,beta=8")),
           "smoke": Settings(variants=("noisy",), layers=1, queries=100)}
DOCS = ("docs/design.md",)
