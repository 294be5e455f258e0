"""Which attacks an audit runs, against which observer, at which budget.

Two observers, as a user meets them:

- ``id_stream``: someone who reads the obfuscated token ids (request logs, a network tap, another tenant) and, the
  model being open-weight, holds the public model, tokenizer and chat template, but neither the obfuscated weights
  nor the key. The id-stream decipherers (with and without the public model) and the frequency attacks (TFMA,
  SDA) are theirs; their figure holds for the volume of traffic the audit shows them (its prompts), and grows
  with more.
- ``provider``: the server that hosts the obfuscated model and can download the public plaintext model. It sees
  the id stream too, so every attack counts against it: the weight attacks (VMA, Gate-IA, Attn-IA), the state
  inversions (ISA, IMA), the behavioural attacks (running both models) and the MoE routing leak.

Attacks that read the key for more than scoring (``ridge-k*``, ``ima_oracle``, ``routing_leak_oracle``) model
an attacker who already knows part of the secret: outside the threat model, so an audit never runs them.
"""
from __future__ import annotations

from dataclasses import dataclass

BUDGETS = ("ci", "small", "full")

ID_STREAM = "id_stream"
PROVIDER = "provider"
OBSERVERS = {
    ID_STREAM: "an observer of the logs, who holds the public model",
    PROVIDER: "the provider, who holds the public model",
}


@dataclass(frozen=True)
class PlannedAttack:
    name: str  # registry name (aloepri.attacks.REGISTRY)
    observer: str
    budgets: tuple[str, ...]  # the budgets that run it
    needs_tokenizer: bool = False  # tokenizes public text (frequency attacks)
    moe_only: bool = False


# The two weight attacks first: Gate-IA takes seconds and VMA minutes, and where they read every prompt token the
# provider's figure is final (run_audit does not run what cannot change it). Then the strongest (measured highest
# recovery), the cheap frequency attacks before the slower state inversions, so that a partial report (an audit
# stopped midway) already holds the figures that matter most.
PLAN: tuple[PlannedAttack, ...] = (
    PlannedAttack("gate-ia", PROVIDER, BUDGETS),
    PlannedAttack("vma", PROVIDER, BUDGETS),
    PlannedAttack("behavioural-composed", PROVIDER, BUDGETS),
    PlannedAttack("behavioural", PROVIDER, ("small", "full")),
    PlannedAttack("stream-decipher", ID_STREAM, BUDGETS, needs_tokenizer=True),
    PlannedAttack("stream-decipher-lm", ID_STREAM, BUDGETS, needs_tokenizer=True),
    PlannedAttack("tfma", ID_STREAM, BUDGETS, needs_tokenizer=True),
    PlannedAttack("tfma-domain-aware", ID_STREAM, BUDGETS, needs_tokenizer=True),
    PlannedAttack("tfma-zero-knowledge", ID_STREAM, BUDGETS, needs_tokenizer=True),
    PlannedAttack("isa_anchor", PROVIDER, BUDGETS),
    PlannedAttack("routing_leak", PROVIDER, BUDGETS, moe_only=True),
    PlannedAttack("freq-ridge", PROVIDER, ("small", "full"), needs_tokenizer=True),
    PlannedAttack("attn-ia-sorted", PROVIDER, ("small", "full")),
    PlannedAttack("sda-distribution-aware", ID_STREAM, ("small", "full"), needs_tokenizer=True),
    PlannedAttack("attn-ia", PROVIDER, ("full",)),
    PlannedAttack("nn", PROVIDER, ("full",)),
    PlannedAttack("isa_hidden", PROVIDER, ("full",)),
    PlannedAttack("isa_attention", PROVIDER, ("full",)),
    PlannedAttack("ima", PROVIDER, ("full",)),
    PlannedAttack("sda-domain-aware", ID_STREAM, ("full",), needs_tokenizer=True),
    PlannedAttack("sda-zero-knowledge", ID_STREAM, ("full",), needs_tokenizer=True),
)


def smallest_budget_running(attack: PlannedAttack) -> str:
    return next(b for b in BUDGETS if b in attack.budgets)


def why_not_run(attack: PlannedAttack, budget: str, registered: set[str], unavailable: dict[str, str],
                has_tokenizer: bool, is_moe: bool) -> tuple[str, str, bool] | None:
    """None to run the attack; else (reason, short reason, whether it would apply to this model at all).

    An attack that does not apply (the routing leak on a dense model) leaves nothing unmeasured; every other
    reason does, and the verdict then calls its figure a lower bound."""
    if attack.moe_only and not is_moe:
        return "does not apply: the model has no routed experts (dense feed-forward)", "does not apply", False
    if attack.name not in registered:
        missing = "; ".join(unavailable.values())
        return (f"not installed ({missing})" if missing else "not available in this aloepri"), "not installed", True
    if budget not in attack.budgets:
        return (f"outside the '{budget}' budget (runs with --budget {smallest_budget_running(attack)})",
                f"outside the '{budget}' budget", True)
    if attack.needs_tokenizer and not has_tokenizer:
        return ("the plaintext model ships no tokenizer, and this attack tokenizes public text",
                "needs a tokenizer", True)
    return None
