"""A homophonic vocabulary against the frequency attacks TFMA and SDA, simulated on SmolLM2-135M's
49,152-token vocabulary (resumable JSON: benchmarks/results/defence_homophonic.json).

The defence: every plaintext token t gets k_t server ids; the server's embedding table holds one row per server id
(the token's row, each copy with its OWN noise, then the key matrix P); the LM head duplicates the token's row
into every copy (so the served distribution is exact once the client merges copies); the client picks one of
t's ids at random for every occurrence in its prompt. Allocations (``--schemes``):
- ``k1`` (a plain permutation: the baseline), ``k2``, ``k4``: the same k for every token;
- ``flat2`` / ``flat4``: 2x / 4x the vocabulary in server ids, given to tokens in proportion to their frequency
  (k_t = max(1, round(f_t / c)), c set so sum k_t ~= m V), so every frequent server id has about the same count.
  f_t is the defender's best estimate of the client's distribution: the held-out half of the Python docs, which
  is also the distribution-aware attacker's prior (best flattening; there the group sizes ARE the prior's counts);
- ``pflat2`` / ``pflat4``: the same with f_t from public general text (fortunes + Debian Reference, which are the
  zero-knowledge / domain-aware attackers' priors).

Nothing is built into the obfuscation pipeline: the served embedding / head rows are computed with the
pipeline's own pure functions (``obfuscate_embedding`` / ``obfuscate_head``) and a real ``SecretSampler`` key
(preset ``noisy`` or ``paper``, seed 11), and the client's traffic is simulated from the corpora of
docs/data.md (1,000,000-token private stream + the 50 Faker PII prompts, seed 0).

Attackers:
- **naive**: TFMA / SDA exactly as in src/aloepri/attacks (they do not know the scheme);
- **group-aware**: knows the scheme, first GROUPS server ids into tokens from the served weights, sums the
  group counts (TFMA) or rewrites every id as its group (SDA), then runs the unchanged attack. Groupings measured
  (section "grouping" of the JSON): bit-identical LM-head rows (what exactness requires), nearest embedding row
  despite the per-copy noise, and nearest LM-head row when the head copies carry their own noise (not exact);
- **group-size** (flattening schemes only, no traffic at all): a group's size k_t is a frequency estimate;
  rank groups by size and match to the prior's ranks (TFMA's matching);
- **traffic-only** (no weights at all): groups ids by the ids next to them in the stream (``traffic-grouping``:
  nearest-profile accuracy; ``traffic-tfma``: mutual nearest neighbours merged, then TFMA on the groups).
SDA trains a small transformer: its budget here is ``sda_budget`` (default ci: 150 steps, a 50,000-token
stream and prior), far below what the paper used.
SDA's budget is ``sda_budget`` in the settings. Caches (token streams, groupings) live under
benchmarks.lib.targets.WORK / defence-homophonic.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from ..lib import ResultStore
from ..lib.legacy import legacy_note
from ..lib.models import model_path
from ..lib.targets import WORK as TARGETS_WORK

WORK = TARGETS_WORK / "defence-homophonic"
OBF_SEED = 11  # the key's seed (as the attack_frequency experiment)
SCHEME_SEED = 5  # which server ids a token owns (part of the key)
CLIENT_SEED = 6  # the client's random choice among copies (the real client would use the OS CSPRNG)
SCHEMES = ("k1", "k2", "k4", "flat2", "flat4", "pflat2", "pflat4")
SETTINGS = ("zero-knowledge", "domain-aware", "distribution-aware")


# --- the scheme ---------------------------------------------------------------------------------------------


def flat_allocation(ref_counts: np.ndarray, total_ids: int) -> np.ndarray:
    """k_t = max(1, round(f_t / c)) with c chosen (bisection) so that sum k_t is as close to total_ids as it gets
    from below: frequent tokens get copies in proportion to their frequency, every copy ~c occurrences."""
    f = np.asarray(ref_counts, dtype=np.float64)
    lo, hi = 1e-9, float(f.max()) + 1.0
    for _ in range(100):
        c = (lo * hi) ** 0.5
        if np.maximum(1, np.rint(f / c)).sum() > total_ids:
            lo = c
        else:
            hi = c
    return np.maximum(1, np.rint(f / hi)).astype(np.int64)


class Homophones:
    """k_t server ids per plaintext token t, placed at random over V' = sum k_t server ids."""

    def __init__(self, copies: np.ndarray, seed: int):
        self.copies = np.asarray(copies, dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(self.copies)[:-1]])
        self.n_server = int(self.copies.sum())
        self.owner_by_copy = np.repeat(np.arange(len(self.copies)), self.copies)  # copy j belongs to token owner[j]
        self.server_of_copy = np.random.default_rng(seed).permutation(self.n_server)
        self.owner = np.empty(self.n_server, dtype=np.int64)  # server id -> plaintext token
        self.owner[self.server_of_copy] = self.owner_by_copy

    def encode(self, plain_ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The client's side: each occurrence of t becomes one of t's server ids, uniformly at random."""
        x = np.asarray(plain_ids, dtype=np.int64)
        r = np.floor(rng.random(len(x)) * self.copies[x]).astype(np.int64)
        return self.server_of_copy[self.start[x] + r]


def scheme(name: str, vocab: int, references: dict[str, np.ndarray]) -> Homophones:
    """``k<n>``: n copies of every token; ``flat<m>`` / ``pflat<m>``: m x vocab server ids allocated by the counts
    of ``references['domain']`` / ``references['public']``."""
    if name.startswith("k"):
        copies = np.full(vocab, int(name[1:]), dtype=np.int64)
    elif name.startswith("flat"):
        copies = flat_allocation(references["domain"], int(name[4:]) * vocab)
    elif name.startswith("pflat"):
        copies = flat_allocation(references["public"], int(name[5:]) * vocab)
    else:
        raise ValueError(f"unknown scheme {name!r}; choose from {SCHEMES}")
    return Homophones(copies, SCHEME_SEED)


# --- the served rows and the attacker's groupings -----------------------------------------------------------


def served_rows(src, plain, hom: Homophones, preset: str, head_noise_per_copy: bool = False,
                embedding: bool = True):
    """(embedding rows, LM-head rows) the server holds, indexed by server id, built by the pipeline's own
    transforms with a real key (preset, seed OBF_SEED; kept outlier dimensions chosen from the source file ``src``
    as the pipeline does). Embedding: one noise draw per copy. Head: the token's obfuscated row duplicated into
    every copy (exact), or, if ``head_noise_per_copy``, one noise draw per copy."""
    import torch

    from aloepri.obfuscation.checkpoint import GGUFCheckpoint
    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.pipeline import massive_activation_dims
    from aloepri.obfuscation.secrets import SecretSampler
    from aloepri.obfuscation.shape import ModelShape
    from aloepri.obfuscation.transforms import obfuscate_embedding, obfuscate_head, split_norm_weight

    cfg = plain.config
    params = resolve_params(preset)
    shape = ModelShape(d=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                       num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.hidden_size // cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
                       rope_base=float(getattr(cfg, "rope_theta", 10000.0)), qk_norm=False)
    outliers = (massive_activation_dims(GGUFCheckpoint(src), shape.num_layers, params.outlier_dims)
                if params.outlier_dims else ())
    secrets = SecretSampler(OBF_SEED, params, shape, outliers)
    w_e = plain.get_input_embeddings().weight.detach()
    w_h = plain.get_output_embeddings().weight.detach()
    # the part of the final norm weight the head folds in (all of it unless dimensions are kept), as the pipeline
    _, norm = split_norm_weight(plain.model.norm.weight.detach(), secrets.kappa(), secrets.kept_columns,
                                secrets.hidden_size)
    emb = None
    if embedding:
        emb = obfuscate_embedding(w_e[torch.from_numpy(hom.owner_by_copy)], hom.server_of_copy,
                                  secrets.writer_P("embed"), params.alpha_e, secrets.rng("noise", "embed"),
                                  torch.float32, params.noise_shape)
    if head_noise_per_copy:
        head = obfuscate_head(w_h[torch.from_numpy(hom.owner_by_copy)], norm, hom.server_of_copy,
                              secrets.reader_Q("head"), params.alpha_h, secrets.rng("noise", "head"), torch.float32,
                              params.noise_shape)
    else:
        per_token = obfuscate_head(w_h, norm, np.arange(w_h.shape[0]), secrets.reader_Q("head"), params.alpha_h,
                                   secrets.rng("noise", "head"), torch.float32, params.noise_shape)
        head = per_token[torch.from_numpy(hom.owner)]
    return (None if emb is None else emb.numpy()), head.numpy()


def group_identical_rows(rows: np.ndarray) -> np.ndarray:
    """Group label per row: rows that are bit-identical share a label (labels 0..G-1)."""
    r = np.ascontiguousarray(rows)
    keys = r.view(np.dtype((np.void, r.dtype.itemsize * r.shape[1]))).ravel()
    _, labels = np.unique(keys, return_inverse=True)
    return labels.astype(np.int64)


def grouping_quality(labels: np.ndarray, hom: Homophones, weights_ids: np.ndarray | None = None) -> dict:
    """How well a grouping recovers the scheme's partition: the fraction of server ids (or, with ``weights_ids``,
    of those occurrences) that sit in a group made of exactly one token's copies."""
    n_groups = int(labels.max()) + 1
    first_owner = np.full(n_groups, -1, dtype=np.int64)
    first_owner[labels] = hom.owner  # some member's token (any one: a pure group has only one)
    pure = np.ones(n_groups, dtype=bool)
    np.logical_and.at(pure, labels, hom.owner == first_owner[labels])
    exact = pure & (np.bincount(labels, minlength=n_groups) == hom.copies[first_owner])
    ids = np.arange(len(labels)) if weights_ids is None else np.asarray(weights_ids)
    return {"groups": n_groups, "tokens": int(len(hom.copies)),
            "server_ids_in_exact_groups": float(exact[labels[ids]].mean())}


