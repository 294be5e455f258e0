"""Fidelity of an obfuscated model against its plaintext original: prompt metrics (``compare``: top-1 agreement,
KL, max logit error, greedy match on the same prompts) and perplexity on real text (``perplexity_pair``).

Perplexity is measured on the same token ids for both models: the plaintext model reads the ids, the
obfuscated model reads them mapped by the key, and its logits are mapped back before the log-softmax, so the
two numbers are directly comparable (and equal, up to float rounding, for the exact preset).

Corpus: ``aloepri.corpora.corpus(name)`` (real public text from Debian packages, provenance in
docs/data.md), by default ``debian-reference`` (the Debian Reference manual, one document per section, the
first ``max_tokens`` tokens of each); when that corpus is not installed, the built-in fallback ``stdlib-docstrings``: paragraphs of the docstrings of a
fixed list of CPython standard-library modules (real English technical prose written by the CPython
developers, PSF licence, present on every Python install — no download). Its exact content depends on the
Python version, which is recorded with every result.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import inspect
import math
import platform
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..corpora import CorpusNotInstalledError, corpus
from ..keyfile import KeyFile
from ..storage.devices import model_device, resolve_device

# Built-in prompts for `aloepri verify` and the preset benchmark: varied tasks, short enough for CPU.
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "List three prime numbers greater than 20.",
    "My name is Alice Johnson and I live at 42 Elm Street, Springfield. Summarise this sentence.",
    "What is 17 multiplied by 23?",
    "Give me a haiku about the ocean.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Write a short email asking my manager for a day off on Friday.",
    "Define the word 'ephemeral' and use it in a sentence.",
    "What are the health benefits of drinking water?",
    "Name the planets of the solar system in order.",
    "Suggest a name for a bakery that sells only bread.",
    "Explain what a hash table is to a ten-year-old.",
    "My phone number is 555-0142 and my account id is 88321. Remind me of both.",
    "Who wrote 'Pride and Prejudice'?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Write a SQL query that counts the rows of a table named users.",
]


@dataclass
class Fidelity:
    top1_agreement: float  # fraction of positions where the argmax token agrees
    mean_kl: float  # mean KL(plain || obfuscated) over positions, nats
    max_logit_error: float  # max |logit_plain - logit_obf| (obfuscated logits mapped back)
    greedy_match_rate: float  # fraction of prompts whose greedy continuation is identical
    positions: int
    prompts: int
    greedy_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def place_models(device, *models) -> "torch.device":
    """Move ``models`` (in place, as ``nn.Module.to`` does) to ``device``; None: where the first model already is.
    Returns the device the comparison runs on."""
    dev = model_device(models[0]) if device is None else resolve_device(device)
    for m in models:
        m.to(dev)
    return dev


class PlainReference:
    """The plaintext model's logits on a list of id sequences (and its greedy continuation of each), taken once so
    that the plaintext model can be freed before the obfuscated one loads: a comparison then holds one model at a
    time. The logits keep the model's own dtype and every metric is computed from them exactly as from a live
    model, so the results are the same as with both models in memory.

    ``spill_dir``: keep the logits there (one file per sequence, read back one at a time) rather than in memory;
    a corpus of 32 x 128 tokens over a 152k vocabulary is 2.5 GB of float32 logits."""

    @torch.no_grad()
    def __init__(self, plain_model, ids_list: Sequence[Sequence[int]], greedy_tokens: int = 0,
                 eos: int | list[int] | None = None, device=None, spill_dir: str | Path | None = None):
        dev = place_models(device, plain_model)
        self.eos: list[int] | None = [eos] if isinstance(eos, int) else eos
        self.ids = [list(ids) for ids in ids_list]
        self.greedy_tokens = greedy_tokens
        self.greedy: list[list[int]] = []
        self._spill = Path(spill_dir) if spill_dir is not None else None
        self._logits: list[torch.Tensor] = []
        for i, ids in enumerate(self.ids):
            x = torch.tensor([ids], device=dev)
            logits = plain_model(x).logits[0].cpu()
            if self._spill is None:
                self._logits.append(logits)
            else:
                torch.save(logits, self._spill / f"logits-{i}.pt")
            del logits
            if greedy_tokens:
                self.greedy.append(plain_model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=greedy_tokens, do_sample=False,
                    eos_token_id=self.eos, pad_token_id=(self.eos or [0])[0])[0, x.shape[1]:].tolist())

    def logits(self, i: int, device) -> torch.Tensor:
        if self._spill is None:
            return self._logits[i].to(device)
        return torch.load(self._spill / f"logits-{i}.pt", weights_only=True).to(device)


@torch.no_grad()
def compare(plain_model, obf_model, key: KeyFile | None, prompts_ids: Sequence[Sequence[int]],
            greedy_tokens: int = 24, device=None) -> Fidelity:
    """``obf_model`` against ``plain_model`` on the same plaintext prompts. ``key=None``: the second model takes
    plaintext ids too (a plaintext model in another dtype or engine, e.g. the float32 floor of a float64 one).

    ``device`` ('cpu', 'cuda', ...): both models are moved there (in place) and run there; None keeps them where
    they are. The metrics are taken in float64 on that device (element-wise work on one prompt's logits, cheap
    even where float64 matrix products are slow) and returned as Python numbers."""
    dev = place_models(device, plain_model, obf_model)
    eos = key.special_tokens.get("eos_token_id") if key is not None else plain_model.generation_config.eos_token_id
    reference = PlainReference(plain_model, prompts_ids, greedy_tokens, eos, dev)
    return compare_with_reference(reference, obf_model, key, dev)


@torch.no_grad()
def compare_with_reference(reference: PlainReference, obf_model, key: KeyFile | None, device=None) -> Fidelity:
    """``compare`` with the plaintext side already taken (``PlainReference``): only ``obf_model`` is needed."""
    dev = place_models(device, obf_model)
    encode = key.encode_ids if key is not None else list
    decode = key.decode_ids if key is not None else list
    perm = torch.from_numpy(key.permutation).to(dev) if key is not None else None
    agree = 0
    kl_sum = torch.zeros((), dtype=torch.float64, device=dev)
    max_err = torch.zeros((), dtype=torch.float64, device=dev)
    n_pos = 0
    greedy_same = 0
    greedy_tokens, eos_plain = reference.greedy_tokens, reference.eos
    for i, ids in enumerate(reference.ids):
        xo = torch.tensor([encode(ids)], device=dev)
        lp = reference.logits(i, dev).double()
        lo = obf_model(xo).logits[0].double()
        if perm is not None:
            lo = lo[:, perm]  # column i = obfuscated logit of plain token i
        n = min(lp.shape[-1], lo.shape[-1])
        lp, lo = lp[:, :n], lo[:, :n]
        agree += int((lp.argmax(-1) == lo.argmax(-1)).sum())
        kl_sum += F.kl_div(F.log_softmax(lo, -1), F.log_softmax(lp, -1), log_target=True, reduction="sum")
        max_err = torch.maximum(max_err, (lp - lo).abs().max())
        n_pos += lp.shape[0]
        if greedy_tokens:
            eo = encode(eos_plain) if eos_plain else None
            go = obf_model.generate(xo, attention_mask=torch.ones_like(xo), max_new_tokens=greedy_tokens, do_sample=False,
                                    eos_token_id=eo, pad_token_id=(eo or [0])[0])[0, xo.shape[1]:].tolist()
            greedy_same += int(decode(go) == reference.greedy[i])
    return Fidelity(agree / n_pos, float(kl_sum) / n_pos, float(max_err), greedy_same / max(1, len(reference.ids)),
                    n_pos, len(reference.ids), greedy_tokens)


def builtin_prompt_ids(tokenizer, vocab_size: int, n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Chat-templated built-in prompts, or random ids when the model has no tokenizer."""
    prompts = BUILTIN_PROMPTS[:n] if n else BUILTIN_PROMPTS
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (16,), generator=g).tolist() for _ in prompts]
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


