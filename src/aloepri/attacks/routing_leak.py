"""MoE routing leak: recover the victim's plaintext tokens from the experts the server saw chosen.

Threat: the server runs the obfuscated MoE model, so per token and MoE layer it sees which expert *slots* were
chosen (``aloepri.obfuscation.routing.routing_decisions``). AloePri permutes the experts of every layer by a secret
``Z_router`` but, in the exact variant, keeps the choices themselves: the obfuscated model picks the same experts
as the public plaintext model, relabelled. The attacker holds the public plaintext model and the obfuscated ids.

Attack (``decode_routing_leak``, a pure function on id sequences):
1. **Relabelling.** Per layer an obfuscated-slot -> plaintext-expert map. The oracle variant reads it from the key
   (an upper bound). The learned variant bootstraps it from positions whose plaintext the attacker knows — the
   public chat template that opens every prompt — by counting ``C[obf expert, plain expert]`` co-occurrences and
   solving an assignment (``scipy.optimize.linear_sum_assignment``); after each decoding pass the counts are
   recomputed from every decoded position and the assignment is solved again.
   Slots with no evidence yet stay unknown (-1) and never count as a match.
2. **Decoding**, left to right per prompt: for position j, run the plaintext model on (decoded prefix + v + the
   current guesses of the later positions) for every candidate v in the pool (the full vocabulary unless
   ``candidates`` says otherwise), batched, and score v by the number of experts its plaintext routing shares with
   the observed routing mapped through the relabelling, over all MoE layers, at j *and* at the later positions
   (v changes their routing through attention, which separates tokens whose own routing collides), plus a small
   tie-break: the plaintext router's mean log-probability of the observed experts at j. Passes repeat (coordinate
   ascent: a new guess is used at once) until nothing changes or ``max_passes``.
3. **Consistency of the obfuscated ids.** The vocabulary permutation is fixed, so every occurrence of an obfuscated
   id is the same plaintext token: scores are summed per obfuscated id over all its occurrences in all prompts
   (online in the first pass: an id decoded earlier is reused with the evidence of every occurrence so far), and
   the final id map is a one-to-one assignment. Ids of the known template are known outright.

What it does not use (so the numbers are a lower bound on what routing leaks): the routing weights/logits the
server also sees, and any language prior.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ..obfuscation.routing import expert_orders, router_module_names, routing_decisions
from ..runtime.probe import forward_hooks
from ..storage.devices import model_device
from .base import AttackResult, AttackTarget, Budget, PrivateData, register_variant, score_predictions

Routing = dict[int, np.ndarray]  # {MoE layer: (tokens, top_k) expert numbers}

SOFT_WEIGHT = 0.02  # tie-break weight of the router log-likelihood (in [-20, 0]): never outweighs one expert match
LOGP_FLOOR = -20.0


# --- observations ------------------------------------------------------------------------------------------------


def observe_routing(obf_model: Any, obf_id_seqs: Sequence[Sequence[int]]) -> list[Routing]:
    """What the server records while serving: per prompt, every MoE layer's chosen expert slots per token."""
    out = []
    for ids in obf_id_seqs:
        if len(ids) == 0:
            raise ValueError("empty prompt: nothing to observe")
        dec = routing_decisions(obf_model, torch.tensor([list(ids)], dtype=torch.long, device=model_device(obf_model)))
        out.append({layer: d.numpy() for layer, d in dec.items()})
    return out


