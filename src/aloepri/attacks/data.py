"""Victim data for the attack suite: Faker-generated PII prompts, and the frequency attacks' settings over the
public text corpora (provenance in docs/data.md).

PII prompts: realistic templates (emails, support tickets, forms, chat requests) filled with Faker values; every
PII value's character span is recorded while the text is built, and a token is PII when its offsets overlap one.

Corpora: ``aloepri.corpora`` (python-docs, debian-reference, fortunes).

The paper's three frequency-attack settings (Section "Information Leakage of Token Frequency"), with the client's
private text always a seeded half of ``python-docs`` (split by source file, so no document is in both halves):
- ``zero-knowledge``      attacker prior = ``fortunes`` (public general text, nothing about the client's data);
- ``domain-aware``        attacker prior = ``debian-reference`` (same domain, computing documentation, other source);
- ``distribution-aware``  attacker prior = the other half of ``python-docs`` (same distribution, disjoint files).
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable

import numpy as np

from ..corpora import corpus, documents
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


# --- the paper's frequency-attack settings over the public corpora ------------------------------------------

SETTINGS = ("zero-knowledge", "domain-aware", "distribution-aware")


def _split_python_docs(seed: int) -> tuple[list[str], list[str]]:
    """Seeded split of python-docs by file into (client-private, held-out same-distribution) halves."""
    docs = documents("python-docs")
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
