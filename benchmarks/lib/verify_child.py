"""Compare an obfuscated model with its source once in this fresh process and print one JSON line: the numbers,
the time and the peak RSS (VmHWM), so that a parent measures one comparison's own memory.

    python -m benchmarks.lib.verify_child MODE SRC SERVER KEY PROMPTS GREEDY_TOKENS THREADS

MODE: ``verify`` runs `aloepri verify` (one model in memory at a time); ``both`` loads the two models side by
side and compares them, as verify did before; ``eval-fidelity`` and ``eval-fidelity-both`` do the same for
`aloepri eval fidelity` (prompts and a corpus of PROMPTS texts of 64 tokens).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from .proc_status import status_kib

CORPUS = {"corpus_texts_n": None, "max_tokens": 64}  # corpus_texts_n: PROMPTS


def compare_once(mode: str, src: str, server: str, key_path: str, prompts: int, greedy_tokens: int) -> dict:
    import torch

    from aloepri import load_key
    from aloepri.eval.fidelity import builtin_prompt_ids, compare, fidelity_report, load_and_report
    from aloepri.models import resolve_model
    from aloepri.runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer

    src = str(resolve_model(src))  # a bundled model's name, as the CLI takes it
    key = load_key(key_path)
    tokenizer_src = src if Path(src).is_file() else None  # as verify chooses (a directory's key records its own)
    corpus = {**CORPUS, "corpus_texts_n": prompts}
    if mode == "verify":
        from aloepri.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["verify", src, server, "--key", key_path, "--prompts", str(prompts),
                       "--greedy-tokens", str(greedy_tokens)])
        if rc:
            raise RuntimeError(f"aloepri verify exited {rc}")
        return json.loads(out.getvalue())
    if mode == "both":
        torch.manual_seed(0)
        tok = load_tokenizer(key, tokenizer_src)
        plain, obf = load_plain_model(src), load_obfuscated_model(server)
        return compare(plain, obf, key, builtin_prompt_ids(tok, key.vocab_size, prompts),
                       greedy_tokens=greedy_tokens).to_dict()
    if mode == "eval-fidelity":
        return load_and_report(src, server, key_path, prompts=prompts, greedy_tokens=greedy_tokens, **corpus)
    if mode == "eval-fidelity-both":
        return fidelity_report(load_plain_model(src), load_obfuscated_model(server), key,
                               load_tokenizer(key, tokenizer_src),
                               prompts=prompts, greedy_tokens=greedy_tokens, **corpus)
    raise ValueError(f"unknown mode {mode!r}")


def main(argv: list[str]) -> int:
    mode, src, server, key_path, prompts, greedy_tokens, threads = argv
    import torch

    import aloepri.cli  # noqa: F401  (the imports' memory is counted before the comparison)

    torch.set_num_threads(int(threads))
    before = status_kib("VmHWM") / 1024
    t = time.perf_counter()
    result = compare_once(mode, src, server, key_path, int(prompts), int(greedy_tokens))
    print(json.dumps({"mode": mode, "seconds": time.perf_counter() - t, "peak_rss_mib": status_kib("VmHWM") / 1024,
                      "imports_rss_mib": before, "result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