@torch.no_grad()
def candidate_routing(model: Any, prefix: Sequence[int], candidates: np.ndarray, suffix: Sequence[int] = (),
                      batch: int = 256) -> tuple[Routing, dict[int, np.ndarray]]:
    """Plaintext routing of ``prefix + [v] + suffix`` for each candidate v, from v's position on:
    ({layer: (C, 1 + len(suffix), k) sorted experts}, {layer: (C, E) router log-softmax at v's position})."""
    names = router_module_names(model)
    modules = dict(model.named_modules())
    j, n = len(prefix), len(prefix) + 1 + len(suffix)
    dev = model_device(model)
    sets: dict[int, list[torch.Tensor]] = {layer: [] for layer in names}
    logps: dict[int, list[torch.Tensor]] = {layer: [] for layer in names}
    for s in range(0, len(candidates), batch):
        cand = torch.as_tensor(candidates[s:s + batch], dtype=torch.long, device=dev)
        b = len(cand)
        ids = torch.cat([torch.tensor(list(prefix), dtype=torch.long, device=dev).expand(b, -1), cand[:, None],
                         torch.tensor(list(suffix), dtype=torch.long, device=dev).expand(b, -1)], dim=1)

        def record(layer, out, b=b):  # routers return (logits, weights, indices)
            logits = out[0].reshape(b, n, -1)[:, j].float()
            idx = out[2].reshape(b, n, -1)[:, j:]
            sets[layer].append(torch.sort(idx, dim=-1).values)
            logps[layer].append(torch.log_softmax(logits, dim=-1))

        with forward_hooks(((layer, modules[name]) for layer, name in names.items()), record):
            model(ids, use_cache=False)
    return ({layer: torch.cat(v).cpu().numpy() for layer, v in sets.items()},
            {layer: torch.cat(v).cpu().numpy() for layer, v in logps.items()})


# --- relabelling ---------------------------------------------------------------------------------------------------


def cooccurrence_counts(observed: Sequence[np.ndarray], plain: Sequence[np.ndarray], n_experts: int) -> np.ndarray:
    """C[o, p] = how often obfuscated slot o and plaintext expert p were chosen at the same (position, layer);
    ``observed[i]`` and ``plain[i]`` are the k-sets of position i."""
    c = np.zeros((n_experts, n_experts))
    for o, p in zip(observed, plain):
        np.add.at(c, (np.repeat(o, len(p)), np.tile(p, len(o))), 1.0)
    return c


def assign_relabelling(counts: np.ndarray) -> np.ndarray:
    """The one-to-one obfuscated-slot -> plaintext-expert map that agrees with the most co-occurrences; -1 for
    slots never observed (no evidence: they count as unknown when scoring, not as a guess)."""
    rows, cols = linear_sum_assignment(-counts)
    out = np.full(len(counts), -1, dtype=np.int64)
    out[rows] = cols
    out[counts.sum(axis=1) == 0] = -1
    return out


# --- scoring and the decoder ---------------------------------------------------------------------------------------


def score_candidates(cand_sets: Routing, cand_logp: dict[int, np.ndarray], observed_plain: dict[int, np.ndarray]
                     ) -> np.ndarray:
    """Per candidate: experts shared with the observed routing (mapped into plaintext experts), summed over layers
    and over the candidate's position and the positions after it (whose routing it changes through attention),
    plus SOFT_WEIGHT x the mean router log-probability of the observed experts at its own position (a tie-break
    below one match). ``cand_sets[L]``: (C, t, k); ``observed_plain[L]``: (t, k), both from the candidate's position."""
    layers = sorted(observed_plain)
    matches = sum((cand_sets[L][..., :, None] == observed_plain[L][None, :, None, :]).any(-1).sum((-1, -2))
                  for L in layers)  # unknown experts (-1) never match
    soft_terms = []
    for L in layers:
        known = observed_plain[L][0][observed_plain[L][0] >= 0]
        if len(known):
            soft_terms.append(np.maximum(cand_logp[L][:, known], LOGP_FLOOR).mean(-1))
    soft = np.mean(soft_terms, axis=0) if soft_terms else 0.0
    return matches.astype(np.float64) + SOFT_WEIGHT * soft


def unique_id_map(scores: dict[int, np.ndarray]) -> dict[int, int]:
    """Obfuscated id -> plaintext id maximising the summed scores, one-to-one (the vocabulary map is a permutation)."""
    obf = sorted(scores)
    if not obf:
        return {}
    s = np.stack([scores[o] for o in obf])
    rows, cols = linear_sum_assignment(-(s - s.max(axis=1, keepdims=True)))  # per-row shift: scores are per id
    return {obf[r]: int(c) for r, c in zip(rows, cols)}


