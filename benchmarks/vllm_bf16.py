"""Reduced-precision serving of obfuscated SmolLM2-135M-Instruct on vLLM (CPU build) and transformers: how much
does bf16 / f16 lose against plaintext float32, and is it more than plaintext bf16 / f16 loses on its own?

Text: the 20 built-in chat prompts (aloepri.eval.fidelity) each followed by the plaintext float32 model's greedy
reply on vLLM (up to --reply-tokens). Every position of that text is scored teacher-forced (the model sees the
same tokens whatever it predicts): full-vocabulary logits, mapped back through the key for obfuscated models,
against plaintext float32 on vLLM. Reported per (model, engine, dtype):

- top1: fraction of positions whose argmax equals plaintext float32's;
- kl: mean KL(plaintext float32 || model) in nats, over all positions and over the reply positions;
- self_top1 / self_kl (vLLM): the same against the model's own float32 vLLM run (what the rounding alone costs,
  which for a noisy preset such as `noisy` removes its float32 noise floor; float32 runs first);
- greedy_agree: mean number of reply tokens a free-running greedy decode reproduces before its first difference
  (exact: before the first teacher-forced argmax difference the free-running context is the same text).

vLLM logits are the full rows its LogitsProcessor computes (a forward hook, in-process engine), the same values
vLLM turns into prompt_logprobs (checked against them on the reference run). vLLM runs in its own venv
(.venv-vllm, or --vllm-python); this script re-runs itself there with --worker.

Usage: python benchmarks/vllm_bf16.py [--seeds 11 12 13] [--presets exact noisy] [--dtypes float32 bfloat16 float16]
       [--engines vllm transformers] [--diagnose bfloat16]
Results: benchmarks/results/vllm_bf16.json (resumable: finished entries are kept; --workdir keeps the models).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import parse_variant  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "vllm_bf16.json"


# ----------------------------------------------------------------------------------------------- shared metrics


def score(ref_logprobs: np.ndarray, logits: np.ndarray, reply_start: int) -> dict:
    """Per-position comparison of a model's logits (plaintext vocabulary order) with the reference log-probs,
    rows = predicted positions. Returns sums so that sequences can be pooled."""
    import torch

    ref = torch.from_numpy(ref_logprobs).double()
    test = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    kl = (ref.exp() * (ref - test)).sum(-1)
    agree = ref.argmax(-1) == test.argmax(-1)
    reply = agree[reply_start:]
    miss = (~reply).nonzero()
    return {"positions": int(ref.shape[0]), "top1_hits": int(agree.sum()), "kl_sum": float(kl.sum()),
            "reply_positions": int(reply.numel()), "reply_top1_hits": int(reply.sum()),
            "reply_kl_sum": float(kl[reply_start:].sum()), "kl_max": float(kl.max()),
            "greedy_agree": int(miss[0, 0]) if miss.numel() else int(reply.numel())}


def pool(per_seq: list[dict]) -> dict:
    n = sum(s["positions"] for s in per_seq)
    nr = sum(s["reply_positions"] for s in per_seq)
    return {"positions": n, "top1": round(sum(s["top1_hits"] for s in per_seq) / n, 5),
            "kl": round(sum(s["kl_sum"] for s in per_seq) / n, 6),
            "reply_top1": round(sum(s["reply_top1_hits"] for s in per_seq) / nr, 5),
            "reply_kl": round(sum(s["reply_kl_sum"] for s in per_seq) / nr, 6),
            "kl_max": round(max(s["kl_max"] for s in per_seq), 4),
            "greedy_agree_mean": round(float(np.mean([s["greedy_agree"] for s in per_seq])), 2),
            "greedy_identical": f"{sum(s['greedy_agree'] == s['reply_positions'] for s in per_seq)}/{len(per_seq)}"}


# ------------------------------------------------------------------------------- worker (inside the vLLM venv)


def worker(jobs_path: str) -> None:
    """Runs under the vLLM venv's python. Each job: one model directory at one dtype; writes its result file."""
    import gc

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    jobs = json.loads(Path(jobs_path).read_text())
    for job in jobs:
        out = Path(job["out"])
        if out.exists():
            continue
        t0 = time.monotonic()
        llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=1024, max_num_seqs=1, seed=0, max_logprobs=1)
        load_s = time.monotonic() - t0
        captured: list = []

        def install(model):
            model.logits_processor.register_forward_hook(
                lambda m, i, o: captured.append(o.detach().float().cpu().clone()))
            return True

        assert llm.apply_model(install) == [True]

        def full_logits(seq):
            """Logits predicting seq[1:], all positions, and vLLM's own prompt_logprobs for the same tokens."""
            captured.clear()
            res = llm.generate([TokensPrompt(prompt_token_ids=seq)],
                               SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False),
                               use_tqdm=False)[0]
            rows = torch.cat([c for c in captured if c.shape[0] > 1] or [captured[-1][:0]])
            assert rows.shape[0] == len(seq) - 1, (rows.shape, len(seq))
            vllm_lp = [res.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))]
            return rows, vllm_lp

        result = {"model": job["model"], "dtype": job["dtype"], "load_seconds": round(load_s, 1)}
        t1 = time.monotonic()
        if job["mode"] == "reference":
            sp = SamplingParams(max_tokens=job["reply_tokens"], temperature=0, stop_token_ids=[job["eos"]],
                                detokenize=False)
            replies = [list(o.outputs[0].token_ids) for o in
                       llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)]
            result["replies"] = replies
            max_dev = 0.0
            for i, (p, r) in enumerate(zip(job["prompts"], replies)):
                seq = p + r
                rows, vllm_lp = full_logits(seq)
                lp = torch.log_softmax(rows.double(), -1)
                mine = lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
                max_dev = max(max_dev, float((mine - torch.tensor(vllm_lp, dtype=torch.double)).abs().max()))
                np.save(Path(job["ref_dir"]) / f"ref{i}.npy", lp.float().numpy())
            result["hook_vs_prompt_logprobs_max_abs"] = max_dev
        else:
            perm = None if job["perm"] is None else torch.tensor(np.load(job["perm"]))
            per_seq, self_per_seq = [], []
            own = Path(job["self_dir"])  # this model's own float32 log-probs: what the rounding alone costs
            for i, (seq, rs) in enumerate(zip(job["seqs"], job["reply_starts"])):
                rows, _ = full_logits(seq)
                if perm is not None:
                    rows = rows[:, perm]  # column j = the model's logit for plaintext token j
                ref = np.load(Path(job["ref_dir"]) / f"ref{i}.npy")
                per_seq.append(score(ref, rows.numpy(), rs))
                if job["dtype"] == "float32":
                    np.save(own / f"self{i}.npy", torch.log_softmax(rows.double(), -1).float().numpy())
                elif (own / f"self{i}.npy").exists():
                    self_per_seq.append(score(np.load(own / f"self{i}.npy"), rows.numpy(), rs))
            result["per_seq"] = per_seq
            if self_per_seq:
                result["self_per_seq"] = self_per_seq
        result["score_seconds"] = round(time.monotonic() - t1, 1)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)
        print(json.dumps({k: v for k, v in result.items() if k not in ("per_seq", "replies")}), flush=True)
        del llm
        gc.collect()


