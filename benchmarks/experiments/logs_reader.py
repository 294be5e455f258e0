"""The log reader at every volume: ``aloepri.attacks.log_reader.decipher_logs`` (sparse, bounded scores) on the
streams of ``logs_only`` / ``logs_decipher`` (SmolLM2 chat traffic, half Faker PII prompts, half passages of the
client's python-docs half; one secret permutation of the vocabulary) from 10^3 to 10^6 observed tokens, with the
peak memory of the process that ran it.

References (the observer's text):

- ``public``: fortunes + debian-reference (general English and computing documentation);
- ``public+domain``: the same plus traffic the observer generated itself like the client's: the other half of
  python-docs and PII prompts from the same ten templates with its own Faker seed, wrapped in the public chat
  template (``logs_only.prior_ids('same-distribution')``). It shares no document or PII value with the client.

Methods: ``log-reader`` (the new decipherer; volumes run in increasing order, each warm-started from the map this
store holds for the previous volume, the likelier of the warm and the fresh map kept: an observer who reads the
logs as they grow; from 10^6 tokens on only the warm start is refined, with a shorter search, for time);
``log-reader-lm`` (the same observer holding the public model: its next-token distribution after each candidate
token joins the reference's bigram model, ``lm_successors``); ``log-reader-em`` (the observer with the public model
reading whole requests, ``lm_refine``: the maps of the bigram search and of ``decipher_stream`` are deciphered,
the model reads them and keeps the likeliest, then EM rounds with its full-context predictions and the digits as a
unit, each kept only where the model's likelihood rises; ``parts`` holds the figures after each part);
``log-reader+digits`` (the map another config's bigram search stored, then the digits read as a unit from the
reference alone, ``decipher_logs(digits=...)``; ``parts`` holds the figures before and after);
``stream-decipher`` (the earlier ``decipher_stream``,
measured in the same run where it fits); controls at one volume: ``control/victim-text`` (positive: the traffic's
own plaintext as reference) and ``control/random-mapping`` (negative: a random 1:1 guess).

Resumable: keyed ``<method>/<reference>/<volume>``; entries present are skipped. ``ALOEPRI_BENCH_ONLY=KEY,...``
(environment) makes one invocation fill only those entries of the config (a run can leave the shared heavy-run lock
between entries); it chooses which entries this run fills, not what they mean, so it is not a setting.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import numpy as np

from ..lib import ResultStore, UsageError
from ..lib.models import model_path
from .logs_only import build_stream, chat_wrapper, observed_prefix, prior_ids, recovery_report, split_requests

VOLUMES = (1_000, 10_000, 100_000, 1_000_000)
REFERENCES = ("public", "public+domain")


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    volumes: tuple[int, ...] = VOLUMES
    references: tuple[str, ...] = REFERENCES
    old_at: tuple[int, ...] = (1_000, 10_000)  # the earlier decipher_stream, side by side, where it fits
    controls_at: tuple[int, ...] = (10_000,)
    reference_tokens: int = 1_000_000
    old_max_candidates: int = 20_000
    lm_at: tuple[int, ...] = ()  # volumes of the observer with the public model (log-reader-lm)
    # a memory check: one mean-field step, one round of block moves, 10 annealing proposals per id (its recovery
    # is that of a short search, a lower bound; its peak memory is the decipherer's at that volume)
    short_search: bool = False
    seed: int = 0
    threads: int = 1
    # the observer with the public model reading whole requests (``log-reader-em``: decipher_logs' ``lm_rounds``):
    # the maps of the bigram search (this store's ``log-reader`` entry, else the ``em_from`` config's, else a
    # search run here) and of ``decipher_stream`` (at volumes up to ``old_start_at``) are read by the model, the
    # likeliest kept, then refined (EM with the model's predictions, then the digits as a unit)
    em_at: tuple[int, ...] = ()
    em_from: str | None = None
    em_method: str = "log-reader"  # the entries of ``em_from`` whose maps the model starts from
    em_rounds: int = 6
    em_options: tuple[tuple[str, object], ...] = ()
    old_start_at: int = 10_000
    stream_tokens: int | None = None  # the stream built (its order depends on it): default the largest volume
    # more keywords of decipher_logs for the log-reader entries and the victim-text control (``restarts``: more
    # mean-field schedules, the likeliest polished map kept; "RESTARTS" stands for log_reader.RESTARTS)
    search: tuple[tuple[str, object], ...] = ()
    # the digits as a unit on the maps other configs hold (``log-reader+digits`` entries: the first of these configs
    # with a ``log-reader`` entry for the reference and volume, the same stream and key; ``digits_unit``)
    digits_from: tuple[str, ...] = ()
    # the controls of the model's moves (``log-reader-em`` with ``move_evals`` in ``em_options``) at these volumes:
    # ``control/victim-text+moves`` (the bigram search with the traffic's own text as reference, then the moves)
    # and ``control/random-mapping+moves`` (a random 1:1 map, then the moves, with the generic reference)
    moves_controls_at: tuple[int, ...] = ()
    # more starts for the model to choose among (``log-reader-em``, volumes up to ``old_start_at``): the earlier
    # decipher_stream run again with these (seed, max_candidates)
    old_restarts: tuple[tuple[int, int], ...] = ()


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (GiB): an upper bound on what the entry needed."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.log_reader import decipher_logs
    from aloepri.attacks.stream_decipher import decipher_stream, public_reference
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    keys = [f"log-reader/{r}/{v}" for r in s.references for v in s.volumes if not s.digits_from]
    keys += [f"log-reader-lm/{r}/{v}" for r in s.references for v in s.lm_at]
    keys += [f"stream-decipher/{r}/{v}" for r in s.references for v in s.old_at]
    keys += [f"log-reader-em/{r}/{v}" for r in s.references for v in s.em_at]
    keys += [f"log-reader+digits/{r}/{v}" for r in s.references for v in s.volumes if s.digits_from]
    keys += [f"control/{c}/{v}" for c in ("victim-text", "random-mapping") for v in s.controls_at]
    keys += [f"control/{c}+moves/{v}" for c in ("victim-text", "random-mapping") for v in s.moves_controls_at]
    only = [x.strip() for x in os.environ.get("ALOEPRI_BENCH_ONLY", "").split(",") if x.strip()]
    unknown = [x for x in only if x not in keys]
    if unknown:
        raise UsageError(f"ALOEPRI_BENCH_ONLY: {', '.join(unknown)} is not an entry of this config "
                         f"({', '.join(keys)})")
    # by volume; the model's refinement after the search whose map it reads
    todo = sorted((k for k in keys if not store.has(k) and (not only or k in only)),
                  key=lambda k: (int(k.rsplit("/", 1)[1]), k.startswith("log-reader-em/"), k))
    if not todo:
        return
    torch.set_num_threads(s.threads)
    tok = load_hf_tokenizer(model_path(s.model))
    stream = build_stream(tok, s.stream_tokens or max(s.volumes + s.lm_at + s.em_at), s.seed)
    perm = np.random.default_rng(s.seed + 99).permutation(len(tok))  # the client's key (seeded: reproducible)
    pre, post = chat_wrapper(tok)
    refs: dict[str, list[np.ndarray]] = {}
    lm = None

    def reference(name: str) -> list[np.ndarray]:
        if name not in refs:
            refs[name] = public_reference(tok, s.reference_tokens)
            if name == "public+domain":
                refs[name] = refs[name] + [prior_ids(tok, "same-distribution", s.reference_tokens, s.seed)]
        return refs[name]

    for key in todo:
        method, ref_name, volume = key.rsplit("/", 2)[0], key.rsplit("/", 2)[1], int(key.rsplit("/", 1)[1])
        sl = observed_prefix(stream, volume)
        truth_reqs = split_requests(stream.ids[sl], stream.request_ends[stream.request_ends <= sl.stop])
        observed = [perm[r] for r in truth_reqs]
        flat = np.concatenate(observed)
        truth = stream.ids[sl]
        t0 = time.perf_counter()
        extra: dict = {}

        def score(entry: dict, mapping: np.ndarray) -> dict:
            ok = mapping[flat] == truth
            return {"token_recovery": round(float(ok.mean()), 4),
                    "user_text_recovery": round(float(ok[~stream.template[sl]].mean()), 4),
                    "pii_recovery": round(float(ok[stream.pii[sl]].mean()), 4)}

        if key.startswith("control/") and ref_name.endswith("+moves"):
            guess, extra = _moves_control(s, ref_name, volume, observed, truth_reqs, flat, len(perm),
                                          reference("public"), pre, post, score, lambda: _load_lm(s))
        elif method == "log-reader+digits":
            guess, extra = _digits_entry(s, store, ref_name, volume, observed, flat, tok, len(perm),
                                         reference(ref_name), pre, post, score)
        elif method == "log-reader-em":
            guess, extra = _em_entry(s, store, ref_name, volume, observed, flat, tok, len(perm), reference(ref_name),
                                     pre, post, score, lambda: _load_lm(s))
        elif key.startswith("control/random-mapping"):
            guess = np.random.default_rng(s.seed + 7).permutation(len(perm))[flat]
        elif method == "stream-decipher":
            res = decipher_stream(observed, len(perm), reference(ref_name), pre, post,
                                  max_candidates=s.old_max_candidates, seed=s.seed, progress=score)
            guess = res.obf_to_plain[flat]
            extra = {"trace": res.trace, "anchors": res.anchors}
        else:
            victim = key.startswith("control/victim-text")
            ref = truth_reqs if victim else reference(ref_name)
            init = None
            prev = [v for v in (s.lm_at if method == "log-reader-lm" else s.volumes) if v < volume]
            if not victim and prev and store.has(f"{method}/{ref_name}/{max(prev)}"):
                held = store.entries()[f"{method}/{ref_name}/{max(prev)}"]["map"]
                init = dict(zip(held["cipher"], held["plain"]))
            if method == "log-reader-lm" and lm is None:
                from aloepri.runtime.inference import load_plain_model

                lm = load_plain_model(model_path(s.model))
            # from 10^6 tokens on, the warm start alone is refined, with 8 rounds of block moves and 100 annealing
            # proposals per id (the 10^5 map it starts from had the full search): a 2-core machine's hour
            big = volume >= 1_000_000
            search = {"temperatures": (1.0,), "block_rounds": 1, "anneal_steps": 10} if s.short_search else \
                ({"block_rounds": 8, "anneal_steps": 100} if big else {})
            search.update(_search_options(s))
            res = decipher_logs(observed, len(perm), ref, pre, post, init=init, seed=s.seed, progress=score,
                                lm=lm if method == "log-reader-lm" else None, fresh=not big, **search)
            guess = res.obf_to_plain[flat]
            seen = np.unique(flat)
            extra = {"trace": res.trace, "anchors": res.anchors, "warm_started_from": max(prev) if init else None,
                     "map": {"cipher": seen.tolist(), "plain": res.obf_to_plain[seen].tolist()}}
        out = recovery_report(tok, truth, guess, stream.pii[sl], stream.template[sl])
        out.update(extra)
        out.update({"model": s.model, "key": key, "requests_observed": len(truth_reqs),
                    "seconds": round(time.perf_counter() - t0, 1), "seed": s.seed,
                    "reference_tokens": int(sum(len(r) for r in reference(ref_name))) if ref_name in REFERENCES
                    else int(len(truth)), "peak_rss_gib": peak_rss_gib()})
        store.put(key, out)
        print(f"{key}: all {out['token_recovery']:.3f} user {out['user_text_recovery']:.3f} "
              f"pii {out['pii_recovery']} ({out['seconds']} s, peak {out['peak_rss_gib']} GiB)", flush=True)


def _search_options(s: Settings) -> dict:
    from aloepri.attacks.log_reader import RESTARTS

    opts = dict(s.search)
    if opts.get("restarts") == "RESTARTS":
        opts["restarts"] = RESTARTS
    if s.digits_from:  # the victim-text control reads the digits as a unit too
        opts["digits"] = _digits(s)
    return opts


def _digits(s: Settings) -> list[int]:
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(model_path(s.model))
    return [tok.convert_tokens_to_ids(str(d)) for d in range(10)]


def _digits_entry(s: Settings, store: ResultStore, ref_name: str, volume: int, observed, flat, tok, vocab: int,
                  ref, pre, post, score) -> tuple[np.ndarray, dict]:
    """One ``log-reader+digits`` entry: the map another config's bigram search ended on (the same stream and
    key), then the digits as a unit (``decipher_logs(digits=...)``, from the reference alone; no other search).
    ``parts``: the figures before and after."""
    from aloepri.attacks.log_reader import decipher_logs

    init, source = None, None
    for cfg in s.digits_from:
        other = ResultStore(store.experiment, cfg)
        theirs = other.load().get("settings") or {}
        same = theirs.get("model") == s.model and theirs.get("seed") == s.seed and \
            (theirs.get("stream_tokens") or max(theirs.get("volumes", []) + theirs.get("lm_at", []) +
                                                theirs.get("em_at", []))) == (s.stream_tokens or max(s.volumes)) and \
            theirs.get("reference_tokens") == s.reference_tokens
        key = f"log-reader/{ref_name}/{volume}"
        if same and other.has(key):
            held = other.entries()[key]["map"]
            init, source = dict(zip(held["cipher"], held["plain"])), cfg
            break
    if init is None:
        raise ValueError(f"no config of {s.digits_from} holds log-reader/{ref_name}/{volume} on this stream")
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    res = decipher_logs(observed, vocab, ref, pre, post, init=init, fresh=False, block_rounds=0, anneal_steps=0,
                        seed=s.seed, digits=digits, progress=score)
    figures = ("token_recovery", "user_text_recovery", "pii_recovery")
    start = next(e for e in res.trace if e["stage"] == "warm start")
    end = next(e for e in res.trace if e["stage"].startswith("digits as a unit"))
    parts = {f"bigram search ({source})": {k: start[k] for k in figures},
             "+ digits as a unit (reference)": {k: end[k] for k in figures}}
    seen = np.unique(flat)
    return res.obf_to_plain[flat], {"trace": res.trace, "anchors": res.anchors, "parts": parts, "start_from": source,
                                    "map": {"cipher": seen.tolist(), "plain": res.obf_to_plain[seen].tolist()}}


_LM: dict = {}


def _load_lm(s: Settings):
    if s.model not in _LM:
        from aloepri.runtime.inference import load_plain_model

        _LM[s.model] = load_plain_model(model_path(s.model))
    return _LM[s.model]


def _stored_map(s: Settings, store: ResultStore, ref_name: str, volume: int) -> tuple[dict | None, str | None]:
    """The bigram search's map for this volume: this store's ``log-reader`` entry, else the ``em_from`` config's
    (the same stream and key: its settings must match)."""
    key = f"{s.em_method}/{ref_name}/{volume}"
    if store.has(key):
        held = store.entries()[key]["map"]
        return dict(zip(held["cipher"], held["plain"])), store.config
    if s.em_from:
        other = ResultStore(store.experiment, s.em_from)
        theirs = other.load().get("settings") or {}
        same = theirs.get("model") == s.model and theirs.get("seed") == s.seed and \
            (theirs.get("stream_tokens") or max(theirs.get("volumes", []) + theirs.get("lm_at", []) +
                                                theirs.get("em_at", []))) == \
            (s.stream_tokens or max(s.volumes + s.lm_at + s.em_at)) and \
            theirs.get("reference_tokens") == s.reference_tokens
        if same and other.has(key):
            held = other.entries()[key]["map"]
            return dict(zip(held["cipher"], held["plain"])), s.em_from
    return None, None


def _em_entry(s: Settings, store: ResultStore, ref_name: str, volume: int, observed, flat, tok, vocab: int,
              ref, pre, post, score, lm_of) -> tuple[np.ndarray, dict]:
    """One ``log-reader-em`` entry: the figures after each part (the bigram search's map alone; the map the model
    chose among the starts; after the EM rounds; after the digits) from the trace, scored with the key."""
    from aloepri.attacks.log_reader import decipher_logs
    from aloepri.attacks.stream_decipher import decipher_stream

    init, source = _stored_map(s, store, ref_name, volume)
    t0 = time.perf_counter()
    searched = None
    if init is None:  # the bigram search here, the same as ``log-reader``
        res = decipher_logs(observed, vocab, ref, pre, post, seed=s.seed)
        seen = np.unique(flat)
        init = {int(c): int(res.obf_to_plain[c]) for c in seen}
        source, searched = "searched here", round(time.perf_counter() - t0, 1)
    extra_starts, old_figures = [], None
    if volume <= s.old_start_at:
        t1 = time.perf_counter()
        old = decipher_stream(observed, vocab, ref, pre, post, max_candidates=s.old_max_candidates, seed=s.seed)
        seen = np.unique(flat)
        extra_starts = [("decipher_stream", {int(c): int(old.obf_to_plain[c]) for c in seen})]
        old_figures = {**score({}, old.obf_to_plain), "seconds": round(time.perf_counter() - t1, 1)}
        for seed, cands in s.old_restarts:  # restarts of the earlier decipherer: more maps for the model to read
            other = decipher_stream(observed, vocab, ref, pre, post, max_candidates=cands, seed=seed)
            extra_starts.append((f"decipher_stream seed {seed}, {cands} candidates",
                                 {int(c): int(other.obf_to_plain[c]) for c in seen}))
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    options = {"digits": digits, **dict(s.em_options)}
    t2 = time.perf_counter()
    res = decipher_logs(observed, vocab, ref, pre, post, init=init, fresh=False, block_rounds=0, anneal_steps=0,
                        seed=s.seed, lm=lm_of(), lm_bigram=False, lm_rounds=s.em_rounds, lm_options=options,
                        extra_starts=extra_starts, progress=score)
    model_seconds = round(time.perf_counter() - t2, 1)
    figures = ("token_recovery", "user_text_recovery", "pii_recovery")
    reads = [e for e in res.trace if e["stage"].startswith("model reads")]
    chosen = max(reads, key=lambda e: e["model_ll"])
    em = [e for e in res.trace if e["stage"].startswith("model EM") and e.get("kept")]
    dg = [e for e in res.trace if e["stage"].startswith("digits") and e.get("kept")]
    part = lambda e: {k: e[k] for k in figures + ("model_ll",)}  # noqa: E731
    parts = {"bigram search (" + source + ")": part(next(e for e in reads if "warm start" in e["stage"]))}
    if old_figures:
        parts["decipher_stream"] = {**old_figures,
                                    "model_ll": next(e["model_ll"] for e in reads if "decipher_stream" in e["stage"])}
    for e in reads:
        if "decipher_stream seed" in e["stage"]:
            parts[e["stage"].split(": ", 1)[1]] = part(e)
    parts["the model chooses the start"] = part(chosen)
    if s.em_rounds:
        parts["+ EM with the model"] = part(em[-1] if em else chosen)
    parts["+ digits as a unit"] = part(dg[-1] if dg else (em[-1] if em else chosen))
    if options.get("move_evals"):
        mv = [e for e in res.trace if e["stage"].startswith("model moves: round") and e.get("kept")]
        parts["+ moves judged by the model"] = part(mv[-1]) if mv else parts["+ digits as a unit"]
    seen = np.unique(flat)
    return res.obf_to_plain[flat], {
        "trace": res.trace, "anchors": res.anchors, "parts": parts, "start_from": source,
        "search_seconds": searched, "model_seconds": model_seconds, "em_rounds": s.em_rounds,
        "em_rounds_kept": sum(bool(e.get("kept")) for e in res.trace if e["stage"].startswith("model EM")),
        "digit_swaps_kept": bool(dg),
        "move_rounds_kept": sum(bool(e.get("kept")) for e in res.trace if e["stage"].startswith("model moves: round")),
        "em_options": {k: v for k, v in options.items() if k != "digits"},
        "map": {"cipher": seen.tolist(), "plain": res.obf_to_plain[seen].tolist()}}


def _moves_control(s: Settings, method: str, volume: int, observed, truth_reqs, flat, vocab: int, ref, pre, post,
                   score, lm_of) -> tuple[np.ndarray, dict]:
    """The controls of the model's moves: ``control/victim-text+moves`` (positive: the bigram search with the
    traffic's own text as reference, then the moves as ``log-reader-em`` makes them) and
    ``control/random-mapping+moves`` (negative: a random 1:1 map of the observed ids, then the moves, with the
    generic reference). ``parts``: the figures before and after the moves."""
    from aloepri.attacks.log_reader import decipher_logs

    opts = {k: v for k, v in dict(s.em_options).items() if k.startswith("move_") or k == "sample_tokens"}
    opts.update({"digits": _digits(s), "digit_rounds": 0})  # the digits kept where they are (move_keep_digits)
    seen = np.unique(flat)
    common = {"lm": lm_of(), "lm_bigram": False, "lm_rounds": 0, "lm_options": opts, "seed": s.seed,
              "progress": score}
    if method.startswith("victim-text"):
        res = decipher_logs(observed, vocab, truth_reqs, pre, post, **common)
    else:
        rand = np.random.default_rng(s.seed + 7).permutation(vocab)
        res = decipher_logs(observed, vocab, ref, pre, post, init={int(c): int(rand[c]) for c in seen},
                            fresh=False, block_rounds=0, anneal_steps=0, **common)
    figures = ("token_recovery", "user_text_recovery", "pii_recovery", "model_ll")
    start = next(e for e in res.trace if e["stage"] == "model moves: start")
    kept = [e for e in res.trace if e["stage"].startswith("model moves: round") and e.get("kept")]
    parts = {"before the moves": {k: start[k] for k in figures},
             "+ moves judged by the model": {k: (kept[-1] if kept else start)[k] for k in figures}}
    return res.obf_to_plain[flat], {"trace": res.trace, "anchors": res.anchors, "parts": parts,
                                    "map": {"cipher": seen.tolist(), "plain": res.obf_to_plain[seen].tolist()}}


def render(entries: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    lines = ["| method | reference | tokens observed | all (%) | user text (%) | PII (%) | distinct ids recovered | "
             "seconds | peak memory (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(entries, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1]))):
        e = entries[key]
        method, ref, _ = key.rsplit("/", 2)
        lines.append(f"| {method} | {ref} | {e['tokens_observed']:,} | {pct(e['token_recovery'])} | "
                     f"{pct(e['user_text_recovery'])} | {pct(e['pii_recovery'])} | "
                     f"{e['distinct_types_recovered']} / {e['distinct_types_observed']} | {e['seconds']} | "
                     f"{e['peak_rss_gib']} |")
    parts = [k for k in sorted(entries, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])))
             if entries[k].get("parts")]
    with_model = any("model_ll" in f for k in parts for f in entries[k]["parts"].values())
    if parts:  # what each part adds (log-reader-em: the observer with the model; log-reader+digits: the digits)
        lines += ["", "| reference | tokens observed | part | all (%) | user text (%) | PII (%) |" +
                  (" the model's log-likelihood per token |" if with_model else ""),
                  "|---|---|---|---|---|---|" + ("---|" if with_model else "")]
        for key in parts:
            e = entries[key]
            for name, f in e["parts"].items():
                if name == "+ EM with the model" and not e.get("em_rounds"):
                    continue  # no EM round was run for this entry
                lines.append(f"| {key.rsplit('/', 2)[1]} | {e['tokens_observed']:,} | {name} | "
                             f"{pct(f['token_recovery'])} | {pct(f['user_text_recovery'])} | {pct(f['pii_recovery'])} |" +
                             ((f" {f['model_ll']:.3f} |" if "model_ll" in f else " - |") if with_model else ""))
    return "\n".join(lines)


def report(store: ResultStore) -> str:
    from .logs_decipher import plot

    entries = store.entries()
    figure = store.figure_path(".png")
    plot({k: e for k, e in entries.items() if not k.startswith("control/")}, figure)
    return render(entries) + f"\n\nFigure: results/{store.experiment}/{figure.name}"


def _moves(volume: int, ref: str, sample: int, evals: int, rounds: int, keep_digits: bool = True,
           rank: str | None = None) -> Settings:
    """A config of the public model's moves (``log-reader-em`` with ``move_evals``) at one volume, from the maps of
    ``smollm2-digits`` (the same stream and key)."""
    options = (("sample_tokens", sample), ("digit_rounds", 0), ("move_evals", evals), ("move_rounds", rounds),
               ("move_occurrences", 6))
    if keep_digits:
        options += (("move_keep_digits", True), ("move_min_occurrences", 3))
    if rank:
        options += (("move_rank", rank),)
    return Settings(volumes=(), references=(ref,), old_at=(), controls_at=(), em_at=(volume,),
                    em_from="smollm2-digits", em_method="log-reader+digits", stream_tokens=1_000_000, em_rounds=0,
                    old_start_at=0, em_options=options)


SUMMARY = "the log reader (sparse decipherer) from 10^3 to 10^6 observed tokens, with peak memory (an hour or more)"
CONFIGS = {
    "smollm2": Settings(),
    "smollm2-seed1": Settings(volumes=(1_000, 10_000, 100_000), old_at=(), controls_at=(), seed=1),
    # a third key at 10^3 and 10^4, with both controls
    "smollm2-seed2": Settings(volumes=(1_000, 10_000), old_at=(), seed=2),
    # the earlier decipher_stream at its registered defaults (30,000 candidates), where it fits: the column
    "smollm2-old-defaults": Settings(volumes=(), old_at=(1_000, 10_000), old_max_candidates=30_000,
                                     controls_at=(1_000,), stream_tokens=1_000_000),
    # 10^6 tokens with a short search, one reference per config (run side by side): the memory check
    **{f"smollm2-1e6-short-{r.replace('+', '-')}": Settings(volumes=(1_000_000,), references=(r,), old_at=(),
                                                           controls_at=(), short_search=True) for r in REFERENCES},
    # 10^6 tokens from scratch (no warm start in these stores), one reference per config (run side by side)
    **{f"smollm2-1e6-{r.replace('+', '-')}": Settings(volumes=(1_000_000,), references=(r,), old_at=(), controls_at=())
       for r in REFERENCES},
    # the observer with the public model (a config of its own: it loads the model)
    "smollm2-lm": Settings(volumes=(), lm_at=(1_000, 10_000, 100_000), old_at=(), controls_at=()),
    # the observer holding the public model reading whole requests, from the bigram search's maps of ``smollm2``
    # (the same stream and key): the model chooses among them and decipher_stream's, EM, then the digits as a unit
    **{f"smollm2-em{'' if v < 100_000 else '-1e5'}": Settings(
        volumes=(), old_at=(), controls_at=(), em_at=(v,) if v == 100_000 else (1_000, 10_000), em_from="smollm2",
        stream_tokens=1_000_000, em_rounds=2 if v < 100_000 else 0,
        em_options=(("sample_tokens", 5_000), ("digit_rounds", 4))) for v in (1_000, 100_000)},
    # the generic reference at 10^4 on its own (run beside smollm2-em, which stops after public+domain at 10^4)
    "smollm2-em-1e4-public": Settings(volumes=(), references=("public",), old_at=(), controls_at=(),
                                      em_at=(10_000,), em_from="smollm2", stream_tokens=1_000_000, em_rounds=2,
                                      em_options=(("sample_tokens", 5_000), ("digit_rounds", 4))),
    # the digits as a unit with the whole sample read after every round (the likeliest round kept), at 10^4, from
    # the bigram search's maps; no EM round, no other start
    **{f"smollm2-digits-1e4-{r.replace('+', '-')}": Settings(
        volumes=(), references=(r,), old_at=(), controls_at=(), em_at=(10_000,), em_from="smollm2",
        stream_tokens=1_000_000, em_rounds=0, old_start_at=0,
        em_options=(("sample_tokens", 5_000), ("digit_rounds", 4), ("digit_check_each", True))) for r in REFERENCES},
    # a third key: the bigram search and the model's refinement on the same stream
    "smollm2-seed2-em": Settings(volumes=(1_000, 10_000), old_at=(), controls_at=(), em_at=(1_000, 10_000), seed=2,
                                 em_rounds=2, em_options=(("sample_tokens", 5_000), ("digit_rounds", 4))),
    # restarts: more mean-field schedules (per-id temperatures among them), each polished by block moves, the
    # likeliest under the observer's bigram model kept (log_reader.RESTARTS); with both controls
    "smollm2-restarts": Settings(volumes=(1_000, 10_000), old_at=(), search=(("restarts", "RESTARTS"),),
                                 stream_tokens=1_000_000),
    # the digits as a unit (from the reference alone) on the bigram search's maps of smollm2 and of the 10^6 configs
    # (the same stream and key), with both controls (the victim-text control reads its digits as a unit too)
    "smollm2-digits": Settings(volumes=VOLUMES, old_at=(), stream_tokens=1_000_000,
                               digits_from=("smollm2", "smollm2-1e6-short-public", "smollm2-1e6-short-public-domain")),
    # the same on the maps of the search with restarts
    "smollm2-restarts-digits": Settings(volumes=(1_000, 10_000), old_at=(), controls_at=(), stream_tokens=1_000_000,
                                        digits_from=("smollm2-restarts",)),
    # the public model reading whole requests from the maps with the digits read as a unit (smollm2-digits), at
    # 10^5 tokens with the generic reference: no EM round, no other start, the digits' swaps scored by the model
    "smollm2-digits-em-1e5-public": Settings(
        volumes=(), references=("public",), old_at=(), controls_at=(), em_at=(100_000,), em_from="smollm2-digits",
        em_method="log-reader+digits", stream_tokens=1_000_000, em_rounds=0, old_start_at=0,
        em_options=(("sample_tokens", 5_000), ("digit_rounds", 4), ("digit_check_each", True))),
    # the third key's maps (smollm2-seed2: its own stream of 10^4 tokens), the digits as a unit
    "smollm2-seed2-digits": Settings(volumes=(1_000, 10_000), old_at=(), controls_at=(), seed=2,
                                     digits_from=("smollm2-seed2",)),
    # moves of two and three ids judged by the public model (``model_moves``) after the model has chosen the start,
    # one volume per config, run one by one in this order. First as built: the digits may move, from the maps with
    # the digits read as a unit (smollm2-digits); a sample of 2,000 tokens, 20 moves judged per round on 6
    # occurrences of each id moved (2 shared cores)
    "smollm2-moves-1e5-public-domain": _moves(100_000, "public+domain", 2_000, 20, 2, keep_digits=False),
    # the digits kept where the reference put them (``move_keep_digits``: in random numbers the model's preferences
    # among digits are its prior; the config above moved digits and read less) and ids read at least 3 times
    "smollm2-moves-kd-1e5-public-domain": _moves(100_000, "public+domain", 2_000, 20, 2),
    # a larger sample and more moves; then the proposals ranked by the gain per occurrence of the ids moved
    "smollm2-moves-kd6k-1e5-public-domain": _moves(100_000, "public+domain", 6_000, 40, 3),
    "smollm2-moves-mean-1e5-public-domain": _moves(100_000, "public+domain", 6_000, 40, 3, rank="mean"),
    # the generic reference: at 10^3 from the starts of ``smollm2-em`` (the bigram search, decipher_stream; the
    # whole stream read), with both controls of the moves; at 10^4 and 10^5 from the maps of smollm2-digits
    "smollm2-moves-kd-1e3-public": Settings(
        volumes=(), references=("public",), old_at=(), controls_at=(), em_at=(1_000,), em_from="smollm2",
        stream_tokens=1_000_000, em_rounds=0, moves_controls_at=(1_000,),
        em_options=(("digit_rounds", 0), ("move_evals", 30), ("move_rounds", 2), ("move_keep_digits", True),
                    ("move_min_occurrences", 3))),
    "smollm2-moves-kd-1e4-public": _moves(10_000, "public", 2_000, 20, 2),
    # sampling with restarts at 10^3 with the generic reference: the earlier decipherer from four more seeds and
    # at its registered 30,000 candidates, the model's likelihood choosing among all the maps (no other step)
    "smollm2-em-restarts-1e3-public": Settings(
        volumes=(), references=("public",), old_at=(), controls_at=(), em_at=(1_000,), em_from="smollm2",
        stream_tokens=1_000_000, em_rounds=0, em_options=(("digit_rounds", 0),),
        old_restarts=((1, 20_000), (2, 20_000), (3, 20_000), (4, 20_000), (0, 30_000))),
    "smollm2-moves-kd-1e5-public": _moves(100_000, "public", 2_000, 20, 2),
    "smoke": Settings(volumes=(300, 1_000), references=("public",), old_at=(300,), controls_at=(300,),
                      reference_tokens=50_000),
}
DOCS = ("docs/security.md",)
NOTES = "needs the corpora of docs/data.md; 10^6 tokens take tens of minutes on 2 cores"
