"""Error budget of float32 weight products (pipeline.product_dtype): the same obfuscation (same key seed) with its
products in float64 and in float32, both stored as float32, scored against plaintext computed in float64.

Per model and preset it reports
- weights: the largest difference between the two outputs, per tensor, in units of that tensor's float32 rounding
  step at its largest entry (max|a - b| / (max|a| * 2^-24)): what float32 products add to the storage rounding;
- logits (teacher-forced, --texts debian-reference texts x 128 tokens): KL(plain float64 || X) and max |logit
  error| for X = plaintext float32 (the floor any float32 model pays), the float64-product obfuscation and the
  float32-product obfuscation; top-1 agreement with the float64 plaintext.

Entries ``model|preset``. The obfuscations are built here, not taken from benchmarks.lib.targets: the product
dtype is patched per build, which the target cache's key does not (and should not) know about.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("qwen-coder", "smollm2")
    presets: tuple[str, ...] = ("exact", "noisy")
    texts: int = 8
    seed: int = 4242
    threads: int = 2


def score(plain64, model, key, ids_list) -> dict:
    """eval.fidelity.compare against the float64 plaintext (``key=None``: ``model`` is a plaintext model)."""
    from aloepri.eval.fidelity import compare

    f = compare(plain64, model, key, ids_list, greedy_tokens=0)
    return {"mean_kl_vs_plain64": f.mean_kl, "top1_vs_plain64": f.top1_agreement,
            "max_logit_error": f.max_logit_error, "positions": f.positions}


def weight_gap(dir_a: Path, dir_b: Path) -> dict:
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
        return out

    a, b = tensors(dir_a), tensors(dir_b)
    ulps = {}
    for k in a:
        scale = a[k].abs().max().double().item() * 2.0 ** -24
        ulps[k] = (a[k].double() - b[k].double()).abs().max().item() / scale if scale > 0 else 0.0
    worst = max(ulps, key=ulps.get)
    vals = sorted(ulps.values())
    return {"max_ulps_at_tensor_max": ulps[worst], "worst_tensor": worst,
            "median_ulps_at_tensor_max": vals[len(vals) // 2], "tensors": len(vals)}


def run(s: Settings, store: ResultStore) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import aloepri
    import aloepri.obfuscation.pipeline as pipeline
    from aloepri.eval.fidelity import corpus_ids, corpus_texts
    from aloepri.keyfile import load_key
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    torch.set_num_threads(s.threads)
    chosen = pipeline.product_dtype
    for model in s.models:
        todo = [p for p in s.presets if not store.has(f"{model}|{p}")]
        if not todo:
            continue
        src = model_path(model)
        tok = load_hf_tokenizer(src)
        texts, prov = corpus_texts(None, s.texts)
        ids_list = corpus_ids(tok, texts, 128)
        plain64 = load_plain_model(src, torch.float64)
        plain32 = load_plain_model(src, torch.float32)
        with torch.no_grad():
            floor = score(plain64, plain32, None, ids_list)
        del plain32
        for preset in todo:
            work = Path(tempfile.mkdtemp(prefix="aloepri-precision-"))
            params = aloepri.resolve_params(preset)
            entry = {"model": model, "preset": preset, "params": params.to_dict(), "seed": s.seed, "corpus": prov,
                     "texts": len(ids_list), "plaintext_float32": floor}
            try:
                for label, dt in (("float64_products", torch.float64), ("float32_products", torch.float32)):
                    pipeline.product_dtype = lambda *_, dt=dt: dt
                    t0 = time.perf_counter()
                    aloepri.obfuscate(src, work / label, work / f"{label}.key", params, seed=s.seed,
                                      allow_weak_seed=True, progress=False, dtype="float32")
                    seconds = time.perf_counter() - t0
                    key = load_key(work / f"{label}.key")
                    obf = AutoModelForCausalLM.from_pretrained(str(work / label), dtype=torch.float32).eval()
                    with torch.no_grad():
                        entry[label] = score(plain64, obf, key, ids_list)
                    entry[label]["obfuscation_seconds"] = seconds
                    del obf
                entry["weights"] = weight_gap(work / "float64_products", work / "float32_products")
            finally:
                pipeline.product_dtype = chosen
                shutil.rmtree(work, ignore_errors=True)
            store.put(f"{model}|{preset}", entry)
            f64, f32 = entry["float64_products"], entry["float32_products"]
            print(f"{model}/{preset}: KL vs plain64: plain32 {floor['mean_kl_vs_plain64']:.3g}, "
                  f"f64 products {f64['mean_kl_vs_plain64']:.3g}, f32 products {f32['mean_kl_vs_plain64']:.3g}; "
                  f"max logit err {floor['max_logit_error']:.3g} / {f64['max_logit_error']:.3g} / "
                  f"{f32['max_logit_error']:.3g}; weights max {entry['weights']['max_ulps_at_tensor_max']:.1f} ulps "
                  f"({entry['weights']['worst_tensor']})", flush=True)


def report(store: ResultStore) -> str:
    rows = ["| model / preset | plaintext float32 KL / max logit error | float64 products | float32 products | "
            "top-1 (f64 / f32 products) | weights: max (median) float32 ulps between the two |",
            "|---|---|---|---|---|---|"]

    def kl_err(x: dict) -> str:  # enough digits to show how little float32 products move a noisy preset
        kl, err = x["mean_kl_vs_plain64"], x["max_logit_error"]
        return f"{kl:.3g} / {err:.2g}" if kl < 1e-6 else f"{kl:.7g} / {err:.6g}"

    for e in store.entries().values():
        f64, f32, w = e["float64_products"], e["float32_products"], e["weights"]
        rows.append(f"| {e['model']} `{e['preset']}` | {kl_err(e['plaintext_float32'])} | {kl_err(f64)} | "
                    f"{kl_err(f32)} | {f64['top1_vs_plain64']:.3f} / {f32['top1_vs_plain64']:.3f} | "
                    f"{w['max_ulps_at_tensor_max']:.1f} ({w['median_ulps_at_tensor_max']:.1f}) |")
    return "\n".join(rows)


SUMMARY = ("error budget of float32 weight products: the same key with float64 and float32 products, vs float64 "
           "plaintext")
CONFIGS = {"full": Settings(), "smoke": Settings(models=("smollm2",), presets=("exact",), texts=1)}
DOCS = ("docs/performance.md",)
NOTES = "full: 8 obfuscations (both models, 2 presets x 2 product dtypes), minutes on 2 threads"
