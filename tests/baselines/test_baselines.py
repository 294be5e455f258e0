"""The Table 1 baselines (aloepri.baselines): each mechanism checked against its definition, plus end-to-end smokes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aloepri.baselines import (DPForward, RanText, SanText, SanTextPlus, analytic_gaussian_sigma,
                               classical_gaussian_sigma, clip_rows, gaussian_delta, noisy_prefill)
from aloepri.baselines.harness import fidelity, make_method, privacy


def _table(n=40, d=8, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _max_log_ratio(p: torch.Tensor) -> torch.Tensor:
    """(n, n): max over outputs y of log p(y|x) - log p(y|x') for every pair (x, x')."""
    lp = torch.log(p.double())
    return (lp[:, None, :] - lp[None, :, :]).max(-1).values


# --- SANTEXT -------------------------------------------------------------------------------------------------------


def test_santext_ratio_bound_on_the_actual_distributions():
    emb = _table()
    eps = 2.0
    mech = SanText(emb, eps)
    p = mech.distributions(torch.arange(len(emb)))
    assert torch.allclose(p.sum(1), torch.ones(len(emb)))
    d = torch.cdist(emb.double(), emb.double())
    ratio = _max_log_ratio(p)
    assert (ratio <= eps * d + 1e-6).all()  # eps * d(x, x') metric-LDP, every pair, every output
    assert (ratio > 0.5 * eps * d).any()  # and the bound is not vacuous: some pairs come close to it
    # a mechanism with twice the budget breaks the eps bound: the check discriminates
    assert (_max_log_ratio(SanText(emb, 2 * eps).distributions(torch.arange(len(emb)))) > eps * d + 1e-6).any()


def test_santext_closer_tokens_are_likelier_and_sampling_follows_the_distribution():
    emb = _table(n=30)
    mech = SanText(emb, 1.5)
    x = 3
    p = mech.distributions(torch.tensor([x]))[0]
    d = torch.cdist(emb[x:x + 1], emb)[0]
    order = torch.argsort(d)
    assert (p[order][1:] <= p[order][:-1] + 1e-9).all()  # monotone in the distance
    draws = mech.perturb([x] * 20000, seed=1)
    freq = torch.bincount(torch.tensor(draws), minlength=len(emb)).double() / len(draws)
    assert 0.5 * (freq - p.double()).abs().sum() < 0.02  # total variation


def test_santext_eps_validation():
    with pytest.raises(ValueError):
        SanText(_table(), 0.0)
    with pytest.raises(ValueError):
        SanText(_table(), float("nan"))


def test_santext_plus_keeps_non_sensitive_tokens_with_probability_one_minus_p():
    emb = _table(n=20)
    sensitive = torch.zeros(20, dtype=torch.bool)
    sensitive[10:] = True
    plus = SanTextPlus(emb, 2.0, sensitive=sensitive, p=0.3)
    base = SanText(emb, 2.0).distributions(torch.arange(20))
    q = plus.distributions(torch.arange(20))
    assert torch.allclose(q[10:], base[10:])  # sensitive: always the exponential mechanism
    for x in range(10):
        assert q[x, x] == pytest.approx(0.7 + 0.3 * base[x, x].item(), abs=1e-6)
    assert torch.equal(SanTextPlus.rarest(torch.tensor([5, 1, 9, 3]), w=0.5), torch.tensor([False, True, False, True]))


# --- RANTEXT -------------------------------------------------------------------------------------------------------


def test_rantext_within_set_ratio_bound_for_a_fixed_adjacency_list():
    emb = _table(n=30)
    eps = 3.0
    mech = RanText(emb, eps)
    tokens = torch.arange(30)
    d = torch.cdist(emb, emb)
    member = torch.zeros(30, 30, dtype=torch.bool)
    member[:, :12] = True  # the same candidate set for every input
    p = mech.within_set(d, member)
    assert (p[:, 12:] == 0).all()
    ratio = _max_log_ratio(p[:, :12])
    assert (ratio <= eps + 1e-6).all()  # utility range 1 -> exp(eps) between any two inputs
    assert ratio.max() > 0.3 * eps
    assert torch.equal(p.argmax(1)[:12], tokens[:12])  # inside the set, the token itself is the likeliest


def test_rantext_adjacency_radius_follows_the_laplace_law_and_contains_the_token():
    emb = _table(n=50, d=16)
    mech = RanText(emb, 4.0)
    g = torch.Generator().manual_seed(0)
    r = mech.thresholds(20000, g).double()
    b = mech.laplace_scale
    assert (r ** 2).mean().item() == pytest.approx(emb.shape[1] * 2 * b * b, rel=0.03)  # E||eta||^2 = d * 2b^2
    p = mech.distributions(torch.arange(50), g)
    assert (p[torch.arange(50), torch.arange(50)] > 0).all()
    big = RanText(emb, 1e4)  # tiny radius: the set is the token alone
    assert torch.allclose(big.distributions(torch.arange(50), g), torch.eye(50))
    small = RanText(emb, 0.01)  # huge radius: the whole vocabulary is adjacent
    assert (small.distributions(torch.arange(50), g) > 0).all()


# --- DP-Forward ----------------------------------------------------------------------------------------------------


def test_analytic_gaussian_known_values():
    # Balle & Wang (2018): eps=1, delta=1e-5, Delta=1 needs sigma ~ 3.73 (the classical bound says 4.84)
    s = analytic_gaussian_sigma(1.0, 1e-5)
    assert s == pytest.approx(3.7306, abs=1e-3)
    assert classical_gaussian_sigma(1.0, 1e-5) == pytest.approx(4.8448, abs=1e-3)
    assert gaussian_delta(1.0, s, 1.0) == pytest.approx(1e-5, rel=1e-6)
    # eps = 0: delta is the total variation between N(0,1) and N(1,1) = 2 Phi(1/2) - 1
    assert gaussian_delta(0.0, 1.0, 1.0) == pytest.approx(math.erf(0.5 / math.sqrt(2)), abs=1e-12)
    assert analytic_gaussian_sigma(1.0, 1e-5, 3.0) == pytest.approx(3 * s, rel=1e-6)  # linear in the sensitivity


def test_gaussian_delta_matches_a_monte_carlo_privacy_profile():
    eps, sigma, sens = 1.0, 1.0, 1.0
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * sigma
    log_q_over_p = (2 * x * sens - sens ** 2) / (2 * sigma ** 2)  # N(Delta, s^2) against N(0, s^2) at x ~ N(0, s^2)
    terms = (1 - torch.exp(eps + log_q_over_p)).clamp_min(0)
    mc, se = terms.mean().item(), terms.std().item() / math.sqrt(len(terms))
    assert gaussian_delta(eps, sigma, sens) == pytest.approx(mc, abs=4 * se)


def test_dp_forward_noise_std_and_clipping():
    mech = DPForward(5.0, 1e-5, clip_norm=2.0, sensitivity=4.0)
    assert mech.sigma == pytest.approx(analytic_gaussian_sigma(5.0, 1e-5, 4.0))
    out = mech.privatize(torch.zeros(400, 500), torch.Generator().manual_seed(0))
    assert out.std().item() == pytest.approx(mech.sigma, rel=0.01)
    assert abs(out.mean().item()) < 0.01 * mech.sigma
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    assert torch.allclose(clip_rows(rows, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    assert DPForward.paper_setting().clip_norm is None and "none" in DPForward.paper_setting().guarantee


# --- end to end on a tiny model --------------------------------------------------------------------------------------


def _tiny_data(vocab: int, n: int = 4, length: int = 12):
    from aloepri.attacks.base import PrivateData

    g = np.random.default_rng(0)
    ids = [g.integers(3, vocab, length).tolist() for _ in range(n)]
    return PrivateData([""] * n, ids, [[j % 3 == 0 for j in range(length)] for _ in range(n)])


def test_end_to_end_smoke_on_a_tiny_model(tiny_dir):
    from aloepri.runtime.inference import load_plain_model

    model = load_plain_model(tiny_dir("llama"), dtype=torch.float32)
    vocab = model.config.vocab_size
    data = _tiny_data(vocab)
    # token substitution: a huge eps keeps every token (TTRSR 1), a tiny one keeps few
    keep = privacy(make_method("santext", model, 1e6), model, None, data, seed=0, text_metrics=False)
    assert keep["direct-observation"]["ttrsr"] == 1.0 and keep["worst_ttrsr"] == 1.0
    noisy = privacy(make_method("santext", model, 1e-3), model, None, data, seed=0, text_metrics=False)
    assert noisy["worst_ttrsr"] < 0.2
    ran = privacy(make_method("rantext", model, 1e-3), model, None, data, seed=0, text_metrics=False)
    assert ran["worst_ttrsr"] < 0.2
    # DP-Forward: NN recovers everything when the noise is negligible (positive control), IMA runs end to end
    weak = privacy(make_method("dp-forward", model, 1e7), model, None, data, seed=0, budget="ci", text_metrics=False)
    assert weak["nn"]["ttrsr"] == 1.0 and 0.0 <= weak["ima"]["ttrsr"] <= 1.0
    strong = privacy(make_method("dp-forward", model, 0.5), model, None, data, seed=0, attacks=("nn",),
                     text_metrics=False)
    assert strong["nn"]["ttrsr"] < 0.3
    # fidelity: perfect with a negligible perturbation, worse with a strong one
    prompts = [(ids, list(range(len(ids)))) for ids in data.plain_ids]
    assert fidelity(make_method("santext", model, 1e6), model, prompts, seed=0)["top1_agreement"] == 1.0
    f_strong = fidelity(make_method("dp-forward", model, 0.5), model, prompts, seed=0)
    assert f_strong["top1_agreement"] < 1.0 and f_strong["mean_kl"] > 0
    # generation: only the prefill is privatised, once
    x = torch.tensor([data.plain_ids[0]])
    with noisy_prefill(model, make_method("dp-forward", model, 0.5), seed=0) as stats:
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert stats["calls"] == 1


def test_dp_forward_hidden_layer_needs_a_clip_norm(tiny_dir):
    from aloepri.runtime.inference import load_plain_model

    model = load_plain_model(tiny_dir("llama"), dtype=torch.float32)
    with pytest.raises(ValueError, match="clip_norm"):
        make_method("dp-forward", model, 5.0, layer=1)
    with pytest.raises(ValueError, match="unknown baseline"):
        make_method("nonesuch", model, 5.0)
    with pytest.raises(ValueError, match="sgt_params"):
        make_method("sgt", model, None)
    from aloepri.runtime.probe import layer_states
    from aloepri.baselines.dp_forward import observed_states

    data = _tiny_data(model.config.vocab_size, n=2)
    paper = make_method("dp-forward-paper", model, 5.0)
    assert paper.layer == 1 and paper.sigma == pytest.approx(analytic_gaussian_sigma(5.0, 1e-5, 1.0))
    seen = observed_states(model, paper, data.plain_ids, seed=0)[0]
    clean = layer_states(model, 1, input_ids=torch.tensor([data.plain_ids[0]]))[0]
    assert (seen - clean).std().item() == pytest.approx(paper.sigma, rel=0.15)  # noise after layer 1, unclipped
    out = privacy(make_method("dp-forward-paper", model, 1e7), model, None, data, seed=0, attacks=("nn",),
                  text_metrics=False)
    # position 0 attends to itself only, so its layer-1 state is the single-token state NN compares against
    assert out["nn"]["ttrsr"] >= 1 / len(data.plain_ids[0])


# --- SGT --------------------------------------------------------------------------------------------------------------


def _tiny_sgt(model, steps=1, **kw):
    from aloepri.baselines.sgt import SGTConfig, train_sgt, train_stream

    cfg = SGTConfig(width=8, heads=2, steps=steps, batch=2, seq_len=8, **kw)
    stream, _ = train_stream(None, 2000, 0, model.config.vocab_size)
    return train_sgt(model, stream, cfg)


def test_sgt_shapes_noise_is_applied_and_save_load_round_trips(tiny_dir, tmp_path):
    from aloepri.baselines.dp_forward import observed_states
    from aloepri.baselines.sgt import SGT

    model = _tiny_llama(tiny_dir)
    mech = _tiny_sgt(model)
    emb = model.get_input_embeddings().weight.detach().float()
    x = emb[:10]
    mean, std = mech.generator(x)
    assert mean.shape == x.shape and std.shape == x.shape and (std > 0).all()
    batched = mech.generator(torch.stack([x, x]))[0]
    assert batched.shape == (2, 10, x.shape[1]) and torch.allclose(batched[0], mean, atol=1e-5)
    a = mech.privatize(x, torch.Generator().manual_seed(1))
    b = mech.privatize(x, torch.Generator().manual_seed(1))
    c = mech.privatize(x, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.allclose(a, c)  # seeded, and fresh noise per draw
    assert (a - x).norm(dim=1).min() > 0.1 * x.norm(dim=1).mean()  # the sent vectors really differ
    # the server-side view: observed states are the embeddings plus the noise
    data = _tiny_data(model.config.vocab_size, n=1)
    seen = observed_states(model, mech, data.plain_ids, seed=0)[0]
    assert seen.shape == (len(data.plain_ids[0]), x.shape[1]) and not torch.allclose(seen, emb[data.plain_ids[0]])
    path = mech.save(tmp_path / "sgt.pt")
    back = make_method("sgt", model, None, sgt_params=str(path))
    assert isinstance(back, SGT) and back.config == mech.config and back.facts == mech.facts
    assert torch.equal(back.privatize(x, torch.Generator().manual_seed(1)), a)
    wrong = mech.generator.inp.in_features + 1
    with pytest.raises(ValueError, match="embedding width"):
        SGT.load(path, _EmbeddingOnly(wrong))


class _EmbeddingOnly:
    def __init__(self, d):
        self._emb = torch.nn.Embedding(4, d)

    def get_input_embeddings(self):
        return self._emb


def _tiny_llama(tiny_dir):
    from aloepri.runtime.inference import load_plain_model

    return load_plain_model(tiny_dir("llama"), dtype=torch.float32)


def test_sgt_training_lowers_its_loss_and_leaves_the_model_alone(tiny_dir):
    from aloepri.baselines.sgt import SGTConfig

    model = _tiny_llama(tiny_dir)
    before = [p.detach().clone() for p in model.parameters()]
    # a utility-only objective from large initial noise: training must shrink the noise and the KL
    mech = _tiny_sgt(model, steps=60, lr=3e-2, init_log_std=1.0, coefficients=(1.0, 0.0, 0.0, 0.0))
    first, last = mech.facts["loss_first"], mech.facts["loss_last"]
    assert last["total"] < 0.7 * first["total"], (first, last)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the served model is frozen
    assert all(p.requires_grad for p in model.parameters())  # and its flags restored
    # the paper's coefficients: the |cos| term dominates and training lowers it
    paper = _tiny_sgt(model, steps=60, lr=3e-2)
    assert paper.config.coefficients == (1.0, 3e-5, 30.0, 1.0)
    assert paper.facts["loss_last"]["abs_cos"] < paper.facts["loss_first"]["abs_cos"]
    with pytest.raises(ValueError, match="divisible"):
        SGTConfig(width=10, heads=4)


def test_sgt_attacks_and_fidelity_run_end_to_end(tiny_dir):
    model = _tiny_llama(tiny_dir)
    data = _tiny_data(model.config.vocab_size)
    mech = _tiny_sgt(model)
    out = privacy(mech, model, None, data, seed=0, budget="ci", text_metrics=False)
    assert set(out) >= {"nn", "ima", "worst_ttrsr"} and 0.0 <= out["worst_ttrsr"] <= 1.0
    prompts = [(ids, list(range(len(ids)))) for ids in data.plain_ids]
    f = fidelity(mech, model, prompts, seed=0)
    assert f["top1_agreement"] < 1.0 and f["mean_kl"] > 0  # the noise reaches the model
    # a generator that adds (almost) nothing: NN recovers every token and fidelity is perfect (positive control)
    for w in (mech.generator.mean.weight, mech.generator.mean.bias, mech.generator.log_std.weight):
        torch.nn.init.zeros_(w)
    torch.nn.init.constant_(mech.generator.log_std.bias, -12.0)
    quiet = privacy(mech, model, None, data, seed=0, attacks=("nn",), text_metrics=False)
    assert quiet["nn"]["ttrsr"] == 1.0
    assert fidelity(mech, model, prompts, seed=0)["top1_agreement"] == 1.0


def test_cli_baseline_sgt_and_eps_are_validated_in_one_line(tmp_path, capsys):
    from aloepri.cli import main

    assert main(["baseline", "sgt", "--plain", "x.gguf"]) == 2
    assert "--sgt-params" in capsys.readouterr().err
    assert main(["baseline", "sgt", "--plain", "x.gguf", "--sgt-params", str(tmp_path / "none.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["baseline", "santext", "--plain", "x.gguf"]) == 2  # --eps is required for the others
    assert "--eps" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_baseline_scores_a_baseline_on_smollm2(tmp_path, capsys):
    import json

    from conftest import smollm2_or_skip

    from aloepri.cli import main

    src = smollm2_or_skip()
    # eps 1000 on SmolLM2's raw embeddings (nearest-neighbour distance > 1): every token survives, nothing changes
    assert main(["baseline", "santext", "--plain", str(src), "--eps", "1000", "--prompts", "3", "--seed", "1",
                 "--report-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "baseline-santext-eps1000.json").read_text())
    obs = report["privacy"]["direct-observation"]
    assert obs["ttrsr"] == 1.0 and obs["piirsr"] == 1.0 and obs["tokens_scored"] > 50
    assert report["fidelity"]["top1_agreement"] == 1.0 and report["fidelity"]["token_change_rate"] == 0.0
    assert (tmp_path / "baseline-santext-eps1000.md").is_file()
    # and a strong setting really hides tokens
    assert main(["baseline", "santext", "--plain", str(src), "--eps", "1", "--prompts", "3", "--seed", "1",
                 "--no-fidelity", "--report-dir", str(tmp_path)]) == 0
    strong = json.loads((tmp_path / "baseline-santext-eps1.json").read_text())
    assert strong["privacy"]["direct-observation"]["ttrsr"] < 0.05