def nearest_sibling_rate(rows: np.ndarray, hom: Homophones, n_queries: int, seed: int, chunk: int = 256) -> dict:
    """For sampled server ids whose token has >= 2 copies: is the nearest OTHER row (cosine, and Euclidean) a copy
    of the same token? Candidates: every server row."""
    import torch

    multi = np.flatnonzero(hom.copies[hom.owner] >= 2)
    q = np.random.default_rng(seed).choice(multi, size=min(n_queries, len(multi)), replace=False)
    c = torch.from_numpy(rows)
    cn = torch.nn.functional.normalize(c, dim=1)
    sq = (c * c).sum(1)
    hits = {"cosine": 0, "euclidean": 0}
    for s in range(0, len(q), chunk):
        idx = torch.from_numpy(q[s:s + chunk])
        cos = cn[idx] @ cn.T
        cos[torch.arange(len(idx)), idx] = -np.inf
        dist = sq[None, :] - 2 * (c[idx] @ c.T)  # + |q|^2, constant per query
        dist[torch.arange(len(idx)), idx] = np.inf
        for name, best in (("cosine", cos.argmax(1)), ("euclidean", dist.argmin(1))):
            hits[name] += int((hom.owner[best.numpy()] == hom.owner[idx.numpy()]).sum())
    return {f"nearest_is_sibling_{k}": v / len(q) for k, v in hits.items()} | {"queries": int(len(q))}


