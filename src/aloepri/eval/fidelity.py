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
import hashlib
import importlib
import inspect
import json
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


class PlainReference:
    """The plaintext model's logits on a list of id sequences (and its greedy continuation of each), taken once so
    that the plaintext model can be freed before the obfuscated one loads: a comparison then holds one model at a
    time. The logits keep the model's own dtype and every metric is computed from them exactly as from a live
    model, so the results are the same as with both models in memory.

    ``spill_dir``: keep the logits there (one file per sequence, read back one at a time) rather than in memory;
    a corpus of 32 x 128 tokens over a 152k vocabulary is 2.5 GB of float32 logits. ``skip``: one flag per
    sequence; a flagged one is not run (its record is already in a result file: a resumed run). ``progress``
    advances once per sequence run and counts a skipped one as done by an earlier run."""

    @torch.no_grad()
    def __init__(self, plain_model, ids_list: Sequence[Sequence[int]], greedy_tokens: int = 0,
                 eos: int | list[int] | None = None, device=None, spill_dir: str | Path | None = None,
                 skip: Sequence[bool] | None = None, progress: Progress | None = None):
        dev = place_models(device, plain_model)
        self.eos: list[int] | None = [eos] if isinstance(eos, int) else eos
        self.ids = [list(ids) for ids in ids_list]
        self.greedy_tokens = greedy_tokens
        self.skipped = [bool(s) for s in skip] if skip is not None else [False] * len(self.ids)
        if len(self.skipped) != len(self.ids):
            raise ValueError(f"skip has {len(self.skipped)} flags for {len(self.ids)} sequences")
        self.greedy: list[list[int] | None] = []
        self._spill = Path(spill_dir) if spill_dir is not None else None
        self._logits: list[torch.Tensor | None] = []
        for i, ids in enumerate(self.ids):
            if self.skipped[i]:
                self._logits.append(None)
                self.greedy.append(None)
                if progress is not None:
                    progress.skip()
                continue
            x = torch.tensor([ids], device=dev)
            logits = plain_model(x).logits[0].cpu()
            if self._spill is None:
                self._logits.append(logits)
            else:
                torch.save(logits, self._spill / f"logits-{i}.pt")
                self._logits.append(None)
            del logits
            self.greedy.append(greedy_continuation(plain_model, x, greedy_tokens, self.eos) if greedy_tokens else None)
            if progress is not None:
                progress.advance()

    def logits(self, i: int, device) -> torch.Tensor:
        if self.skipped[i]:
            raise KeyError(f"sequence {i} was skipped (its record was kept by an earlier run), it has no logits")
        if self._spill is None:
            return self._logits[i].to(device)
        return torch.load(self._spill / f"logits-{i}.pt", weights_only=True).to(device)


def greedy_continuation(model, x: torch.Tensor, tokens: int, eos) -> list[int]:
    """The new tokens of ``model``'s greedy continuation of the one sequence ``x`` (1, L), stopping after an EOS
    (padded after it with the first EOS, as transformers pads)."""
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=(eos or [0])[0])
    return out[0, x.shape[1]:].tolist()


