"""Child of the ``command_times`` experiment: one ``aloepri`` command run in this process, with the time spent
loading models and tokenizers counted apart from the rest (the command's compute), and the peak RSS.

    python -m benchmarks.lib.command_child OUT.json -- verify smollm2 DIR --key KEY ...

OUT.json: {"argv", "exit_code", "seconds", "cpu_seconds", "load_seconds", "loads": [[what, seconds], ...],
"peak_rss_mib"}. ``cpu_seconds`` (user + system, this process and its threads) is what a one-thread command would
take on an idle core, where the wall time on a shared machine is not. A load nested in another (a tokenizer loaded
by a model loader) counts once, in the outer one.
"""
from __future__ import annotations

import functools
import json
import resource
import sys
import time

from .proc_status import status_kib


def main() -> int:
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    import aloepri.runtime.inference as inference
    import aloepri.runtime.tokenizer as tokenizer

    loads: list[list] = []
    depth = [0]

    def timed(fn, what: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    loads.append([what, round(time.perf_counter() - t, 2)])
        return wrapper

    # the commands import these names at call time from their modules, so patching the modules reaches them all
    inference.load_plain_model = timed(inference.load_plain_model, "plaintext model")
    inference.load_obfuscated_model = timed(inference.load_obfuscated_model, "obfuscated model")
    inference.load_tokenizer = timed(inference.load_tokenizer, "tokenizer")
    tokenizer.load_hf_tokenizer = timed(tokenizer.load_hf_tokenizer, "tokenizer")
    # the audit and the attacks restart the kernel's peak-RSS count before each step (to report each step's own);
    # the whole command's peak is the highest of those counts, read before each restart and at the end
    import aloepri.attacks.base as attacks_base

    peak_kib = [0]
    restart = attacks_base.reset_peak_rss

    def reset_peak_rss() -> None:
        peak_kib[0] = max(peak_kib[0], status_kib())
        restart()

    attacks_base.reset_peak_rss = reset_peak_rss
    from aloepri.cli import main as aloepri_main

    t, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    code = aloepri_main(argv)
    seconds = time.perf_counter() - t
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = end.ru_utime + end.ru_stime - cpu.ru_utime - cpu.ru_stime
    with open(out, "w") as f:
        json.dump({"argv": argv, "exit_code": code, "seconds": round(seconds, 1),
                   "cpu_seconds": round(cpu_seconds, 1), "load_seconds": round(sum(s for _, s in loads), 1), "loads": loads,
                   "peak_rss_mib": round(max(peak_kib[0], status_kib()) / 1024)}, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