def traffic_profiles(observed: np.ndarray, n: int):
    """Each server id's profile from the id stream alone (no weights): the counts of the ids right before and right
    after it, L2-normalised (sparse, n x 2n). Copies of one token sit in the same contexts."""
    from scipy import sparse

    ones = np.ones(len(observed) - 1, dtype=np.float32)
    nxt = sparse.csr_matrix((ones, (observed[:-1], observed[1:])), shape=(n, n))
    prv = sparse.csr_matrix((ones, (observed[1:], observed[:-1])), shape=(n, n))
    prof = sparse.hstack([nxt, prv]).tocsr()
    norm = np.sqrt(np.asarray(prof.multiply(prof).sum(axis=1)).ravel())
    return sparse.diags((1.0 / np.maximum(norm, 1e-12)).astype(np.float32)) @ prof


def nearest_other(prof, ids: np.ndarray, chunk: int = 256) -> np.ndarray:
    """For each id, the most cosine-similar OTHER id (over all ids)."""
    out = np.empty(len(ids), dtype=np.int64)
    for a in range(0, len(ids), chunk):
        sim = (prof[ids[a:a + chunk]] @ prof.T).toarray()
        sim[np.arange(len(sim)), ids[a:a + chunk]] = -1.0
        out[a:a + chunk] = sim.argmax(1)
    return out


