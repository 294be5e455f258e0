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
One config per model (``python -m benchmarks run fp8_fidelity --config smollm2``); entries ``plain`` and
``SETTING/keyK`` (resumable).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore
from ..lib.models import model_path

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# obfuscation settings: name -> (preset, overrides)
SETTINGS = {
    "exact_h0_outlier4": ("exact", {"h": 0, "outlier_dims": 4}),
    "exact_h0_outlier0": ("exact", {"h": 0, "outlier_dims": 0}),
    "exact_h128_outlier4": ("exact", {}),
}
GROUP = 128  # activation quantization group (per token), as the engines' dynamic scheme


def _quantized_linears(model):
    import torch

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in QUANTIZED]


def _fake_quantize_activation(x):
    """Per token, groups of GROUP channels (a partial last group where the width is not a multiple)."""
    import torch

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
    import torch

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


def reference_log_probs(plain32, ids_list) -> list:
    """float32 log-probabilities of the plaintext model (kept for the whole run: float32 halves their memory)."""
    import torch

    with torch.no_grad():
        return [torch.log_softmax(plain32(torch.tensor([list(ids)])).logits[0].double(), -1).float()
                for ids in ids_list]


def score(reference: list, model, key, ids_list) -> dict:
    """Mean KL(plain float32 || model) and top-1 agreement, teacher-forced; ``key`` maps plaintext ids to the
    model's (None: a plaintext model)."""
    import torch
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
    models = sorted({v["model"] for v in results.values()})
    for model in models:
        plain = next((v for v in results.values() if v["model"] == model and "setting" not in v), None)
        groups: dict[str, list[dict]] = {}
        for k, v in sorted(results.items()):
            if v["model"] == model and "setting" in v:
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


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    settings: tuple[str, ...] = ("exact_h0_outlier4", "exact_h0_outlier0")  # names in SETTINGS
    keys: int = 3  # obfuscation keys (seeds 1000, 1001, ...) per setting
    texts: int = 4
    threads: int = 2


def run(s: Settings, store: ResultStore) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    import aloepri
    from aloepri.eval.fidelity import corpus_ids, corpus_texts
    from aloepri.keyfile import load_key
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    from ..lib import UsageError
    from ..lib.targets import obfuscated

    unknown = [x for x in s.settings if x not in SETTINGS]
    if unknown:
        raise UsageError(f"fp8_fidelity: unknown setting(s) {unknown}; settings: {', '.join(SETTINGS)}")
    jobs = ["plain"] + [f"{x}/key{k}" for x in s.settings for k in range(s.keys)]
    if all(store.has(j) for j in jobs):
        return
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    modes = ("float32", "bf16", "fp8_w", "fp8_w8a8")
    tok = load_hf_tokenizer(src)
    texts, prov = corpus_texts(None, s.texts)
    ids_list = corpus_ids(tok, texts, 128)
    plain32 = load_plain_model(src, torch.float32)
    reference = reference_log_probs(plain32, ids_list)
    plain_dir = Path(tempfile.mkdtemp(prefix="aloepri-fp8-plain-"))
    try:
        # each emulation reloads it (one model in memory at a time); save_pretrained refuses GGUF-loaded models
        save_model(plain32, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
        plain32.config.save_pretrained(plain_dir)
        del plain32
        common = {"model": s.model, "source": src.name, "corpus": prov, "texts": len(ids_list), "block": [128, 128],
                  "activation_group": GROUP}
        with torch.no_grad():
            if not store.has("plain"):
                entry = dict(common)
                for mode in modes[1:]:
                    m = AutoModelForCausalLM.from_pretrained(str(plain_dir), dtype=torch.float32).eval()
                    diag = emulate(m, mode)
                    entry[mode] = {**score(reference, m, None, ids_list), **diag}
                    del m
                store.put("plain", entry)
                print(f"{s.model}/plain: " + ", ".join(f"{m} KL {entry[m]['mean_kl']:.4g}" for m in modes[1:]),
                      flush=True)
            for k in range(s.keys):  # key-major: an interrupted run has every setting at its first keys
                for setting in s.settings:
                    preset, overrides = SETTINGS[setting]
                    name = f"{setting}/key{k}"
                    if store.has(name):
                        continue
                    target = obfuscated(src, aloepri.resolve_params(preset, **overrides), 1000 + k, dtype="float32")
                    key = load_key(target.key_path)
                    hidden = json.loads((target.model_dir / "config.json").read_text())["hidden_size"]
                    entry = {**common, "setting": setting, "preset": preset, "overrides": overrides,
                             "seed": 1000 + k, "hidden_size": hidden}
                    for mode in modes:
                        obf = AutoModelForCausalLM.from_pretrained(str(target.model_dir), dtype=torch.float32).eval()
                        diag = emulate(obf, mode) if mode != "float32" else {}
                        entry[mode] = {**score(reference, obf, key, ids_list), **diag}
                        del obf
                    store.put(name, entry)
                    print(f"{name}: " + ", ".join(f"{m} KL {entry[m]['mean_kl']:.4g}" for m in modes), flush=True)
    finally:
        shutil.rmtree(plain_dir, ignore_errors=True)


def report(store: ResultStore) -> str:
    return table(store.entries())


SUMMARY = "what emulated FP8 (weights, W8A8) costs the obfuscated model against the plaintext one, per key"
CONFIGS = {"smollm2": Settings(),
           "qwen-coder": Settings(model="qwen-coder", keys=2),
           "smoke": Settings(settings=("exact_h0_outlier4",), keys=1, texts=1)}
DOCS = ("docs/fp8.md",)
NOTES = "smollm2: 6 obfuscations of SmolLM2 and 4 emulations each, tens of minutes on 2 threads"
