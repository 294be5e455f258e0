"""The public text corpora by name, read from Debian packages installed offline (provenance in docs/data.md).

- ``python-docs``      Python 3.11 documentation sources (reStructuredText), package ``python3.11-doc``.
- ``debian-reference`` the Debian Reference manual (plain text), package ``debian-reference-en``.
- ``fortunes``         BSD fortune(6) cookie files: general English quotes, jokes, poems, package ``fortunes``
                       (the computing-themed files are left out so it stays out of the client's domain).

They feed the frequency attacks' settings and the IMA attacker's own text (aloepri.attacks), the fidelity
perplexity (aloepri.eval.fidelity) and the sensitivity pass of the fisher noise shape (aloepri.runtime.sensitivity).
``corpus(name)`` raises ``CorpusNotInstalledError`` naming the package when one is missing.
"""
from __future__ import annotations

import gzip
import re
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np


class CorpusNotInstalledError(RuntimeError):
    pass


@dataclass(frozen=True)
class CorpusSource:
    name: str
    debian_package: str
    path: Path
    description: str


PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DEBIAN_REFERENCE = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
FORTUNES = Path("/usr/share/games/fortunes")
# fortune files about computing are left out of the zero-knowledge prior (they would leak the client's domain)
_FORTUNE_SKIP = {"computers", "linux", "linuxcookie", "debian", "perl", "art", "ascii-art", "translate-me"}

SOURCES = {
    "python-docs": CorpusSource("python-docs", "python3.11-doc", PYTHON_DOCS,
                                "Python 3.11 documentation, reStructuredText sources, one document per file"),
    "debian-reference": CorpusSource("debian-reference", "debian-reference-en", DEBIAN_REFERENCE,
                                     "Debian Reference manual (plain text), one document per section"),
    "fortunes": CorpusSource("fortunes", "fortunes", FORTUNES,
                             "BSD fortune cookie files (non-computing themes), one document per file"),
}


def _require(src: CorpusSource) -> None:
    if not src.path.exists():
        raise CorpusNotInstalledError(
            f"corpus {src.name!r} needs the Debian package {src.debian_package} ({src.path} is missing): "
            f"apt-get install --no-install-recommends {src.debian_package}")


def _clean_rst(text: str) -> str:
    # drop directive/comment lines and role markup, keep the prose and code a reader of the docs sees
    lines = [ln for ln in text.splitlines()
             if not re.match(r"\s*\.\. ", ln) and not re.fullmatch(r"[=\-~^*#+\"']{3,}", ln.strip())]
    text = "\n".join(lines)
    text = re.sub(r":[\w:+-]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


@lru_cache(maxsize=None)
def documents(name: str) -> tuple[tuple[str, str], ...]:
    """(document id, text) pairs of a corpus, in a fixed order."""
    if name not in SOURCES:
        raise ValueError(f"unknown corpus {name!r}; choose from {sorted(SOURCES)}")
    src = SOURCES[name]
    _require(src)
    docs: list[tuple[str, str]] = []
    if name == "python-docs":
        for p in sorted(src.path.rglob("*.rst.txt")):
            if p.name.startswith(("license", "copyright")):
                continue  # boilerplate legal text, not documentation prose
            t = _clean_rst(p.read_text(encoding="utf-8", errors="replace"))
            if t:
                docs.append((str(p.relative_to(src.path)), t))
    elif name == "debian-reference":
        raw = gzip.open(src.path, "rt", encoding="utf-8", errors="replace").read()
        # sections start with a numbered heading line like "1.2.3. Title"
        parts = re.split(r"\n(?=\d+(?:\.\d+)+\.\s+\S)", raw)
        # the table of contents splits into one-line pieces: keep sections with real prose only
        docs = [(f"section-{i:04d}", t.strip()) for i, t in enumerate(parts) if len(t.split()) >= 20]
    elif name == "fortunes":
        for p in sorted(src.path.glob("*.u8")):
            if p.stem in _FORTUNE_SKIP:
                continue
            items = [t.strip() for t in p.read_text(encoding="utf-8", errors="replace").split("\n%\n")]
            docs.append((p.stem, "\n\n".join(t for t in items if t)))
    return tuple(docs)


def corpus(name: str) -> list[str]:
    """All documents of a public corpus ('python-docs', 'debian-reference', 'fortunes')."""
    return [t for _, t in documents(name)]


def document_ids(name: str) -> list[str]:
    """The documents' ids (file or section names) of a corpus, in the order of ``corpus(name)``."""
    return [i for i, _ in documents(name)]


@dataclass
class _Encoded:
    ids: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: int = 0


# tokenizer -> the texts it encoded and their ids (weakly keyed: dropped with the tokenizer), bounded below
_ENCODED: "weakref.WeakKeyDictionary[object, _Encoded]" = weakref.WeakKeyDictionary()
ENCODED_MAX_TOKENS = 4_000_000  # per tokenizer (32 MB of ids): past it the memo starts afresh


def encode_text(tokenizer, text: str) -> np.ndarray:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` as a read-only int64 array, each text encoded
    once per tokenizer and process: the attacks of one run (``aloepri attack all``, the audit) read the same public
    text (fortunes and debian-reference: SDA, IMA, the log reader; python-docs: the frequency settings; the
    stdlib: the behavioural attacks), each from scratch before. A tokenizer that cannot be weakly referenced is
    not remembered (every call encodes)."""
    try:
        memo = _ENCODED.get(tokenizer)
        if memo is None:
            memo = _ENCODED[tokenizer] = _Encoded()
    except TypeError:
        memo = _Encoded()
    ids = memo.ids.get(text)
    if ids is None:
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        ids.flags.writeable = False
        if memo.tokens + len(ids) > ENCODED_MAX_TOKENS:
            memo.ids.clear()
            memo.tokens = 0
        memo.ids[text] = ids
        memo.tokens += len(ids)
    return ids


def tokenize_texts(tokenizer, texts: Iterable[str], max_tokens: int | None = None) -> np.ndarray:
    """Concatenated token ids of ``texts`` (no special tokens), cut at ``max_tokens`` (``encode_text``: each text
    encoded once per tokenizer and process). A new array, the caller's to change."""
    parts: list[np.ndarray] = []
    n = 0
    for t in texts:
        parts.append(encode_text(tokenizer, t))
        n += len(parts[-1])
        if max_tokens is not None and n >= max_tokens:
            break
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return out[:max_tokens].copy() if max_tokens is not None else out