def traffic_nearest_sibling(observed: np.ndarray, hom: Homophones, n_queries: int, seed: int) -> dict:
    """Queries: stream positions sampled uniformly (token-weighted); is the id with the most similar traffic
    profile a copy of the same token?"""
    prof = traffic_profiles(observed, hom.n_server)
    q = observed[np.random.default_rng(seed).choice(len(observed), size=n_queries, replace=False)]
    has_sibling = hom.copies[hom.owner[q]] >= 2
    uq, inverse = np.unique(q, return_inverse=True)
    hit = (hom.owner[nearest_other(prof, uq)] == hom.owner[uq])[inverse]
    return {"nearest_is_sibling_token_weighted": float(hit[has_sibling].mean()) if has_sibling.any() else None,
            "queries": int(n_queries), "queries_with_siblings": int(has_sibling.sum()),
            "profile": "counts of the previous and next server id over the observed stream, cosine"}


def traffic_groups(observed: np.ndarray, n: int) -> np.ndarray:
    """A grouping from the id stream alone: every observed id joined (union-find) with its mutual nearest
    neighbour by traffic profile. Labels 0..n-1 (unobserved ids stay alone)."""
    seen = np.unique(observed)
    nn = np.full(n, -1, dtype=np.int64)
    nn[seen] = nearest_other(traffic_profiles(observed, n), seen)
    parent = np.arange(n)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in seen:
        j = nn[i]
        if j >= 0 and nn[j] == i:
            parent[root(i)] = root(j)
    roots = np.array([root(i) for i in range(n)])
    return np.unique(roots, return_inverse=True)[1].astype(np.int64)


# --- traffic and the frequency attacks ----------------------------------------------------------------------


class _IdentityTarget:
    """What aloepri.attacks' stream helpers need from a target, for a server vocabulary of ``n`` ids that the
    simulation has already produced (identity 'key'): the public tokenizer and an id space."""

    def __init__(self, tokenizer, n: int):
        self.tokenizer, self.key, self.vocab_size = tokenizer, None, n

    def true_permutation(self) -> np.ndarray:
        return np.arange(self.vocab_size)


def streams(tokenizer, data, setting: str, tokens: int | None, budget) -> tuple[np.ndarray, np.ndarray]:
    """(prior plaintext ids, client's plaintext traffic = private stream + prompts), cached on disk."""
    from aloepri.attacks.frequency import frequency_streams

    WORK.mkdir(parents=True, exist_ok=True)
    cache = WORK / f"streams-{setting}-{tokens or budget.name}.npz"
    if cache.exists():
        z = np.load(cache)
        return z["prior"], z["truth"]
    prior, _, truth, _ = frequency_streams(_IdentityTarget(tokenizer, len(tokenizer)), data, setting, budget, 0,
                                           tokens)
    np.savez(cache, prior=prior, truth=truth)
    return prior, truth


def score_prompts(data, guess_of_server_id: np.ndarray, observed: np.ndarray) -> dict:
    from aloepri.attacks.base import score_predictions
    from aloepri.attacks.frequency import observed_prompts

    predicted = [guess_of_server_id[s] for s in observed_prompts(observed, data)]
    return score_predictions(None, data, predicted, text_metrics=False)


