"""Victim data for the attack suite: Faker-generated PII prompts, and real public text corpora for the
frequency attacks (provenance in docs/data.md).

PII prompts: realistic templates (emails, support tickets, forms, chat requests) filled with Faker values; every
PII value's character span is recorded while the text is built, and a token is PII when its offsets overlap one.

Corpora (all read from Debian packages installed offline; ``corpus(name)`` raises a clear error when missing):
- ``python-docs``      Python 3.11 documentation sources (reStructuredText), package ``python3.11-doc``.
- ``debian-reference`` the Debian Reference manual (plain text), package ``debian-reference-en``.
- ``fortunes``         BSD fortune(6) cookie files: general English quotes, jokes, poems, package ``fortunes``
                       (the computing-themed files are left out so it stays out of the client's domain).

The paper's three frequency-attack settings (Section "Information Leakage of Token Frequency"), with the client's
private text always a seeded half of ``python-docs`` (split by source file, so no document is in both halves):
- ``zero-knowledge``      attacker prior = ``fortunes`` (public general text, nothing about the client's data);
- ``domain-aware``        attacker prior = ``debian-reference`` (same domain, computing documentation, other source);
- ``distribution-aware``  attacker prior = the other half of ``python-docs`` (same distribution, disjoint files).
"""
from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from .base import PrivateData

# --- PII prompts ----------------------------------------------------------------------------------------------

# Each template is a sequence of literal text and {field} placeholders; the fields are PII kinds below.
_TEMPLATES: tuple[str, ...] = (
    "Subject: Update my billing details\n\nHi team,\n\nPlease update the card on file for {name} to {cc}. "
    "The billing address is {address}. You can reach me at {phone} or {email}.\n\nThanks,\n{first}",
    "Support ticket #{ticket}\nCustomer: {name}\nDate of birth: {dob}\nSSN: {ssn}\nPhone: {phone}\n"
    "Issue: I was charged twice on account {account} and need a refund as soon as possible.",
    "Can you help me write a short letter to my landlord? My name is {name}, I live at {address}, and I want "
    "to say that the rent for account {account} will be paid late this month.",
    "NEW PATIENT INTAKE FORM\nFull name: {name}\nDOB: {dob}\nAddress: {address}\nPhone: {phone}\n"
    "Email: {email}\nInsurance member ID: {member_id}\nReason for visit: persistent headaches.",
    "Hello, I lost my credit card ending in {cc_last4}. The full number was {cc} and it expires {cc_exp}. "
    "My social security number is {ssn}. What should I do first?",
    "Dear {name},\n\nYour loan application has been approved. Please confirm that your date of birth is {dob} "
    "and your checking account number is {account} (routing {routing}).\n\nBest regards,\n{name2}\n{company}",
    "I'm {name} and my email is {email}. Please summarize this note for me: call {name2} at {phone} about "
    "the delivery to {address} before Friday.",
    "EMPLOYMENT VERIFICATION\nEmployee: {name}\nEmployee ID: {employee_id}\nSSN: {ssn}\nHome address: {address}\n"
    "Start date: {date}\nPlease verify the above and reply to {email}.",
    "Translate to French: 'Hi, this is {name}. My phone number is {phone} and my passport number is "
    "{passport}. I will arrive on {date}.'",
    "Chat: hey, my IBAN is {iban} and my name is {name}. can you check if a transfer to {name2} at "
    "{address} would arrive by tomorrow?",
)

_FIELD = re.compile(r"\{(\w+)\}")


def _pii_values(fake) -> dict[str, Callable[[], str]]:
    return {
        "name": fake.name, "name2": fake.name, "first": fake.first_name,
        "address": lambda: fake.address().replace("\n", ", "),
        "phone": fake.phone_number, "email": fake.email, "ssn": fake.ssn,
        "account": lambda: fake.bothify("##########"), "routing": fake.aba, "iban": fake.iban,
        "cc": fake.credit_card_number, "cc_last4": lambda: fake.bothify("####"),
        "cc_exp": fake.credit_card_expire, "dob": lambda: fake.date_of_birth(minimum_age=18).isoformat(),
        "date": lambda: fake.date_this_year().strftime("%B %d, %Y"),
        "member_id": lambda: fake.bothify("???#######").upper(),
        "employee_id": lambda: fake.bothify("EMP-#####"), "passport": fake.passport_number,
        "company": fake.company,
    }


