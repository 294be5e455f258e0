"""The child process of the experiment obfuscation_perf: obfuscates one model with its phases timed and float64/float32
matmul roofline probes between blocks, and prints one JSON line. A fresh process, so its peak RSS (VmHWM) is the
obfuscation's own.

    python -m benchmarks.lib.perf_child MODEL_OR_PATH WORKDIR PRESET THREADS PROBE_EVERY [PROBE_SIZE]

It calls the real ``aloepri.obfuscate`` and observes it through the pipeline's public seam: ``obfuscate`` asks
``pipeline.obfuscated_tensors(plan)`` for the output tensors, and the child hands it a thin wrapper around that
generator. The wrapper times every step of the generator (and of the vocabulary matrices' row-block streams), runs
the roofline probes between blocks, and gives the generator the plan's source and secrets behind timing stand-ins,
so reading/dequantizing and key drawing are split out of the products. Phases (exclusive wall time of the main
thread; work on the pipeline's worker threads -- shard writer, hash, noise drawn ahead -- overlaps them):

- ``plan``: opening and parsing the source, validating it, drawing the global secrets (key base, permutation,
  kappa, the outlier scan), everything before the first output tensor is asked for;
- ``read_dequantize`` / ``key_generation``: calls of the source's / the secrets' methods made by the generator;
- ``vocab_products_noise`` / ``layer_products``: the rest of the generator's time (products, noise, norm fusing,
  conversion to the output dtype), by the block the tensor belongs to;
- ``write``: the consumer's time between two tensors (the shard writer's ``add``, handing blocks to the hash);
- ``finish``: after the last tensor (last shard, waiting for the hash, config, tokenizer, key).

The pipeline's own per-block wall time (``ObfuscationResult.block_seconds``) is reported too, less the probes that
ran inside each block.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .proc_status import status_kib


class PhaseClock:
    """Exclusive wall time per phase on the main thread: time goes to the innermost phase entered. Calls from other
    threads overlap the main thread's work, so they are summed apart (``background``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.background: dict[str, float] = {}
        self.current: str | None = None
        self.since = time.perf_counter()

    def switch(self, phase: str | None) -> str | None:
        now = time.perf_counter()
        if self.current is not None:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.since
        previous, self.current, self.since = self.current, phase, now
        return previous

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            t = time.perf_counter()
            try:
                yield
            finally:
                self.background[phase] = self.background.get(phase, 0.0) + time.perf_counter() - t
            return
        previous = self.switch(phase)
        try:
            yield
        finally:
            self.switch(previous)

    def step(self, iterator: Iterator, phase: str) -> tuple[Any, float]:
        """The iterator's next item (None when exhausted) and the exclusive time it took, charged to ``phase``."""
        before = self.seconds.get(phase, 0.0)
        with self.during(phase):
            item = next(iterator, None)
        return item, self.seconds.get(phase, 0.0) - before

    def move(self, seconds: float, source: str, target: str) -> None:
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds


class Timed:
    """Stands in for an object whose method calls are timed as one phase; other attributes pass through."""

    def __init__(self, wrapped: Any, phase: str, clock: PhaseClock) -> None:
        object.__setattr__(self, "_wrapped", wrapped)
        object.__setattr__(self, "_phase", phase)
        object.__setattr__(self, "_clock", clock)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._wrapped, name)
        if not callable(value):
            return value
        clock, phase = self._clock, self._phase

        def timed(*args, **kwargs):
            with clock.during(phase):
                return value(*args, **kwargs)
        return timed

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)


class Roofline:
    """A float64 (and a float32) N x N matmul in this process, with its thread count: GFLOP/s of each probe."""

    def __init__(self, n: int) -> None:
        import torch

        self.n = n
        self.a, self.b = torch.randn(n, n, dtype=torch.float64), torch.randn(n, n, dtype=torch.float64)
        self.c = torch.empty(n, n, dtype=torch.float64)
        self.a32, self.b32, self.c32 = self.a.float(), self.b.float(), self.c.float()
        torch.matmul(self.a, self.b, out=self.c)  # warm-up
        self.float64: list[float] = []
        self.float32: list[float] = []  # before and after only: the products of noisy presets run in float32
        self.seconds = 0.0  # the float64 probes' wall time, taken out of the obfuscation's
        # and their CPU time (this process's, so it includes what the pipeline's worker threads did meanwhile),
        # taken out of its CPU time: on a loaded machine a probe gets less than its threads x its wall time
        self.cpu_seconds = 0.0

    def probe(self) -> float:
        import torch

        cpu, t = _cpu_seconds(), time.perf_counter()
        torch.matmul(self.a, self.b, out=self.c)
        dt = time.perf_counter() - t
        self.float64.append(2.0 * self.n**3 / dt / 1e9)
        self.seconds += dt
        self.cpu_seconds += _cpu_seconds() - cpu
        return dt

    def probe32(self) -> None:
        import torch

        torch.matmul(self.a32, self.b32, out=self.c32)
        t = time.perf_counter()
        torch.matmul(self.a32, self.b32, out=self.c32)
        self.float32.append(2.0 * self.n**3 / (time.perf_counter() - t) / 1e9)


