"""Online token perturbation (the paper's Remark in "Online Inference"): a client-side defence, applied to the
plaintext ids before the secret mapping.

The client replaces each token x of the private text by y drawn from an exponential mechanism over the
similarity of *plaintext* embeddings (SANTEXT/RANTEXT style), then maps the result with its key as usual:

    p(y | x)  proportional to  exp(eps_tok * cos(e_x, e_y) / (2 * Delta)),   Delta = 2 (cosine range),

over the whole vocabulary (the candidate set must not depend on x, or the guarantee breaks). This is the
standard exponential mechanism, so one perturbed token is eps_tok-DP between any two tokens: the normaliser
depends on x, hence the factor 2 in the denominator.

Budget fed to the accountant (aloepri.eval.privacy.composed_epsilon): the paper's Theorem needs M_1 to be
(2, eps_1, d)-RmDP in the *permutation metric* d on token sequences. Two sequences at permutation distance
d >= 1 can differ in up to all of their l perturbed positions (one transposition of the vocabulary renames a
token everywhere), and per-token pure DP composes additively, so D_2 <= l * eps_tok <= (l * eps_tok) * d:
we report eps_1 = l * eps_tok, where l is the number of perturbed positions. Conservative but sound.

Everything is seeded (torch.Generator) and pure; ``perturbed_chat`` wraps an aloepri.runtime.inference.PrivateModel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

SENSITIVITY = 2.0  # cosine similarity lies in [-1, 1]


def _check_eps(eps_tok: float) -> None:
    if eps_tok < 0:
        raise ValueError("eps_tok must be >= 0")


def normalized_embeddings(embedding: torch.Tensor) -> torch.Tensor:
    e = torch.as_tensor(embedding).to(torch.float32)
    return e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def token_distribution(unit_emb: torch.Tensor, token: int, eps_tok: float,
                       candidates: torch.Tensor | None = None) -> torch.Tensor:
    """p(. | token) over the candidate ids (default: the whole vocabulary)."""
    cand = unit_emb if candidates is None else unit_emb[candidates]
    return token_distributions(unit_emb, torch.tensor([int(token)]), eps_tok, cand)[0]


def token_distributions(unit_emb: torch.Tensor, tokens: torch.Tensor, eps_tok: float, cand: torch.Tensor
                        ) -> torch.Tensor:
    """(len(tokens), len(cand)): p(. | token) for several tokens at once over the candidate rows ``cand``."""
    _check_eps(eps_tok)
    return torch.softmax(eps_tok * (unit_emb[tokens] @ cand.T) / (2 * SENSITIVITY), dim=1)


def perturb_ids(ids: Sequence[int], unit_emb: torch.Tensor, eps_tok: float, seed: int,
                positions: Sequence[int] | None = None, candidates: torch.Tensor | None = None) -> list[int]:
    """Exponential-mechanism replacement of ``ids[positions]`` (default: all); other ids are kept.

    ``candidates`` (a fixed id set, independent of the input, e.g. the non-special tokens) restricts outputs.
    """
    g = torch.Generator().manual_seed(int(seed))
    out = list(ids)
    for i in (range(len(ids)) if positions is None else positions):
        p = token_distribution(unit_emb, int(ids[i]), eps_tok, candidates)
        j = int(torch.multinomial(p, 1, generator=g))
        out[i] = int(candidates[j]) if candidates is not None else j
    return out


def perturb_stream(ids: np.ndarray, unit_emb: torch.Tensor, eps_tok: float, seed: int,
                   candidates: torch.Tensor | None = None) -> np.ndarray:
    """``perturb_ids`` on every token of a long stream (the same mechanism, independent draws), computing each
    distinct token's distribution once."""
    _check_eps(eps_tok)
    ids = np.asarray(ids, dtype=np.int64)
    out = ids.copy()
    g = torch.Generator().manual_seed(int(seed))
    uniq, inverse = np.unique(ids, return_inverse=True)
    # The candidate rows are gathered once and the similarities computed in blocks: gathering a
    # vocabulary-sized matrix per distinct token dominated the run time (30 min for a 50k-token stream).
    cand = unit_emb if candidates is None else unit_emb[candidates]
    cand_ids = None if candidates is None else candidates.numpy()
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(len(uniq) + 1))
    block = 256
    for start in range(0, len(uniq), block):
        toks = torch.as_tensor(uniq[start:start + block])
        probs = token_distributions(unit_emb, toks, eps_tok, cand)
        for r in range(len(toks)):
            u = start + r
            where = order[bounds[u]:bounds[u + 1]]
            draw = torch.multinomial(probs[r], len(where), replacement=True, generator=g).numpy()
            out[where] = cand_ids[draw] if cand_ids is not None else draw
    return out


