"""The verdict of an audit in plain words, one per observer, following the measured numbers.

Rules (never an over-claim):
- the figure is the best recovery (TTRSR: fraction of the private prompts' tokens recovered exactly) of the attacks
  that ran; an attack that did not run or failed contributes nothing, and then the figure is a lower bound, which
  the text says, together with which attacks are missing and why;
- no attack ran for an observer: the verdict is "unknown", whatever else ran;
- a low figure is what these attacks achieved, never "safe": the wording says so even when every attack ran.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .plan import ID_STREAM, OBSERVERS, PROVIDER

# (lowest recovery, level, what the observer can do) from the top; the first row whose bound is met applies
LEVELS: tuple[tuple[float, str, str], ...] = (
    (0.9, "reads", "can read your prompts"),
    (0.5, "reads_most", "can read most of your prompts"),
    (0.1, "reads_part", "can read part of your prompts"),
    (0.0, "little", "recovered little of your prompts with the attacks that ran"),
)

RAN, SKIPPED, FAILED = "ran", "skipped", "failed"


@dataclass
class ObserverVerdict:
    observer: str  # id_stream | provider
    who: str  # the observer in words
    level: str  # reads | reads_most | reads_part | little | unknown
    recovery: float | None  # best TTRSR over the attacks that ran for this observer
    attack: str | None  # the attack that reached it
    lower_bound: bool  # some applicable attack did not run or failed
    not_run: list[str] = field(default_factory=list)  # "name: why" of the applicable attacks that did not run
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def below_maximum(recovery: float) -> bool:
    """Whether a figure, as printed, is below 100%: only then can an attack that did not run raise it, and only
    then do the words 'at least' / 'a lower bound' mean anything."""
    return _pct(recovery) != _pct(1.0)


def level_for(recovery: float) -> tuple[str, str]:
    for bound, level, words in LEVELS:
        if recovery >= bound:
            return level, words
    return LEVELS[-1][1], LEVELS[-1][2]


def observer_verdict(observer: str, attacks: Sequence[dict[str, Any]]) -> ObserverVerdict:
    """``attacks``: the report's attack entries (name, observer, status, applicable, ttrsr, reason / error).
    The provider also sees the id stream, so the id-stream attacks count against it too."""
    mine = [a for a in attacks if observer == PROVIDER or a["observer"] == observer]
    ran = [a for a in mine if a["status"] == RAN and a.get("ttrsr") is not None]
    absent = [a for a in mine if a.get("applicable", True) and a not in ran]
    missing = [f"{a['name']}: {a.get('reason') or a.get('error') or a['status']}" for a in absent]
    who = OBSERVERS[observer]
    if not ran:
        text = (f"Unknown: no attack of this audit ran against {who}, so this audit says nothing about what they "
                f"can read. Do not read it as safety. Not run: {_grouped(absent)}.")
        return ObserverVerdict(observer, who, "unknown", None, None, True, missing, text)
    best = max(ran, key=lambda a: a["ttrsr"])
    rec = float(best["ttrsr"])
    level, words = level_for(rec)
    subject = who[0].upper() + who[1:] + ("," if "," in who else "")
    text = f"{subject} {words}: {best['name']} recovered {_pct(rec)} of the private prompt tokens."
    if observer == ID_STREAM:
        volume = best.get("tokens_observed")
        text += (f" That is for the {volume:,} tokens of traffic this audit showed it" if volume else
                 " That is for the traffic this audit showed it") + (
            "; a log reader who sees more traffic reads more (measured volume curves: docs/security.md, "
            "\"The observer of the logs\").")
    if level == "little":
        text += (" That is what these attacks achieved, not a guarantee: a stronger or longer attack may recover "
                 "more.")
    if absent and below_maximum(rec):
        text += (f" {len(absent)} attack(s) did not run ({_grouped(absent)}), so {_pct(rec)} is a lower bound "
                 "and cannot be read as safety.")
    elif absent:
        text += f" {len(absent)} attack(s) did not run ({_grouped(absent)}); they could not raise this figure."
    return ObserverVerdict(observer, who, level, rec, best["name"], bool(absent), missing, text)


def _grouped(absent: Sequence[dict[str, Any]]) -> str:
    """'outside the 'ci' budget: a, b; failed: c' (the full reasons are in the table and in ``not_run``)."""
    groups: dict[str, list[str]] = {}
    for a in absent:
        groups.setdefault(a.get("why") or a["status"], []).append(a["name"])
    return "; ".join(f"{why}: {', '.join(names)}" for why, names in groups.items())


def verdicts(attacks: Sequence[dict[str, Any]]) -> dict[str, ObserverVerdict]:
    return {obs: observer_verdict(obs, attacks) for obs in (ID_STREAM, PROVIDER)}


def headline(v: dict[str, ObserverVerdict]) -> str:
    """One sentence for the top of the report: the provider's verdict (the strongest observer)."""
    p = v[PROVIDER]
    if p.level == "unknown":
        return "Unknown: no attack by the provider ran, so this audit cannot tell who can read your prompts."
    head = f"The provider {level_for(p.recovery)[1]}: {p.attack} recovered {_pct(p.recovery)} of the private prompt tokens"
    lower = p.lower_bound and below_maximum(p.recovery)
    return head + ("; a lower bound, since some attacks did not run." if lower else ".")
