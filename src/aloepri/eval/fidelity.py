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

import hashlib
import importlib
import inspect
import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..corpora import CorpusNotInstalledError, corpus
from ..keyfile import KeyFile
from ..progress import Progress
from ..storage.results import ResultStore
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


class ModelPair:
    """Two models on one device, and the key's maps between their ids (identity when ``key`` is None: the second
    model reads plaintext ids too)."""

    def __init__(self, plain_model, obf_model, key: KeyFile | None, device=None):
        self.plain, self.obf, self.key = plain_model, obf_model, key
        self.dev = place_models(device, plain_model, obf_model)
        self.encode = key.encode_ids if key is not None else list
        self.decode = key.decode_ids if key is not None else list
        self.perm = torch.from_numpy(key.permutation).to(self.dev) if key is not None else None
        eos = key.special_tokens.get("eos_token_id") if key is not None else plain_model.generation_config.eos_token_id
        self.eos_plain = [eos] if isinstance(eos, int) else eos

    @torch.no_grad()
    def measure(self, ids: Sequence[int], greedy_tokens: int, nll: bool = False) -> dict:
        """One text's sums: agreeing positions, KL, max logit error, and (``nll``) both models' next-token NLL,
        from one forward pass of each model; with ``greedy_tokens``, whether the greedy continuations match. The
        metrics are taken in float64 (element-wise work on one text's logits, cheap even where float64 matrix
        products are slow)."""
        x = torch.tensor([list(ids)], device=self.dev)
        xo = torch.tensor([self.encode(list(ids))], device=self.dev)
        lp = self.plain(x).logits[0].double()
        lo = self.obf(xo).logits[0].double()
        if self.perm is not None:
            lo = lo[:, self.perm]  # column i = obfuscated logit of plain token i
        rec: dict = {}
        if nll:
            target = x[0, 1:]
            rec.update(nll_plain=float(F.cross_entropy(lp[:-1], target, reduction="sum")),
                       nll_obfuscated=float(F.cross_entropy(lo[:-1], target, reduction="sum")),
                       nll_tokens=target.numel())
        n = min(lp.shape[-1], lo.shape[-1])
        lp, lo = lp[:, :n], lo[:, :n]
        rec.update(agree=int((lp.argmax(-1) == lo.argmax(-1)).sum()),
                   kl=float(F.kl_div(F.log_softmax(lo, -1), F.log_softmax(lp, -1), log_target=True, reduction="sum")),
                   max_err=float((lp - lo).abs().max()), positions=lp.shape[0])
        if greedy_tokens:
            eos = self.eos_plain
            gp = self.plain.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=greedy_tokens,
                                     do_sample=False, eos_token_id=eos, pad_token_id=(eos or [0])[0])[0, x.shape[1]:]
            eo = self.encode(eos) if eos else None
            go = self.obf.generate(xo, attention_mask=torch.ones_like(xo), max_new_tokens=greedy_tokens,
                                   do_sample=False, eos_token_id=eo, pad_token_id=(eo or [0])[0])[0, xo.shape[1]:]
            rec["greedy_same"] = int(self.decode(go.tolist()) == gp.tolist())
        return rec


def measure_texts(pair: ModelPair, ids_list: Sequence[Sequence[int]], greedy_tokens: int, nll: bool = False,
                  section: str = "prompts", progress: Progress | None = None,
                  store: ResultStore | None = None, scope: str = "") -> list[dict]:
    """``ModelPair.measure`` of every text, in order. ``progress`` advances once per text; ``store`` keeps every
    text's record as soon as it is measured and hands back the records an earlier run of the same ``scope``
    (the models and settings, see ``record_scope``) already measured, so a stopped run resumes."""
    records = []
    for ids in ids_list:
        key = None
        if store is not None:
            key = hashlib.sha256(json.dumps([scope, section, list(ids), greedy_tokens, nll]).encode()).hexdigest()[:20]
            kept = store.load().get(key)
            if kept is not None and kept.get("status") == "done":
                records.append(kept["record"])
                if progress is not None:
                    progress.skip()
                continue
        rec = pair.measure(ids, greedy_tokens, nll)
        if store is not None:
            store.put(key, {"section": section, "record": rec})
        records.append(rec)
        if progress is not None:
            progress.advance()
    return records


def record_scope(src: str | Path, server_dir: str | Path, key: KeyFile, device) -> str:
    """What a stored fidelity record depends on besides its text: the two models and where they ran."""
    return json.dumps([str(src), str(server_dir), key.model_fingerprint, str(device)])


def fidelity_of(records: Sequence[dict], greedy_tokens: int) -> "Fidelity":
    n_pos = sum(r["positions"] for r in records)
    return Fidelity(sum(r["agree"] for r in records) / n_pos, sum(r["kl"] for r in records) / n_pos,
                    max(r["max_err"] for r in records), sum(r.get("greedy_same", 0) for r in records) /
                    max(1, len(records)), n_pos, len(records), greedy_tokens)


def perplexity_of(records: Sequence[dict]) -> "Perplexity":
    n = sum(r["nll_tokens"] for r in records)
    if n == 0:
        raise ValueError("no text with at least 2 tokens")
    nll_p, nll_o = sum(r["nll_plain"] for r in records), sum(r["nll_obfuscated"] for r in records)
    return Perplexity(math.exp(nll_p / n), math.exp(nll_o / n), n, len(records), nll_p / n, nll_o / n)


