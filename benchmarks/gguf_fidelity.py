"""Fidelity of exported GGUFs on llama.cpp at reduced precision, obfuscated vs plaintext AT THE SAME BITS.

SmolLM2-135M-Instruct (or --model qwen-coder). Every model is exported by the same exporter
(``aloepri.export.gguf.export_gguf``) at each tensor type: the plaintext reference directory (the very f32 weights
the obfuscation starts from), and the obfuscated server directories (presets ``exact`` and ``noisy``, one key
per --seeds). All run on llama.cpp (llama-cpp-python, f32 KV cache, --threads threads).

Text: the first --prompts built-in chat prompts, each followed by the plaintext f32 GGUF's greedy reply (up to
--reply-tokens). Every position is scored teacher-forced (full-vocabulary logits, mapped back through the key for
obfuscated models) against the plaintext f32 GGUF. Reported per (model, type):

- top1 / kl: argmax agreement with, and mean KL(plaintext f32 || model) in nats from, plaintext f32;
- self_top1 / self_kl: the same against that model's own f32 export (the loss the rounding alone causes; for
  ``noisy`` this removes its float32 noise floor);
- excess = obfuscated at b bits minus plaintext at b bits (kl and self_kl; top1 as a difference).

--diagnose runs the same text through transformers in float32 with llama.cpp's q8_0 / q4_0 rounding emulated on
the weights only, on the matmul inputs only (llama.cpp quantizes activations to q8_0 blocks of 32 before a
quantized matmul), or both, for plaintext and the first seed's obfuscated models: which rounding costs what.

Results: benchmarks/results/gguf_fidelity.json (resumable: finished entries are kept; --workdir keeps the models)
Usage: python benchmarks/gguf_fidelity.py [--types f32 f16 q8_0 q4_0] [--presets exact noisy] [--seeds 11]
       [--prompts 8] [--reply-tokens 64] [--threads 2]
       [--diagnose q8_0 [--diagnose-seqs 3] [--diagnose-where weights inputs] [--massive-k 4]]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import parse_variant  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "gguf_fidelity.json"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref_lp: np.ndarray, test_lp: np.ndarray) -> dict:
    """Sums over positions (rows) so that sequences pool: argmax hits and KL(ref || test)."""
    kl = (np.exp(ref_lp) * (ref_lp - test_lp)).sum(-1)
    return {"n": int(ref_lp.shape[0]), "top1_hits": int((ref_lp.argmax(-1) == test_lp.argmax(-1)).sum()),
            "kl_sum": float(kl.sum()), "kl_max": float(kl.max())}


def pooled(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    return {"positions": n, "top1": round(sum(p["top1_hits"] for p in parts) / n, 5),
            "kl": round(sum(p["kl_sum"] for p in parts) / n, 6), "kl_max": round(max(p["kl_max"] for p in parts), 4)}


# ------------------------------------------------------------------- llama.cpp's rounding, emulated in torch


def q8_0_round(x, block: int = 32):
    """llama.cpp's q8_0 (reference quantizer): per block of 32 along the last dim, d = amax/127, round(x/d)."""
    import torch

    shp = x.shape
    b = x.reshape(-1, block)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(b))
    return (q * d).reshape(shp)


def q4_0_round(x, block: int = 32):
    """llama.cpp's q4_0: per block, d = (signed value of largest magnitude) / -8, q = clamp(round(x/d)+8, 0, 15)."""
    import torch

    shp = x.shape
    b = x.reshape(-1, block)
    idx = b.abs().argmax(-1, keepdim=True)
    d = b.gather(-1, idx) / -8
    safe = torch.where(d != 0, d, torch.ones_like(d))
    q = torch.clamp(torch.floor(b / safe + 8.5), 0, 15) - 8
    return torch.where(d != 0, q * d, torch.zeros_like(b)).reshape(shp)