def run_worker(python: Path, jobs: list[dict], workdir: Path, threads: int) -> None:
    pending = [j for j in jobs if not Path(j["out"]).exists()]
    if not pending:
        return
    jobs_path = workdir / f"jobs-{int(time.time() * 1000)}.json"
    jobs_path.write_text(json.dumps(pending))
    env = dict(os.environ)
    for sub in ("cache", "rpc", "tmp", "config"):
        (workdir / "vllm" / sub).mkdir(parents=True, exist_ok=True)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine in this process: the logits hook sees it
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_CACHE_ROOT=str(workdir / "vllm" / "cache"), VLLM_RPC_BASE_PATH=str(workdir / "vllm" / "rpc"),
               VLLM_CONFIG_ROOT=str(workdir / "vllm" / "config"), TMPDIR=str(workdir / "vllm" / "tmp"),
               VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)
    subprocess.run([str(python), __file__, "--worker", str(jobs_path)], env=env, check=True, cwd=workdir)


# ------------------------------------------------------------------------------------ driver (project venv)


WEIGHT_GROUPS = {
    "all": ("",),
    "embed+head": ("embed_tokens", "lm_head"),
    "attention": ("self_attn.",),
    "mlp": ("mlp.",),
    "norms": ("norm",),
}


def transformers_scores(model_dir: Path, dtype: str, seqs, reply_starts, perm, ref_dir: Path,
                        rounded_group: str | None = None) -> list[dict]:
    """transformers on CPU in ``dtype``; or, with ``rounded_group``, in float32 with only that group of weights
    rounded to ``dtype`` and back (which weights' rounding costs what, with float32 activations)."""
    import torch
    from transformers import AutoModelForCausalLM

    load_dtype = torch.float32 if rounded_group else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=load_dtype).eval()
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen-coder"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    ap.add_argument("--presets", nargs="+", default=["exact", "noisy"],
                    help="presets, or ablations LABEL=PRESET:key=value,... (e.g. rot=exact:h=0,vo_scale_range=1)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--engines", nargs="+", default=["vllm", "transformers"])
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/aloepri-vllm-bf16")
    ap.add_argument("--vllm-python", default=os.environ.get("ALOEPRI_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--diagnose", metavar="DTYPE",
                    help="also score transformers in float32 with one weight group at a time rounded to DTYPE")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)

    import torch

    import aloepri
    from aloepri.eval.fidelity import builtin_prompt_ids
    from aloepri.export.gguf import plaintext_reference_dir
    from aloepri.runtime.tokenizer import load_tokenizer
    from aloepri.models import qwen25_coder_05b_gguf, smollm2_gguf

    torch.set_num_threads(a.threads)
    work = Path(a.workdir)
    (work / "ref").mkdir(parents=True, exist_ok=True)
    (work / "res").mkdir(exist_ok=True)
    out_path = Path(a.out)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report.setdefault("results", {})
    smol = {"smollm2": smollm2_gguf, "qwen-coder": qwen25_coder_05b_gguf}[a.model]()  # the source model
    if not (work / "plain").exists():
        plaintext_reference_dir(smol, work / "plain")
    models = {"plain": (work / "plain", None)}
    variants = dict(parse_variant(v) for v in a.presets)
    for label, params in variants.items():
        for seed in a.seeds:
            d = work / f"{label}-s{seed}"
            if not (d / "client.key").exists():
                t0 = time.monotonic()
                aloepri.obfuscate(smol, d / "server", d / "client.key", params, seed=seed,
                                  allow_weak_seed=True, progress=False, overwrite=True)
                print(f"obfuscated {label} seed {seed} in {time.monotonic() - t0:.0f} s", flush=True)
            key = aloepri.load_key(d / "client.key")
            np.save(d / "perm.npy", key.permutation)
            models[f"{label}-s{seed}"] = (d / "server", key)
    report["variants"] = {**report.get("variants", {}), **{k: v.to_dict() for k, v in variants.items()}}

    key0 = next(k for _, k in models.values() if k is not None)
    tok = load_tokenizer(key0, smol)
    eos = key0.special_tokens["eos_token_id"]
    prompts = builtin_prompt_ids(tok, key0.vocab_size)
    vpy = Path(a.vllm_python)

    ref_file = work / "res" / "reference.json"
    run_worker(vpy, [{"mode": "reference", "model": str(work / "plain"), "dtype": "float32", "prompts": prompts,
                      "reply_tokens": a.reply_tokens, "eos": eos, "ref_dir": str(work / "ref"),
                      "out": str(ref_file)}], work, a.threads)
    ref = json.loads(ref_file.read_text())
    seqs = [p + r for p, r in zip(prompts, ref["replies"])]
    reply_starts = [len(p) - 1 for p in prompts]  # row len(p)-1 predicts the first reply token
    report["reference"] = {"engine": "vllm", "dtype": "float32", "load_seconds": ref["load_seconds"],
                           "hook_vs_prompt_logprobs_max_abs": ref["hook_vs_prompt_logprobs_max_abs"],
                           "prompts": len(prompts), "positions": sum(len(s) - 1 for s in seqs),
                           "reply_positions": sum(len(r) for r in ref["replies"])}

    def save():
        report.update(model=smol.name, seeds=a.seeds, presets=a.presets, reply_tokens=a.reply_tokens,
                      threads=a.threads, machine=platform.machine(), date=time.strftime("%Y-%m-%d"))
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(out_path)

    if "vllm" in a.engines:
        jobs = []
        for name, (d, key) in models.items():
            enc = seqs if key is None else [key.encode_ids(s) for s in seqs]
            own = work / "self" / name
            own.mkdir(parents=True, exist_ok=True)
            for dt in sorted(a.dtypes, key=lambda t: t != "float32"):  # float32 first: the others' own reference
                if f"vllm/{name}/{dt}" in report["results"]:
                    continue
                jobs.append({"mode": "test", "model": str(d), "dtype": dt, "seqs": enc, "reply_starts": reply_starts,
                             "perm": None if key is None else str(d.parent / "perm.npy"), "ref_dir": str(work / "ref"),
                             "self_dir": str(own), "out": str(work / "res" / f"vllm-{name}-{dt}.json"), "name": name})
        if jobs:
            try:
                run_worker(vpy, jobs, work, a.threads)
            finally:
                for j in jobs:
                    if Path(j["out"]).exists():
                        r = json.loads(Path(j["out"]).read_text())
                        own = {f"self_{k}": v for k, v in pool(r["self_per_seq"]).items()
                               if k in ("top1", "kl", "reply_kl")} if "self_per_seq" in r else {}
                        report["results"][f"vllm/{j['name']}/{j['dtype']}"] = {
                            **pool(r["per_seq"]), **own, "load_seconds": r["load_seconds"],
                            "score_seconds": r["score_seconds"]}
                save()
    if "transformers" in a.engines:
        for name, (d, key) in models.items():
            enc = seqs if key is None else [key.encode_ids(s) for s in seqs]
            for dt in a.dtypes:
                k = f"transformers/{name}/{dt}"
                if k in report["results"]:
                    continue
                t0 = time.monotonic()
                per = transformers_scores(d, dt, enc, reply_starts, None if key is None else key.permutation,
                                          work / "ref")
                report["results"][k] = {**pool(per), "score_seconds": round(time.monotonic() - t0, 1)}
                print(k, json.dumps(report["results"][k]), flush=True)
                save()
    if a.diagnose:
        # the first seed's models only: which weights' rounding (activations kept in float32) costs what
        for name in ["plain"] + [f"{label}-s{a.seeds[0]}" for label in variants]:
            d, key = models[name]
            enc = seqs if key is None else [key.encode_ids(s) for s in seqs]
            for group in WEIGHT_GROUPS:
                k = f"weights-only/{name}/{a.diagnose}/{group}"
                if k in report["results"]:
                    continue
                t0 = time.monotonic()
                per = transformers_scores(d, a.diagnose, enc, reply_starts,
                                          None if key is None else key.permutation, work / "ref", group)
                report["results"][k] = {**pool(per), "score_seconds": round(time.monotonic() - t0, 1)}
                print(k, json.dumps(report["results"][k]), flush=True)
                save()
    save()
    for k, v in report["results"].items():
        print(f"{k:36s} top1 {v['top1']:.4f}  kl {v['kl']:.5f}  reply top1 {v['reply_top1']:.4f}  "
              f"reply kl {v['reply_kl']:.5f}  greedy {v['greedy_agree_mean']:5.1f} ({v['greedy_identical']})"
              + (f"  | vs own f32: top1 {v['self_top1']:.4f} kl {v['self_kl']:.5f}" if "self_kl" in v else ""))


if __name__ == "__main__":
    main()
