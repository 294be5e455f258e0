import numpy as np
import pytest

from aloepri.obfuscation import keymat
from aloepri.obfuscation.shape import effective_h
from aloepri.obfuscation.transforms import (KEPT_NORM_WEIGHT_MAX, pair_permutation_matrix, rope_pair_rotation,
                                           split_norm_weight)


@pytest.mark.parametrize("lam,e_scale,c_scale", [(0.0, 0.0, 0.0), (0.3, 1.0, 1.0), (0.3, 1.0, 10.0)])
def test_any_P_and_Q_from_one_base_invert(lam, e_scale, c_scale):
    d, h = 24, 8
    base = keymat.init_key_base(keymat.derive_rng(1, "base"), d, h, lam, e_scale)
    Ps = [keymat.key_matrix(base, keymat.sample_C(keymat.derive_rng(1, "C", i), base, c_scale)) for i in range(3)]
    Qs = [keymat.inverse_key_matrix(base, keymat.sample_D(keymat.derive_rng(1, "D", i), base)) for i in range(3)]
    for P in Ps:
        assert P.shape == (d, d + 2 * h)
        for Q in Qs:
            assert Q.shape == (d + 2 * h, d)
            np.testing.assert_allclose(P @ Q, np.eye(d), atol=1e-10)
    # distinct draws are really distinct (the identity above is not trivially one matrix)
    assert not np.allclose(Qs[0], Qs[1])
    if c_scale:
        assert not np.allclose(Ps[0], Ps[1])


def test_null_space_constraints_and_orthogonality():
    d, h = 20, 6
    base = keymat.init_key_base(keymat.derive_rng(3, "base"), d, h, 0.3, 1.0)
    C = keymat.sample_C(keymat.derive_rng(3, "C"), base, 1.0)
    D = keymat.sample_D(keymat.derive_rng(3, "D"), base)
    assert np.abs(C @ base.F).max() < 1e-12 and np.abs(C).max() > 1e-6
    assert np.abs(base.E @ D).max() < 1e-12 and np.abs(D).max() > 1e-6
    np.testing.assert_allclose(base.Z @ base.Z.T, np.eye(d + 2 * h), atol=1e-12)
    np.testing.assert_allclose(base.B @ base.B_inv, np.eye(d), atol=1e-10)


def test_exact_setting_key_is_a_scaled_isometry():
    d, h = 16, 4
    base = keymat.init_key_base(keymat.derive_rng(0, "base"), d, h, 0.0, 0.0)
    P = keymat.key_matrix(base, keymat.sample_C(keymat.derive_rng(0, "C"), base, 0.0))
    np.testing.assert_allclose(P @ P.T, base.scale**2 * np.eye(d), atol=1e-12)
    # the scale keeps the RMS over d+2h dims equal to the plaintext RMS over d dims
    x = np.random.default_rng(0).normal(size=(5, d))
    np.testing.assert_allclose(np.sqrt(((x @ P) ** 2).mean(1)), np.sqrt((x**2).mean(1)), rtol=1e-12)


def test_secrets_depend_only_on_seed_and_label():
    a = keymat.derive_rng(5, "attn", 3).normal(size=4)
    b = keymat.derive_rng(5, "attn", 3).normal(size=4)
    c = keymat.derive_rng(5, "attn", 4).normal(size=4)
    d = keymat.derive_rng(6, "attn", 3).normal(size=4)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, d)


def test_block_permutation_windows():
    rng = keymat.derive_rng(0, "bp")
    m, beta = 32, 8
    seen_nontrivial = False
    for _ in range(50):
        order = keymat.block_permutation(rng, m, beta, 1e3, 10000.0)
        assert sorted(order) == list(range(m))
        assert np.all(np.abs(order - np.arange(m)) < beta)  # windows never exceed beta
        seen_nontrivial |= not np.array_equal(order, np.arange(m))
    assert seen_nontrivial
    assert np.array_equal(keymat.block_permutation(rng, m, 1, 1e3, 10000.0), np.arange(m))


def test_block_permutation_prefers_low_frequency_pairs():
    """High-frequency pairs (small index) differ most in frequency: they should move less often."""
    rng = keymat.derive_rng(1, "bp")
    moved = np.zeros(32)
    for _ in range(300):
        moved += keymat.block_permutation(rng, 32, 8, 1e3, 10000.0) != np.arange(32)
    assert moved[:4].mean() < moved[-8:].mean()


