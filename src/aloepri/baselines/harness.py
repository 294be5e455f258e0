"""The baselines through aloepri's own harness: the same Faker-PII prompts and TTRSR/PIIRSR scoring
(aloepri.attacks), the same fidelity numbers as `aloepri verify` / the frontier (top-1 agreement and KL of the
next-token distribution against the clean plaintext model, on the built-in chat prompts), and HumanEval pass@1
through aloepri.eval.humaneval's prompt format, greedy decoding and sandbox.

What the server (attacker) sees:
- SANTEXT / RANTEXT: the perturbed token ids in plaintext -> "direct observation": a position is recovered iff
  its token survived (TTRSR = survival rate, the paper's Table 1 convention).
- DP-Forward and SGT: the noisy states (SGT: noisy input embeddings) -> NN and IMA inversions (dp_forward.py);
  the worst of the two is reported.
Perturbation is applied to the user's own text only (chat-template tokens are public), or, for DP-Forward, to the
whole prompt's states (the mechanism privatises the matrix it sends).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..runtime.probe import single_token_states
from .dp_forward import DPForward, ima_inversion, nn_inversion, noisy_prefill, observed_states
from .sgt import SGT
from .token_substitution import RanText, SanText, TokenSubstitution, fresh_seed

METHODS = ("santext", "rantext", "dp-forward", "dp-forward-paper", "sgt")
# Mechanisms that send noisy states (``layer``, ``privatize``) rather than substituted token ids.
STATE_NOISE = (DPForward, SGT)
# The AloePri paper's appendix (Table 1 settings): SANTEXT eps 3, RANTEXT eps 30, DP-Forward eps 5 (delta assumed 1e-5).
PAPER_EPS = {"santext": 3.0, "rantext": 30.0, "dp-forward": 5.0, "dp-forward-paper": 5.0}


def make_method(name: str, model, eps: float | None, delta: float = 1e-5, layer: int | None = None,
                clip_norm: float | None = None, normalize: bool = False, sgt_params: str | None = None):
    """A baseline mechanism for ``model`` by name (see METHODS). SGT has no epsilon: it is the trained generator
    saved at ``sgt_params`` (aloepri.baselines.sgt.train_sgt)."""
    if name == "sgt":
        if sgt_params is None:
            raise ValueError("sgt needs the trained generator's file (sgt_params)")
        return SGT.load(sgt_params, model)
    if name == "santext":
        return SanText.from_model(model, eps, normalize)
    if name == "rantext":
        return RanText.from_model(model, eps, normalize)
    if name == "dp-forward":
        return DPForward.tok_ldp(model, eps, delta, 0 if layer is None else layer, clip_norm)
    if name == "dp-forward-paper":
        return DPForward.paper_setting(eps, delta, 1 if layer is None else layer)
    raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(METHODS)}")


# --- privacy -----------------------------------------------------------------------------------------------------


def _score(tokenizer, data, predicted, text_metrics: bool) -> dict:
    from ..attacks.base import score_predictions

    return score_predictions(SimpleNamespace(tokenizer=tokenizer), data, predicted, text_metrics)


def privacy(method, model, tokenizer, data, seed: int, budget: str = "small", text_metrics: bool = True,
            attacks: Sequence[str] = ("nn", "ima")) -> dict[str, Any]:
    """Attack results on the victim's PII prompts ``data`` (aloepri.attacks.PrivateData), keyed by attack name,
    plus ``worst_ttrsr``."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if isinstance(method, TokenSubstitution):
        observed = [method.perturb(ids, seed=seed * 1_000_003 + i) for i, ids in enumerate(data.plain_ids)]
        out["direct-observation"] = {**_score(tokenizer, data, observed, text_metrics),
                                     "uses": "the perturbed plaintext ids the server receives",
                                     "seconds": time.perf_counter() - t0}
    elif isinstance(method, STATE_NOISE):
        noisy = observed_states(model, method, data.plain_ids, seed)
        if "nn" in attacks:
            table = single_token_states(model, method.layer)
            out["nn"] = {**_score(tokenizer, data, nn_inversion(noisy, table), text_metrics),
                         "uses": f"noisy states after layer {method.layer}; nearest single-token state over the full "
                                 f"vocabulary ({table.shape[0]}), nothing fitted",
                         "seconds": time.perf_counter() - t0}
        if "ima" in attacks:
            from ..attacks.base import Budget
            from ..attacks.ima import IMAConfig, attacker_token_stream

            t1 = time.perf_counter()
            cfg = IMAConfig.for_budget(Budget.named(budget), layer=method.layer)
            vocab = int(model.get_input_embeddings().weight.shape[0])
            stream, provenance = attacker_token_stream(SimpleNamespace(tokenizer=tokenizer), cfg.train_tokens, seed,
                                                     vocab)
            guesses, facts = ima_inversion(model, method, noisy, stream, cfg, seed)
            out["ima"] = {**_score(tokenizer, data, guesses, text_metrics), **facts, "budget": budget,
                          "train_data": provenance,
                          "uses": "noisy states of the victim's prompts; inversion model trained on the attacker's "
                                  "public corpus privatised by the same public mechanism with its own noise",
                          "seconds": time.perf_counter() - t1}
    else:
        raise TypeError(f"not a baseline mechanism: {type(method).__name__}")
    out["worst_ttrsr"] = max(v["ttrsr"] for v in out.values() if isinstance(v, dict))
    out["worst_piirsr"] = max((v["piirsr"] or 0.0) for k, v in out.items() if isinstance(v, dict))
    return out