def tfma_runs(hom: Homophones, groups: np.ndarray, prior: np.ndarray, truth: np.ndarray, data) -> dict:
    from aloepri.attacks.frequency import tfma_match

    observed = hom.encode(truth, np.random.default_rng(CLIENT_SEED))
    vocab = len(hom.copies)
    out = {}
    naive = tfma_match(observed, prior, hom.n_server, seed=0)
    out["naive"] = score_prompts(data, naive.obf_to_plain, observed)
    out["naive"]["stream_top1"] = float((naive.obf_to_plain[observed] == truth).mean())
    grouped = tfma_match(groups[observed], prior, max(vocab, int(groups.max()) + 1), seed=0)
    guess = grouped.obf_to_plain[groups]
    out["group-aware"] = score_prompts(data, guess, observed)
    out["group-aware"]["stream_top1"] = float((guess[observed] == truth).mean())
    if hom.copies.max() != hom.copies.min():  # the group sizes themselves are a frequency ranking
        sizes = np.bincount(groups)
        by_size = tfma_match(np.repeat(np.arange(len(sizes)), sizes), prior, max(vocab, len(sizes)), seed=0)
        guess = by_size.obf_to_plain[groups]
        out["group-size"] = score_prompts(data, guess, observed)
        out["group-size"]["stream_top1"] = float((guess[observed] == truth).mean())
    for v in out.values():
        v.update(observed_tokens=int(len(observed)), server_ids_seen=int(len(np.unique(observed))))
    return out


def sda_run(hom: Homophones, groups: np.ndarray | None, tokenizer, data, setting: str, budget) -> dict:
    """SDA as in aloepri.attacks.decipher, on the homophonic traffic (naive) or on the traffic rewritten as the
    attacker's groups (group-aware). The client's homophone choice enters through the attack's ``perturb`` hook
    (the client's map applied before the key; the 'key' here is the identity over server ids)."""
    from aloepri.attacks.decipher import sda_setting_attack

    rng = np.random.default_rng(CLIENT_SEED)
    if groups is None:
        send, n = (lambda x: hom.encode(x, rng)), hom.n_server
    else:
        send, n = (lambda x: groups[hom.encode(x, rng)]), max(len(hom.copies), int(groups.max()) + 1)
    res = sda_setting_attack(_IdentityTarget(tokenizer, n), data, setting, budget, 0, perturb=send)
    res.budget.pop("perturbed_token_fraction", None)  # not a perturbation: every token is re-encoded
    return {"ttrsr": res.ttrsr, "piirsr": res.piirsr, **{k: res.metrics[k] for k in
            ("private_stream_recovery", "truth_in_pool", "final_train_loss", "tokens_scored", "pii_tokens_scored")},
            "budget": res.budget}


# --- driver -------------------------------------------------------------------------------------------------


