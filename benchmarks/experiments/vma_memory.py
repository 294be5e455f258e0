"""VMA's memory and time at 8B width: `aloepri attack vma --budget ci` on a Llama-3.1-8B-config checkpoint (random
weights, aloepri.testing.synthetic) obfuscated with the lossless setting (`exact`, h = 0, 4 outlier dimensions),
the command in a fresh child (its wall and CPU seconds, every thread, and peak RSS, VmHWM).

VMA streams the tensors it uses from the two checkpoints (the embedding, the head and the final norm, and the
feed-forward weights of the layers its budget picks, one layer at a time): its memory follows the vocabulary and
the width, not the depth. At ``ci`` it reads the first and the last layer, so a 1-layer checkpoint at the full
vocabulary holds what the 32-layer model's VMA holds (its 3 weight combinations of layer 0; the 32-layer model
adds the same 3 for layer 31, one layer at a time: the same peak, about twice the time).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore


@dataclass(frozen=True)
class Settings:
    synthetic: str = "llama-3.1-8b"  # aloepri.testing.synthetic family
    synthetic_layers: int = 1
    synthetic_vocab: int = 0  # 0: the published vocabulary (128,256)
    seed: int = 2026  # the obfuscation seed (benchmarks.lib.targets caches the output)
    budget: str = "ci"
    threads: int = 2


def run(s: Settings, store: ResultStore) -> None:
    if store.has("vma"):
        return
    import aloepri

    from ..lib.targets import obfuscated
    from .audit_smollm2 import _run_child, synthetic_source

    src = synthetic_source(s)
    t = obfuscated(src, aloepri.resolve_params("exact", h=0, outlier_dims=4), s.seed)
    with tempfile.TemporaryDirectory(prefix="vma-memory-") as work:
        w = Path(work)
        argv = ["attack", "vma", "--plain", str(src), "--obfuscated", str(t.model_dir), "--key", str(t.key_path),
                "--budget", s.budget, "--threads", str(s.threads), "--engine", "torch", "--report-dir",
                str(w / "report"), "--quiet"]
        process = _run_child(argv, w / "child.json", "attack vma", echo=True)
        report = json.loads((w / "report" / "attack_report.json").read_text())
    (res,) = report["results"]
    if res["metrics"].get("error"):
        raise RuntimeError(f"vma failed: {res['metrics']['error']}")
    cfg = json.loads((src / "config.json").read_text())
    store.put("vma", {**process, "ttrsr": res["ttrsr"], "vocab_recovery_sampled": res["metrics"]["vocab_recovery_sampled"],
                      "sources": res["budget"]["sources"], "attack_peak_rss_gib": res["budget"]["peak_rss_gib"],
                      "attack_seconds": round(res["seconds"], 1), "vocab_size": cfg["vocab_size"],
                      "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
                      "layers": cfg["num_hidden_layers"],
                      # the attack records how it held the obfuscated model's weights only when it loaded the model
                      "obfuscated_model_loaded": "obfuscated_weights" in res["budget"]})
    print(f"vma: {100 * res['ttrsr']:.1f}% of prompt tokens, {process['wall_seconds']} s, "
          f"{process['peak_rss_gib']} GiB peak RSS")


def report(store: ResultStore) -> str:
    e = store.get("vma")
    if e is None:
        return "(not run)"
    return "\n".join([
        "| checkpoint | vocabulary | width / ffn | layers | weight combinations | TTRSR (%) | wall (min) | CPU (min) | "
        "peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|---|",
        f"| synthetic Llama-3.1-8B config, `exact` | {e['vocab_size']:,} | {e['hidden_size']} / {e['intermediate_size']} "
        f"| {e['layers']} | {len(e['sources'])} | {100 * e['ttrsr']:.1f} | {e['wall_seconds'] / 60:.1f} | "
        f"{e['cpu_seconds'] / 60:.1f} | {e['peak_rss_gib']:.2f} |",
        "", f"command: `{e['command']}`" + ("" if "obfuscated_model_loaded" not in e else
                                            "; obfuscated model " + ("loaded" if e["obfuscated_model_loaded"] else
                                                                     "not loaded (streamed)"))])


SUMMARY = "VMA streamed from the checkpoints at 8B width and full vocabulary: its peak RSS and time (~20 min)"
CONFIGS = {"synthetic-8b-1layer": Settings(),
           # the audit's 2-layer, 16k-vocabulary shape (synthetic-8b-2layers-llamacpp), VMA alone
           "synthetic-8b-2layers-16k": Settings(synthetic_layers=2, synthetic_vocab=16384)}
NOTES = "CPU; writes and obfuscates the synthetic checkpoint once (benchmarks cache), a few minutes"
DOCS = ("docs/performance.md",)