def sequence_epsilon(eps_tok: float, perturbed_positions: int) -> float:
    """eps_1 of the whole perturbed sequence in the permutation metric (see the module docstring)."""
    return eps_tok * perturbed_positions


def content_span(tokenizer, messages: Sequence[dict[str, str]]) -> tuple[list[int], range]:
    """Chat-templated ids and the positions of the last user message's content (the template is public).

    Found as what differs between the template applied to the real content and to an empty content.
    """
    def ids_of(msgs):
        ids = tokenizer.apply_chat_template(list(msgs), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    full = ids_of(messages)
    empty = ids_of(list(messages[:-1]) + [{**messages[-1], "content": ""}])
    pre = 0
    while pre < min(len(full), len(empty)) and full[pre] == empty[pre]:
        pre += 1
    suf = 0
    while suf < min(len(full), len(empty)) - pre and full[-1 - suf] == empty[-1 - suf]:
        suf += 1
    return full, range(pre, len(full) - suf)


@dataclass
class TokenPerturbation:
    """Client-side option: perturb the user's content tokens with budget eps_tok per token."""
    unit_embeddings: torch.Tensor  # normalized plaintext embedding rows (n, d)
    eps_tok: float
    seed: int
    candidates: torch.Tensor | None = None  # fixed output set (e.g. excludes special tokens)

    @classmethod
    def from_plain_model(cls, plain_model_or_src: Any, eps_tok: float, seed: int,
                         exclude_ids: Sequence[int] = ()) -> "TokenPerturbation":
        if hasattr(plain_model_or_src, "get_input_embeddings"):
            emb = plain_model_or_src.get_input_embeddings().weight.detach()
        else:  # a checkpoint directory or .gguf file: its embedding only
            from ..obfuscation.checkpoint import open_checkpoint

            ck = open_checkpoint(plain_model_or_src)
            try:
                emb = ck.get("embed", dtype=torch.float32)
            finally:
                ck.close()
        keep = torch.ones(emb.shape[0], dtype=torch.bool)
        keep[list(exclude_ids)] = False
        cand = None if keep.all() else torch.nonzero(keep).flatten()
        return cls(normalized_embeddings(emb), float(eps_tok), int(seed), cand)

    def apply(self, ids: Sequence[int], positions: Sequence[int], call_index: int = 0) -> list[int]:
        # A fresh stream per call (seed, call_index): repeated prompts must not reuse the same draws.
        return perturb_ids(ids, self.unit_embeddings, self.eps_tok, (self.seed * 1_000_003 + call_index) % (1 << 63),
                           positions, self.candidates)

    def apply_stream(self, ids: np.ndarray, call_index: int = 0) -> np.ndarray:
        """Every token of a stream perturbed (the client's whole traffic, e.g. for the frequency attacks)."""
        return perturb_stream(ids, self.unit_embeddings, self.eps_tok, (self.seed * 1_000_003 + call_index) % (1 << 63),
                              self.candidates)


def perturbed_chat(private_model, messages, perturbation: TokenPerturbation, max_new_tokens: int = 64,
                   call_index: int = 0, **gen_kwargs):
    """PrivateModel.chat with the user's content perturbed before the key maps it.

    Returns (reply, eps_1): the reply of PrivateModel.generate_ids (text filled in) and the sequence budget
    eps_1 to feed aloepri.eval.privacy.composed_epsilon.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids, span = content_span(private_model.tokenizer, messages)
    noisy = perturbation.apply(ids, list(span), call_index)
    reply = private_model.generate_ids(noisy, max_new_tokens, **gen_kwargs)
    reply.text = private_model.tokenizer.decode(reply.plain_reply_ids, skip_special_tokens=True)
    return reply, sequence_epsilon(perturbation.eps_tok, len(span))
