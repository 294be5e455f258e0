"""Attack framework: what the attacker holds, what the victim sends, what an attack returns, and scoring.

Threat model (docs/threat-model.md): an honest-but-curious server knows the method and the public plaintext
model, holds the obfuscated weights, sees every obfuscated id, hidden state and attention score, and does not
hold the key. ``AttackTarget.key`` is the ground truth: attacks use it only to *score* (and the oracle variants,
which say so in ``AttackResult.uses``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..keyfile import KeyFile, load_key
from ..storage.devices import resolve_device


@dataclass
class Budget:
    """How much an attack may spend. ``scale`` multiplies training steps / data sizes of the heavy attacks:
    'ci' runs a small version, 'full' the reported one. Every result records the budget actually used."""

    name: str = "full"
    scale: float = 1.0
    max_tokens_scored: int | None = None  # cap on observed prompt tokens scored (None = all)
    threads: int = 1
    # probe sequences per forward pass for the attacks that run the models on many inputs (behavioural); None =
    # each stage's own default. It changes the speed and memory; the result only through float32 rounding
    batch: int | None = None

    @classmethod
    def named(cls, name: str) -> "Budget":
        return {"ci": cls("ci", 0.05), "small": cls("small", 0.25), "full": cls("full", 1.0)}[name]


class AttackTarget:
    """An obfuscated deployment under attack: public plaintext model, server artifact, and the key (scoring only).

    ``device`` ('cpu', 'cuda', 'cuda:1', ...; checked here, once): where both models are loaded and the attacks
    that support it compute (``register(..., on_device=True)``); the others run on a CPU copy (``on("cpu")``).

    The obfuscated model computes in ``dtype``; a checkpoint stored in a narrower float (bfloat16, what
    ``aloepri obfuscate`` writes from a quantized source) can keep its weights as stored (``runtime.precision``:
    the same logits, half the memory of a float32 copy, but each weight is converted when its layer runs: 1.8x the
    time of a batched forward pass on 2 cores, 3.8x a one-token step). ``hold_stored`` None (default) holds it as
    stored only when two float32 models would crowd the memory (``float32_copy_crowds``); True / False force it.

    ``engine`` (aloepri.attacks.engines.ENGINES; ``engine_why``: how it was chosen, in words): how the attacks that
    run the models run them (``engines()``); the attacks that read hidden states use the torch models
    (``plain_model``, ``obf_model``) whatever the engine, and those that read only weights (VMA, Gate-IA, Attn-IA,
    NN, the ridge rows) stream the tensors they use from the checkpoints unless a model is loaded
    (``vma.target_weights``)."""

    def __init__(self, plain_src: str | Path, obfuscated_dir: str | Path, key: KeyFile | str | Path | None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                 hold_stored: bool | None = None, engine: str = "torch", engine_why: str = "the default (torch)",
                 threads: int | None = None):
        self.plain_src = Path(plain_src)
        self.obfuscated_dir = Path(obfuscated_dir)
        self.key = key if (key is None or isinstance(key, KeyFile)) else load_key(key)
        self.dtype = dtype
        self.device = resolve_device(device)
        self.hold_stored = hold_stored
        self.engine, self.engine_why = engine, engine_why
        self.threads = threads
        self._engines: tuple | None = None
        self._elsewhere: dict[str, AttackTarget] = {}
        self._memo: dict[tuple, Any] = {}

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` while the models are held: what several attacks of one run derive from
        the same weights or forward passes (Attn-IA's leverages, VMA's plaintext signatures, ISA's state
        codebook). ``key`` names the quantity and every setting it depends on; ``release(models=True)`` drops
        them with the models."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def on(self, device: str | torch.device) -> "AttackTarget":
        """The same deployment with its models on ``device`` (this target itself when it is already there; the
        copy is made once and kept)."""
        dev = resolve_device(device)
        if dev == self.device:
            return self
        if str(dev) not in self._elsewhere:
            self._elsewhere[str(dev)] = AttackTarget(self.plain_src, self.obfuscated_dir, self.key, self.dtype, dev,
                                                     self.hold_stored, self.engine, self.engine_why, self.threads)
        return self._elsewhere[str(dev)]

    def engines(self):
        """(plaintext engine, obfuscated engine) of ``engine``, each opened once (aloepri.attacks.engines)."""
        return self.engine_of("plain"), self.engine_of("obf")

    def engine_of(self, side: str):
        """The engine of one side ('plain' or 'obf'), opened on first use."""
        from .engines import TORCH, EngineError, open_engine

        held = dict(self._engines or ())
        if side not in held:
            model = (self.plain_model if side == "plain" else self.obf_model) if self.engine == TORCH else None
            held[side] = open_engine(self.engine, side, self.plain_src, self.obfuscated_dir, model,
                                     threads=self.threads or torch.get_num_threads())
            self._engines = tuple(held.items())
            if "plain" in held and "obf" in held and held["plain"].vocab_size != held["obf"].vocab_size:
                raise EngineError(f"the plaintext model gives {held['plain'].vocab_size} logits per row on "
                                  f"{self.engine} and the obfuscated {held['obf'].vocab_size}")
        return held[side]

    def public_lm(self):
        """The public model as a language model (called with input_ids and attention_mask, returning ``.logits``),
        for the attacks that only score text with it (the observer of the logs): the torch model, or the plaintext
        model on the target's engine."""
        from .engines import TORCH, EngineAsModel

        return self.plain_model if self.engine == TORCH else EngineAsModel(self.engines()[0])

    def engine_record(self) -> dict[str, Any]:
        """The engine as an attack's result records it (from the engines opened so far)."""
        from .engines import describe_engines

        return {**describe_engines(self.engine, dict(self._engines or ())), "engine_choice": self.engine,
                "engine_why": self.engine_why}

    def release(self, models: bool = True, engines: bool = True) -> None:
        """Free the torch models and/or the engines held (the next use loads them again), so that one step's
        memory is not the next's."""
        if engines and self._engines is not None:
            for _, e in self._engines:
                e.close()
            self._engines = None
        if models:
            if self.engine == "torch":
                self._engines = None  # they wrap the models
            for name in ("plain_model", "obf_model"):
                self.__dict__.pop(name, None)
            self._memo.clear()
        for other in self._elsewhere.values():
            other.release(models, engines)
        import gc

        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    @cached_property
    def plain_config(self):
        """The public model's config (read without loading the model, unless it is loaded already)."""
        if "plain_model" in self.__dict__:
            return self.plain_model.config
        from ..obfuscation.plain_model import source_config

        return source_config(self.plain_src)

    @cached_property
    def plain_model(self):
        from ..runtime.inference import load_plain_model

        return load_plain_model(self.plain_src, dtype=self.dtype, device=self.device)

    @cached_property
    def obf_model(self):
        from ..runtime.inference import load_obfuscated_model

        hold = self.hold_stored
        if hold is None:  # a plaintext model already loaded is already out of the available memory
            hold = float32_copy_crowds(self.obfuscated_dir, self.device, models=1 if "plain_model" in self.__dict__
                                       else 2)
        return load_obfuscated_model(self.obfuscated_dir, dtype=self.dtype, device=self.device, hold_stored=hold)

    def obfuscated_weights(self) -> str | None:
        """How the obfuscated model holds its weights, in words (None until it is loaded)."""
        if "obf_model" not in self.__dict__:
            return None
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in self.obf_model.parameters()})
        return ("as stored (" + ", ".join(dtypes) + "), computed in " + str(self.dtype).replace("torch.", "")
                if len(dtypes) > 1 else dtypes[0])

    @cached_property
    def tokenizer(self):
        """The public plaintext tokenizer (the attacker has it: the plaintext model is public).
        ``NoTokenizerError`` when the plaintext checkpoint ships none (test and synthetic checkpoints)."""
        from ..runtime.tokenizer import load_hf_tokenizer

        try:
            return load_hf_tokenizer(self.plain_src)
        except Exception:
            if ships_no_tokenizer(self.plain_src):
                raise NoTokenizerError(f"the plaintext model {self.plain_src} ships no tokenizer") from None
            raise

    @property
    def vocab_size(self) -> int:
        return int(self.plain_config.vocab_size)

    def true_permutation(self) -> np.ndarray:
        """perm[plain id] = obfuscated id. Ground truth for scoring; an attack must not read it."""
        if self.key is None:
            raise ValueError("scoring needs the key (ground truth); pass --key")
        return self.key.permutation

    def obfuscate_ids(self, plain_ids: Sequence[int]) -> list[int]:
        """What the server observes for a plaintext prompt (the victim's side, not the attacker's)."""
        if self.key is None:
            raise ValueError("simulating the victim's traffic needs the key (ground truth); pass --key")
        return self.key.encode_ids(list(plain_ids))


