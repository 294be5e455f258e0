"""What serving an obfuscated model in FP8 costs, against what FP8 costs the plaintext model itself.

FP8 is emulated (no FP8 engine runs here): every linear weight of the decoder layers is block-quantized to
float8_e4m3fn in 128 x 128 blocks and dequantized again (aloepri.obfuscation.fp8.fake_quantize, the format
`--dtype fp8` writes), embedding / head / norms are rounded to bfloat16 as in the FP8 releases, and the model runs
in float32. Two emulations:
- ``fp8_w``: weights only (what the stored checkpoint loses);
- ``fp8_w8a8``: also the activations entering each quantized linear, quantized per token in groups of 128
  (``activation_scheme: dynamic``, what vLLM and SGLang do with these checkpoints).
``bf16`` (every tensor rounded to bfloat16) is the reference a bf16 deployment pays.

Every score is teacher-forced on corpus texts (--texts x 128 tokens) against the plaintext model in float32:
mean KL(plain float32 || X) in nats and top-1 agreement. X = the plaintext model in each emulation, and the
obfuscated model (obfuscated in float32, several keys) in each emulation, its logits mapped back through the key.
The weight-level diagnosis: the relative Frobenius error fake_quantize adds to the linear weights, plaintext vs
obfuscated.

    python benchmarks/fp8_fidelity.py --models smollm2 qwen-coder --keys 3
Results: benchmarks/results/fp8_fidelity.json (resumable: finished entries are kept; --force recomputes).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "fp8_fidelity.json"
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# obfuscation settings: name -> (preset, overrides)
SETTINGS = {
    "exact_h0_outlier4": ("exact", {"h": 0, "outlier_dims": 4}),
    "exact_h0_outlier0": ("exact", {"h": 0, "outlier_dims": 0}),
    "exact_h128_outlier4": ("exact", {}),
}
GROUP = 128  # activation quantization group (per token), as the engines' dynamic scheme


def _quantized_linears(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in QUANTIZED]


def _fake_quantize_activation(x: torch.Tensor) -> torch.Tensor:
    """Per token, groups of GROUP channels (a partial last group where the width is not a multiple)."""
    from aloepri.obfuscation.fp8 import FP8_DTYPE, FP8_MAX

    n = x.shape[-1]
    pad = (-n) % GROUP
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    g = xp.reshape(*xp.shape[:-1], -1, GROUP)
    scale = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype) * scale
    return q.reshape(*xp.shape)[..., :n]


def emulate(model, mode: str) -> dict:
    """Round ``model`` in place to ``mode`` ('bf16', 'fp8_w', 'fp8_w8a8'); returns the weight-error diagnosis."""
    from aloepri.obfuscation.fp8 import fake_quantize

    quantized = {id(m.weight) for _, m in _quantized_linears(model)}
    err_num = err_den = 0.0
    per_role: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if mode != "bf16" and id(p) in quantized:
                w = p.data
                deq = fake_quantize(w)
                e = float((deq - w).norm() ** 2)
                err_num += e
                err_den += float(w.norm() ** 2)
                per_role.setdefault(name.rsplit(".", 2)[-2], []).append((e / float(w.norm() ** 2)) ** 0.5)
                p.data = deq
            else:
                p.data = p.data.to(torch.bfloat16).to(p.dtype)
    if mode == "fp8_w8a8":
        for _, m in _quantized_linears(model):
            m.register_forward_pre_hook(lambda _m, args: (_fake_quantize_activation(args[0]),) + tuple(args[1:]))
    if mode == "bf16":
        return {}
    return {"weight_rel_error": (err_num / err_den) ** 0.5,
            "weight_rel_error_by_role": {r: sum(v) / len(v) for r, v in sorted(per_role.items())}}


@torch.no_grad()
def reference_log_probs(plain32, ids_list) -> list[torch.Tensor]:
    """float32 log-probabilities of the plaintext model (kept for the whole run: float32 halves their memory)."""
    return [torch.log_softmax(plain32(torch.tensor([list(ids)])).logits[0].double(), -1).float() for ids in ids_list]


@torch.no_grad()
def score(reference: list[torch.Tensor], model, key, ids_list) -> dict:
    """Mean KL(plain float32 || model) and top-1 agreement, teacher-forced; ``key`` maps plaintext ids to the
    model's (None: a plaintext model)."""
    import torch.nn.functional as F

    perm = torch.from_numpy(key.permutation) if key is not None else None
    kl = agree = n = 0.0
    for ref, ids in zip(reference, ids_list):
        x = torch.tensor([key.encode_ids(list(ids)) if key is not None else list(ids)])
        lo = model(x).logits[0].double()
        lo = lo[:, perm] if perm is not None else lo
        kl += float(F.kl_div(F.log_softmax(lo, -1), ref.double(), log_target=True, reduction="sum"))
        agree += float((lo.argmax(-1) == ref.argmax(-1)).sum())
        n += ref.shape[0]
    return {"mean_kl": kl / n, "top1": agree / n, "positions": int(n)}