class ModelPair:
    """The obfuscated model against the plaintext side (a ``PlainReference``: the plaintext model's logits and
    greedy continuations, taken before), on one device, with the key's maps between their ids (identity when
    ``key`` is None: the second model reads plaintext ids too)."""

    def __init__(self, reference: PlainReference, obf_model, key: KeyFile | None, device=None):
        self.reference, self.obf, self.key = reference, obf_model, key
        self.dev = place_models(device, obf_model)
        self.encode = key.encode_ids if key is not None else list
        self.decode = key.decode_ids if key is not None else list
        self.perm = torch.from_numpy(key.permutation).to(self.dev) if key is not None else None

    @torch.no_grad()
    def measure(self, i: int, nll: bool = False) -> dict:
        """Text ``i`` of the reference's sums: agreeing positions, KL, max logit error, and (``nll``) both models'
        next-token NLL, from one forward pass of the obfuscated model; with the reference's ``greedy_tokens``,
        whether the greedy continuations match. The metrics are taken in float64 (element-wise work on one text's
        logits, cheap even where float64 matrix products are slow)."""
        ids = self.reference.ids[i]
        xo = torch.tensor([self.encode(ids)], device=self.dev)
        lp = self.reference.logits(i, self.dev).double()
        lo = self.obf(xo).logits[0].double()
        if self.perm is not None:
            lo = lo[:, self.perm]  # column i = obfuscated logit of plain token i
        rec: dict = {}
        if nll:
            target = torch.tensor(ids[1:], device=self.dev)
            rec.update(nll_plain=float(F.cross_entropy(lp[:-1], target, reduction="sum")),
                       nll_obfuscated=float(F.cross_entropy(lo[:-1], target, reduction="sum")),
                       nll_tokens=target.numel())
        n = min(lp.shape[-1], lo.shape[-1])
        lp, lo = lp[:, :n], lo[:, :n]
        rec.update(agree=int((lp.argmax(-1) == lo.argmax(-1)).sum()),
                   kl=float(F.kl_div(F.log_softmax(lo, -1), F.log_softmax(lp, -1), log_target=True, reduction="sum")),
                   max_err=float((lp - lo).abs().max()), positions=lp.shape[0])
        greedy_tokens, eos = self.reference.greedy_tokens, self.reference.eos
        if greedy_tokens:
            eo = self.encode(eos) if eos else None
            go = greedy_continuation(self.obf, xo, greedy_tokens, eo)
            rec["greedy_same"] = int(self.decode(go) == self.reference.greedy[i])
        return rec


def _record_key(scope: str, section: str, ids: Sequence[int], greedy_tokens: int, nll: bool) -> str:
    return hashlib.sha256(json.dumps([scope, section, list(ids), greedy_tokens, nll]).encode()).hexdigest()[:20]


def kept_records(store: ResultStore | None, ids_list: Sequence[Sequence[int]], greedy_tokens: int, nll: bool = False,
                 section: str = "prompts", scope: str = "") -> list[dict | None]:
    """Per text, the record an earlier run of the same ``scope`` kept in ``store`` (None: not measured yet)."""
    if store is None:
        return [None] * len(ids_list)
    data = store.load()
    out = []
    for ids in ids_list:
        kept = data.get(_record_key(scope, section, ids, greedy_tokens, nll))
        out.append(kept["record"] if kept is not None and kept.get("status") == "done" else None)
    return out