def rotated_plaintext(plain_dir: Path, variant: str, massive: list[int], seed: int = 0):
    """The plaintext model rewritten in float32 as the obfuscation rewrites it, one mechanism at a time (no
    expansion, no scalings): ``fold`` fuses every RMSNorm weight into the matmuls that read it (the norms become
    1); ``fold+rotate`` also turns the residual basis by a random orthogonal matrix; ``fold+rotate-keep`` does
    so but keeps the ``massive`` dimensions out of the rotation and their norm weights unfused (what a key that
    maps massive-activation dimensions to single coordinates would do). Same function as plaintext."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(plain_dir), dtype=torch.float32).eval()
    base = model.model
    d = model.config.hidden_size
    keep = torch.zeros(d, dtype=torch.bool)
    if variant.endswith("-keep"):
        keep[massive] = True
    R = torch.eye(d, dtype=torch.float64)
    if "rotate" in variant:
        rest = (~keep).nonzero().flatten()
        g = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(len(rest), len(rest), generator=g, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r))[None, :]
        R[rest[:, None], rest[None, :]] = q
    R = R.float()

    def fold(norm, readers):
        w = norm.weight.detach().clone()
        fused = torch.where(keep, torch.ones_like(w), w)
        for lin in readers:
            lin.weight.copy_(lin.weight * fused[None, :] @ R)
        norm.weight.copy_(torch.where(keep, w, torch.ones_like(w)))

    with torch.no_grad():
        head = torch.nn.Linear(d, model.config.vocab_size, bias=False)
        head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied, as obfuscation does
        model.lm_head = head
        model.config.tie_word_embeddings = False
        emb = base.embed_tokens.weight
        emb.copy_(emb @ R)
        for layer in base.layers:
            at, mlp = layer.self_attn, layer.mlp
            fold(layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj])
            fold(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
            at.o_proj.weight.copy_(R.T @ at.o_proj.weight)
            mlp.down_proj.weight.copy_(R.T @ mlp.down_proj.weight)
        fold(base.norm, [model.lm_head])
    return model


def massive_dims(plain_dir: Path, seqs: list[list[int]], k: int) -> tuple[list[int], float]:
    """The k residual dimensions with the largest mean square over all layers' outputs and positions, and their
    share of the residual energy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(plain_dir), dtype=torch.float32).eval()
    acc = None
    with torch.no_grad():
        for s in seqs:
            hs = model(torch.tensor([s]), output_hidden_states=True).hidden_states[1:]
            e = sum((h[0] ** 2).sum(0) for h in hs).double()
            acc = e if acc is None else acc + e
    top = torch.topk(acc, k).indices
    return sorted(int(i) for i in top), float(acc[top].sum() / acc.sum())


def emulate(model, seqs: list[list[int]], qtype: str, where: str) -> list[np.ndarray]:
    """Logits of ``model`` (float32) with llama.cpp's rounding emulated on ``where`` (none, weights, inputs, both)."""
    import torch

    wround = {"q8_0": q8_0_round, "q4_0": q4_0_round}[qtype]
    hooks = []
    with torch.no_grad():
        if where in ("weights", "both"):
            tied = model.lm_head.weight is model.get_input_embeddings().weight
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Embedding):
                    mod.weight.copy_(q8_0_round(mod.weight))  # the exporter keeps the vocabulary tables at q8_0
                elif isinstance(mod, torch.nn.Linear) and not (tied and name.endswith("lm_head")):
                    mod.weight.copy_((q8_0_round if name.endswith("lm_head") else wround)(mod.weight))
        if where in ("inputs", "both"):
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear):
                    hooks.append(mod.register_forward_pre_hook(lambda m, args: (q8_0_round(args[0]),)))
        out = [model(torch.tensor([s])).logits[0, :-1].double().numpy() for s in seqs]
    for h in hooks:
        h.remove()
    return out