@dataclass
class RoutingLeakOutcome:
    predicted: list[list[int]]  # per prompt, per position: plaintext guess (known prefix included)
    id_map: dict[int, int]  # obfuscated id -> plaintext guess
    relabelling: dict[int, np.ndarray]  # per layer: obfuscated slot -> plaintext expert
    passes: int
    history: list[dict[str, Any]] = field(default_factory=list)  # per pass: changes (and truth-free diagnostics)


def decode_routing_leak(plain_model: Any, obf_id_seqs: Sequence[Sequence[int]], observed: Sequence[Routing],
                        n_experts: int, known_prefix: Sequence[int] = (),
                        relabelling: dict[int, np.ndarray] | None = None, candidates: np.ndarray | None = None,
                        max_passes: int = 6, batch: int = 256) -> RoutingLeakOutcome:
    """Recover plaintext ids from observed expert choices.

    ``obf_id_seqs[i]`` are the obfuscated ids of prompt i and ``observed[i]`` its routing ({layer: (n, k) slots}).
    Every prompt starts with the public ``known_prefix`` (plaintext ids, e.g. the chat template; may be empty).
    ``relabelling`` fixed (the oracle) or None (learned from the prefix and refined after each pass).
    ``candidates``: the plaintext ids tried at every position (default: the whole vocabulary).
    """
    vocab = int(plain_model.config.vocab_size)
    pool = np.arange(vocab) if candidates is None else np.asarray(candidates, dtype=np.int64)
    m = len(known_prefix)
    if not observed or len(observed) != len(obf_id_seqs):
        raise ValueError("need one routing observation per prompt, and at least one prompt")
    layers = sorted(observed[0])
    for ids, obs in zip(obf_id_seqs, observed):
        if len(ids) <= m or sorted(obs) != layers or any(len(obs[L]) != len(ids) for L in layers):
            raise ValueError("every prompt needs routing for all its positions and must extend the known prefix")
    if m and len({tuple(int(x) for x in ids[:m]) for ids in obf_id_seqs}) != 1:
        raise ValueError("every prompt must start with the same (obfuscated) known prefix")
    known_ids = {int(o): int(p) for o, p in zip(obf_id_seqs[0][:m], known_prefix)} if m else {}

    # plaintext routing of the known prefix: identical in every prompt, computed once
    prefix_plain: Routing = {}
    if m:
        dec = routing_decisions(plain_model, torch.tensor([list(known_prefix)], dtype=torch.long,
                                                          device=model_device(plain_model)))
        prefix_plain = {L: d.numpy() for L, d in dec.items()}

    learn = relabelling is None
    if learn:
        if not m:
            raise ValueError("learning the expert relabelling needs a known prefix (e.g. the chat template); "
                             "pass relabelling=... for the oracle variant")
        # the prefix routes identically in every prompt (same ids, causal model): one prompt's worth of evidence
        relabelling = {L: assign_relabelling(cooccurrence_counts(observed[0][L][:m], prefix_plain[L], n_experts))
                       for L in layers}
    relabelling = {L: np.asarray(relabelling[L]) for L in layers}

    id_map: dict[int, int] = dict(known_ids)
    contrib: dict[tuple[int, int], np.ndarray] = {}  # latest score vector of every (prompt, position)
    total: dict[int, np.ndarray] = {}  # per obfuscated id: sum of the latest scores of all its occurrences
    history: list[dict[str, Any]] = []
    passes = 0
    for passes in range(1, max_passes + 1):
        before = dict(id_map)
        chosen_plain: list[Routing] = []
        for i, (ids, obs) in enumerate(zip(obf_id_seqs, observed)):
            plain_sets = {L: [prefix_plain[L][t] for t in range(m)] for L in layers}
            for j in range(m, len(ids)):
                o = int(ids[j])
                ctx = list(known_prefix) + [id_map.get(int(x), 0) for x in ids[m:j]]
                # later positions already guessed (earlier prompts, earlier passes) also judge the candidate: it
                # changes their routing through attention. Take them up to the first id without a guess.
                suffix: list[int] = []
                for x in ids[j + 1:]:
                    if int(x) not in id_map:
                        break
                    suffix.append(id_map[int(x)])
                sets, logp = candidate_routing(plain_model, ctx, pool, suffix, batch)
                sc = score_candidates(sets, logp, {L: relabelling[L][obs[L][j:j + 1 + len(suffix)]] for L in layers})
                full = np.full(vocab, -1e9)
                full[pool] = sc
                old = contrib.get((i, j))
                total[o] = total.get(o, 0.0) + full - (old if old is not None else 0.0)
                contrib[(i, j)] = full
                if o not in known_ids:  # Gauss-Seidel: the new guess is used at once by later positions
                    id_map[o] = int(np.argmax(total[o]))
                row = np.nonzero(pool == id_map[o])[0]
                for L in layers:  # plaintext routing of the guess (for re-learning the relabelling)
                    plain_sets[L].append(sets[L][row[0], 0] if len(row) else np.full(sets[L].shape[-1], -1))
            chosen_plain.append({L: np.stack(v) for L, v in plain_sets.items()})
        changed_ids = sum(before.get(o) != id_map.get(o) for o in id_map)
        changed_labels = 0
        if learn:
            for L in layers:
                obs_sets = [s for obs in observed for s in obs[L]]
                pl_sets = [s for cp in chosen_plain for s in cp[L]]
                keep = [t for t, p in enumerate(pl_sets) if (p >= 0).all()]
                new = assign_relabelling(cooccurrence_counts([obs_sets[t] for t in keep],
                                                             [pl_sets[t] for t in keep], n_experts))
                changed_labels += int((new != relabelling[L]).sum())
                relabelling[L] = new
        history.append({"pass": passes, "id_map_changes": int(changed_ids), "relabel_changes": changed_labels})
        if changed_ids == 0 and changed_labels == 0:
            break
    id_map = {**unique_id_map({o: t for o, t in total.items() if o not in known_ids}), **known_ids}
    # final prediction: the one-to-one map (consistent across prompts)
    predicted = [[int(id_map.get(int(o), -1)) for o in ids] for ids in obf_id_seqs]
    return RoutingLeakOutcome(predicted, id_map, relabelling, passes, history)


