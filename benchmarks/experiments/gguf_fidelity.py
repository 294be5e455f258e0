"""Fidelity of exported GGUFs on llama.cpp at reduced precision, obfuscated vs plaintext AT THE SAME BITS.

SmolLM2-135M-Instruct (or qwen-coder). Every model is exported by the same exporter
(``aloepri.export.gguf.export_gguf``) at each tensor type: the plaintext reference directory (the very f32 weights
the obfuscation starts from), and the obfuscated server directories (presets ``exact`` and ``noisy``, one key
per seed). All run on llama.cpp (llama-cpp-python, f32 KV cache, ``threads`` threads).

Text: the first ``prompts`` built-in chat prompts, each followed by the plaintext f32 GGUF's greedy reply (up to
``reply_tokens``). Every position is scored teacher-forced (full-vocabulary logits, mapped back through the key for
obfuscated models) against the plaintext f32 GGUF. Reported per (model, type):

- top1 / kl: argmax agreement with, and mean KL(plaintext f32 || model) in nats from, plaintext f32;
- self_top1 / self_kl: the same against that model's own f32 export (the loss the rounding alone causes; for
  ``noisy`` this removes its float32 noise floor);
- excess = obfuscated at b bits minus plaintext at b bits (kl and self_kl; top1 as a difference).

``diagnose`` runs the same text through transformers in float32 with llama.cpp's q8_0 / q4_0 rounding emulated on
the weights only, on the matmul inputs only (llama.cpp quantizes activations to q8_0 blocks of 32 before a
quantized matmul), or both, for plaintext and the first seed's obfuscated models: which rounding costs what.

Needs llama-cpp-python (not a dependency of aloepri): run() stops with one line when it is missing. Obfuscated
models come from benchmarks.lib.targets (cached by parameters); exports and log-prob caches in ``workdir`` are
named by the target's cache key, so a relabelled or changed variant never reuses a stale model. The result files
of earlier runs (one per study, several commands each) are kept as report-only configs.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.models import model_path
from ..lib.variants import parse_variant

STUDY = "study"  # the entry describing the run: engine, text, widths, file sizes, excess over plaintext


def log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref_lp, test_lp) -> dict:
    """Sums over positions (rows) so that sequences pool: argmax hits and KL(ref || test)."""
    import numpy as np

    kl = (np.exp(ref_lp) * (ref_lp - test_lp)).sum(-1)
    return {"n": int(ref_lp.shape[0]), "top1_hits": int((ref_lp.argmax(-1) == test_lp.argmax(-1)).sum()),
            "kl_sum": float(kl.sum()), "kl_max": float(kl.max())}


def pooled(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    return {"positions": n, "top1": round(sum(p["top1_hits"] for p in parts) / n, 5),
            "kl": round(sum(p["kl_sum"] for p in parts) / n, 6), "kl_max": round(max(p["kl_max"] for p in parts), 4)}


def scores(ref: list, own: list, lps: list, t0: float) -> dict:
    """``lps`` against the plaintext f32 reference and (``self_*``) against the same model unrounded."""
    return {**pooled([compare(a, x) for a, x in zip(ref, lps)]),
            **{f"self_{k}": v for k, v in pooled([compare(a, x) for a, x in zip(own, lps)]).items()
               if k != "positions"},
            "seconds": round(time.monotonic() - t0, 1)}


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


def emulate(model, seqs: list[list[int]], qtype: str, where: str) -> list:
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


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    types: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0")
    presets: tuple[str, ...] = ("exact", "noisy")  # presets, or LABEL=PRESET:field=value,... variants
    seeds: tuple[int, ...] = (11,)
    prompts: int = 8
    reply_tokens: int = 64
    threads: int = 2
    workdir: str = "/tmp/aloepri-gguf-fid"  # exports and log-prob caches (named by content, reusable)
    diagnose: tuple[str, ...] = ()  # emulated rounding in transformers: q8_0, q4_0
    diagnose_seqs: int = 3  # diagnose: the first N sequences only
    diagnose_where: tuple[str, ...] = ("weights", "inputs")  # of weights, inputs, both
    massive_k: int = 4  # diagnose: dimensions kept out of the rotation
    kept_norm_max: float | None = None  # override transforms.KEPT_NORM_WEIGHT_MAX for this run's obfuscations


def _require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise UsageError("gguf_fidelity needs llama-cpp-python (`pip install llama-cpp-python`), which is not "
                         "installed in this environment") from None
    return llama_cpp


def run(s: Settings, store: ResultStore) -> None:
    llama_cpp = _require_llama_cpp()
    import numpy as np

    import aloepri
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.eval.fidelity import builtin_prompt_ids
    from aloepri.runtime.tokenizer import load_tokenizer

    from ..lib.targets import WORK, obfuscated

    bad = [w for w in s.diagnose_where if w not in ("weights", "inputs", "both")]
    if bad or any(q not in ("q8_0", "q4_0") for q in s.diagnose):
        raise UsageError("gguf_fidelity: diagnose takes q8_0/q4_0, diagnose_where weights/inputs/both")
    try:
        variants = [parse_variant(v) for v in s.presets]
    except ValueError as e:
        raise UsageError(f"gguf_fidelity presets: {e}") from None
    src = model_path(s.model)
    targets_root = None
    if s.kept_norm_max is not None:
        from aloepri.obfuscation import transforms

        transforms.KEPT_NORM_WEIGHT_MAX = s.kept_norm_max
        targets_root = WORK / f"kept-norm-max-{s.kept_norm_max}"  # the target cache does not see this override
    work = Path(s.workdir) / s.model
    work.mkdir(parents=True, exist_ok=True)
    study: dict = dict((store.get(STUDY) or {}))

    def save_study() -> None:
        study.update(source=src.name, seeds=list(s.seeds), prompts=s.prompts, reply_tokens=s.reply_tokens,
                     engine=f"llama-cpp-python {llama_cpp.__version__}, f32 KV cache, n_threads {s.threads}",
                     machine=platform.machine(), load_average=list(os.getloadavg()))
        store.put(STUDY, study)

    if not (work / "plain" / "config.json").exists():
        plaintext_reference_dir(src, work / "plain")
    # name -> (HF directory, key, the name its exports and caches carry)
    models: dict[str, tuple[Path, object, str]] = {"plain": (work / "plain", None, "plain")}
    # a label names the parameters it was run with (a preset's meaning can change between versions)
    study["variants"] = {label: params.to_dict() for label, params in variants}
    for label, params in variants:
        for seed in s.seeds:
            t = obfuscated(src, params, seed, work=targets_root)
            cache_id = t.cache_key if s.kept_norm_max is None else f"{t.cache_key}-clip{s.kept_norm_max}"
            models[f"{label}-s{seed}"] = (t.model_dir, aloepri.load_key(t.key_path), cache_id)
    key0 = next(k for _, k, _ in models.values() if k is not None)
    study["hidden"] = {name: json.loads((d / "config.json").read_text())["hidden_size"]
                       for name, (d, _, _) in models.items()}

    def llama(path: Path):
        return llama_cpp.Llama(str(path), n_threads=s.threads, n_threads_batch=s.threads, n_ctx=1024,
                               logits_all=True, type_k=0, type_v=0, verbose=False)

    def gguf(name: str, qtype: str) -> Path:
        g = work / f"{models[name][2]}-{qtype}.gguf"
        if not g.exists():
            export_gguf(models[name][0], g, qtype)
        return g

    # the text: prompts + plaintext f32 greedy replies (llama.cpp), and the reference log-probs
    text_id = f"text-p{s.prompts}-r{s.reply_tokens}"
    text_file = work / f"{text_id}.json"
    if not text_file.exists():
        tok = load_tokenizer(key0, src)
        prompts = builtin_prompt_ids(tok, key0.vocab_size, s.prompts)
        eos = key0.special_tokens["eos_token_id"]
        m = llama(gguf("plain", "f32"))
        seqs = []
        for p in prompts:
            reply = []
            for t in m.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
                if t == eos or len(reply) >= s.reply_tokens:
                    break
                reply.append(int(t))
            seqs.append([int(x) for x in p] + reply)
        del m
        text_file.write_text(json.dumps({"seqs": seqs, "prompt_lens": [len(p) for p in prompts]}))
    seqs = json.loads(text_file.read_text())["seqs"]
    study["positions"] = sum(len(x) - 1 for x in seqs)

    def cached_logprobs(name: str, qtype: str) -> list:
        """Log-probs (plaintext vocabulary order) predicting seq[1:], cached as float32 .npy."""
        files = [work / "lp" / f"{text_id}-{models[name][2]}-{qtype}-{i}.npy" for i in range(len(seqs))]
        if not all(f.exists() for f in files):
            (work / "lp").mkdir(exist_ok=True)
            key = models[name][1]
            g = gguf(name, qtype)
            m = llama(g)
            for f, x in zip(files, seqs):
                ids = x if key is None else key.encode_ids(x)
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
    for qtype in s.types:
        for name in models:
            k = f"llamacpp/{name}/{qtype}"
            if store.has(k):
                continue
            t0 = time.monotonic()
            lp = cached_logprobs(name, qtype)
            own = cached_logprobs(name, "f32")
            r = scores(ref, own, lp, t0)
            store.put(k, r)
            print(k, json.dumps(r), flush=True)
            save_study()

    if s.diagnose:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(s.threads)
        seqs = seqs[: s.diagnose_seqs]
        ref = ref[: s.diagnose_seqs]
        massive, share = massive_dims(work / "plain", seqs, s.massive_k)
        study["massive_dims"] = {"dims": massive, "energy_share": round(share, 4)}
        # obfuscated models as served, and the plaintext rewritten one mechanism at a time
        subjects = [(n, lambda n=n: AutoModelForCausalLM.from_pretrained(str(models[n][0]), dtype=torch.float32).eval(),
                     models[n][1]) for n in ["plain"] + [f"{label}-s{s.seeds[0]}" for label, _ in variants]]
        subjects += [(f"plain-{v}", lambda v=v: rotated_plaintext(work / "plain", v, massive), None)
                     for v in ("fold", "fold+rotate", "fold+rotate-keep")]
        for qtype in s.diagnose:
            for name, load, key in subjects:
                enc = seqs if key is None else [key.encode_ids(x) for x in seqs]
                base = None
                for where in ["none", *s.diagnose_where]:
                    k = f"emulated/{name}/{qtype}/{where}"
                    if store.has(k) and where != "none":
                        continue
                    t0 = time.monotonic()
                    lps = [log_softmax(lg if key is None else lg[:, key.permutation])
                           for lg in emulate(load(), enc, qtype, where)]
                    if where == "none":
                        base = lps
                    r = scores(ref, base, lps, t0)
                    store.put(k, r)
                    print(k, json.dumps(r), flush=True)
                    save_study()

    study["excess_over_plaintext_same_type"] = excess(store.entries())
    save_study()


def excess(res: dict) -> dict:
    """Obfuscated minus plaintext at the same type (kl, self_kl, top1) and the self_kl ratio."""
    out = {}
    names = sorted({k.split("/")[1] for k in res if k.startswith("llamacpp/")} - {"plain"})
    for name in names:
        for qtype in ("f32", "f16", "q8_0", "q5_0", "q4_0"):
            o, p = res.get(f"llamacpp/{name}/{qtype}"), res.get(f"llamacpp/plain/{qtype}")
            if o and p:
                out[f"{name}/{qtype}"] = {"kl": round(o["kl"] - p["kl"], 6),
                                          "self_kl": round(o["self_kl"] - p["self_kl"], 6),
                                          "top1": round(o["top1"] - p["top1"], 5),
                                          # None where plaintext loses nothing (f32): no ratio to speak of
                                          "self_kl_ratio": round(o["self_kl"] / p["self_kl"], 2) if p["self_kl"] > 0
                                          else None}
    return out


def report(store: ResultStore) -> str:
    entries = store.entries()
    study = entries.get(STUDY, {})
    rows = [f"{study.get('source', '?')}: {study.get('positions', '?')} teacher-forced positions; "
            f"{study.get('engine', 'engine not recorded')}.", "",
            "| measured | model | type / rounding | top-1 / KL vs plaintext f32 | top-1 / KL vs own f32 (unrounded) | "
            "KL vs own f32, x plaintext's |", "|---|---|---|---|---|---|"]
    ratios = excess(entries)
    for k, e in entries.items():
        if k == STUDY:
            continue
        parts = k.split("/")
        where, name, qtype = parts[0], parts[1], "/".join(parts[2:])
        ratio = ratios.get(f"{name}/{qtype}", {}).get("self_kl_ratio") if where == "llamacpp" else None
        rows.append(f"| {'llama.cpp' if where == 'llamacpp' else 'emulated'} | {name} | {qtype} | "
                    f"{e['top1']:.4f} / {e['kl']:.5g} | {e['self_top1']:.4f} / {e['self_kl']:.5g} | "
                    f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    if study.get("massive_dims"):
        m = study["massive_dims"]
        rows += ["", f"Massive-activation dimensions {m['dims']}: {m['energy_share']:.0%} of the residual energy."]
    if study.get("note"):
        rows += ["", f"Note: {study['note']}"]
    return "\n".join(rows)


LEGACY = ("smollm2-types-diagnose", "smollm2-outliers-folded", "smollm2-normsplit", "qwen-coder-noclip",
          "qwen-coder-noclip-diagnose", "qwen-coder-diagnose-key15", "keptclip-sweep-smollm2",
          "keptclip-sweep-qwen-coder", "keptclip-smollm2", "keptclip-qwen-coder", "lam0-smollm2", "lam0-qwen-coder")

SUMMARY = "obfuscated vs plaintext GGUFs on llama.cpp at the same bits (f32, f16, q8_0, q4_0), optional emulation"
CONFIGS = {"smollm2": Settings(),
           "qwen-coder": Settings(model="qwen-coder", types=("f32", "q8_0"), presets=("exact_h0=exact:h=0", "noisy"),
                                  seeds=(11, 12, 13), threads=1),
           "smoke": Settings(types=("f32", "q8_0"), presets=("exact",), prompts=1, reply_tokens=8)}
DOCS = ("docs/serving-gguf.md",)
LEGACY_CONFIGS = LEGACY
NOTES = ("needs llama-cpp-python; smollm2: minutes per model and type on 2 threads; the kept result files are "
         "studies of several commands each (their run records quote them)")
