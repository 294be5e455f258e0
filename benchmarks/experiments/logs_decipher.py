"""The observer who reads the logs: the id stream, the public tokenizer and chat template, public text and (one
observer of the two) the public model; not the obfuscated weights and not the key.

Traffic: the stream of ``logs_only`` (requests in the model's own chat template, half Faker PII prompts, half
passages of the client's documents, one secret permutation of the full vocabulary), for SmolLM2 or
Qwen2.5-Coder-0.5B. A volume V is the first whole requests totalling V tokens; every observed token is scored.

Attack: ``aloepri.attacks.stream_decipher.decipher_stream`` (template anchors, frequency seed, mean-field
decipherment and simulated annealing on a bigram model of the reference text). Observers:

- ``no-model``: what a model-free decipherer reads;
- ``no-model-best4``: the same, keeping the likeliest of four annealing runs under its own bigram model;
- ``public-model``: the same as ``no-model``, plus the public LM (restarts and an LM-refined mapping, the one whose deciphered
  stream the LM finds most likely is kept: no key involved in the choice).

References (the observer's text): ``public`` = fortunes + debian-reference (Debian packages; general English and
computing documentation, neither the client's source); ``same-distribution`` = traffic generated exactly like the
client's with other Faker values and the other half of python-docs (the observer's best case). Controls:
``control/victim-text`` (positive: the reference is the observed traffic's own plaintext) and
``control/random-mapping`` (negative: a random 1:1 guess). The paper's attacks run on the same streams: TFMA
(``tfma/<reference>``, every volume) and SDA (``sda/<reference>``, budget ci, at the controls' volumes).

Resumable: keyed ``<reference>/<observer>/<volume>``; entries present are skipped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..lib import ResultStore
from ..lib.models import model_path
from .logs_only import build_stream, chat_wrapper, observed_prefix, prior_ids, recovery_report, split_requests

VOLUMES = (100, 300, 1_000, 10_000, 100_000)


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    volumes: tuple[int, ...] = VOLUMES
    # (reference, observer) pairs measured at every volume; controls and TFMA are added per volume
    runs: tuple[str, ...] = ("public/no-model", "public/public-model", "same-distribution/no-model")
    controls_at: tuple[int, ...] = (1_000, 10_000)
    reference_tokens: int = 1_000_000
    lm_tokens: int = 10_000  # tokens the public LM reads to refine a mapping (per entry)
    lm_judge_tokens: int = 3_000  # tokens it reads to compare candidate mappings
    max_candidates: int = 20_000
    seed: int = 0
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.frequency import tfma_match
    from aloepri.attacks.stream_decipher import LMScorer, decipher_stream, public_reference
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    keys = [f"{r}/{v}" for r in s.runs for v in s.volumes]
    keys += [f"tfma/{ref}/{v}" for ref in ("public", "same-distribution") for v in s.volumes]
    keys += [f"control/{c}/{v}" for c in ("victim-text", "random-mapping") for v in s.controls_at]
    # the paper's own context attack (SDA, budget ci) on the same streams, where the controls are
    keys += [f"sda/{ref}/{v}" for ref in ("public", "same-distribution") for v in s.controls_at]
    # the slow public-model entries after all others, small volumes first, so that a stopped run already holds
    # the model-free curves whole
    todo = sorted((k for k in keys if not store.has(k)),
                  key=lambda k: ("public-model" in k, int(k.rsplit("/", 1)[1])))
    if not todo:
        return
    torch.set_num_threads(s.threads)
    tok = load_hf_tokenizer(model_path(s.model))
    stream = build_stream(tok, max(s.volumes), s.seed)
    # the client's key: a uniformly random permutation (seeded so that the study is reproducible)
    perm = np.random.default_rng(s.seed + 99).permutation(len(tok))
    pre, post = chat_wrapper(tok)
    refs: dict[str, list[np.ndarray]] = {}
    lm = None

    def reference(name: str) -> list[np.ndarray]:
        if name not in refs:
            refs[name] = (public_reference(tok, s.reference_tokens) if name == "public" else
                          [prior_ids(tok, "same-distribution", s.reference_tokens, s.seed)])
        return refs[name]

    for key in todo:
        parts = key.split("/")
        volume = int(parts[-1])
        sl = observed_prefix(stream, volume)
        truth_reqs = split_requests(stream.ids[sl], stream.request_ends[stream.request_ends <= sl.stop])
        observed = [perm[r] for r in truth_reqs]
        truth = stream.ids[sl]
        t0 = time.perf_counter()
        extra: dict = {}
        if parts[0] == "sda":
            from .logs_only import run_sda

            ref = np.concatenate(reference(parts[1]))
            sda = run_sda(tok, stream, sl, ref, perm, s.seed)
            guess, extra = sda.pop("guess"), {"sda": sda["sda"]}
        elif parts[0] == "tfma":
            match = tfma_match(np.concatenate(observed), np.concatenate(reference(parts[1])), len(perm), s.seed)
            guess = match.obf_to_plain[np.concatenate(observed)]
        elif parts[0] == "control" and parts[1] == "random-mapping":
            guess = np.random.default_rng(s.seed + 7).permutation(len(perm))[np.concatenate(observed)]
        else:
            ref_name, observer = (("victim", "no-model") if parts[0] == "control" else (parts[0], parts[1]))
            # 'no-model-best4': four annealing runs, the one its bigram model finds likeliest kept
            restarts = 3 if observer == "no-model-best4" else (1 if observer == "public-model" else 0)
            ref = truth_reqs if ref_name == "victim" else reference(ref_name)
            if observer == "public-model" and lm is None:
                from aloepri.runtime.inference import load_plain_model

                model = load_plain_model(model_path(s.model))
                model.eval()
                lm = LMScorer(model, batch=4)
            inv = np.argsort(perm)

            def score(entry: dict, mapping: np.ndarray) -> dict:
                g = mapping[np.concatenate(observed)]
                ok = g == truth
                return {"token_recovery": round(float(ok.mean()), 4),
                        "pii_recovery": round(float(ok[stream.pii[sl]].mean()), 4)}

            res = decipher_stream(observed, len(perm), ref, pre, post, lm=lm if observer == "public-model" else None,
                                  lm_tokens=s.lm_tokens, lm_judge_tokens=s.lm_judge_tokens,
                                  max_candidates=s.max_candidates, restarts=restarts, seed=s.seed, progress=score)
            guess = res.obf_to_plain[np.concatenate(observed)]
            seen = np.unique(np.concatenate(observed))
            extra = {"trace": res.trace, "anchors": res.anchors,
                     "distinct_ids_recovered_share": float(np.mean(res.obf_to_plain[seen] == inv[seen]))}
        out = recovery_report(tok, truth, guess, stream.pii[sl], stream.template[sl])
        out.update(extra)
        out.update({"model": s.model, "key": key, "requests_observed": len(truth_reqs),
                    "seconds": round(time.perf_counter() - t0, 1), "seed": s.seed,
                    "reference_tokens": s.reference_tokens})
        store.put(key, out)
        print(f"{key}: all {out['token_recovery']:.3f} user {out['user_text_recovery']:.3f} "
              f"pii {out['pii_recovery']} ({out['seconds']} s)", flush=True)


def render(entries: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = ["| attack / reference / observer | tokens observed | requests | all (%) | user text (%) | PII (%) | "
             "distinct ids recovered | seconds |", "|---|---|---|---|---|---|---|---|"]
    for key in sorted(entries, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1]))):
        e = entries[key]
        lines.append(f"| {key.rsplit('/', 1)[0]} | {e['tokens_observed']:,} | {e['requests_observed']} | "
                     f"{pct(e['token_recovery'])} | {pct(e['user_text_recovery'])} | {pct(e['pii_recovery'])} | "
                     f"{e['distinct_types_recovered']} / {e['distinct_types_observed']} | {e['seconds']} |")
    return "\n".join(lines)


def plot(entries: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    series: dict[str, list[tuple[int, dict]]] = {}
    for key, e in entries.items():
        if key.startswith("control/random"):
            continue
        series.setdefault(key.rsplit("/", 1)[0], []).append((e["tokens_observed"], e))
    for name, pts in sorted(series.items()):
        pts.sort(key=lambda x: x[0])
        for ax, fld in zip(axes, ("token_recovery", "pii_recovery")):
            ax.plot([x for x, _ in pts], [100 * (e[fld] or 0) for _, e in pts], "o-", label=name)
    for ax, title in zip(axes, ("all observed tokens", "PII tokens")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens observed")
        ax.set_title(f"recovered: {title}")
        ax.grid(alpha=0.3)
        ax.axhline(5, color="grey", lw=0.8, ls=":")
    axes[0].set_ylabel("recovered (%)")
    axes[1].legend(fontsize=6)
    fig.suptitle("The observer of the logs (no key, no obfuscated weights): recovery vs. volume", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rekey_volumes(entries: dict, threshold: float = 0.05) -> dict[str, int | None]:
    """Per attack series: the largest measured volume V such that PII recovery stayed below ``threshold`` at every
    measured volume up to V (a client re-keying every V tokens shows each key's observer at most V tokens).
    None: already above it at the smallest volume measured with PII in it."""
    series: dict[str, list[tuple[int, float | None]]] = {}
    for key, e in entries.items():
        if key.startswith("control/"):
            continue
        series.setdefault(key.rsplit("/", 1)[0], []).append((e["tokens_observed"], e["pii_recovery"]))
    out: dict[str, int | None] = {}
    for name, pts in sorted(series.items()):
        best = None
        for vol, pii in sorted(pts):
            if pii is None:
                continue
            if pii >= threshold:
                break
            best = vol
        out[name] = best
    return out


def report(store: ResultStore) -> str:
    entries = store.entries()
    figure = store.figure_path(".png")
    plot(entries, figure)
    rekey = "\n".join(f"- {name}: {'none measured' if v is None else f'{v:,} tokens'}"
                      for name, v in rekey_volumes(entries).items())
    return (render(entries) + f"\n\nFigure: results/{store.experiment}/{figure.name}\n\n"
            "Largest volume measured with PII recovery below 5% at it and every smaller volume (re-keying every "
            f"that many tokens keeps each key's observer there):\n{rekey}")


SUMMARY = "the observer of the logs with the public model: decipherment of the id stream vs. volume (minutes to hours)"
CONFIGS = {
    "smollm2": Settings(),
    "qwen-coder": Settings(model="qwen-coder", volumes=(100, 1_000, 10_000, 100_000),
                           runs=("public/no-model", "public/public-model"), controls_at=(10_000,),
                           lm_tokens=5_000, lm_judge_tokens=2_000),
    # replications (another key, traffic order and annealing seed) for the spread of the model-free figures
    **{f"smollm2-seed{k}": Settings(volumes=(1_000, 10_000), runs=("public/no-model", "same-distribution/no-model"),
                                    controls_at=(), seed=k) for k in (1, 2)},
    # the model-free observer keeping the likeliest of four annealing runs (three keys)
    **{f"smollm2-best4{'' if k == 0 else f'-seed{k}'}": Settings(
        volumes=(1_000, 10_000) if k else (1_000, 10_000, 100_000),
        runs=("public/no-model-best4", "same-distribution/no-model-best4"), controls_at=(), seed=k) for k in (0, 1, 2)},
    "smoke": Settings(volumes=(300,), runs=("public/no-model",), controls_at=(300,), reference_tokens=50_000),
}
DOCS = ("docs/security.md",)
NOTES = "needs the corpora of docs/data.md; SmolLM2 takes about an hour on 2 cores, Qwen2.5-Coder-0.5B longer"