def measure_texts(pair: ModelPair, nll: bool = False, section: str = "prompts", progress: Progress | None = None,
                  store: ResultStore | None = None, scope: str = "") -> list[dict]:
    """``ModelPair.measure`` of every text of the pair's reference, in order. ``progress`` advances once per text;
    ``store`` keeps every text's record as soon as it is measured and hands back the records an earlier run of the
    same ``scope`` (the models and settings, see ``record_scope``) already measured, so a stopped run resumes (the
    reference need not have run those texts: see ``PlainReference``'s ``skip``)."""
    reference, records = pair.reference, []
    for i, ids in enumerate(reference.ids):
        key = None
        if store is not None:
            key = _record_key(scope, section, ids, reference.greedy_tokens, nll)
            kept = store.load().get(key)
            if kept is not None and kept.get("status") == "done":
                records.append(kept["record"])
                if progress is not None:
                    progress.skip()
                continue
        if reference.skipped[i]:
            raise RuntimeError(f"{store.path if store is not None else 'no results file'}: the record of a text "
                               "this run skipped is gone (the file changed during the run); run again")
        rec = pair.measure(i, nll)
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
    they are. Returned as Python numbers. The plaintext side is taken first (``PlainReference``); ``progress``
    advances once per prompt compared."""
    dev = place_models(device, plain_model, obf_model)
    eos = key.special_tokens.get("eos_token_id") if key is not None else plain_model.generation_config.eos_token_id
    reference = PlainReference(plain_model, prompts_ids, greedy_tokens, eos, dev)
    return compare_with_reference(reference, obf_model, key, dev, progress=progress)


def compare_with_reference(reference: PlainReference, obf_model, key: KeyFile | None, device=None,
                           progress: Progress | None = None, store: ResultStore | None = None,
                           scope: str = "") -> Fidelity:
    """``compare`` with the plaintext side already taken (``PlainReference``): only ``obf_model`` is needed.
    ``progress``, ``store`` and ``scope``: as for ``measure_texts``."""
    records = measure_texts(ModelPair(reference, obf_model, key, device), progress=progress, store=store,
                            scope=scope)
    return fidelity_of(records, reference.greedy_tokens)


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
    dev = place_models(device, plain_model, obf_model)
    return perplexity_with_reference(PlainReference(plain_model, ids_list, device=dev), obf_model, key, dev)


def perplexity_with_reference(reference: PlainReference, obf_model, key: KeyFile, device=None) -> Perplexity:
    """``perplexity_pair`` with the plaintext side already taken: only ``obf_model`` is needed."""
    return perplexity_of(measure_texts(ModelPair(reference, obf_model, key, device), nll=True))


def fidelity_steps(prompts: int | None, tokenizer, corpus_texts_n: int) -> int:
    """How many texts ``fidelity_report`` measures (for a progress bar's total): prompts, then corpus texts."""
    n_prompts = len(BUILTIN_PROMPTS[:prompts] if prompts else BUILTIN_PROMPTS)
    return n_prompts + (corpus_texts_n if tokenizer is not None and corpus_texts_n else 0)


@dataclass
class ReportTexts:
    """The ids ``fidelity_report`` measures: the built-in prompts, and (with a tokenizer) the corpus texts."""
    prompts: list[list[int]]
    corpus: list[list[int]] | None = None
    corpus_provenance: str | None = None
    max_tokens: int = 128

    @property
    def count(self) -> int:
        return len(self.prompts) + len(self.corpus or [])


def report_texts(key: KeyFile, tokenizer, prompts: int | None = None, corpus: str | None = None,
                 corpus_texts_n: int = 32, max_tokens: int = 128) -> ReportTexts:
    texts = ReportTexts(builtin_prompt_ids(tokenizer, key.vocab_size, prompts), max_tokens=max_tokens)
    if tokenizer is not None and corpus_texts_n:
        corpus_list, texts.corpus_provenance = corpus_texts(corpus, corpus_texts_n)
        texts.corpus = corpus_ids(tokenizer, corpus_list, max_tokens)
    return texts


class ReportReferences:
    """The plaintext side of ``fidelity_report`` (see ``PlainReference``): the model can be freed after this.
    ``texts``: the ids to run (``report_texts``; by default from the other arguments). ``store`` and ``scope``:
    texts whose records an earlier run kept are not run; ``progress`` advances once per text."""

    def __init__(self, plain_model, key: KeyFile, tokenizer, prompts: int | None = None, greedy_tokens: int = 24,
                 corpus: str | None = None, corpus_texts_n: int = 32, max_tokens: int = 128, device=None,
                 spill_dir: str | Path | None = None, texts: ReportTexts | None = None,
                 progress: Progress | None = None, store: ResultStore | None = None, scope: str = "",
                 also_scope: str = ""):
        dev = place_models(device, plain_model)
        if texts is None:
            texts = report_texts(key, tokenizer, prompts, corpus, corpus_texts_n, max_tokens)
        eos = key.special_tokens.get("eos_token_id")
        done = [r is not None for r in kept_records(store, texts.prompts, greedy_tokens, False, "prompts", scope)]
        if also_scope:  # a second comparison of the prompts (``also_scope``) must have kept its records too
            done = [d and r is not None for d, r in
                    zip(done, kept_records(store, texts.prompts, greedy_tokens, False, "prompts", also_scope))]
        self.prompts = PlainReference(plain_model, texts.prompts, greedy_tokens, eos, dev,
                                      _subdir(spill_dir, "prompts"), skip=done, progress=progress)
        self.corpus: PlainReference | None = None
        self.corpus_provenance, self.max_tokens = texts.corpus_provenance, texts.max_tokens
        if texts.corpus is not None:
            done = [r is not None for r in kept_records(store, texts.corpus, 0, True, "corpus", scope)]
            self.corpus = PlainReference(plain_model, texts.corpus, 0, eos, dev, _subdir(spill_dir, "corpus"),
                                         skip=done, progress=progress)


def _subdir(parent: str | Path | None, name: str) -> Path | None:
    if parent is None:
        return None
    path = Path(parent) / name
    path.mkdir()
    return path


def fidelity_report(plain_model, obf_model, key: KeyFile, tokenizer, prompts: int | None = None,
                    greedy_tokens: int = 24, corpus: str | None = None, corpus_texts_n: int = 32,
                    max_tokens: int = 128, device=None, progress: Progress | None = None,
                    store: ResultStore | None = None, scope: str = "") -> dict:
    """Everything at once: prompt fidelity (built-in chat prompts), corpus top-1/KL and perplexity (one forward
    pass of each model per corpus text), on ``device`` (models moved there in place; None = where they are).
    The plaintext side is taken first (``ReportReferences``). ``progress`` (advancing once per text compared,
    ``fidelity_steps`` of them) and ``store``: as for ``measure_texts``."""
    dev = place_models(device, plain_model, obf_model)
    texts = report_texts(key, tokenizer, prompts, corpus, corpus_texts_n, max_tokens)
    if progress is not None and texts.corpus is not None and len(texts.corpus) < corpus_texts_n:
        progress.set_total(progress.total - (corpus_texts_n - len(texts.corpus)))  # short or missing texts
    references = ReportReferences(plain_model, key, tokenizer, greedy_tokens=greedy_tokens, device=dev, texts=texts,
                                  store=store, scope=scope)
    return report_with_references(references, obf_model, key, dev, progress=progress, store=store, scope=scope)


def report_with_references(references: ReportReferences, obf_model, key: KeyFile, device=None,
                           progress: Progress | None = None, store: ResultStore | None = None,
                           scope: str = "") -> dict:
    """``fidelity_report`` with the plaintext side already taken: only ``obf_model`` is needed. ``progress``,
    ``store`` and ``scope``: as for ``measure_texts``."""
    kept = dict(progress=progress, store=store, scope=scope)
    fid = compare_with_reference(references.prompts, obf_model, key, device, **kept)
    report = {"prompts": fid.to_dict()}
    if references.corpus is not None:
        records = measure_texts(ModelPair(references.corpus, obf_model, key, device), nll=True, section="corpus",
                                **kept)
        teacher_forced = fidelity_of(records, 0).to_dict()
        for k in ("greedy_match_rate", "greedy_tokens"):  # no greedy continuation is run on corpus text
            teacher_forced.pop(k)
        report["corpus"] = {"provenance": references.corpus_provenance, "max_tokens": references.max_tokens,
                            **teacher_forced, "perplexity": perplexity_of(records).to_dict()}
    return report


def load_and_report(src: str | Path, server_dir: str | Path, key_path: str | Path, device=None,
                    progress: bool = False, results: str | Path | None = None, prompts: int | None = None,
                    greedy_tokens: int = 24, corpus: str | None = None, corpus_texts_n: int = 32,
                    max_tokens: int = 128) -> dict:
    """``fidelity_report`` of the obfuscated directory against its source, on ``device`` (default cpu; an invalid
    or absent device is refused before anything is loaded). One model is in memory at a time: the plaintext
    model's outputs are taken (its logits kept in a temporary directory) and it is freed before the obfuscated
    model loads. ``progress``: a bar on stderr, two steps per text (the plaintext model's pass, then the
    obfuscated model's); ``results``: a JSON file that keeps every text's measurement as it is made, so a rerun
    with the same file resumes (aloepri.storage.results): neither model is run again on a text it holds."""
    from ..runtime import inference
    from ..keyfile import check_key_matches, load_key

    dev = resolve_device(device)
    key = load_key(key_path)
    check_key_matches(key, server_dir)
    tok = inference.load_tokenizer(key, src if Path(src).is_file() else None)
    store = ResultStore(results) if results is not None else None
    scope = record_scope(src, server_dir, key, dev)
    texts = report_texts(key, tok, prompts, corpus, corpus_texts_n, max_tokens)
    # an output narrower than float32 is read against plaintext rounded to its precision on the same prompts
    dtype = stored_precision(server_dir)
    narrow = needs_precision_reference(dtype)
    ref_scope = precision_scope(scope, dtype) if narrow else ""
    with tempfile.TemporaryDirectory(prefix="aloepri-reference-") as spill:
        plain = inference.load_plain_model(src, device=dev)
        steps = 2 * texts.count + (len(texts.prompts) if narrow else 0)
        with Progress(steps, "fidelity", unit="step", enabled=progress) as bar:
            bar.start("plaintext model")
            references = ReportReferences(plain, key, tok, greedy_tokens=greedy_tokens, device=dev,
                                          spill_dir=spill, texts=texts, progress=bar, store=store, scope=scope,
                                          also_scope=ref_scope)
            at_precision = compare_at_precision(references.prompts, plain, dtype, dev, bar, store, scope)
            del plain
            release_memory()
            bar.start("obfuscated model")
            obf = inference.load_obfuscated_model(server_dir, device=dev)
            report = report_with_references(references, obf, key, dev, progress=bar, store=store, scope=scope)
    report["prompts"].update(fidelity_verdict(report["prompts"], at_precision, dtype))
    return report


# --- the reference a fidelity figure is read against ------------------------------------------------------------

WIDE_FLOATS = (torch.float32, torch.float64)


def stored_precision(model_dir: str | Path) -> torch.dtype | None:
    """The float an obfuscated checkpoint is stored in (its config's ``dtype`` / ``torch_dtype``); None when it
    does not say or is quantized (an engine's own format)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("quantization_config") is not None:
        return None
    name = str(config.get("dtype") or config.get("torch_dtype") or "").replace("torch.", "")
    dtype = getattr(torch, name, None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def needs_precision_reference(dtype: torch.dtype | None) -> bool:
    """Whether an output in ``dtype`` is read against plaintext rounded to it (narrower than float32) rather than
    against plaintext itself."""
    return dtype is not None and dtype not in WIDE_FLOATS


@torch.no_grad()
def round_weights_(model, dtype: torch.dtype):
    """``model`` with every floating parameter rounded to ``dtype`` and kept in its own dtype (in place): the
    plaintext model as it would be stored at an output's precision, computed as the obfuscated one is."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype).to(p.dtype)
    return model


def precision_scope(scope: str, dtype: torch.dtype) -> str:
    """The record scope of the plaintext-rounded-to-``dtype`` reference beside a fidelity run's ``scope``."""
    return json.dumps([scope, "plaintext rounded to", str(dtype)])


def compare_at_precision(reference: "PlainReference", plain_model, dtype: torch.dtype | None, device=None,
                         progress: Progress | None = None, store: ResultStore | None = None,
                         scope: str = "") -> dict | None:
    """The reference a fidelity figure of an output stored in ``dtype`` is read against: ``plain_model`` rounded to
    ``dtype`` (in place: the caller frees it next) compared with its own float outputs on ``reference``'s texts;
    None when ``dtype`` needs no such reference (float32 or wider: plaintext itself is the reference). ``scope``:
    that of the main comparison (``precision_scope`` derives this one's)."""
    if not needs_precision_reference(dtype):
        return None
    if progress is not None:
        progress.start(f"plaintext at {_dtype_name(dtype)}")
    return compare_with_reference(reference, round_weights_(plain_model, dtype), None, device, progress=progress,
                                  store=store, scope=precision_scope(scope, dtype)).to_dict()


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "the source's precision"


def fidelity_verdict(fid: dict, reference: dict | None, dtype: torch.dtype | None) -> dict:
    """One word for a prompt-fidelity figure, read against what the output's precision allows.

    - no reference (a float32 or wider output): ``lossless`` when every position's top token and every greedy
      continuation agree with plaintext, else ``lossy``;
    - a reference (plaintext rounded to a narrower output precision, measured on the same prompts): ``as plaintext
      at <dtype>`` when the top-1 agreement is within two standard errors of the reference's (a key moves it by
      about that much) and the mean KL is at most 3x the reference's, else ``lossy``."""
    if reference is None:
        exact = fid["top1_agreement"] == 1.0 and fid["greedy_match_rate"] == 1.0
        word = "lossless" if exact else "lossy"
        why = ("every top token and greedy continuation equals plaintext's" if exact else
               "top tokens or greedy continuations differ from plaintext's")
        return {"verdict": word, "reference": {"what": f"plaintext ({_dtype_name(dtype)})", "top1_agreement": 1.0,
                                               "mean_kl": 0.0, "greedy_match_rate": 1.0}, "why": why}
    q, n = 1.0 - reference["top1_agreement"], max(1, reference["positions"])
    tolerance = max(0.005, 2 * math.sqrt(2 * q * (1 - q) / n))
    close_top1 = fid["top1_agreement"] >= reference["top1_agreement"] - tolerance
    close_kl = fid["mean_kl"] <= 3 * reference["mean_kl"] + 1e-9
    name = _dtype_name(dtype)
    word = f"as plaintext at {name}" if close_top1 and close_kl else "lossy"
    why = (f"top-1 {fid['top1_agreement']:.3f} against plaintext {name}'s {reference['top1_agreement']:.3f} "
           f"(tolerance {tolerance:.3f}); KL {fid['mean_kl']:.2e} against {reference['mean_kl']:.2e} (at most 3x)")
    return {"verdict": word, "reference": {"what": f"plaintext with its weights rounded to {name}, the same prompts",
                                           **{k: reference[k] for k in ("top1_agreement", "mean_kl",
                                                                         "greedy_match_rate")}}, "why": why}


def verdict_line(fid: dict, verdict: dict) -> str:
    """The verdict in one line for a terminal, with the reference beside each figure."""
    ref = verdict["reference"]
    return (f"fidelity: {verdict['verdict']} -- top-1 {fid['top1_agreement']:.3f} (reference "
            f"{ref['top1_agreement']:.3f}), greedy match {fid['greedy_match_rate']:.2f} (reference "
            f"{ref['greedy_match_rate']:.2f}), KL {fid['mean_kl']:.2e} (reference {ref['mean_kl']:.2e}); reference: "
            f"{ref['what']}")


def release_memory() -> None:
    """Return a freed model's memory: collect it (transformers modules hold reference cycles) and hand the freed
    heap back to the OS (glibc keeps large freed arenas otherwise, and the next model would be counted on top)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass


__all__ = ["BUILTIN_PROMPTS", "Fidelity", "ModelPair", "Perplexity", "PlainReference", "ReportReferences",
           "ReportTexts", "builtin_prompt_ids", "compare", "compare_with_reference", "corpus_ids", "corpus_texts",
           "fidelity_report", "fidelity_steps", "kept_records", "load_and_report", "measure_texts",
           "perplexity_pair", "perplexity_with_reference", "record_scope", "release_memory", "report_texts",
           "report_with_references", "stdlib_docstring_paragraphs"]