def compare(plain_model, obf_model, key: KeyFile | None, prompts_ids: Sequence[Sequence[int]],
            greedy_tokens: int = 24, device=None, progress: Progress | None = None) -> Fidelity:
    """``obf_model`` against ``plain_model`` on the same plaintext prompts. ``key=None``: the second model takes
    plaintext ids too (a plaintext model in another dtype or engine, e.g. the float32 floor of a float64 one).

    ``device`` ('cpu', 'cuda', ...): both models are moved there (in place) and run there; None keeps them where
    they are. Returned as Python numbers. ``progress`` advances once per prompt."""
    records = measure_texts(ModelPair(plain_model, obf_model, key, device), prompts_ids, greedy_tokens, progress=progress)
    return fidelity_of(records, greedy_tokens)


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


def perplexity_pair(plain_model, obf_model, key: KeyFile, ids_list: Sequence[Sequence[int]],
                    device=None) -> Perplexity:
    """Perplexity of both models on the same plaintext ids (obfuscated logits mapped back by the key).
    ``device``: as for ``compare`` (models moved there in place; None = where they are)."""
    return perplexity_of(measure_texts(ModelPair(plain_model, obf_model, key, device), ids_list, 0, nll=True))


def fidelity_steps(prompts: int | None, tokenizer, corpus_texts_n: int) -> int:
    """How many texts ``fidelity_report`` measures (for a progress bar's total): prompts, then corpus texts."""
    n_prompts = len(BUILTIN_PROMPTS[:prompts] if prompts else BUILTIN_PROMPTS)
    return n_prompts + (corpus_texts_n if tokenizer is not None and corpus_texts_n else 0)


def fidelity_report(plain_model, obf_model, key: KeyFile, tokenizer, prompts: int | None = None,
                    greedy_tokens: int = 24, corpus: str | None = None, corpus_texts_n: int = 32,
                    max_tokens: int = 128, device=None, progress: Progress | None = None,
                    store: ResultStore | None = None, scope: str = "") -> dict:
    """Everything at once: prompt fidelity (built-in chat prompts), corpus top-1/KL and perplexity (one forward
    pass of each model per corpus text), on ``device`` (models moved there in place; None = where they are).
    ``progress`` and ``store``: as for ``measure_texts``."""
    pair = ModelPair(plain_model, obf_model, key, device)
    prompt_ids = builtin_prompt_ids(tokenizer, key.vocab_size, prompts)
    kept = dict(progress=progress, store=store, scope=scope)
    fid = fidelity_of(measure_texts(pair, prompt_ids, greedy_tokens, **kept), greedy_tokens)
    report = {"prompts": fid.to_dict()}
    if tokenizer is not None and corpus_texts_n:
        texts, prov = corpus_texts(corpus, corpus_texts_n)
        ids = corpus_ids(tokenizer, texts, max_tokens)
        if progress is not None and len(ids) < corpus_texts_n:  # short or missing texts: fewer steps than planned
            progress.set_total(progress.total - (corpus_texts_n - len(ids)))
        records = measure_texts(pair, ids, 0, nll=True, section="corpus", **kept)
        teacher_forced = fidelity_of(records, 0).to_dict()
        for k in ("greedy_match_rate", "greedy_tokens"):  # no greedy continuation is run on corpus text
            teacher_forced.pop(k)
        report["corpus"] = {"provenance": prov, "max_tokens": max_tokens, **teacher_forced,
                            "perplexity": perplexity_of(records).to_dict()}
    return report


def load_and_report(src: str | Path, server_dir: str | Path, key_path: str | Path, device=None,
                    progress: bool = False, results: str | Path | None = None, **kwargs) -> dict:
    """``fidelity_report`` of the obfuscated directory against its source, both loaded on ``device`` (default
    cpu; an invalid or absent device is refused before anything is loaded). ``progress``: a bar per text on
    stderr; ``results``: a JSON file that keeps every text's measurement as it is made, so a rerun with the same
    file resumes (aloepri.storage.results)."""
    from ..runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer
    from ..keyfile import check_key_matches, load_key

    dev = resolve_device(device)
    key = load_key(key_path)
    check_key_matches(key, server_dir)
    tok = load_tokenizer(key, src if Path(src).is_file() else None)
    plain = load_plain_model(src, device=dev)
    obf = load_obfuscated_model(server_dir, device=dev)
    store = ResultStore(results) if results is not None else None
    steps = fidelity_steps(kwargs.get("prompts"), tok, kwargs.get("corpus_texts_n", 32))
    with Progress(steps, "fidelity", unit="text", enabled=progress) as bar:
        return fidelity_report(plain, obf, key, tok, device=dev, progress=bar, store=store,
                               scope=record_scope(src, server_dir, key, dev), **kwargs)


__all__ = ["BUILTIN_PROMPTS", "Fidelity", "Perplexity", "builtin_prompt_ids", "compare", "corpus_ids", "corpus_texts",
           "fidelity_report", "fidelity_steps", "load_and_report", "measure_texts", "ModelPair", "perplexity_pair",
           "record_scope", "stdlib_docstring_paragraphs"]