def report(store: ResultStore) -> str:
    """The docs/defences.md tables (TTRSR / PIIRSR on the prompts, in %)."""
    results = store.entries()
    note = legacy_note(store)
    out = [note.rstrip(), ""] if note else []
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
    out.append("| setting | scheme | server ids | naive TFMA | group-aware TFMA | group-size only |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    for key in sorted(k for k in results if k.startswith("tfma/")):
        v = results[key]
        cells = [f"{pct(v[a]['ttrsr'])} / {pct(v[a]['piirsr'])}" if a in v else "-"
                 for a in ("naive", "group-aware", "group-size")]
        out.append(f"| {v['setting']} | {v['scheme']} | {v['server_vocab']:,} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("| setting | scheme | attacker | SDA TTRSR / PIIRSR | private stream recovery |")
    out.append("| --- | --- | --- | --- | --- |")
    for key in sorted(k for k in results if k.startswith("sda/")):
        v = results[key]
        out.append(f"| {v['setting']} | {v['scheme']} | {v['attacker']} | {pct(v['ttrsr'])} / {pct(v['piirsr'])} | "
              f"{pct(v['private_stream_recovery'])} |")
    out.append("")
    out.append("| preset | scheme | identical head rows | nearest embedding row (cos / eucl) | "
          "head noise per copy: nearest head row (cos / eucl) |")
    out.append("| --- | --- | --- | --- | --- |")
    for key in sorted(k for k in results if k.startswith("grouping/")):
        v = results[key]
        e, h = v.get("embedding_nearest_row", {}), v.get("head_noise_per_copy", {}).get("nearest_row", {})
        out.append(f"| {v['preset']} | {v['scheme']} | {pct(v['identical_head_rows']['server_ids_in_exact_groups'])} | "
              f"{pct(e.get('nearest_is_sibling_cosine'))} / {pct(e.get('nearest_is_sibling_euclidean'))} | "
              f"{pct(h.get('nearest_is_sibling_cosine'))} / {pct(h.get('nearest_is_sibling_euclidean'))} |")
    out.append("")
    for key in sorted(k for k in results if k.startswith("traffic-tfma")):
        v = results[key]
        out.append(f"{key.split('/')[0]}: traffic-only group-aware TFMA, {v['setting']}, {v['scheme']}: TTRSR / PIIRSR {pct(v['ttrsr'])} / "
              f"{pct(v['piirsr'])}; traffic in exactly recovered groups {pct(v['traffic_in_exact_groups'])}%")
    for key in sorted(k for k in results if k.startswith("traffic-grouping/")):
        v = results[key]
        out.append(f"traffic-only grouping, {v['scheme']}: nearest id is a sibling for "
              f"{pct(v['nearest_is_sibling_token_weighted'])}% of {v['queries_with_siblings']} sampled positions")
    return "\n".join(out)


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2"
    parts: tuple[str, ...] = ("grouping", "traffic-grouping", "traffic-tfma", "tfma", "sda")
    schemes: tuple[str, ...] = SCHEMES
    tfma_settings: tuple[str, ...] = SETTINGS
    sda_settings: tuple[str, ...] = ("distribution-aware",)
    sda_budget: str = "ci"  # aloepri.attacks.base.Budget.named: ci, small, full
    grouping_presets: tuple[str, ...] = ("noisy", "paper")
    grouping_queries: int = 2000
    threads: int = 1


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import Budget
    from aloepri.attacks.data import private_prompts
    from aloepri.attacks.frequency import tfma_match
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    unknown = set(s.parts) - {"grouping", "traffic-grouping", "traffic-tfma", "tfma", "sda"}
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}")
    torch.set_num_threads(s.threads)
    src = model_path(s.model)
    tokenizer = load_hf_tokenizer(src)
    plain = load_plain_model(src)
    vocab = int(plain.config.vocab_size)
    data = private_prompts(tokenizer, n=50, seed=0)
    full = Budget.named("full")
    references: dict[str, np.ndarray] = {}
    if any("flat" in name for name in s.schemes):
        # the defender's frequency estimates: held-out text of the client's own domain (the distribution-aware
        # prior) or public general text (fortunes + Debian Reference: the zero-knowledge and domain-aware priors)
        references = {"domain": np.bincount(streams(tokenizer, data, "distribution-aware", None, full)[0],
                                            minlength=vocab),
                      "public": sum(np.bincount(streams(tokenizer, data, st, None, full)[0], minlength=vocab)
                                    for st in ("zero-knowledge", "domain-aware"))}
    parts = set(s.parts)

    def measure(entry: str, fn) -> None:
        if store.has(entry):
            return
        t0 = time.perf_counter()
        value = fn()
        value["seconds"] = time.perf_counter() - t0
        store.put(entry, value)
        print(f"[{entry}] {json.dumps(value, default=float)[:400]}", flush=True)

    for name in s.schemes:
        hom = scheme(name, vocab, references)
        desc = {"scheme": name, "server_vocab": hom.n_server, "max_copies": int(hom.copies.max()),
                "tokens_with_copies": int((hom.copies > 1).sum())}
        # the group-aware attacker's grouping: bit-identical served head rows (the scheme and key seeds decide it)
        groups_file = WORK / f"groups-{s.model}-{name}-s{SCHEME_SEED}-k{OBF_SEED}.npy"
        if not groups_file.exists():
            WORK.mkdir(parents=True, exist_ok=True)
            _, head = served_rows(src, plain, hom, "noisy", embedding=False)
            np.save(groups_file, group_identical_rows(head))
        groups = np.load(groups_file)
        if "grouping" in parts:
            for preset in s.grouping_presets:
                def grouping(preset=preset):
                    emb, head = served_rows(src, plain, hom, preset)
                    out = {**desc, "preset": preset,
                           "identical_head_rows": grouping_quality(group_identical_rows(head), hom)}
                    if hom.copies.max() > 1:
                        out["embedding_nearest_row"] = nearest_sibling_rate(emb, hom, s.grouping_queries, 0)
                        del emb, head
                        _, noisy_head = served_rows(src, plain, hom, preset, head_noise_per_copy=True,
                                                    embedding=False)
                        out["head_noise_per_copy"] = {
                            "identical_head_rows": grouping_quality(group_identical_rows(noisy_head), hom),
                            "nearest_row": nearest_sibling_rate(noisy_head, hom, s.grouping_queries, 0)}
                    return out
                measure(f"grouping/{preset}/{name}", grouping)
        if "traffic-grouping" in parts and hom.copies.max() > 1:
            def traffic_grouping():
                _, truth = streams(tokenizer, data, "distribution-aware", None, full)
                observed = hom.encode(truth, np.random.default_rng(CLIENT_SEED))
                return {**desc, "stream": "distribution-aware client traffic (1 M private tokens + prompts)",
                        **traffic_nearest_sibling(observed, hom, s.grouping_queries, 0)}
            measure(f"traffic-grouping/{name}", traffic_grouping)
        if "traffic-tfma" in parts and hom.copies.max() > 1:
            def traffic_tfma():
                prior, truth = streams(tokenizer, data, "distribution-aware", None, full)
                observed = hom.encode(truth, np.random.default_rng(CLIENT_SEED))
                # the scheme is public: k = server ids / tokens, and each round of mutual-nearest merging pairs
                # groups up, so log2(k) rounds, each on the stream rewritten as the groups found so far
                rounds = max(1, int(round(np.log2(hom.n_server / len(hom.copies)))))
                labels = np.arange(hom.n_server)
                for _ in range(rounds):
                    labels = traffic_groups(labels[observed], hom.n_server)[labels]
                grouped = tfma_match(labels[observed], prior, hom.n_server, seed=0)
                guess = grouped.obf_to_plain[labels]
                return {**desc, "setting": "distribution-aware",
                        "grouping": "mutual nearest neighbours by traffic profile (ids only, no weights), "
                                    f"{rounds} round(s)",
                        "grouping_quality": grouping_quality(labels, hom),
                        "traffic_in_exact_groups": float(grouping_quality(labels, hom, observed)
                                                         ["server_ids_in_exact_groups"]),
                        **score_prompts(data, guess, observed),
                        "stream_top1": float((guess[observed] == truth).mean())}
            measure(f"traffic-tfma/distribution-aware/{name}", traffic_tfma)
        if "tfma" in parts:
            for setting in s.tfma_settings:
                def tfma(setting=setting):
                    prior, truth = streams(tokenizer, data, setting, None, full)
                    return {**desc, "setting": setting, "prior_tokens": int(len(prior)),
                            "grouping": "bit-identical served LM-head rows (preset noisy)",
                            **tfma_runs(hom, groups, prior, truth, data)}
                measure(f"tfma/{setting}/{name}", tfma)
        if "sda" in parts:
            budget = Budget.named(s.sda_budget)
            for setting in s.sda_settings:
                attackers = [("naive", None)] + ([("group-aware", groups)] if name != "k1" else [])
                for attacker, g in attackers:
                    measure(f"sda/{setting}/{name}/{attacker}/{budget.name}",
                            lambda g=g, setting=setting, attacker=attacker: {
                                **desc, "setting": setting, "attacker": attacker,
                                **sda_run(hom, g, tokenizer, data, setting, budget)})


SUMMARY = "a homophonic vocabulary against TFMA and SDA, simulated on SmolLM2's vocabulary (about an hour)"
CONFIGS = {"full": Settings(),
           "smoke": Settings(parts=("tfma",), schemes=("k1", "k2"), tfma_settings=("zero-knowledge",))}
DOCS = ("docs/defences.md",)
LEGACY_CONFIGS = ("old-presets",)
NOTES = "needs the corpora of docs/data.md; old-presets: rows measured on 2026-11-23 with the presets of then"