# ----------------------------------------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0", "q4_0"])
    ap.add_argument("--presets", nargs="+", default=["exact", "noisy"],
                    help="presets, or LABEL=PRESET:key=value,... variants (benchmarks/variants.py)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[11])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/aloepri-gguf-fid")
    ap.add_argument("--diagnose", nargs="*", metavar="QTYPE", help="emulated rounding in transformers (q8_0, q4_0)")
    ap.add_argument("--diagnose-seqs", type=int, default=3, help="--diagnose: the first N sequences only")
    ap.add_argument("--diagnose-where", nargs="+", default=["weights", "inputs"],
                    choices=["weights", "inputs", "both"])
    ap.add_argument("--massive-k", type=int, default=4, help="--diagnose: dimensions kept out of the rotation")
    ap.add_argument("--kept-norm-max", type=float, default=None,
                    help="override transforms.KEPT_NORM_WEIGHT_MAX for the models this run obfuscates (give them "
                         "their own labels: finished models are reused by label)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()

    import llama_cpp

    import aloepri
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf
    from aloepri.eval.fidelity import builtin_prompt_ids
    from aloepri.runtime.tokenizer import load_tokenizer

    if a.kept_norm_max is not None:
        from aloepri.obfuscation import transforms

        transforms.KEPT_NORM_WEIGHT_MAX = a.kept_norm_max
    src = smollm2_gguf() if a.model == "smollm2" else qwen25_coder_05b_gguf()
    work = Path(a.workdir) / a.model
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(a.out)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    if report.get("model") not in (None, src.name) or "studies" not in report:
        report = {"studies": {}}
    study = report["studies"].setdefault(a.model, {"results": {}})
    res = study["results"]

    def save():
        study.update(source=src.name, seeds=sorted(set(study.get("seeds", [])) | set(a.seeds)),
                     engine=f"llama-cpp-python {llama_cpp.__version__}, f32 KV cache, n_threads {a.threads}",
                     prompts=a.prompts, reply_tokens=a.reply_tokens)
        report.update(machine=platform.machine(), date=time.strftime("%Y-%m-%d"),
                      load_average=os.getloadavg())
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out_path)

    if not (work / "plain" / "config.json").exists():
        plaintext_reference_dir(src, work / "plain")
    models: dict[str, tuple[Path, object]] = {"plain": (work / "plain", None)}
    variants = [parse_variant(v) for v in a.presets]
    # a label names the parameters it was run with (a preset's meaning can change between versions)
    study.setdefault("variants", {}).update({label: params.to_dict() for label, params in variants})
    for preset, params in variants:
        for seed in a.seeds:
            d = work / f"{preset}-s{seed}"
            if not (d / "client.key").exists():
                t0 = time.monotonic()
                aloepri.obfuscate(src, d / "server", d / "client.key", params, seed=seed,
                                  allow_weak_seed=True, progress=False, overwrite=True)
                print(f"obfuscated {preset} seed {seed} in {time.monotonic() - t0:.0f} s", flush=True)
            models[f"{preset}-s{seed}"] = (d / "server", aloepri.load_key(d / "client.key"))
    key0 = next(k for _, k in models.values() if k is not None)
    study.setdefault("hidden", {}).update(
        {name: json.loads((d / "config.json").read_text())["hidden_size"] for name, (d, _) in models.items()})

    def llama(path: Path):
        return llama_cpp.Llama(str(path), n_threads=a.threads, n_threads_batch=a.threads, n_ctx=1024,
                               logits_all=True, type_k=0, type_v=0, verbose=False)

    def gguf(name: str, qtype: str) -> Path:
        g = work / f"{name}-{qtype}.gguf"
        if not g.exists():
            export_gguf(models[name][0], g, qtype)
        return g

    # the text: prompts + plaintext f32 greedy replies (llama.cpp), and the reference log-probs
    text_file = work / "text.json"
    if not text_file.exists():
        tok = load_tokenizer(key0, src)
        prompts = builtin_prompt_ids(tok, key0.vocab_size, a.prompts)
        eos = key0.special_tokens["eos_token_id"]
        m = llama(gguf("plain", "f32"))
        seqs = []
        for p in prompts:
            reply = []
            for t in m.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                if t == eos or len(reply) >= a.reply_tokens:
                    break
                reply.append(int(t))
            seqs.append([int(x) for x in p] + reply)
        del m
        text_file.write_text(json.dumps({"seqs": seqs, "prompt_lens": [len(p) for p in prompts]}))
    seqs = json.loads(text_file.read_text())["seqs"]
    study["positions"] = sum(len(s) - 1 for s in seqs)

    def cached_logprobs(name: str, qtype: str) -> list[np.ndarray]:
        """Log-probs (plaintext vocabulary order) predicting seq[1:], cached as float32 .npy."""
        files = [work / "lp" / f"{name}-{qtype}-{i}.npy" for i in range(len(seqs))]
        if not all(f.exists() for f in files):
            (work / "lp").mkdir(exist_ok=True)
            key = models[name][1]
            g = gguf(name, qtype)
            m = llama(g)
            for f, s in zip(files, seqs):
                ids = s if key is None else key.encode_ids(s)
                m.reset()
                m.eval(ids)
                lg = np.array(m.scores[: len(ids) - 1], dtype=np.float64)
                if key is not None:
                    lg = lg[:, key.permutation]  # column j = the model's logit for plaintext token j
                np.save(f, log_softmax(lg).astype(np.float32))
            del m
            study.setdefault("file_mib", {})[f"{name}/{qtype}"] = round(g.stat().st_size / 2**20, 1)
            if qtype != "f32":
                g.unlink()  # keep the disk small; f32 exports are the self references
        return [np.load(f).astype(np.float64) for f in files]

    ref = cached_logprobs("plain", "f32")
    for qtype in a.types:
        for name in models:
            k = f"llamacpp/{name}/{qtype}"
            if k in res:
                continue
            t0 = time.monotonic()
            lp = cached_logprobs(name, qtype)
            own = cached_logprobs(name, "f32")
            res[k] = {**pooled([compare(r, x) for r, x in zip(ref, lp)]),
                      **{f"self_{kk}": v for kk, v in pooled([compare(r, x) for r, x in zip(own, lp)]).items()
                         if kk != "positions"},
                      "seconds": round(time.monotonic() - t0, 1)}
            print(k, json.dumps(res[k]), flush=True)
            save()

    if a.diagnose:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(a.threads)
        seqs = seqs[: a.diagnose_seqs]
        ref = ref[: a.diagnose_seqs]
        massive, share = massive_dims(work / "plain", seqs, a.massive_k)
        study["massive_dims"] = {"dims": massive, "energy_share": round(share, 4)}
        # obfuscated models as served, and the plaintext rewritten one mechanism at a time
        subjects = [(n, lambda n=n: AutoModelForCausalLM.from_pretrained(str(models[n][0]), dtype=torch.float32).eval(),
                     models[n][1]) for n in ["plain"] + [f"{label}-s{a.seeds[0]}" for label, _ in variants]]
        subjects += [(f"plain-{v}", lambda v=v: rotated_plaintext(work / "plain", v, massive), None)
                     for v in ("fold", "fold+rotate", "fold+rotate-keep")]
        for qtype in a.diagnose:
            for name, load, key in subjects:
                enc = seqs if key is None else [key.encode_ids(s) for s in seqs]
                base = None
                for where in ["none"] + a.diagnose_where:
                    k = f"emulated/{name}/{qtype}/{where}"
                    if k in res and where != "none":
                        continue
                    t0 = time.monotonic()
                    lps = [log_softmax(lg if key is None else lg[:, key.permutation])
                           for lg in emulate(load(), enc, qtype, where)]
                    if where == "none":
                        base = lps
                    res[k] = {**pooled([compare(r, x) for r, x in zip(ref, lps)]),
                              **{f"self_{kk}": v for kk, v in pooled([compare(r, x) for r, x in zip(base, lps)]).items()
                                 if kk != "positions"},
                              "seconds": round(time.monotonic() - t0, 1)}
                    print(k, json.dumps(res[k]), flush=True)
                    save()

    # excess over plaintext at the same bits
    study["excess_over_plaintext_same_type"] = {
        f"{name}/{qtype}": {"kl": round(res[f"llamacpp/{name}/{qtype}"]["kl"] - res[f"llamacpp/plain/{qtype}"]["kl"], 6),
                            "self_kl": round(res[f"llamacpp/{name}/{qtype}"]["self_kl"]
                                             - res[f"llamacpp/plain/{qtype}"]["self_kl"], 6),
                            "top1": round(res[f"llamacpp/{name}/{qtype}"]["top1"]
                                          - res[f"llamacpp/plain/{qtype}"]["top1"], 5),
                            "self_kl_ratio": round(res[f"llamacpp/{name}/{qtype}"]["self_kl"]
                                                   / max(res[f"llamacpp/plain/{qtype}"]["self_kl"], 1e-12), 2)}
        for name in sorted({k.split("/")[1] for k in res if k.startswith("llamacpp/")} - {"plain"})
        for qtype in ("f32", "f16", "q8_0", "q5_0", "q4_0")
        if f"llamacpp/{name}/{qtype}" in res and f"llamacpp/plain/{qtype}" in res}
    save()
    for k, v in sorted(res.items()):
        print(f"{k:44s} top1 {v['top1']:.4f} kl {v['kl']:.5f} | self top1 {v['self_top1']:.4f} self kl {v['self_kl']:.5f}")


if __name__ == "__main__":
    main()
