"""NN: the nearest-neighbour attack on observed internal states (the paper's "NN", as used against DP-Forward and
SGT in its Table 1: map each observed representation to the nearest plaintext token embedding).

What the server uses, exactly: for every observed obfuscated id, the input state the server itself computes for
it at layer 0 (= that id's row of the obfuscated embedding table, width D = d + 2h), and the public plaintext
embedding table (width d, zero-padded to D). Nearest row by Euclidean distance over the FULL plaintext
vocabulary. Nothing is fitted (no pairs, no key): this is the paper's NN, which measures whether the
obfuscated states still live in the plaintext embedding space. (An attacker who aligns the two spaces with known
pairs is the "known-pair ridge" attack in frequency.py; one who aligns them without pairs is VMA / IA.)

The positive control is ``permutation_only_target``: the plaintext model with its vocabulary rows permuted and
nothing else (no noise, no key matrices), where NN must recover every token whose embedding row is unique.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from .base import AttackResult, AttackTarget, Budget, PrivateData, register
from .vma import match_features, target_weights

NN_BUDGETS = {"ci": {"vocab_sample": 256}, "small": {"vocab_sample": 1024}, "full": {"vocab_sample": 4096}}


def pad_columns(m: torch.Tensor, width: int) -> torch.Tensor:
    if m.shape[1] > width:
        raise ValueError(f"plaintext width {m.shape[1]} exceeds the obfuscated width {width}")
    return torch.nn.functional.pad(m, (0, width - m.shape[1]))


def run_nn(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    cfg = NN_BUDGETS.get(budget.name, NN_BUDGETS["full"])
    with target_weights(target, "obf") as w:  # streamed from the checkpoints unless the models are loaded
        obf = w.get("embed")
    with target_weights(target, "plain") as w:
        plain = pad_columns(w.get("embed"), obf.shape[1])
    n = plain.shape[0]
    queries, sampled, _, scores = match_features(target, data, plain, obf, cfg["vocab_sample"], seed)
    return AttackResult(
        "nn", scores["ttrsr"], scores["piirsr"], scores,
        budget={"budget": budget.name, "candidate_pool": n, "candidate_pool_is_full_vocabulary": True,
                "state": "layer-0 input state (obfuscated embedding row) vs plaintext embedding, zero-padded, "
                         "Euclidean, nothing fitted",
                "vocab_sample": int(len(sampled)), "queries": int(len(queries))},
        uses="observed obfuscated ids and their layer-0 states (obfuscated embedding rows) + public plaintext "
             "embedding; no key, no pairs")


@register("nn")
def nn(target: AttackTarget, data: PrivateData, budget: Budget, seed: int = 0) -> AttackResult:
    """Nearest plaintext embedding to each observed obfuscated layer-0 state (no fitting, full vocabulary)."""
    return run_nn(target, data, budget, seed)


def permutation_only_target(plain_src: str | Path, seed: int = 0, plain_model=None) -> AttackTarget:
    """A deliberately weak target: the plaintext model whose vocabulary (embedding and head rows) is permuted by a
    seeded secret permutation, with no noise and no key matrices. Positive control for NN (and VMA / IA)."""
    from ..keyfile import KeyFile

    t = AttackTarget(plain_src, plain_src, None)
    if plain_model is not None:
        t.plain_model = plain_model
    plain = t.plain_model
    n = int(plain.get_input_embeddings().weight.shape[0])
    perm = np.random.default_rng(seed).permutation(n)  # perm[plain id] = obfuscated id
    rows = torch.from_numpy(np.argsort(perm))  # obfuscated row j holds plain token rows[j]
    obf = copy.deepcopy(plain)
    with torch.no_grad():
        obf.get_input_embeddings().weight.copy_(plain.get_input_embeddings().weight[rows])
        head = obf.get_output_embeddings()
        if head.weight.data_ptr() != obf.get_input_embeddings().weight.data_ptr():  # untied head
            head.weight.copy_(plain.get_output_embeddings().weight[rows])
    t.obf_model = obf
    cfg = plain.config
    t.key = KeyFile(vocab_permutation=perm.tolist(), model_fingerprint="permutation-only",
                    params={"mechanism": "permutation-only"}, seed=seed, h_effective=0,
                    hidden_size=int(cfg.hidden_size), source=str(plain_src), architecture=type(plain).__name__)
    return t
