"""Where the residual stream's energy sits, and whether ``outlier_dims`` keeps it out of the key's mixing: a
diagnostic for the bfloat16 loss of obfuscated models (docs/accuracy.md, "Output precision").

The key mixes every residual dimension except the ``outlier_dims`` kept ones (chosen from the public weights by
``aloepri.obfuscation.pipeline.massive_activation_dims``: the largest feed-forward output rows). bfloat16 rounds
each coordinate relative to its own size, so a large dimension mixed into all coordinates adds its rounding error
to every one of them. This measures, on the plaintext model over the built-in chat prompts, each residual
dimension's root mean square (hidden states after every layer, all positions), and reports: the largest
dimensions and their share of the energy, the dimensions ``massive_activation_dims`` picks (ranked), and the
largest dimension left to the mixing against the median dimension, at outlier_dims 4 (the presets' count before
outlier_rms) and 8, and under the presets' rule (outlier_rms, measured by the library on its own calibration input).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lib import ResultStore
from ..lib.models import model_path


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = ("smollm2", "qwen-coder", "qwen-coder-1.5b")
    prompts: int = 8
    top: int = 8
    threads: int = 2


def residual_energy(model, prompts) -> "torch.Tensor":
    """Per-dimension mean square of the residual stream (every layer's output, every position), float64."""
    import torch

    total, count = None, 0
    with torch.no_grad():
        for ids in prompts:
            out = model(torch.tensor([ids]), output_hidden_states=True)
            for h in out.hidden_states[1:]:
                sq = h[0].double().square().sum(dim=0)
                total = sq if total is None else total + sq
                count += h.shape[1]
    return total / count


def run(s: Settings, store: ResultStore) -> None:
    import torch

    from aloepri.eval.fidelity import builtin_prompt_ids, release_memory
    from aloepri.obfuscation.checkpoint import open_checkpoint
    from aloepri.obfuscation.params import resolve_params
    from aloepri.obfuscation.pipeline import kept_dimensions, massive_activation_dims, model_shape
    from aloepri.runtime.inference import load_plain_model
    from aloepri.runtime.tokenizer import load_hf_tokenizer

    torch.set_num_threads(s.threads)
    for name in s.models:
        if store.has(name):
            continue
        src = model_path(name)
        # bfloat16 weights: the magnitudes, not the last digits, are what is measured, and a 1.5B model fits
        model = load_plain_model(src, dtype=torch.bfloat16)
        prompts = builtin_prompt_ids(load_hf_tokenizer(src), model.config.vocab_size, s.prompts)
        energy = residual_energy(model, prompts)
        layers = model.config.num_hidden_layers
        del model
        release_memory()
        source = open_checkpoint(src)
        try:
            # the function returns its picks sorted by index; growing the count one at a time gives their rank
            kept_at = {0: ()}
            for k in range(1, s.top + 1):
                kept_at[k] = massive_activation_dims(source, layers, k)
            # the presets' rule: measured by the library on its own calibration input (not these prompts)
            rule = kept_dimensions(source, model_shape(source.config, source.spec), resolve_params("default"))
        finally:
            source.close()
        by_weights = [next(iter(set(kept_at[k]) - set(kept_at[k - 1]))) for k in range(1, s.top + 1)]
        ranked = [int(i) for i in torch.argsort(energy, descending=True)]
        rms = energy.sqrt()
        median = float(rms.median())
        share = energy / energy.sum()

        def left_to_mixing(k: int | tuple) -> dict:
            kept = set(kept_at[k] if isinstance(k, int) else k)
            rest = [i for i in ranked if i not in kept]
            return {"kept": sorted(kept), "largest_mixed_dim": rest[0], "largest_mixed_rms_over_median":
                    float(rms[rest[0]]) / median, "mixed_energy_share_of_largest": float(share[rest[0]])}

        entry = {"model": name, "hidden_size": int(energy.numel()), "layers": layers, "prompts": s.prompts,
                 "top_dims": [{"dim": i, "rms_over_median": float(rms[i]) / median, "energy_share": float(share[i]),
                               "rank_by_weights": (by_weights.index(i) + 1) if i in by_weights else None}
                              for i in ranked[:s.top]],
                 "top4_energy_share": float(share[ranked[:4]].sum()),
                 "picked_by_weights": [{"dim": i, "rank_by_energy": ranked.index(i) + 1} for i in by_weights],
                 "outlier_dims_4": left_to_mixing(4), "outlier_dims_8": left_to_mixing(8), "outlier_dims_0":
                     left_to_mixing(0),
                 "outlier_rms": {**left_to_mixing(rule.dims), "threshold": resolve_params("default").outlier_rms,
                                 "rule": rule.rule, "calibration_rms_over_median": list(rule.rms_over_median)}}
        store.put(name, entry)
        print(name, [(d["dim"], round(d["rms_over_median"], 1)) for d in entry["top_dims"]],
              "left mixed at 4:", round(entry["outlier_dims_4"]["largest_mixed_rms_over_median"], 1),
              f"presets' rule keeps {len(rule.dims)} ({rule.rule}), left mixed:",
              round(entry["outlier_rms"]["largest_mixed_rms_over_median"], 1), flush=True)


def report(store: ResultStore) -> str:
    rows = ["| model | hidden size | largest dimensions: RMS / median RMS (rank among the weight-chosen ones) | "
            "top-4 share of energy | weight-chosen top 4: rank by energy | largest dimension mixed, RMS / median: "
            "outlier_dims 0 / 4 / 8 | the presets' rule (outlier_rms): dimensions kept, largest mixed |",
            "|---|---|---|---|---|---|---|"]
    for e in store.entries().values():
        tops = ", ".join(f"{d['dim']}: {d['rms_over_median']:.0f}"
                         + (f" ({d['rank_by_weights']})" if d["rank_by_weights"] else " (-)") for d in e["top_dims"])
        picks = ", ".join(str(p["rank_by_energy"]) for p in e["picked_by_weights"][:4])
        mixed = " / ".join(f"{e[f'outlier_dims_{k}']['largest_mixed_rms_over_median']:.0f}" for k in (0, 4, 8))
        rule = e.get("outlier_rms")
        ruled = (f"{len(rule['kept'])} ({rule['rule']}), {rule['largest_mixed_rms_over_median']:.0f}" if rule
                 else "(not measured)")
        rows.append(f"| {e['model']} | {e['hidden_size']} | {tops} | {e['top4_energy_share']:.3f} | {picks} | {mixed} "
                    f"| {ruled} |")
    return "\n".join(rows)


SUMMARY = ("residual-stream energy per dimension on the plaintext models, and what outlier_dims keeps out of the "
           "key's mixing (a diagnostic for bfloat16 loss)")
CONFIGS = {"bundled": Settings(), "small": Settings(models=("smollm2", "qwen-coder")),
           "qwen-coder-1.5b": Settings(models=("qwen-coder-1.5b",))}
DOCS = ("docs/accuracy.md",)
NOTES = "loads each plaintext model in bfloat16, one at a time (the 1.5B model: about 4 GB)"
