"""Noise defences against the strongest attacker (docs/defences.md "Sensitivity-shaped noise" and "Distillation").
Every row: accuracy of an obfuscated SmolLM2 (top-1 agreement / mean KL vs plaintext on the built-in chat prompts)
AND attacks on the very same obfuscated model.

Targets (benchmarks.lib.attack_targets)
  <shape>-<alpha>               the noisy preset with alpha_e = alpha_h = alpha and noise_shape = <shape>
                                (isotropic: the paper's; fisher: aloepri.obfuscation.noise + eval.sensitivity)
  <shape>-<alpha>+headfit-<n>   that model after client-side distillation of its head on <n> windows (below)

Distillation (client side, in obfuscated coordinates; the client holds the key and the public model): the noisy
obfuscated head is replaced by the least-squares fit of the plaintext model's logits (mapped through the key's
permutation) from the obfuscated model's own final hidden states, on <n> x 128-token windows of the public
`fortunes` corpus (refit_head). The noisy embedding is kept. The client then uploads the refitted checkpoint
instead of the noisy one: the server sees one obfuscated checkpoint, as before (same ids, same shapes).

Rows keyed smollm2/<target>/<attack or fidelity>/<budget>.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.attack_targets import CLIENT_STEP, pct, print_entry, run_attack, target_record
from ..lib.models import model_path

DISTILL_CORPUS = "fortunes"  # public; disjoint from the evaluation prompts and the attacks' private corpus
ATTACKS = ("vma", "behavioural", "behavioural-composed")


@dataclass(frozen=True)
class Settings:
    targets: tuple[str, ...] = ("isotropic-0.3", "fisher-0.5")
    attacks: tuple[str, ...] = ()  # of ATTACKS; none: accuracy only
    budget: str = "small"
    prompts: int = 50
    seed: int = 1234
    threads: int = 1
    distill_length: int = 128  # window length of the head-refit corpus


def refit_head(plain, obf, perm, ids, ridge: float = 1e-3, batch: int = 4,
               log=print) -> dict:
    """Client-side distillation of the obfuscated head, in closed form: the head rows W~ (obfuscated coordinates,
    obfuscated ids) minimising || H W~^T - L ||^2 + ridge * tr(H^T H)/D * ||W~||^2, where H are the obfuscated
    model's final-norm outputs and L the plaintext model's logits (centred per position, columns mapped through
    perm[plain id] = obfuscated id) on the public corpus windows ``ids``. Replaces obf's head in place.

    Why closed form: a KL-trained head or embedding needs a backward pass through the 49,152 x 864 head per step,
    ~30 s on this (shared, load 13) machine, so a few hundred steps do not fit; the least-squares fit is one pass."""
    import torch

    t0 = time.perf_counter()
    norm_out: list[torch.Tensor] = []
    hook = obf.model.norm.register_forward_hook(lambda _m, _i, out: norm_out.append(out.detach()))
    perm_t = torch.from_numpy(perm)
    D = obf.get_output_embeddings().weight.shape[1]
    hth = torch.zeros(D, D, dtype=torch.float64)
    htl = None
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], batch):
                x = ids[start : start + batch]
                obf(perm_t[x])
                h = norm_out.pop().flatten(0, 1).double()
                lp = plain(x).logits.flatten(0, 1).double()
                target = torch.empty_like(lp)
                target[:, perm_t] = lp - lp.mean(1, keepdim=True)  # column perm[i] = plain token i
                hth += h.T @ h
                htl = h.T @ target if htl is None else htl + h.T @ target
    finally:
        hook.remove()
    reg = ridge * float(torch.trace(hth)) / D
    w = torch.linalg.solve(hth + reg * torch.eye(D, dtype=torch.float64), htl).T  # (vocab, D)
    head = obf.get_output_embeddings().weight
    before = float((head.detach().double() - w).norm() / head.detach().double().norm())
    with torch.no_grad():
        head.copy_(w.to(head.dtype))
    log(f"  head refit on {ids.numel()} positions: relative change {before:.3f} ({time.perf_counter() - t0:.0f} s)")
    return {"method": "closed-form least-squares head refit", "positions": int(ids.numel()), "ridge": ridge,
            "corpus": DISTILL_CORPUS, "trained": ["lm_head.weight"], "relative_change": before,
            "seconds": time.perf_counter() - t0}


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.attacks.base import Budget
    from aloepri.attacks.cli import private_data
    from aloepri.runtime.inference import load_plain_model

    from ..lib.attack_targets import build_target, fidelity_entry, target_params

    bad = set(s.attacks) - set(ATTACKS)
    if bad:
        raise ValueError(f"attacks {sorted(bad)}: not one of {', '.join(ATTACKS)}")
    torch.set_num_threads(s.threads)
    budget = Budget.named(s.budget)
    budget.threads = s.threads
    src = model_path("smollm2")
    plain = None
    for target in s.targets:
        fkey = f"smollm2/{target}/fidelity/-"
        todo = [n for n in s.attacks if not store.has(f"smollm2/{target}/{n}/{s.budget}")]
        if not todo and store.has(fkey):
            continue
        if plain is None:
            plain = load_plain_model(src)
        base = target.split(CLIENT_STEP, 1)[0]
        factors = None
        if target_params(base).needs_noise_factors:
            from aloepri.runtime.sensitivity import fisher_noise_factors

            factors = fisher_noise_factors(src)
        t = build_target(src, base, s.seed, plain, noise_factors=factors)
        extra = {}
        if CLIENT_STEP in target:
            from aloepri.corpora import corpus, tokenize_texts

            n_seqs = int(target.rsplit("-", 1)[1])
            toks = tokenize_texts(t.tokenizer, corpus(DISTILL_CORPUS), max_tokens=n_seqs * s.distill_length)
            ids = torch.from_numpy(toks.reshape(n_seqs, s.distill_length))
            print(f"refitting the head of {base} on {n_seqs} x {s.distill_length} positions", flush=True)
            extra["distillation"] = refit_head(plain, t.obf_model, t.key.permutation, ids)
        if not store.has(fkey):
            entry = {**fidelity_entry(plain, t), "target_params": target_record(target), **extra}
            store.put(fkey, entry)
            print(f"{target}: top-1 {entry['top1_agreement']:.3f} KL {entry['mean_kl']:.3f}", flush=True)
        data = private_data(t.tokenizer, s.prompts, 0) if todo else None
        for name in todo:
            key = f"smollm2/{target}/{name}/{s.budget}"
            print(f"{key} ...", flush=True)
            entry = {**run_attack(name, t, data, budget), "target_params": target_record(target)}
            store.put(key, entry)
            print_entry(key, entry)
        del t


def report(store: ResultStore) -> str:
    entries = store.entries()
    lines = ["| Target | top-1 agreement | mean KL | Attack | TTRSR (%) | PIIRSR (%) | Vocab. recovery (%) | "
             "Wall time (s) | Budget |", "|---|---|---|---|---|---|---|---|---|"]
    fid = {k.split("/")[1]: v for k, v in entries.items() if k.split("/")[2] == "fidelity"}
    for key in sorted(entries, key=lambda k: (k.split("/")[1].split("-")[0], k)):
        model, target, attack, budget = key.split("/")
        f = fid.get(target, {})
        t1 = "-" if "top1_agreement" not in f else f"{f['top1_agreement']:.3f}"
        kl = "-" if "mean_kl" not in f else f"{f['mean_kl']:.3f}"
        if attack == "fidelity":
            if not any(k.split("/")[1] == target and k.split("/")[2] != "fidelity" for k in entries):
                lines.append(f"| {target} | {t1} | {kl} | (accuracy only) | | | | | |")
            continue
        e = entries[key]
        m = e["metrics"]
        if "error" in m:
            lines.append(f"| {target} | {t1} | {kl} | {attack} | error: {m['error'][:80]} | | | | {budget} |")
            continue
        vocab = m.get("vocab_recovery", m.get("vocab_recovery_sampled"))
        lines.append(f"| {target} | {t1} | {kl} | {attack} | {pct(e['ttrsr'])} | {pct(e['piirsr'])} | {pct(vocab)} "
                     f"| {e['seconds']:.0f} | {budget} |")
    return "\n".join(lines)


SUMMARY = ("sensitivity-shaped noise and head distillation: accuracy and attacks on the same obfuscated SmolLM2 "
           "(3-4 min per target for accuracy; attacks minutes to tens of minutes)")
CONFIGS = {
    # docs/defences.md "Sensitivity-shaped noise": the accuracy rows
    "accuracy": Settings(targets=("fisher-0.15", "fisher-0.5", "isotropic-0.05", "isotropic-0.3", "fisher-0.3",
                                  "isotropic-0.15", "fisher-0.08")),
    # ... and the attacks on the same outputs
    "behavioural-small": Settings(targets=("fisher-0.5",), attacks=("behavioural",)),
    "vma-ci": Settings(targets=("fisher-0.5", "isotropic-0.3", "isotropic-0.05", "fisher-0.08"),
                       attacks=("vma",), budget="ci"),
    # docs/defences.md "Distillation": accuracy after the head refit, then the attacks on it
    "headfit-accuracy": Settings(targets=("isotropic-1.0+headfit-32", "isotropic-0.5+headfit-32")),
    "headfit-small": Settings(targets=("isotropic-0.5+headfit-32",),
                              attacks=("behavioural", "behavioural-composed")),
    # a check that the path runs: one accuracy row (obfuscation + 20 prompts; a few minutes)
    "smoke": Settings(targets=("isotropic-0.05",)),
}
DEFAULT_CONFIG = "accuracy"
DOCS = ("docs/defences.md",)
NOTES = ("CPU; fisher targets compute the noise factors first (2-4 min on SmolLM2). The kept results built on the "
         "noisy preset of then (lam 0.1, h 128, beta 8); every row records its parameters")
