"""Do float32 weight products change a 16-bit output? The same reader product W diag(w) Q^T with a real key at full
width (d = 4096, the Llama-3.1-8B width), computed in float64 and in float32, each rounded to the output dtype:
the share of output entries that differ and the largest difference in units of the output's rounding step
(ulps at the largest entry). For bf16 / fp16 outputs the storage rounding (2^-9 / 2^-12 relative) dwarfs a float32
product's error (~1e-7 relative), so the two should differ only where float64 lands within 1e-7 of a rounding
boundary; float32 outputs are shown for comparison.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..lib import ResultStore


@dataclass(frozen=True)
class Settings:
    rows: int = 2048
    d: int = 4096
    presets: tuple[str, ...] = ("default", "exact")


def ulp_gap(a, b) -> float:
    """max |a - b| in units of the dtype's rounding step at the tensor's largest entry (as product_precision
    measures weights): per-entry steps would make a near-zero entry, where cancellation leaves only rounding, look
    like a large relative change."""
    import torch

    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[a.dtype]
    return float((a.double() - b.double()).abs().max() / (a.double().abs().max() * 2.0 ** -mant))


def run(a: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.secrets import SecretSampler
    from aloepri.obfuscation.shape import ModelShape
    from aloepri.obfuscation.transforms import transform_reader_input

    gen = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn((a.rows, a.d), generator=gen)).to(torch.bfloat16)  # a bf16 source, as released
    norm = 1.0 + 0.1 * torch.randn(a.d, generator=gen, dtype=torch.float64)
    for preset in a.presets:
        if store.has(preset):
            continue
        params = resolve_params(preset, alpha_e=0.0, alpha_h=0.0)  # noise is irrelevant to a layer product
        shape = ModelShape(d=a.d, vocab_size=1024, num_layers=1, num_heads=32, num_kv_heads=8, head_dim=a.d // 32,
                           intermediate_size=4 * a.d, rope_base=5e5, qk_norm=False)
        t = time.perf_counter()
        Q = SecretSampler(2**200 + 1, params, shape, tuple(range(params.outlier_dims))).reader_Q("q", 0)
        keygen = time.perf_counter() - t
        p64 = transform_reader_input(w.double(), norm, Q)
        p32 = transform_reader_input(w.float(), norm, Q)
        entry = {"rows": a.rows, "d": a.d, "D": int(Q.shape[0]), "h": params.h, "keygen_seconds": keygen}
        for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
            r64, r32 = p64.to(dt), p32.to(dt)
            differ = float((r64 != r32).float().mean())
            entry[name] = {"share_of_entries_differing": differ, "max_gap_ulps": ulp_gap(r64, r32)}
        entry["float32_relative_error"] = float((p32.double() - p64).abs().max() / p64.abs().max())
        store.put(preset, entry)
        print(preset, json.dumps(entry), flush=True)



def report(store: ResultStore) -> str:
    rows = ["| preset | rows x d (D) | bf16: entries differing / max gap (ulps) | fp16: entries differing / max gap | "
            "float32: entries differing / max gap | float32 product relative error |",
            "|---|---|---|---|---|---|"]
    for preset, e in store.entries().items():
        cells = [f"{e[dt]['share_of_entries_differing'] * 100:.2f}% / {e[dt]['max_gap_ulps']:.2f}"
                 for dt in ("bfloat16", "float16", "float32")]
        rows.append(f"| {preset} | {e['rows']} x {e['d']} ({e['D']}) | " + " | ".join(cells)
                    + f" | {e['float32_relative_error']:.2g} |")
    return "\n".join(rows)


SUMMARY = "do float32 weight products change a 16-bit output? one reader product, float64 vs float32"
CONFIGS = {"d2048": Settings(rows=1024, d=2048), "d4096": Settings(), "smoke": Settings(rows=64, d=256)}
DOCS = ("docs/performance.md",)
NOTES = "d2048: a minute or two (key generation dominates); d4096: several minutes"