def relabelling_accuracy(learned: dict[int, np.ndarray], truth: dict[int, np.ndarray]) -> float:
    """Fraction of (layer, slot) pairs mapped to the right plaintext expert (scoring only; unknown = wrong)."""
    return float(np.mean(np.concatenate([learned[L] == truth[L] for L in truth])))


def token_accuracy(predicted: Sequence[Sequence[int]], truth: Sequence[Sequence[int]], skip: int = 0) -> float:
    """Fraction of positions (from ``skip`` on, i.e. after the known prefix) whose plaintext id is recovered."""
    hit = tot = 0
    for p, t in zip(predicted, truth):
        p, t = np.asarray(p[skip:]), np.asarray(t[skip:])
        hit += int((p == t).sum())
        tot += len(t)
    return hit / max(tot, 1)


# --- the registered attacks ----------------------------------------------------------------------------------------

TINY_PREFIX_LEN = 8  # stand-in chat template for models without a tokenizer: fixed public ids


def num_experts(config: Any) -> int:
    from ..obfuscation.archs import spec_for_hf

    spec = spec_for_hf(getattr(config, "architectures", None))
    if spec.moe is None:
        raise ValueError(f"routing_leak applies to mixture-of-experts models only; {spec.name} has no routed experts")
    return int(spec.moe.num_experts(config.to_dict()))


def usable_tokenizer(target: AttackTarget) -> Any | None:
    """The public tokenizer, or None when the checkpoint has none (tiny test models: transformers then builds
    an empty one from the config, which must not be used for text metrics)."""
    try:
        tok = target.tokenizer
    except Exception:  # noqa: BLE001 - no tokenizer files
        return None
    return tok if len(tok) >= target.vocab_size // 2 else None