class NoTokenizerError(ValueError):
    """The plaintext model ships no tokenizer, and something asked for it (an attack that tokenizes text)."""


def ships_no_tokenizer(plain_src: str | Path) -> bool:
    """Whether a plaintext checkpoint directory carries no tokenizer (``SourceCheckpoint.tokenizer_kwargs``; a .gguf
    file always carries one)."""
    p = Path(plain_src)
    if not (p / "config.json").is_file():
        return False
    from ..obfuscation.checkpoint import CheckpointError, open_checkpoint

    try:
        ck = open_checkpoint(p)
    except CheckpointError:
        return False
    try:
        return ck.tokenizer_kwargs() is None
    finally:
        ck.close()


def float32_copy_crowds(obfuscated_dir: str | Path, device: torch.device, share: float = 0.7, models: int = 2
                        ) -> bool:
    """Whether ``models`` float32 models of the checkpoint's shapes (each about twice a bfloat16 checkpoint's files)
    would take more than ``share`` of the memory available now on ``device`` (unknown: True, the bounded choice)."""
    from ..obfuscation.pipeline import _available_memory

    stored = sum(f.stat().st_size for f in Path(obfuscated_dir).glob("*.safetensors"))
    need = 2 * models * stored
    try:
        available = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_memory()
    except RuntimeError:
        available = None
    return available is None or need > share * available


