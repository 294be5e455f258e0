""""Only the logs leak": what an observer of the obfuscated id stream alone (no model, no weights) recovers, as a
function of how much traffic it has seen.

The stream is realistic chat traffic for SmolLM2-135M-Instruct: requests rendered with the model's own chat
template (its default system prompt included), half of them Faker PII prompts (``private_prompts``, ten
templates: e-mails, forms, tickets, chats), half requests about a passage of the client's documents ("Explain
this passage ...", the seeded private half of ``python-docs``, docs/data.md), shuffled with a seed. The server
sees every id through one secret permutation. The observer's reference frequencies come from a DIFFERENT public
corpus (setting ``priors``): ``fortunes`` (general English, zero-knowledge) or ``debian-reference`` (computing
documentation, domain-aware), either as raw text or ``+template``: the same text cut into request-sized pieces
and wrapped in the public chat template (an observer who knows the traffic is chat requests); and, as the
observer's best case, ``same-distribution``: traffic generated exactly like the client's (other Faker values,
the other half of python-docs), which no real observer has.

For each observed volume (setting ``volumes``, default 10^3 .. 10^6 tokens: the first requests of the stream up to
that many tokens) TFMA (aloepri.attacks.frequency.tfma_match: frequency-rank matching over the full vocabulary)
maps every observed id, and recovery is scored on everything observed: all tokens, the user's text (template
tokens excluded), the PII tokens; which tokens are recovered (the most frequent recovered types, PII types
recovered, recovery by how frequent a token is in the stream). Attack ``sda`` adds the trained substitution
decipherer (aloepri.attacks.decipher, budget ``ci``) on the same streams.

Resumable: keyed ``<attack>/<prior>/<volume>``; entries present are skipped. The report writes the figure beside
the results (``results/logs_only/<config>.png``).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..lib import ResultStore
from ..lib.models import model_path

VOLUMES = (1_000, 10_000, 100_000, 1_000_000)
PRIORS = ("fortunes", "fortunes+template", "debian-reference", "debian-reference+template", "same-distribution")
DOC_INSTRUCTIONS = ("Explain this passage from our documentation:\n\n",
                    "Summarize the following text in two sentences:\n\n",
                    "Rewrite this for a beginner:\n\n",
                    "What does this mean?\n\n")


@dataclass
class Stream:
    """Plaintext ids of the observed traffic in order, with per-token labels."""

    ids: np.ndarray
    pii: np.ndarray  # bool: the token overlaps a Faker PII value
    template: np.ndarray  # bool: the token belongs to the chat template (not the user's text)
    request_ends: np.ndarray  # cumulative token count at the end of each request


def chat_wrapper(tokenizer) -> tuple[list[int], list[int]]:
    from aloepri.attacks.behavioural import chat_template_ids

    return chat_template_ids(tokenizer)


def doc_passages(tokenizer, max_tokens: int, seed: int, client_half: bool = True) -> list[list[int]]:
    """Request bodies about the client's documents: paragraphs of the private half of python-docs (the other half
    when ``client_half`` is False), grouped up to ~200 tokens, each after one of a few instructions."""
    from aloepri.attacks.data import frequency_setting

    held_out, private = frequency_setting("distribution-aware", seed)  # (prior, private): the client's half
    private = private if client_half else held_out
    rng = np.random.default_rng(seed)
    out, total = [], 0
    for doc in private:
        chunk: list[str] = []
        for para in re.split(r"\n\s*\n", doc):
            chunk.append(para.strip())
            if sum(len(c) for c in chunk) > 700:  # ~200 tokens of prose/code
                text = DOC_INSTRUCTIONS[int(rng.integers(len(DOC_INSTRUCTIONS)))] + "\n\n".join(chunk)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                out.append(ids)
                total += len(ids)
                chunk = []
                if total >= max_tokens:
                    return out
    return out


def build_stream(tokenizer, tokens: int, seed: int, faker_seed: int | None = None, client_half: bool = True
                 ) -> Stream:
    """Requests (half PII prompts, half document passages) in a seeded order until ``tokens`` tokens."""
    from aloepri.attacks.data import private_prompts

    pre, post = chat_wrapper(tokenizer)
    wrap = len(pre) + len(post)
    docs = doc_passages(tokenizer, tokens // 2 + 1000, seed, client_half)
    pii_needed = int(np.ceil(tokens / 2 / (85 + wrap))) + 50
    pii = private_prompts(tokenizer, pii_needed, seed + 1 if faker_seed is None else faker_seed)
    reqs = [(list(i), list(m)) for i, m in zip(pii.plain_ids, pii.pii_mask)] + [(d, [False] * len(d)) for d in docs]
    order = np.random.default_rng(seed).permutation(len(reqs))
    ids, is_pii, is_tpl, ends = [], [], [], []
    for j in order:
        body, mask = reqs[j]
        ids += list(pre) + body + list(post)
        is_pii += [False] * len(pre) + mask + [False] * len(post)
        is_tpl += [True] * len(pre) + [False] * len(body) + [True] * len(post)
        ends.append(len(ids))
        if len(ids) >= tokens:
            break
    return Stream(np.asarray(ids, np.int64), np.asarray(is_pii), np.asarray(is_tpl), np.asarray(ends))


def prior_ids(tokenizer, name: str, max_tokens: int, seed: int) -> np.ndarray:
    """The observer's reference token stream from a public corpus; '+template': request-sized pieces of it
    (60-250 tokens) wrapped in the public chat template. 'same-distribution': the attacker's best case, traffic
    made exactly like the client's (same chat template, same PII templates with other Faker values, the other
    half of python-docs), sharing no document or PII value with it."""
    from aloepri.corpora import corpus, tokenize_texts

    if name == "same-distribution":
        return build_stream(tokenizer, max_tokens, seed, faker_seed=seed + 777, client_half=False).ids[:max_tokens]
    base, _, tpl = name.partition("+")
    ids = tokenize_texts(tokenizer, corpus(base), max_tokens)
    if not tpl:
        return ids
    pre, post = chat_wrapper(tokenizer)
    rng = np.random.default_rng(seed)
    out, pos = [], 0
    while pos < len(ids):
        n = int(rng.integers(60, 251))
        out += list(pre) + ids[pos:pos + n].tolist() + list(post)
        pos += n
    return np.asarray(out[:max_tokens], np.int64)


def split_requests(ids: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """``ids`` cut at the cumulative request ends ``ends``."""
    starts = np.concatenate([[0], ends[:-1]])
    return [ids[a:b] for a, b in zip(starts, ends)]


def observed_prefix(stream: Stream, volume: int) -> slice:
    """The first whole requests totalling at least ``volume`` tokens (the whole stream if shorter)."""
    k = int(np.searchsorted(stream.request_ends, volume))
    return slice(0, int(stream.request_ends[min(k, len(stream.request_ends) - 1)]))


def recovery_report(tokenizer, truth: np.ndarray, guess: np.ndarray, pii: np.ndarray, template: np.ndarray,
                    examples: int = 15) -> dict:
    """Recovery on the observed tokens, by class, and which token types are recovered."""
    ok = guess == truth
    user = ~template
    frac = lambda m: float(ok[m].mean()) if m.any() else None  # noqa: E731
    types, counts = np.unique(truth, return_counts=True)
    rank = np.empty(len(types), np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(types))
    tok_rank = rank[np.searchsorted(types, truth)]
    by_rank = {}
    for lo, hi in ((0, 100), (100, 1000), (1000, 10 ** 9)):
        m = (tok_rank >= lo) & (tok_rank < hi)
        by_rank[f"stream_rank_{lo + 1}-{hi if hi < 10 ** 9 else 'rest'}"] = {
            "tokens": int(m.sum()), "recovery": frac(m)}
    rec_types, rec_counts = np.unique(truth[ok], return_counts=True)
    top = rec_types[np.argsort(-rec_counts, kind="stable")][:examples]
    pii_ok_types = np.unique(truth[ok & pii])
    pii_types = np.unique(truth[pii])
    return {
        "tokens_observed": int(len(truth)), "pii_tokens_observed": int(pii.sum()),
        "user_text_tokens_observed": int(user.sum()),
        "token_recovery": float(ok.mean()), "user_text_recovery": frac(user), "pii_recovery": frac(pii),
        "template_recovery": frac(template),
        "by_stream_frequency": by_rank,
        "distinct_types_observed": int(len(types)), "distinct_types_recovered": int(len(rec_types)),
        "distinct_pii_types_observed": int(len(pii_types)), "distinct_pii_types_recovered": int(len(pii_ok_types)),
        "most_frequent_recovered": [tokenizer.decode([int(t)]) for t in top],
        "pii_types_recovered_examples": [tokenizer.decode([int(t)]) for t in pii_ok_types[:examples]],
    }


def run_tfma(tokenizer, stream: Stream, sl: slice, prior: np.ndarray, perm: np.ndarray, seed: int) -> dict:
    from aloepri.attacks.frequency import tfma_match

    truth = stream.ids[sl]
    observed = perm[truth]
    match = tfma_match(observed, prior, len(perm), seed)
    guess = match.obf_to_plain[observed]
    return recovery_report(tokenizer, truth, guess, stream.pii[sl], stream.template[sl])


def run_sda(tokenizer, stream: Stream, sl: slice, prior: np.ndarray, perm: np.ndarray, seed: int) -> dict:
    """The trained decipherer (budget 'ci') on the observed requests (``guess``: its per-token guesses)."""
    from aloepri.attacks.base import Budget
    from aloepri.attacks.decipher import SDAConfig, build_training_set, decipher, train_decipherer

    cfg = SDAConfig.for_budget(Budget.named("ci"))
    reqs = [perm[r] for r in split_requests(stream.ids, stream.request_ends[stream.request_ends <= sl.stop])]
    prior = prior[: cfg.prior_tokens]
    ids, counts = np.unique(prior, return_counts=True)
    pool = ids[np.argsort(-counts, kind="stable")][: cfg.pool]
    lengths = [len(r) for r in reqs]
    train = build_training_set(prior, int(sum(lengths)), lengths, cfg, len(perm), pool, seed)
    model, loss = train_decipherer(train, cfg, len(pool) + 1, seed)
    guess = np.concatenate([np.asarray(g) for g in decipher(model, [r.tolist() for r in reqs], cfg, pool)])
    out = recovery_report(tokenizer, stream.ids[sl], guess, stream.pii[sl], stream.template[sl])
    out["guess"] = guess
    out["sda"] = {"steps": cfg.steps, "episodes": cfg.episodes, "prior_tokens": int(len(prior)),
                  "pool": int(len(pool)), "final_train_loss": loss}
    return out


def render(entries: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = ["| Attack | Observer's reference | Tokens observed | All tokens (%) | User text (%) | PII tokens (%) | "
             "Types recovered / observed | PII types recovered / observed | Most frequent recovered |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(entries, key=lambda k: (k.split("/")[0], k.split("/")[1], int(k.split("/")[2]))):
        e = entries[key]
        a, p, _ = key.split("/")
        top = ", ".join(repr(t) for t in e["most_frequent_recovered"][:8])
        lines.append(f"| {a} | {p} | {e['tokens_observed']:,} | {pct(e['token_recovery'])} | "
                     f"{pct(e['user_text_recovery'])} | {pct(e['pii_recovery'])} | "
                     f"{e['distinct_types_recovered']} / {e['distinct_types_observed']} | "
                     f"{e['distinct_pii_types_recovered']} / {e['distinct_pii_types_observed']} | {top} |")
    return "\n".join(lines)


def plot(entries: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    series: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for key, e in entries.items():
        a, p, v = key.split("/")
        series.setdefault((a, p), []).append((e["tokens_observed"], e))
    for (a, p), pts in sorted(series.items()):
        pts.sort(key=lambda x: x[0])
        for ax, field in zip(axes, ("user_text_recovery", "pii_recovery")):
            ax.plot([x for x, _ in pts], [100 * (e[field] or 0) for _, e in pts], "o-", label=f"{a}, {p}")
    for ax, title in zip(axes, ("user's text tokens", "PII tokens")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens observed")
        ax.set_title(f"recovered: {title}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("recovered (%)")
    axes[1].legend(fontsize=7)
    fig.suptitle("An observer of the id stream alone (no model): recovery vs. volume", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    volumes: tuple[int, ...] = VOLUMES
    priors: tuple[str, ...] = PRIORS
    prior_tokens: int = 1_000_000
    seed: int = 0
    attacks: tuple[str, ...] = ("tfma",)  # add "sda": the trained decipherer (budget ci)
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.runtime.tokenizer import load_hf_tokenizer

    todo = [(a, p, v) for a in s.attacks for p in s.priors for v in s.volumes if not store.has(f"{a}/{p}/{v}")]
    if not todo:
        return
    for a in s.attacks:
        if a not in ("tfma", "sda"):
            raise ValueError(f"unknown attack {a!r}: tfma or sda")
    torch.set_num_threads(s.threads)
    tok = load_hf_tokenizer(model_path(s.model))
    t0 = time.perf_counter()
    stream = build_stream(tok, max(s.volumes), s.seed)
    print(f"stream: {len(stream.ids)} tokens, {len(stream.request_ends)} requests, "
          f"{int(stream.pii.sum())} PII tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    # the client's key: a uniformly random permutation (seeded here so the study is reproducible)
    perm = np.random.default_rng(s.seed + 99).permutation(len(tok))
    priors_cache: dict[str, np.ndarray] = {}
    for a, p, v in todo:
        if p not in priors_cache:
            priors_cache[p] = prior_ids(tok, p, s.prior_tokens, s.seed)
        sl = observed_prefix(stream, v)
        t1 = time.perf_counter()
        res = (run_tfma if a == "tfma" else run_sda)(tok, stream, sl, priors_cache[p], perm, s.seed)
        res.pop("guess", None)  # per-token guesses: the report above is what is kept
        res.update({"attack": a, "prior": p, "prior_tokens": int(len(priors_cache[p])), "volume_requested": v,
                    "requests_observed": int(np.searchsorted(stream.request_ends, sl.stop) + 1),
                    "seconds": round(time.perf_counter() - t1, 1), "seed": s.seed,
                    "stream": "SmolLM2 chat template; half Faker PII prompts, half python-docs passages"})
        store.put(f"{a}/{p}/{v}", res)
        print(f"{a}/{p}/{v}: all {res['token_recovery']:.3f} user {res['user_text_recovery']:.3f} "
              f"pii {res['pii_recovery']} ({res['seconds']} s) top {res['most_frequent_recovered'][:6]}", flush=True)


def report(store: ResultStore) -> str:
    entries = store.entries()
    figure = store.figure_path(".png")
    plot(entries, figure)
    return render(entries) + f"\n\nFigure: results/{store.experiment}/{figure.name}"


SUMMARY = "what an observer of the obfuscated id stream alone recovers vs. traffic volume (TFMA; minutes)"
CONFIGS = {"full": Settings(),
           "smoke": Settings(volumes=(1_000, 10_000), priors=("fortunes",), prior_tokens=100_000)}
DOCS = ("docs/security.md",)
NOTES = "needs the corpora of docs/data.md; building the 10^6-token stream takes about 1.5 minutes"