def template_prefix(target: AttackTarget, seed: int) -> tuple[list[int], str]:
    """Plaintext ids that open every prompt and that the attacker knows: the public chat template's tokens before
    the user's text; without a tokenizer (tiny test models), TINY_PREFIX_LEN fixed seeded ids."""
    tok = usable_tokenizer(target)
    if tok is not None and getattr(tok, "chat_template", None):
        marker = "\u2063ROUTINGLEAKMARK"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text.split(marker)[0], add_special_tokens=False)["input_ids"]
        return list(ids), "public chat template (tokens before the user text)"
    rng = np.random.default_rng([seed, 0x5EED])
    ids = rng.integers(0, target.vocab_size, TINY_PREFIX_LEN).tolist()
    return ids, f"{TINY_PREFIX_LEN} fixed public ids (stand-in for a chat template; the model has none)"


def run_routing_leak(target: AttackTarget, data: PrivateData, budget: Budget, seed: int, oracle: bool
                     ) -> AttackResult:
    # the obfuscated checkpoint's config names its architecture (aloepri writes it; a plaintext model read from
    # GGUF has none) and keeps the expert count
    n_exp = num_experts(target.obf_model.config)
    n_prompts = len(data.plain_ids) if budget.scale >= 1 else max(2, int(round(len(data.plain_ids) * budget.scale)))
    cap = budget.max_tokens_scored
    plain_private = [list(p)[:cap] if cap else list(p) for p in data.plain_ids[:n_prompts]]
    sub = PrivateData(data.texts[:n_prompts], plain_private,
                      [list(mk)[:len(p)] for mk, p in zip(data.pii_mask[:n_prompts], plain_private)])
    prefix, prefix_kind = template_prefix(target, seed)
    victim_plain = [prefix + p for p in plain_private]
    obf_seqs = [target.obfuscate_ids(v) for v in victim_plain]  # the victim's side: what the server receives
    observed = observe_routing(target.obf_model, obf_seqs)
    relabel = None
    if oracle:
        orders = expert_orders(target.key, target.obf_model.config)
        relabel = {L: np.asarray(orders[L]) for L in observed[0]}
    out = decode_routing_leak(target.plain_model, obf_seqs, observed, n_exp, prefix, relabel)
    predicted = [p[len(prefix):] for p in out.predicted]
    text_metrics = usable_tokenizer(target) is not None
    metrics = score_predictions(target, sub, predicted, text_metrics=text_metrics)
    if not oracle:
        orders = expert_orders(target.key, target.obf_model.config)
        metrics["relabel_accuracy"] = relabelling_accuracy(out.relabelling, {L: np.asarray(orders[L])
                                                                              for L in out.relabelling})
    metrics["passes"] = out.passes
    # private tokens that also occur in the known prefix are known outright (not learned from routing)
    metrics["private_tokens_in_known_prefix"] = float(np.mean([t in set(prefix) for p in plain_private for t in p]))
    budget_info = {"budget": budget.name, "candidate_pool": f"full vocabulary ({target.vocab_size})",
                   "prompts": n_prompts, "private_tokens": sum(map(len, plain_private)),
                   "known_prefix": f"{len(prefix)} ids: {prefix_kind}", "max_passes": 6,
                   "moe_layers": len(observed[0]), "experts_per_layer": n_exp}
    uses = ("obfuscated ids and per-token expert slots chosen in every MoE layer (server view), the public "
            f"plaintext model and its known prompt prefix ({prefix_kind})")
    uses += ("; ORACLE: the true expert relabelling Z_router from the key (upper bound)" if oracle else
             "; expert relabelling learned from the known prefix and refined from its own decoding (no key)")
    return AttackResult("routing_leak_oracle" if oracle else "routing_leak", metrics["ttrsr"], metrics["piirsr"],
                        metrics, budget_info, uses)


routing_leak = register_variant(
    "routing_leak", run_routing_leak,
    "MoE routing leak: tokens from observed expert choices, expert relabelling learned (no key).", on_device=True,
    oracle=False)
routing_leak_oracle = register_variant(
    "routing_leak_oracle", run_routing_leak,
    "MoE routing leak with the true expert relabelling from the key (oracle upper bound).", on_device=True,
    oracle=True)