def test_rope_rotation_commutes_with_rope_and_preserves_scores():
    half = 4
    R = rope_pair_rotation(np.random.default_rng(0).uniform(0, 2 * np.pi, half))
    np.testing.assert_allclose(R @ R.T, np.eye(2 * half), atol=1e-12)
    theta = np.random.default_rng(1).uniform(0, 2 * np.pi, half)
    G = rope_pair_rotation(theta)  # RoPE itself is a rotation of the same (i, i+d/2) pairs
    np.testing.assert_allclose(R @ G, G @ R, atol=1e-12)
    M = pair_permutation_matrix(np.array([1, 0, 3, 2]))
    np.testing.assert_allclose(M @ M.T, np.eye(2 * half))


def test_effective_h_makes_heads_divide():
    assert effective_h(576, 128, 9) == 144  # SmolLM2: 576 + 288 = 864 = 9 * 96
    for d, h, m in [(576, 128, 9), (896, 128, 14), (48, 5 * 2, 6), (4096, 128, 32)]:
        hh = effective_h(d, h, m)
        assert hh >= h and hh % 2 == 0 and (d + 2 * hh) % m == 0


def test_conditioned_vo_mixing_is_well_conditioned():
    """The paper's Gaussian U_vo has condition numbers in the hundreds to thousands (they amplify fp16 rounding
    of v/o); the default draws it as O1 diag(s) O2 with s in [1/2, 2], so cond <= 4."""
    from aloepri.obfuscation.params import ObfuscationParams
    from aloepri.obfuscation.secrets import SecretSampler
    from aloepri.obfuscation.shape import ModelShape

    shape = ModelShape(d=64, vocab_size=10, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=32, rope_base=1e4, qk_norm=False)
    good = SecretSampler(1, ObfuscationParams(h=8), shape).attention(0).vo_mix
    paper = SecretSampler(1, ObfuscationParams(h=8, vo_mixing="gaussian"), shape).attention(0).vo_mix
    assert max(np.linalg.cond(u) for u in good) <= 4.0 + 1e-9
    assert max(np.linalg.cond(u) for u in paper) > 10.0


def test_split_norm_weight_keeps_products_and_clips_kept_dims_on_the_server():
    """server x reader reproduces kappa w at every kept coordinate; mixed dims fold all of w; a kept weight beyond
    KEPT_NORM_WEIGHT_MAX goes to the server clipped (sign kept), a smaller one (e.g. a damping 0.01) whole."""
    import torch

    w = torch.tensor([0.5, -3.0, 0.01, 2.5, -0.7, 1.0], dtype=torch.float64)
    kept = {1: 4, 2: 0, 3: 6, 5: 2}  # residual dim -> server coordinate (width 8)
    kappa = 0.9
    server, reader = split_norm_weight(w, kappa, kept, 8)
    for i, j in kept.items():
        assert abs(float(server[j] * reader[i]) - kappa * float(w[i])) < 1e-15
        assert abs(float(server[j])) <= kappa * KEPT_NORM_WEIGHT_MAX + 1e-15
    assert float(server[4]) == -kappa * KEPT_NORM_WEIGHT_MAX and float(reader[1]) == 3.0 / KEPT_NORM_WEIGHT_MAX
    assert float(server[0]) == kappa * 0.01 and float(reader[2]) == 1.0  # damping stays on the server
    assert torch.equal(reader[[0, 4]], w[[0, 4]])  # mixed dims: folded whole
    assert all(float(server[j]) == kappa for j in (1, 3, 5, 7))


def _shape(d):
    from aloepri.obfuscation.shape import ModelShape

    return ModelShape(d=d, vocab_size=10, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=d - d % 2,
                      intermediate_size=8, rope_base=1e4, qk_norm=False)