# --- perplexity and teacher-forced metrics on real text ------------------------------------------------------

DEFAULT_CORPUS = "debian-reference"
FALLBACK_CORPUS = "stdlib-docstrings"
_STDLIB_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
                   "decimal", "difflib", "email", "functools", "heapq", "http.client", "inspect", "itertools",
                   "json", "logging", "multiprocessing", "pathlib", "pickle", "queue", "random", "re", "shutil",
                   "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
                   "threading", "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile")


def stdlib_docstring_paragraphs(min_chars: int = 200) -> list[str]:
    """Prose paragraphs (>= min_chars, no doctest lines) from the docstrings of fixed stdlib modules/classes."""
    out, seen = [], set()
    for name in _STDLIB_MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and getattr(obj, "__module__", None) == mod.__name__:
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                letters = sum(ch.isalpha() or ch == " " for ch in para) / len(para) if para else 0
                # prose only: skip doctests and code/table paragraphs (mostly punctuation)
                if len(para) >= min_chars and ">>>" not in para and letters > 0.9 and para not in seen:
                    seen.add(para)
                    out.append(para)
    return out


def corpus_texts(name: str | None = None, n: int | None = None) -> tuple[list[str], str]:
    """(texts, provenance). ``name`` None: 'debian-reference' if installed, else the stdlib-docstrings fallback."""
    texts = None
    if name is None:
        try:
            texts, prov = corpus(DEFAULT_CORPUS), f"aloepri.corpora.corpus({DEFAULT_CORPUS!r})"
        except CorpusNotInstalledError:  # the Debian package is missing: the fallback below
            texts = None
    elif name != FALLBACK_CORPUS:
        texts, prov = corpus(name), f"aloepri.corpora.corpus({name!r})"
    if texts is None:
        texts, prov = stdlib_docstring_paragraphs(), f"{FALLBACK_CORPUS} (CPython {platform.python_version()})"
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise ValueError(f"corpus {name!r} is empty")
    return (texts[:n] if n else texts), prov


