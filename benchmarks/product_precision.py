"""Error budget of float32 weight products (pipeline.product_dtype): the same obfuscation (same key seed) with its
products in float64 and in float32, both stored as float32, scored against plaintext computed in float64.

Per model and preset it reports
- weights: the largest difference between the two outputs, per tensor, in units of that tensor's float32 rounding
  step at its largest entry (max|a - b| / (max|a| * 2^-24)): what float32 products add to the storage rounding;
- logits (teacher-forced, --texts debian-reference texts x 128 tokens): KL(plain float64 || X) and max |logit
  error| for X = plaintext float32 (the floor any float32 model pays), the float64-product obfuscation and the
  float32-product obfuscation; top-1 agreement with the float64 plaintext.

    python benchmarks/product_precision.py --models smollm2 --presets exact noisy
Results: benchmarks/results/product_precision.json (one entry per model/preset; --force recomputes).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "product_precision.json"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "qwen-coder"])
    ap.add_argument("--presets", nargs="+", default=["exact", "noisy"])
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import aloepri
    import aloepri.obfuscation.pipeline as pipeline
    from aloepri.eval.fidelity import corpus_ids, corpus_texts
    from aloepri.keyfile import load_key
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer
    from transformers import AutoModelForCausalLM

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    chosen = pipeline.product_dtype
    for model in args.models:
        src = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[model]()
        todo = [p for p in args.presets if args.force or f"{model}/{p}" not in results]
        if not todo:
            continue
        tok = load_hf_tokenizer(src)
        texts, prov = corpus_texts(None, args.texts)
        ids_list = corpus_ids(tok, texts, 128)
        plain64 = load_plain_model(src, torch.float64)
        plain32 = load_plain_model(src, torch.float32)
        with torch.no_grad():
            floor = score(plain64, plain32, None, ids_list)
        del plain32
        for preset in todo:
            work = Path(tempfile.mkdtemp(prefix="aloepri-precision-"))
            entry = {"model": model, "preset": preset, "seed": args.seed, "corpus": prov, "texts": len(ids_list),
                     "plaintext_float32": floor}
            try:
                for label, dt in (("float64_products", torch.float64), ("float32_products", torch.float32)):
                    pipeline.product_dtype = lambda *_, dt=dt: dt
                    t0 = time.perf_counter()
                    res = aloepri.obfuscate(src, work / label, work / f"{label}.key", aloepri.resolve_params(preset),
                                            seed=args.seed, allow_weak_seed=True, progress=False, dtype="float32")
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
            entry["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            results[f"{model}/{preset}"] = entry
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
            f64, f32 = entry["float64_products"], entry["float32_products"]
            print(f"{model}/{preset}: KL vs plain64: plain32 {floor['mean_kl_vs_plain64']:.3g}, "
                  f"f64 products {f64['mean_kl_vs_plain64']:.3g}, f32 products {f32['mean_kl_vs_plain64']:.3g}; "
                  f"max logit err {floor['max_logit_error']:.3g} / {f64['max_logit_error']:.3g} / "
                  f"{f32['max_logit_error']:.3g}; weights max {entry['weights']['max_ulps_at_tensor_max']:.1f} ulps "
                  f"({entry['weights']['worst_tensor']})", flush=True)


if __name__ == "__main__":
    main()