@dataclass
class PrivateData:
    """The victim's private prompts: plaintext ids (ground truth) and a mask of the PII tokens in them."""

    texts: list[str]
    plain_ids: list[list[int]]
    pii_mask: list[list[bool]]

    def observed(self, target: AttackTarget) -> list[list[int]]:
        return [target.obfuscate_ids(ids) for ids in self.plain_ids]


@dataclass
class AttackResult:
    attack: str
    ttrsr: float | None  # token recovery success rate over the private prompt tokens
    piirsr: float | None  # the same over PII tokens only
    metrics: dict[str, Any] = field(default_factory=dict)  # bleu4, cossim, top-k, vocab-level recovery, ...
    budget: dict[str, Any] = field(default_factory=dict)  # candidate pool, steps, data sizes, ... (always reported)
    uses: str = ""  # what the attacker used, in words
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reset_peak_rss() -> None:
    """Start this process's peak-RSS count afresh (Linux: /proc/self/clear_refs; elsewhere nothing), so that the
    peak read after an attack is that attack's, the models it holds included."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gib() -> float | None:
    """This process's peak RSS since the last ``reset_peak_rss`` (None where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


AttackFn = Callable[[AttackTarget, PrivateData, Budget, int], AttackResult]
REGISTRY: dict[str, AttackFn] = {}


NO_ENGINE = "torch: it reads weights or hidden states, which no serving engine exposes"