def corpus_ids(tokenizer, texts: Sequence[str], max_tokens: int = 128) -> list[list[int]]:
    """Token ids per text (with the tokenizer's BOS if it adds one), truncated to max_tokens; >= 2 tokens."""
    out = []
    for t in texts:
        ids = tokenizer(t)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            out.append(list(ids))
    return out


@dataclass
class Perplexity:
    plain: float
    obfuscated: float
    tokens: int  # predicted positions
    texts: int
    mean_nll_plain: float
    mean_nll_obfuscated: float

    @property
    def relative_increase(self) -> float:
        return self.obfuscated / self.plain - 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "relative_increase": self.relative_increase}


@torch.no_grad()
def perplexity_pair(plain_model, obf_model, key: KeyFile, ids_list: Sequence[Sequence[int]],
                    device=None) -> Perplexity:
    """Perplexity of both models on the same plaintext ids (obfuscated logits mapped back by the key).
    ``device``: as for ``compare`` (models moved there in place; None = where they are)."""
    dev = place_models(device, plain_model, obf_model)
    return perplexity_with_reference(PlainReference(plain_model, ids_list, device=dev), obf_model, key, dev)


@torch.no_grad()
def perplexity_with_reference(reference: PlainReference, obf_model, key: KeyFile, device=None) -> Perplexity:
    """``perplexity_pair`` with the plaintext side already taken: only ``obf_model`` is needed."""
    dev = place_models(device, obf_model)
    perm = torch.from_numpy(key.permutation).to(dev)
    nll_p = torch.zeros((), dtype=torch.float64, device=dev)
    nll_o = torch.zeros((), dtype=torch.float64, device=dev)
    n = 0
    for i, ids in enumerate(reference.ids):
        x = torch.tensor([ids], device=dev)
        lp = reference.logits(i, dev)[:-1].double()
        lo = obf_model(torch.tensor([key.encode_ids(ids)], device=dev)).logits[0, :-1].double()[:, perm]
        target = x[0, 1:]
        nll_p += F.cross_entropy(lp, target, reduction="sum")
        nll_o += F.cross_entropy(lo, target, reduction="sum")
        n += target.numel()
    if n == 0:
        raise ValueError("no text with at least 2 tokens")
    nll_p, nll_o = float(nll_p), float(nll_o)
    return Perplexity(math.exp(nll_p / n), math.exp(nll_o / n), n, len(reference.ids), nll_p / n, nll_o / n)