def _plain_key_base(rng, d, h, lam, e_scale, kept):
    """Algorithm 1's INIT written the plain way (one QR after the other, whole-matrix products): what keys drawn
    before the side-by-side key setup were made of. A key file's seed must keep giving these bits."""
    def haar(n):
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))[None, :]

    std, width = 1.0 / np.sqrt(d), d + 2 * h
    if not kept:
        B = haar(d) + lam * rng.normal(0.0, std, (d, d))
        B_inv = np.linalg.inv(B)
        E = (rng.normal(0.0, std, (d, h // 2)) @ rng.normal(0.0, std, (h // 2, h))) * e_scale
        F = rng.normal(0.0, std, (h, h // 2)) @ rng.normal(0.0, std, (h // 2, d))
        return B, B_inv, E, F, haar(width)
    K = np.asarray(kept)
    R = np.setdiff1d(np.arange(d), K)
    signs = rng.choice([-1.0, 1.0], size=len(K))
    B_rr = haar(len(R)) + lam * rng.normal(0.0, std, (len(R), len(R)))
    B, B_inv = np.zeros((d, d)), np.zeros((d, d))
    B[np.ix_(R, R)], B_inv[np.ix_(R, R)] = B_rr, np.linalg.inv(B_rr)
    B[K, K] = B_inv[K, K] = signs
    E = (rng.normal(0.0, std, (d, h // 2)) @ rng.normal(0.0, std, (h // 2, h))) * e_scale
    E[K] = 0.0
    F = rng.normal(0.0, std, (h, h // 2)) @ rng.normal(0.0, std, (h // 2, d))
    F[:, K] = 0.0
    targets = rng.choice(width, size=len(K), replace=False)
    Z = np.zeros((width, width))
    Z[K, targets] = 1.0
    Z[np.ix_(np.setdiff1d(np.arange(width), K), np.setdiff1d(np.arange(width), targets))] = haar(width - len(K))
    return B, B_inv, E, F, Z


@pytest.mark.parametrize("h,lam,e_scale,kept", [(0, 0.0, 0.0, (3, 200, 301, 388)), (8, 0.3, 1.0, ()),
                                                (4, 0.1, 1.0, (0, 5))])
@pytest.mark.parametrize("workers", [1, 2])
def test_key_setup_gives_the_plain_derivations_bits_on_any_thread_count(monkeypatch, h, lam, e_scale, kept, workers):
    """The key's QRs and products run side by side on several threads: a seed must still give
    the bits of the plain one-after-the-other derivation, whatever the thread count (the model a key file
    describes must not depend on the machine's core count)."""
    from aloepri.obfuscation.params import ObfuscationParams
    from aloepri.obfuscation.secrets import SecretSampler

    d = 389
    monkeypatch.setattr(keymat, "key_workers", lambda: workers)
    with keymat.single_threaded_blas():
        base = keymat.init_key_base(keymat.derive_rng(9, "base"), d, h, lam, e_scale, kept=kept)
        C = keymat.sample_C(keymat.derive_rng(9, "C"), base, 1.0)
        D = keymat.sample_D(keymat.derive_rng(9, "D"), base)
        P, Q = keymat.key_matrix(base, C), keymat.inverse_key_matrix(base, D)
        sampler = SecretSampler(9, ObfuscationParams(h=h, lam=lam, e_scale=e_scale, c_scale=1.0,
                                                     outlier_dims=len(kept)), _shape(d), kept)
        B, B_inv, E, F, Z = _plain_key_base(keymat.derive_rng(9, "base"), d, h, lam, e_scale, kept)
        P_plain = base.scale * (np.concatenate([B, C, E], axis=1) @ Z)
        Q_plain = (Z.T @ np.concatenate([B_inv, F, D], axis=0)) / base.scale
        B2, B2_inv, E2, F2, Z2 = _plain_key_base(keymat.derive_rng(9, "base"), d, sampler.h, lam, e_scale, kept)
        P2 = sampler.base.scale * (np.concatenate([B2, keymat.sample_C(sampler.rng("C", "shared"), sampler.base, 1.0),
                                                   E2], axis=1) @ Z2)
        s, D2 = sampler.base.scale, keymat.sample_D(sampler.rng("D", "q", 0), sampler.base)
        # a reader's Q as SecretSampler has always summed it: the part no D changes, plus D's
        Q2 = (Z2.T[:, : d + sampler.h] @ np.concatenate([B2_inv, F2])) / s + (Z2.T[:, d + sampler.h:] @ D2) / s
    for got, want in [(base.B, B), (base.B_inv, B_inv), (base.E, E), (base.F, F), (base.Z, Z), (P, P_plain),
                      (Q, Q_plain), (sampler._shared_P, P2)]:
        np.testing.assert_array_equal(got, want)
    # A reader's Q: one element in 157,545 was seen 1 ULP apart from the plain derivation when the pytest process
    # started OpenBLAS with 2 threads (OMP_NUM_THREADS unset; bit-equal with OMP_NUM_THREADS=1 and in a fresh
    # process either way): OpenBLAS's float64 GEMM, not the key code, decides that last bit (docs/performance.md)
    np.testing.assert_array_max_ulp(sampler.reader_Q("q", 0), Q2, maxulp=1)
