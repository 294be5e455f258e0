"""Obfuscate once in this fresh process and print one JSON line: time, output size, peak RSS (VmHWM) and the RSS
after imports, so a parent measures the obfuscation's own memory.

    python -m benchmarks.lib.obfuscate_child SRC WORKDIR PRESET THREADS
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .proc_status import status_kib


def vm_hwm_mib() -> float:
    return status_kib("VmHWM") / 1024


def main(argv: list[str]) -> int:
    src, work, preset, threads = argv
    import torch

    import aloepri

    torch.set_num_threads(int(threads))
    before = vm_hwm_mib()
    r = aloepri.obfuscate(src, Path(work) / "m", Path(work) / "k.json", aloepri.resolve_params(preset), seed=1,
                          allow_weak_seed=True, progress=False)
    print(json.dumps({"seconds": r.seconds, "output_mib": r.bytes_written / 2**20, "peak_rss_mib": vm_hwm_mib(),
                      "imports_rss_mib": before}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