# --- fidelity ----------------------------------------------------------------------------------------------------


def user_content_prompts(tokenizer, n: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(chat-templated ids, positions of the user's text) for the built-in fidelity prompts."""
    from ..runtime.perturb import content_span
    from ..eval.fidelity import BUILTIN_PROMPTS

    out = []
    for p in BUILTIN_PROMPTS[:n] if n else BUILTIN_PROMPTS:
        ids, span = content_span(tokenizer, [{"role": "user", "content": p}])
        out.append((ids, list(span)))
    return out


@torch.no_grad()
def fidelity(method, model, prompts: Sequence[tuple[list[int], list[int]]], seed: int) -> dict[str, Any]:
    """Top-1 agreement and mean KL(clean || perturbed) of the next-token distribution at every prompt position
    (the same numbers aloepri.eval.fidelity.compare reports for an obfuscated model), the agreement counted only from
    the first perturbed position on, and the token change rate."""
    agree = kl = changed = perturbed_positions = agree_after = 0.0
    n_pos = n_after = 0
    for i, (ids, positions) in enumerate(prompts):
        x = torch.tensor([ids])
        clean = model(x).logits[0].double()
        if isinstance(method, TokenSubstitution):
            noisy_ids = method.perturb(ids, positions, seed=seed * 1_000_003 + i)
            changed += sum(noisy_ids[j] != ids[j] for j in positions)
            perturbed_positions += len(positions)
            other = model(torch.tensor([noisy_ids])).logits[0].double()
        else:
            with noisy_prefill(model, method, seed * 1_000_003 + i):
                other = model(x).logits[0].double()
        same = clean.argmax(-1) == other.argmax(-1)
        agree += same.sum().item()
        # positions before the first perturbed token agree for free (the public template prefix is untouched)
        first = min(positions) if isinstance(method, TokenSubstitution) and positions else 0
        agree_after += same[first:].sum().item()
        n_after += len(same) - first
        kl += F.kl_div(F.log_softmax(other, -1), F.log_softmax(clean, -1), log_target=True, reduction="sum").item()
        n_pos += clean.shape[0]
    out = {"top1_agreement": agree / n_pos, "mean_kl": kl / n_pos, "positions": n_pos, "prompts": len(prompts),
           "top1_agreement_from_first_change": agree_after / max(1, n_after), "positions_from_first_change": n_after}
    if perturbed_positions:
        out["token_change_rate"] = changed / perturbed_positions
    return out


# --- HumanEval ---------------------------------------------------------------------------------------------------


@dataclass
class BaselineRunner:
    """aloepri.eval.humaneval.Runner's interface for a baseline: the prompt (instruction and the function prefill,
    both the user's) is perturbed once; the server then decodes greedily as usual."""

    label: str
    model: Any
    tokenizer: Any
    method: Any
    seed: int
    calls: int = 0

    def complete(self, problem: dict, max_new_tokens: int) -> dict:
        from ..eval.humaneval import INSTRUCTION, _eos_ids, build_prompt_ids, greedy_until
        from ..runtime.perturb import content_span

        ids, prefill = build_prompt_ids(self.tokenizer, problem)
        chat, span = content_span(self.tokenizer, [{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}])
        if ids[: len(chat)] != chat:
            raise RuntimeError("HumanEval prompt does not start with its chat-templated instruction")
        positions = list(span) + list(range(len(chat), len(ids)))  # user text + the prefilled function
        seed = self.seed * 1_000_003 + self.calls
        self.calls += 1
        info: dict[str, Any] = {}
        if isinstance(self.method, TokenSubstitution):
            noisy = self.method.perturb(ids, positions, seed=seed)
            info["token_change_rate"] = sum(noisy[j] != ids[j] for j in positions) / max(1, len(positions))
            to_server = lambda v: noisy  # noqa: E731  (the prompt is sent once, perturbed)
            ctx = contextlib.nullcontext()
        else:
            to_server = lambda v: v  # noqa: E731
            ctx = noisy_prefill(self.model, self.method, seed)
        t0 = time.perf_counter()
        with ctx:
            gen, text, stopped = greedy_until(self.model, ids, self.tokenizer.decode, to_server, lambda v: v,
                                              _eos_ids(self.tokenizer), max_new_tokens)
        return {"completion": text, "new_tokens": len(gen), "stopped": stopped, "prompt_tokens": len(ids),
                "gen_seconds": time.perf_counter() - t0, **info}


__all__ = ["BaselineRunner", "METHODS", "PAPER_EPS", "fidelity", "fresh_seed", "make_method", "privacy",
           "user_content_prompts"]