def table(results: dict) -> str:
    """Markdown: per model, plaintext and each setting (mean and range over keys) in every emulation."""
    modes = ("bf16", "fp8_w", "fp8_w8a8")
    lines = ["| model | weights | bf16 KL | FP8 weights KL | FP8 W8A8 KL | FP8 W8A8 top-1 | FP8 weight error |",
             "|---|---|---|---|---|---|---|"]
    models = sorted({k.split("/")[0] for k in results})
    for model in models:
        plain = results.get(f"{model}/plain")
        groups: dict[str, list[dict]] = {}
        for k, v in sorted(results.items()):
            if k.startswith(model + "/") and k != f"{model}/plain":
                groups.setdefault(v["setting"], []).append(v)
        rows = [("plaintext", [plain])] if plain else []
        rows += [(f"{s} ({len(v)} keys)", v) for s, v in groups.items()]
        for label, entries in rows:
            def cell(mode, field="mean_kl", fmt="{:.3g}"):
                vals = [e[mode][field] for e in entries]
                lo, hi = min(vals), max(vals)
                return fmt.format(lo) if len(vals) == 1 or fmt.format(lo) == fmt.format(hi) else \
                    f"{fmt.format(lo)}-{fmt.format(hi)}"
            lines.append(f"| {model} | {label} | " + " | ".join(cell(m) for m in modes) + " | "
                         + cell("fp8_w8a8", "top1", "{:.3f}") + " | " + cell("fp8_w", "weight_rel_error", "{:.4f}")
                         + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen-coder"], choices=["smollm2", "qwen-coder"])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--keys", type=int, default=3, help="obfuscation keys (seeds 1000, 1001, ...) per setting")
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the saved results and exit")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"JSON file (default {RESULTS.name})")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    torch.set_num_threads(args.threads)

    import aloepri
    from aloepri.eval.fidelity import corpus_ids, corpus_texts
    from aloepri.keyfile import load_key
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    results = json.loads(args.results.read_text()) if args.results.exists() else {}

    def save(k: str, entry: dict) -> None:
        entry["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        results[k] = entry
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")

    modes = ("float32", "bf16", "fp8_w", "fp8_w8a8")
    for model in args.models:
        src = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[model]()
        jobs = [f"{model}/plain"] + [f"{model}/{s}/key{k}" for s in args.settings for k in range(args.keys)]
        if not args.force and all(j in results for j in jobs):
            continue
        tok = load_hf_tokenizer(src)
        texts, prov = corpus_texts(None, args.texts)
        ids_list = corpus_ids(tok, texts, 128)
        plain32 = load_plain_model(src, torch.float32)
        reference = reference_log_probs(plain32, ids_list)
        plain_dir = Path(tempfile.mkdtemp(prefix="aloepri-fp8-plain-"))
        # each emulation reloads it (one model in memory at a time); save_pretrained refuses GGUF-loaded models
        save_model(plain32, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
        plain32.config.save_pretrained(plain_dir)
        del plain32
        common = {"model": model, "source": src.name, "corpus": prov, "texts": len(ids_list), "block": [128, 128],
                  "activation_group": GROUP}
        if args.force or f"{model}/plain" not in results:
            entry = dict(common)
            for mode in modes[1:]:
                m = AutoModelForCausalLM.from_pretrained(str(plain_dir), dtype=torch.float32).eval()
                diag = emulate(m, mode)
                entry[mode] = {**score(reference, m, None, ids_list), **diag}
                del m
            save(f"{model}/plain", entry)
            print(f"{model}/plain: " + ", ".join(f"{m} KL {entry[m]['mean_kl']:.4g}" for m in modes[1:]), flush=True)
        for k in range(args.keys):  # key-major: an interrupted run has every setting at its first keys
            for setting in args.settings:
                preset, overrides = SETTINGS[setting]
                name = f"{model}/{setting}/key{k}"
                if name in results and not args.force:
                    continue
                work = Path(tempfile.mkdtemp(prefix="aloepri-fp8-"))
                try:
                    res = aloepri.obfuscate(src, work / "out", work / "key.json",
                                            aloepri.resolve_params(preset, **overrides), seed=1000 + k,
                                            allow_weak_seed=True, progress=False, dtype="float32")
                    key = load_key(work / "key.json")
                    entry = {**common, "setting": setting, "preset": preset, "overrides": overrides,
                             "seed": 1000 + k, "hidden_size": res.hidden_size}
                    for mode in modes:
                        obf = AutoModelForCausalLM.from_pretrained(str(work / "out"), dtype=torch.float32).eval()
                        diag = emulate(obf, mode) if mode != "float32" else {}
                        entry[mode] = {**score(reference, obf, key, ids_list), **diag}
                        del obf
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                save(name, entry)
                print(f"{name}: " + ", ".join(f"{m} KL {entry[m]['mean_kl']:.4g}" for m in modes), flush=True)
        shutil.rmtree(plain_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