def register(name: str, on_device: bool = False, uses_engine: bool = False) -> Callable[[AttackFn], AttackFn]:
    """Register ``fn(target, data, budget, seed) -> AttackResult`` under ``name`` (wall time is filled in).
    ``on_device``: the attack computes on ``target.device``; otherwise it is handed the CPU copy of a target on
    another device. The device it ran on is recorded in ``AttackResult.budget['device']``. ``uses_engine``: the
    attack runs the models through ``target.engines()`` (recorded in ``budget['engine']``); any other attack
    reads the torch models, and says so when the target's engine is another."""

    def deco(fn: AttackFn) -> AttackFn:
        def timed(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
            t0, c0 = time.perf_counter(), time.process_time()
            reset_peak_rss()
            torch.set_num_threads(max(1, budget.threads))
            where = target if on_device else target.on("cpu")
            res = fn(where, data, budget, seed)
            res.budget.setdefault("device", str(where.device))
            if uses_engine:
                res.budget.setdefault("engine", where.engine_record())
            elif where.engine != "torch":
                res.budget.setdefault("engine", {"engine": "torch", "engine_choice": where.engine,
                                                 "engine_why": NO_ENGINE})
            res.budget["peak_rss_gib"] = peak_rss_gib()
            res.budget["cpu_seconds"] = round(time.process_time() - c0, 1)  # every thread of this process
            held = where.obfuscated_weights()
            if held is not None:
                res.budget["obfuscated_weights"] = held
            res.seconds = time.perf_counter() - t0
            return res

        timed.__doc__, timed.__name__ = fn.__doc__, fn.__name__
        timed.on_device = on_device  # type: ignore[attr-defined]
        timed.uses_engine = uses_engine  # type: ignore[attr-defined]
        REGISTRY[name] = timed
        return timed

    return deco


def register_variant(name: str, run: Callable[..., AttackResult], doc: str, *, on_device: bool = False,
                     **fixed: Any) -> AttackFn:
    """Register ``run(target, data, budget, seed, **fixed)`` under ``name``: one attack driver, several named
    settings (e.g. with and without the oracle)."""

    def variant(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
        return run(target, data, budget, seed, **fixed)

    variant.__doc__, variant.__name__ = doc, name.replace("-", "_")
    return register(name, on_device)(variant)


# --- scoring -------------------------------------------------------------------------------------------------


def has_tokenizer(target: AttackTarget) -> bool:
    """Whether the public tokenizer loads (tiny test checkpoints ship none: score token-level metrics only)."""
    try:
        _ = target.tokenizer
        return True
    except Exception:
        return False


def score_predictions(target: AttackTarget, data: PrivateData, predicted: Sequence[Sequence[int]],
                      text_metrics: bool = True) -> dict[str, Any]:
    """Per-position plaintext guesses against the truth: ttrsr, piirsr and (optionally) bleu4 / cossim of the
    decoded text. ``predicted[i][j]`` is the guess for position j of prompt i (-1 = no guess)."""
    hit = tot = pii_hit = pii_tot = 0
    for truth, guess, mask in zip(data.plain_ids, predicted, data.pii_mask):
        g = np.asarray(list(guess)[: len(truth)] + [-1] * max(0, len(truth) - len(guess)))
        t = np.asarray(truth)
        m = np.asarray(mask, dtype=bool)
        ok = g == t
        hit += int(ok.sum())
        tot += len(t)
        pii_hit += int(ok[m].sum())
        pii_tot += int(m.sum())
    out: dict[str, Any] = {"ttrsr": hit / max(tot, 1), "piirsr": pii_hit / pii_tot if pii_tot else None,
                           "tokens_scored": tot, "pii_tokens_scored": pii_tot}
    if text_metrics:
        from .metrics import bleu4, cosine_similarity

        tok = target.tokenizer
        refs = [tok.decode(list(t), skip_special_tokens=True) for t in data.plain_ids]
        hyps = [tok.decode([i if 0 <= i < len(tok) else tok.unk_token_id or 0 for i in g], skip_special_tokens=True)
                for g in predicted]
        out["bleu4"] = bleu4(hyps, refs)
        out["cossim"] = cosine_similarity(hyps, refs)
    return out


def score_mapping(target: AttackTarget, data: PrivateData, obf_to_plain: np.ndarray,
                  text_metrics: bool = True) -> dict[str, Any]:
    """A recovered vocabulary mapping (obfuscated id -> plain guess, -1 = none) applied to the observed prompts,
    plus the fraction of the whole vocabulary it gets right."""
    perm = target.true_permutation()
    observed = data.observed(target)
    predicted = [[int(obf_to_plain[o]) for o in obs] for obs in observed]
    out = score_predictions(target, data, predicted, text_metrics)
    inv = np.argsort(perm)  # obf id -> plain id
    out["vocab_recovery"] = float(np.mean(np.asarray(obf_to_plain) == inv))
    return out


def score_attacked_prompts(target: AttackTarget, data: PrivateData, predicted: list[list[int]], idx: Sequence[int],
                           max_len: int | None = None) -> dict[str, Any]:
    """Score the attacked prompts only (cut at ``max_len``); text metrics when the public tokenizer loads."""
    sub = PrivateData([data.texts[i] for i in idx], [data.plain_ids[i][:max_len] for i in idx],
                      [data.pii_mask[i][:max_len] for i in idx])
    out = score_predictions(target, sub, predicted, text_metrics=has_tokenizer(target))
    out["prompts_scored"] = len(idx)
    return out


UNPROTECTED = "none"  # key.params["mechanism"] of a target that is the plaintext model itself (positive control)


def unprotected_target(plain_src: str | Path, vocab_size: int | None = None) -> AttackTarget:
    """The plaintext model served as is (identity permutation, no key matrices): the weak target of the ISA/IMA
    positive controls."""
    t = AttackTarget(plain_src, plain_src, None)
    t.obf_model = t.plain_model  # same object: the server runs the public model
    n = vocab_size or int(t.plain_model.get_input_embeddings().weight.shape[0])
    cfg = t.plain_model.config
    t.key = KeyFile(vocab_permutation=list(range(n)), model_fingerprint="unprotected",
                    params={"mechanism": UNPROTECTED},
                    seed=0, h_effective=0, hidden_size=int(cfg.hidden_size), source=str(plain_src),
                    architecture=type(t.plain_model).__name__)
    return t


def built_from_seed(seed: int, build: Callable[[], Any]) -> Any:
    """``build()`` with torch's global RNG seeded by ``seed`` for its duration and restored after: a trained
    attack model's initial weights come from the attack's seed, not from the process's RNG state (the same seed
    gave other figures on every run before)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
