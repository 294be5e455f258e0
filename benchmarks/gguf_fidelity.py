"""Fidelity of the exported GGUF on llama.cpp (SmolLM2-135M-Instruct, exact preset), per tensor type.

For each type the obfuscated GGUF runs on llama.cpp (llama-cpp-python, f32 KV cache, 2 threads) and is compared,
after mapping its logits back through the key, with two plaintext baselines on the same engine: the f32
plaintext (the very weights the obfuscation started from, exported by the same exporter) and the shipped Q4_1
GGUF. Reported: max |delta logit| over all prompt positions, top-1 agreement, greedy continuations (24 tokens
or EOS) that are identical, file size and export time.
Results: benchmarks/results/gguf_fidelity.json
Usage: python benchmarks/gguf_fidelity.py [--types f32 f16 q8_0] [--prompts 4] [--seed 2026]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--greedy-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_fidelity.json"))
    a = ap.parse_args()

    import llama_cpp

    import aloepri
    from aloepri.runtime.fidelity import builtin_prompt_ids
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.runtime.inference import load_tokenizer
    from aloepri.models import smollm2_gguf

    def llama(path):
        return llama_cpp.Llama(str(path), n_threads=2, n_ctx=512, logits_all=True, type_k=0, type_v=0, verbose=False)

    def logits(m, ids):
        m.reset()
        m.eval(ids)
        return np.array(m.scores[: len(ids)], dtype=np.float64)

    def greedy(m, ids):
        out = []
        for t in m.generate(ids, top_k=1, temp=0.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(m._model.vocab, t) or len(out) >= a.greedy_tokens:
                return out
            out.append(t)

    smol = smollm2_gguf()
    work = Path(tempfile.mkdtemp(prefix="aloepri-gguf-fid-"))
    aloepri.obfuscate(smol, work / "out", work / "key.json", aloepri.resolve_params("exact"), seed=a.seed,
                      allow_weak_seed=True, progress=False)
    key = aloepri.load_key(work / "key.json")
    tok = load_tokenizer(key, smol)
    prompts = builtin_prompt_ids(tok, key.vocab_size, a.prompts)
    plain_f32 = export_gguf(plaintext_reference_dir(smol, work / "plain"), work / "plain.gguf", "f32").outfile
    baselines = {}
    for name, path in (("plain_f32", plain_f32), ("plain_q4_1", smol)):
        m = llama(path)
        baselines[name] = [(logits(m, p), greedy(m, p)) for p in prompts]
        del m
    rows = []
    for qt in a.types:
        res = export_gguf(work / "out", work / f"obf-{qt}.gguf", qt)
        m = llama(res.outfile)
        obf = []
        for p in prompts:
            lg = logits(m, key.encode_ids(p))[:, key.permutation]  # back to plaintext vocabulary order
            obf.append((lg, key.decode_ids(greedy(m, key.encode_ids(p)))))
        del m
        row = {"type": qt, "file_mib": round(res.outfile.stat().st_size / 2**20, 1), "export_seconds": round(res.seconds, 2)}
        for name, base in baselines.items():
            row[name] = {
                "max_abs_dlogit": round(max(float(np.abs(o[0] - b[0]).max()) for o, b in zip(obf, base)), 4),
                "top1_agreement": round(float(np.mean([(o[0].argmax(-1) == b[0].argmax(-1)).mean() for o, b in zip(obf, base)])), 4),
                "greedy_identical": f"{sum(o[1] == b[1] for o, b in zip(obf, base))}/{len(prompts)}",
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
        res.outfile.unlink()
    q41_vs_f32 = {
        "top1_agreement": round(float(np.mean([(x[0].argmax(-1) == y[0].argmax(-1)).mean()
                                               for x, y in zip(baselines["plain_q4_1"], baselines["plain_f32"])])), 4),
        "greedy_identical": f"{sum(x[1] == y[1] for x, y in zip(baselines['plain_q4_1'], baselines['plain_f32']))}/{len(prompts)}",
    }
    report = {"model": smol.name, "preset": "exact", "seed": a.seed, "prompts": len(prompts),
              "greedy_tokens": a.greedy_tokens, "engine": f"llama-cpp-python {llama_cpp.__version__}, f32 KV, 2 threads",
              "machine": platform.machine(), "plain_q4_1_vs_plain_f32": q41_vs_f32, "types": rows,
              "date": time.strftime("%Y-%m-%d")}
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(q41_vs_f32))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