# Fields that are filled but are not personal data (the ticket number identifies the ticket, not a person).
_NON_PII = {"ticket", "company"}


def render_pii_prompt(template: str, fake) -> tuple[str, list[tuple[int, int]]]:
    """Fill ``template`` with Faker values; return the text and the character spans of the PII values."""
    values = _pii_values(fake)
    values["ticket"] = lambda: fake.bothify("######")
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for m in _FIELD.finditer(template):
        parts.append(template[pos:m.start()])
        field = m.group(1)
        if field not in values:
            raise KeyError(f"template field {{{field}}} has no Faker generator")
        value = str(values[field]())
        start = sum(len(p) for p in parts)
        parts.append(value)
        if field not in _NON_PII:
            spans.append((start, start + len(value)))
        pos = m.end()
    parts.append(template[pos:])
    return "".join(parts), spans


def pii_token_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` (no special tokens) and, per token, whether its character offsets overlap a PII span."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("pii_token_mask needs a fast tokenizer (offsets mapping); got "
                        f"{type(tokenizer).__name__}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s < e_tok and b_tok < e for (s, e) in spans) for (b_tok, e_tok) in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def private_prompts(tokenizer, n: int = 50, seed: int = 0) -> PrivateData:
    """``n`` realistic prompts carrying Faker PII (names, addresses, phones, emails, SSN / account / card / IBAN
    numbers, dates of birth), cycling through the templates; deterministic in ``seed``."""
    from faker import Faker

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    fake = Faker("en_US")
    fake.seed_instance(seed)
    order = np.random.default_rng(seed).permutation(len(_TEMPLATES))
    texts, ids, masks = [], [], []
    for i in range(n):
        text, spans = render_pii_prompt(_TEMPLATES[order[i % len(_TEMPLATES)]], fake)
        tok_ids, mask = pii_token_mask(tokenizer, text, spans)
        texts.append(text)
        ids.append(tok_ids)
        masks.append(mask)
    return PrivateData(texts, ids, masks)


# --- public text corpora --------------------------------------------------------------------------------------


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
def _load(name: str) -> tuple[tuple[str, str], ...]:
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
    return [t for _, t in _load(name)]


def corpus_ids(name: str) -> list[str]:
    return [i for i, _ in _load(name)]


SETTINGS = ("zero-knowledge", "domain-aware", "distribution-aware")


def _split_python_docs(seed: int) -> tuple[list[str], list[str]]:
    """Seeded split of python-docs by file into (client-private, held-out same-distribution) halves."""
    docs = _load("python-docs")
    # hash of (seed, file) gives a split stable across file-order changes and independent of other RNG use
    key = [int(hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:8], 16) for i, _ in docs]
    order = np.argsort(key, kind="stable")
    half = len(docs) // 2
    private = [docs[j][1] for j in sorted(order[:half])]
    held_out = [docs[j][1] for j in sorted(order[half:])]
    return private, held_out


def frequency_setting(setting: str, seed: int = 0) -> tuple[list[str], list[str]]:
    """(attacker prior texts, client private texts) for one of the paper's three knowledge settings."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {SETTINGS}")
    private, held_out = _split_python_docs(seed)
    prior = {"zero-knowledge": lambda: corpus("fortunes"), "domain-aware": lambda: corpus("debian-reference"),
             "distribution-aware": lambda: held_out}[setting]()
    return prior, private


def tokenize_texts(tokenizer, texts: list[str], max_tokens: int | None = None) -> np.ndarray:
    """Concatenated token ids of ``texts`` (no special tokens), cut at ``max_tokens``."""
    out: list[int] = []
    for t in texts:
        out.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if max_tokens is not None and len(out) >= max_tokens:
            return np.asarray(out[:max_tokens], dtype=np.int64)
    return np.asarray(out, dtype=np.int64)