def instrumented(generate: Callable, clock: PhaseClock, roofline: Roofline, probe_every: int,
                 seen: dict[str, Any]) -> Callable:
    """A drop-in for ``pipeline.obfuscated_tensors`` that times ``generate``'s steps and probes between blocks."""
    from aloepri.obfuscation.blocks import StreamedTensor

    def tensors(plan) -> Iterator:
        clock.switch("write")  # from here the consumer's time is writing, except the generator's steps below
        seen.update(compute_dtype=str(plan.compute_dtype), output_dtype=str(plan.out_dtype),
                    probe_seconds_by_block={})
        names = plan.spec.hf_names

        def block_of(name: str) -> str:  # the pipeline's labels in ObfuscationResult.block_seconds
            layer = names.layer_of(name)
            return f"layer {layer}" if layer is not None else "embedding" if name == names.of("embed") else "head"

        def kind_of(block: str) -> str:
            return "layer_products" if block.startswith("layer ") else "vocab_products_noise"

        def probe(block: str) -> None:
            with clock.during("probe"):
                seconds = roofline.probe()
            by_block = seen["probe_seconds_by_block"]
            by_block[block] = by_block.get(block, 0.0) + seconds

        def rows(stream: Iterator, kind: str) -> Iterator:
            stream = iter(stream)
            while True:
                block, seconds = clock.step(stream, "products")
                clock.move(seconds, "products", kind)
                if block is None:
                    return
                yield block

        def stream() -> Iterator:
            real = plan.source, plan.secrets
            plan.source = Timed(real[0], "read_dequantize", clock)
            plan.secrets = Timed(real[1], "key_generation", clock)
            try:
                items, previous, kind = generate(plan), None, "vocab_products_noise"
                with clock.during("probe"):  # before the embedding; charged below to the first block
                    first_probe = roofline.probe()
                while True:
                    item, seconds = clock.step(items, "products")
                    if item is None:
                        clock.move(seconds, "products", kind)
                        return
                    name = item.name if isinstance(item, StreamedTensor) else item[0]
                    block = block_of(name)
                    kind = kind_of(block)
                    clock.move(seconds, "products", kind)
                    if previous is None:
                        seen["probe_seconds_by_block"][block] = first_probe
                    elif block != previous:
                        layer = names.layer_of(name)
                        if layer is None or (probe_every and layer % probe_every == probe_every - 1):
                            probe(block)  # before the head, and every probe_every-th decoder layer
                    previous = block
                    if isinstance(item, StreamedTensor):
                        item = dataclasses.replace(item, blocks=rows(item.blocks, kind))
                    yield item
            finally:
                plan.source, plan.secrets = real
                clock.switch("finish")
                seen["generator_ran"] = True

        return stream()

    return tensors


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    import torch

    import aloepri.obfuscation.pipeline as pipeline
    from aloepri import obfuscate, resolve_params
    from aloepri.models import BUNDLED_MODELS, resolve_model

    model, work, preset, threads, probe_every = argv[0], Path(argv[1]), argv[2], int(argv[3]), int(argv[4])
    probe_size = int(argv[5]) if len(argv) > 5 else 2048
    torch.set_num_threads(threads)
    src = resolve_model(model) if model in BUNDLED_MODELS else Path(model)
    params = resolve_params(preset)

    roofline, clock, seen = Roofline(probe_size), PhaseClock(), {}
    pipeline.obfuscated_tensors = instrumented(pipeline.obfuscated_tensors, clock, roofline, probe_every, seen)
    for _ in range(2):
        roofline.probe()
        roofline.probe32()
    roofline.seconds = roofline.cpu_seconds = 0.0
    rss_before = status_kib("VmHWM")
    load_before = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    clock.switch("plan")
    res = obfuscate(src, work / "m", work / "k.json", params, seed=1, allow_weak_seed=True, overwrite=True,
                    progress=False)
    clock.switch(None)
    wall = time.perf_counter() - t - roofline.seconds
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if not seen.get("generator_ran"):
        raise RuntimeError("obfuscate() no longer takes its tensors from pipeline.obfuscated_tensors: the perf child "
                           "measured nothing; update benchmarks/lib/perf_child.py to the pipeline's seam")
    cpu = {"user_seconds": cpu1.ru_utime - cpu0.ru_utime, "sys_seconds": cpu1.ru_stime - cpu0.ru_stime,
           "minor_faults": cpu1.ru_minflt - cpu0.ru_minflt, "probe_wall_seconds": roofline.seconds,
           "probe_cpu_seconds": roofline.cpu_seconds}
    for _ in range(2):
        roofline.probe()
        roofline.probe32()
    phase = {k: v for k, v in clock.seconds.items() if k not in ("probe", "products")}
    phase["other"] = wall - sum(phase.values())  # only the timer's own overhead: every step has a phase
    probed = seen["probe_seconds_by_block"]
    block_seconds = {k: v - probed.get(k, 0.0) for k, v in (res.block_seconds or {}).items()}
    print(json.dumps({"src": src.name, "src_bytes": src.stat().st_size if src.is_file() else
                      sum(p.stat().st_size for p in src.iterdir() if p.is_file()),
                      "wall_seconds": wall, "flops": res.flops,
                      "output_bytes": res.bytes_written, "hidden_size": res.hidden_size, "h": res.h,
                      "rss_before_kib": rss_before, "peak_rss_kib": status_kib("VmHWM"), "phase_seconds": phase,
                      "background_seconds": clock.background, "block_seconds": block_seconds, "cpu": cpu,
                      "roofline_probe_gflops": roofline.float64, "float32_probe_gflops": roofline.float32,
                      "probe_size": probe_size, "product_dtype": seen["compute_dtype"],
                      "output_dtype": seen["output_dtype"], "loadavg_1min": [load_before, os.getloadavg()[0]],
                      "torch_threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