def fidelity_report(plain_model, obf_model, key: KeyFile, tokenizer, prompts: int | None = None,
                    greedy_tokens: int = 24, corpus: str | None = None, corpus_texts_n: int = 32,
                    max_tokens: int = 128, device=None) -> dict:
    """Everything at once: prompt fidelity (built-in chat prompts), corpus top-1/KL and perplexity, on ``device``
    (models moved there in place; None = where they are)."""
    dev = place_models(device, plain_model, obf_model)
    references = ReportReferences(plain_model, key, tokenizer, prompts, greedy_tokens, corpus, corpus_texts_n,
                                  max_tokens, dev)
    return report_with_references(references, obf_model, key, dev)


class ReportReferences:
    """The plaintext side of ``fidelity_report`` (see ``PlainReference``): the model can be freed after this."""

    def __init__(self, plain_model, key: KeyFile, tokenizer, prompts: int | None = None, greedy_tokens: int = 24,
                 corpus: str | None = None, corpus_texts_n: int = 32, max_tokens: int = 128, device=None,
                 spill_dir: str | Path | None = None):
        dev = place_models(device, plain_model)
        eos = key.special_tokens.get("eos_token_id")
        self.prompts = PlainReference(plain_model, builtin_prompt_ids(tokenizer, key.vocab_size, prompts),
                                      greedy_tokens, eos, dev, _subdir(spill_dir, "prompts"))
        self.corpus: PlainReference | None = None
        if tokenizer is not None:
            texts, self.corpus_provenance = corpus_texts(corpus, corpus_texts_n)
            self.max_tokens = max_tokens
            self.corpus = PlainReference(plain_model, corpus_ids(tokenizer, texts, max_tokens), 0, eos, dev,
                                         _subdir(spill_dir, "corpus"))


def _subdir(parent: str | Path | None, name: str) -> Path | None:
    if parent is None:
        return None
    path = Path(parent) / name
    path.mkdir()
    return path


def report_with_references(references: ReportReferences, obf_model, key: KeyFile, device=None) -> dict:
    """``fidelity_report`` with the plaintext side already taken: only ``obf_model`` is needed."""
    dev = place_models(device, obf_model)
    fid: Fidelity = compare_with_reference(references.prompts, obf_model, key, dev)
    report = {"prompts": fid.to_dict()}
    if references.corpus is not None:
        teacher_forced = compare_with_reference(references.corpus, obf_model, key, dev).to_dict()
        for k in ("greedy_match_rate", "greedy_tokens"):  # no greedy continuation is run on corpus text
            teacher_forced.pop(k)
        report["corpus"] = {"provenance": references.corpus_provenance, "max_tokens": references.max_tokens,
                            **teacher_forced,
                            "perplexity": perplexity_with_reference(references.corpus, obf_model, key, dev).to_dict()}
    return report


def load_and_report(src: str | Path, server_dir: str | Path, key_path: str | Path, device=None, **kwargs) -> dict:
    """``fidelity_report`` of the obfuscated directory against its source, on ``device`` (default cpu; an invalid
    or absent device is refused before anything is loaded). One model is in memory at a time: the plaintext
    model's outputs are taken (its logits kept in a temporary directory) and it is freed before the obfuscated
    model loads."""
    from ..runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer
    from ..keyfile import check_key_matches, load_key

    dev = resolve_device(device)
    key = load_key(key_path)
    check_key_matches(key, server_dir)
    tok = load_tokenizer(key, src if Path(src).is_file() else None)
    with tempfile.TemporaryDirectory(prefix="aloepri-reference-") as spill:
        references = ReportReferences(load_plain_model(src, device=dev), key, tok, device=dev, spill_dir=spill,
                                      **kwargs)
        release_memory()
        return report_with_references(references, load_obfuscated_model(server_dir, device=dev), key, dev)


def release_memory() -> None:
    """Return a freed model's memory: collect it (transformers modules hold reference cycles) and hand the freed
    heap back to the OS (glibc keeps large freed arenas otherwise, and the next model would be counted on top)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


__all__ = ["BUILTIN_PROMPTS", "Fidelity", "Perplexity", "PlainReference", "ReportReferences", "builtin_prompt_ids",
           "compare", "compare_with_reference", "corpus_ids", "corpus_texts", "fidelity_report", "load_and_report",
           "perplexity_pair", "perplexity_with_reference", "release_memory", "report_with_references",
           "stdlib_docstring_paragraphs"]
