"""Fidelity of an obfuscated model: prompt metrics (aloepri.runtime.fidelity.compare) plus perplexity on real text.

Perplexity is measured on the same token ids for both models: the plaintext model reads the ids, the
obfuscated model reads them mapped by the key, and its logits are mapped back before the log-softmax, so the
two numbers are directly comparable (and equal, up to float rounding, for the exact preset).

Corpus: ``aloepri.attacks.data.corpus(name)`` (real public text from Debian packages, provenance in
docs/data.md), by default ``debian-reference`` (the Debian Reference manual, one document per section, the
first ``max_tokens`` tokens of each); when that corpus is not installed, the built-in fallback ``stdlib-docstrings``: paragraphs of the docstrings of a
fixed list of CPython standard-library modules (real English technical prose written by the CPython
developers, PSF licence, present on every Python install — no download). Its exact content depends on the
Python version, which is recorded with every result.
"""
from __future__ import annotations

import importlib
import inspect
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..runtime.fidelity import BUILTIN_PROMPTS, Fidelity, builtin_prompt_ids, compare, place_models
from ..keyfile import KeyFile

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
    if name in (None, FALLBACK_CORPUS):
        texts = None
        if name is None:
            try:
                data = importlib.import_module("aloepri.attacks.data")
            except ImportError:
                data = None
            if data is not None:
                try:
                    texts = data.corpus(DEFAULT_CORPUS)
                    prov = f"aloepri.attacks.data.corpus({DEFAULT_CORPUS!r})"
                except getattr(data, "CorpusNotInstalledError", FileNotFoundError):  # Debian package missing
                    texts = None
        if texts is None:
            texts, prov = stdlib_docstring_paragraphs(), f"{FALLBACK_CORPUS} (CPython {platform.python_version()})"
    else:
        texts = importlib.import_module("aloepri.attacks.data").corpus(name)
        prov = f"aloepri.attacks.data.corpus({name!r})"
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
    perm = torch.from_numpy(key.permutation).to(dev)
    nll_p = torch.zeros((), dtype=torch.float64, device=dev)
    nll_o = torch.zeros((), dtype=torch.float64, device=dev)
    n = 0
    for ids in ids_list:
        x = torch.tensor([list(ids)], device=dev)
        lp = plain_model(x).logits[0, :-1].double()
        lo = obf_model(torch.tensor([key.encode_ids(list(ids))], device=dev)).logits[0, :-1].double()[:, perm]
        target = x[0, 1:]
        nll_p += F.cross_entropy(lp, target, reduction="sum")
        nll_o += F.cross_entropy(lo, target, reduction="sum")
        n += target.numel()
    if n == 0:
        raise ValueError("no text with at least 2 tokens")
    nll_p, nll_o = float(nll_p), float(nll_o)
    return Perplexity(math.exp(nll_p / n), math.exp(nll_o / n), n, len(ids_list), nll_p / n, nll_o / n)


def fidelity_report(plain_model, obf_model, key: KeyFile, tokenizer, prompts: int | None = None,
                    greedy_tokens: int = 24, corpus: str | None = None, corpus_texts_n: int = 32,
                    max_tokens: int = 128, device=None) -> dict:
    """Everything at once: prompt fidelity (built-in chat prompts), corpus top-1/KL and perplexity, on ``device``
    (models moved there in place; None = where they are)."""
    dev = place_models(device, plain_model, obf_model)
    prompt_ids = builtin_prompt_ids(tokenizer, key.vocab_size, prompts)
    fid: Fidelity = compare(plain_model, obf_model, key, prompt_ids, greedy_tokens=greedy_tokens, device=dev)
    report = {"prompts": fid.to_dict()}
    if tokenizer is not None:
        texts, prov = corpus_texts(corpus, corpus_texts_n)
        ids = corpus_ids(tokenizer, texts, max_tokens)
        teacher_forced = compare(plain_model, obf_model, key, ids, greedy_tokens=0, device=dev).to_dict()
        for k in ("greedy_match_rate", "greedy_tokens"):  # no greedy continuation is run on corpus text
            teacher_forced.pop(k)
        report["corpus"] = {"provenance": prov, "max_tokens": max_tokens, **teacher_forced,
                            "perplexity": perplexity_pair(plain_model, obf_model, key, ids, device=dev).to_dict()}
    return report


def load_and_report(src: str | Path, server_dir: str | Path, key_path: str | Path, device=None, **kwargs) -> dict:
    """``fidelity_report`` of the obfuscated directory against its source, both loaded on ``device`` (default
    cpu; an invalid or absent device is refused before anything is loaded)."""
    from ..runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer
    from ..keyfile import check_key_matches, load_key
    from ..storage.devices import resolve_device

    dev = resolve_device(device)
    key = load_key(key_path)
    check_key_matches(key, server_dir)
    tok = load_tokenizer(key, src if Path(src).is_file() else None)
    plain = load_plain_model(src, device=dev)
    obf = load_obfuscated_model(server_dir, device=dev)
    return fidelity_report(plain, obf, key, tok, device=dev, **kwargs)


__all__ = ["BUILTIN_PROMPTS", "Perplexity", "compare", "corpus_ids", "corpus_texts", "fidelity_report",
           "load_and_report", "perplexity_pair", "stdlib_docstring_paragraphs"]
