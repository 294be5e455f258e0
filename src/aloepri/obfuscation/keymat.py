"""Secret material of AloePri: Algorithm 1 (key matrices), Algorithm 2's BlockPerm, permutations, scalings.

Pure functions of an explicit ``numpy.random.Generator``; everything is float64. Convention: hidden states
are row vectors, ``x_obf = x @ P`` with ``P`` of shape (d, d+2h) and readers undo it with ``Q`` of shape
(d+2h, d), ``P @ Q = I_d``.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


def single_threaded_blas():
    """Context: numpy's BLAS/LAPACK on one thread. The secrets are small matrices (at most (d+2h)^2) whose QR, SVD
    and products gain nothing from threads but pay a barrier per call; on a loaded 2-core machine SmolLM2's key
    base took 54 s with 2 OpenBLAS threads and 0.9 s with 1. LAPACK's blocking depends on the thread count, so
    B^-1 (and the readers built from it) move by float64 rounding against a 2-thread run; with one thread the
    secrets no longer depend on the machine's core count. The big weight products run in torch, whose thread
    count this does not touch. Without threadpoolctl this is a no-op."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def derive_rng(seed: int, *labels: object) -> np.random.Generator:
    """An independent generator for one named secret, so secrets do not depend on processing order."""
    digest = hashlib.sha256(repr((int(seed),) + tuple(str(l) for l in labels)).encode()).digest()
    words = np.frombuffer(digest, dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words.tolist())))


def haar_orthogonal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniform (Haar) sample from O(n): QR of a Gaussian matrix with the sign of R's diagonal fixed."""
    return orthogonal_from_gaussian(rng.standard_normal((n, n)))


def orthogonal_from_gaussian(g: np.ndarray) -> np.ndarray:
    """haar_orthogonal's arithmetic on an already drawn square Gaussian ``g``, which it overwrites: Q of its QR
    with the columns signed by R's diagonal. The same LAPACK calls as ``np.linalg.qr(g)`` (dgeqrf, then dorgqr)
    on the same input, so the same bits, without qr's copy of ``g`` and its full R (two d x d temporaries fewer;
    R's diagonal is the factored matrix's)."""
    raw = getattr(np.linalg, "_umath_linalg", None)
    if g.dtype != np.float64 or not g.flags.c_contiguous or raw is None or not hasattr(raw, "qr_reduced"):
        q, r = np.linalg.qr(g)
        return q * np.sign(np.diag(r))[None, :]
    with np.errstate(over="ignore", divide="ignore", under="ignore", invalid="ignore"):
        tau = raw.qr_r_raw(g, signature="d->d")  # g now holds R (upper triangle) and the reflectors
        signs = np.sign(np.diagonal(g))
        q = raw.qr_reduced(g, tau, signature="dd->d")
    if not np.isfinite(tau).all():
        raise np.linalg.LinAlgError("QR of the key's Gaussian matrix failed")
    q *= signs[None, :]
    return q


def key_workers() -> int:
    """Threads for the key's independent float64 pieces: the cores this process may use. Each piece is one whole
    LAPACK or BLAS call on one BLAS thread (single_threaded_blas), so the thread count decides only what runs side
    by side, never a bit of the result. (Splitting one product into row blocks would use more cores, but changes
    the last bit of some entries against the whole product: OpenBLAS's kernels sum edge tiles differently.)"""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_side_by_side(*tasks, workers: int | None = None) -> list:
    """Call independent zero-argument ``tasks`` on up to ``workers`` threads (default key_workers()) and return
    their results in order. numpy's LAPACK and BLAS calls release the GIL, so two factorizations of the key run
    on two cores, each on one BLAS thread: the same bits as one after the other."""
    workers = key_workers() if workers is None else workers
    if workers <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(max_workers=min(workers, len(tasks))) as pool:
        return [f.result() for f in [pool.submit(t) for t in tasks]]


def null_space_basis(a: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal basis (columns) of {v : a @ v = 0}."""
    _, s, vt = np.linalg.svd(a)
    rank = int((s > tol * max(s.max(initial=0.0), 1.0)).sum())
    return vt[rank:].T


@dataclass(frozen=True)
class KeyBase:
    """Output of Algorithm 1's INIT: (B, B^-1, E, F, Z) plus the null-space bases used by KeyMatGen."""

    B: np.ndarray  # (d, d)
    B_inv: np.ndarray  # (d, d)
    E: np.ndarray  # (d, h)
    F: np.ndarray  # (h, d)
    Z: np.ndarray  # (d+2h, d+2h) orthogonal
    c_basis: np.ndarray  # (h, k): rows of C live in span(c_basis), so C @ F = 0
    d_basis: np.ndarray  # (h, k): columns of D live in span(d_basis), so E @ D = 0
    scale: float  # sqrt((d+2h)/d): keeps the RMS of the expanded state equal to the plaintext RMS
    kept: tuple = ()  # residual dims mapped to single signed coordinates (see init_key_base)

    @property
    def d(self) -> int:
        return self.B.shape[0]

    @property
    def h(self) -> int:
        return self.E.shape[1]


def init_key_base(rng: np.random.Generator, d: int, h: int, lam: float, e_scale: float = 1.0,
                  kept: tuple = ()) -> KeyBase:
    """Algorithm 1, INIT(d, h, lambda). ``e_scale`` multiplies E (1 = the paper; 0 = no E energy).

    ``kept``: residual dimensions that P maps to one signed coordinate each (at a random place) instead of mixing
    them into all d+2h. Massive-activation dimensions need it for bf16 serving: rounding error is relative to a
    value's size, and a rotation spreads a few huge values over every coordinate (docs/serving.md, bf16). B, E, F,
    C, D and Z become block-structured around those dimensions; P Q = I holds as before."""
    if h % 2:
        raise ValueError("h must be even")
    if kept:
        return _init_key_base_keeping(rng, d, h, lam, e_scale, tuple(sorted(int(i) for i in kept)))
    std = 1.0 / np.sqrt(d)
    # every draw first, in the stream's order; then the two QRs side by side and B's inverse (see _mix)
    g_U = rng.standard_normal((d, d))
    V = rng.normal(0.0, std, (d, d))
    E = (rng.normal(0.0, std, (d, h // 2)) @ rng.normal(0.0, std, (h // 2, h))) * e_scale
    F1 = rng.normal(0.0, std, (h, h // 2))
    F = F1 @ rng.normal(0.0, std, (h // 2, d))
    g_Z = rng.standard_normal((d + 2 * h, d + 2 * h))
    B, Z = _mix(g_U, V, lam, g_Z)
    del g_U, V, g_Z
    B_inv = np.linalg.inv(B)
    # Rows of C must be orthogonal to the columns of F (C F = 0): the left null space of F1.
    c_basis = null_space_basis(F1.T)
    # Columns of D must be in null(E). With E = 0 every vector qualifies; we still use null(E2)-sized
    # subspace when E exists so that E D = 0 holds exactly.
    d_basis = null_space_basis(E) if e_scale > 0 else np.eye(h)
    return KeyBase(B=B, B_inv=B_inv, E=E, F=F, Z=Z, c_basis=c_basis, d_basis=d_basis, scale=float(np.sqrt((d + 2 * h) / d)))


def _init_key_base_keeping(rng: np.random.Generator, d: int, h: int, lam: float, e_scale: float,
                           kept: tuple) -> KeyBase:
    """INIT with ``kept`` dimensions outside the mixing: row i of P = s [B C E] Z is +-s at one column j_i.
    B is block-diagonal (signs on kept, U + lam V on the rest), E and C have zero rows and F and D zero columns
    at kept, and Z sends kept to random columns and rotates everything else among the remaining ones."""
    if len(set(kept)) != len(kept) or not all(0 <= i < d for i in kept) or len(kept) >= d:
        raise ValueError(f"kept dimensions must be distinct and in [0, {d}), fewer than {d}")
    K = np.asarray(kept)
    R = np.setdiff1d(np.arange(d), K)
    width = d + 2 * h
    std = 1.0 / np.sqrt(d)
    signs = rng.choice([-1.0, 1.0], size=len(K))
    # every draw first, in the stream's order; then the two QRs side by side and B_rr's inverse (see _mix)
    g_U = rng.standard_normal((len(R), len(R)))
    V = rng.normal(0.0, std, (len(R), len(R)))
    E = (rng.normal(0.0, std, (d, h // 2)) @ rng.normal(0.0, std, (h // 2, h))) * e_scale
    E[K] = 0.0
    F1 = rng.normal(0.0, std, (h, h // 2))
    F = F1 @ rng.normal(0.0, std, (h // 2, d))
    F[:, K] = 0.0
    targets = rng.choice(width, size=len(K), replace=False)
    g_Z = rng.standard_normal((width - len(K), width - len(K)))
    B_rr, Z_rest = _mix(g_U, V, lam, g_Z)
    del g_U, V, g_Z
    Z = np.zeros((width, width))
    Z[K, targets] = 1.0
    Z[np.ix_(np.setdiff1d(np.arange(width), K), np.setdiff1d(np.arange(width), targets))] = Z_rest
    del Z_rest
    B = np.zeros((d, d))
    B[np.ix_(R, R)] = B_rr
    B[K, K] = signs
    B_rr_inv = np.linalg.inv(B_rr)
    del B_rr
    B_inv = np.zeros((d, d))
    B_inv[np.ix_(R, R)] = B_rr_inv
    del B_rr_inv
    B_inv[K, K] = signs
    c_basis = null_space_basis(F1.T)
    d_basis = null_space_basis(E) if e_scale > 0 else np.eye(h)
    return KeyBase(B=B, B_inv=B_inv, E=E, F=F, Z=Z, c_basis=c_basis, d_basis=d_basis,
                   scale=float(np.sqrt(width / d)), kept=kept)


def _mix(g_U: np.ndarray, V: np.ndarray, lam: float, g_Z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """INIT's two orthogonal factors from their drawn Gaussians, side by side (run_side_by_side), and
    B = U + lam V: (B, Z). Overwrites all three inputs; V's buffer becomes B. The arithmetic of
    haar_orthogonal and of ``U + lam * V`` element by element, so a seed gives the bits it gave when they ran
    one after the other (float addition commutes bitwise)."""
    U, Z = run_side_by_side(lambda: orthogonal_from_gaussian(g_U), lambda: orthogonal_from_gaussian(g_Z))
    np.multiply(V, lam, out=V)
    np.add(U, V, out=V)
    return V, Z


def sample_C(rng: np.random.Generator, base: KeyBase, c_scale: float) -> np.ndarray:
    """KeyMatGen's C (d x h) with C F = 0. Energy: c_scale times E's expected energy ||E||_F^2 = h^2/(2d)."""
    d, h = base.d, base.h
    k = base.c_basis.shape[1]
    if c_scale == 0 or k == 0:
        return np.zeros((d, h))
    std = np.sqrt(c_scale * (h * h / (2.0 * d)) / (d * k))
    C = rng.normal(0.0, std, (d, k)) @ base.c_basis.T
    C[list(base.kept)] = 0.0
    return C


def sample_D(rng: np.random.Generator, base: KeyBase) -> np.ndarray:
    """InvKeyMatGen's D (h x d) with E D = 0, energy matched to F's (||F||_F^2 ~ h^2/(2d))."""
    d, h = base.d, base.h
    k = base.d_basis.shape[1]
    if k == 0:  # h = 0 (no expansion) leaves no null space to draw from
        return np.zeros((h, d))
    std = np.sqrt((h * h / (2.0 * d)) / (d * k))
    D = base.d_basis @ rng.normal(0.0, std, (k, d))
    D[:, list(base.kept)] = 0.0
    return D


def key_matrix(base: KeyBase, C: np.ndarray) -> np.ndarray:
    """P = s [B C E] Z, shape (d, d+2h). s = sqrt((d+2h)/d) is our addition (see docs/design.md)."""
    left = np.concatenate([base.B, C, base.E], axis=1) if C.shape[1] or base.E.shape[1] else base.B
    P = left @ base.Z
    P *= base.scale  # in place: the bits of base.scale * P without another (d, d+2h) temporary
    return P


def inverse_key_matrix(base: KeyBase, D: np.ndarray) -> np.ndarray:
    """Q = Z^T [B^-1; F; D] / s, shape (d+2h, d); P Q = I for any P, Q from one base."""
    Q = base.Z.T @ np.concatenate([base.B_inv, base.F, D], axis=0)
    Q /= base.scale
    return Q


def log_uniform(rng: np.random.Generator, size: int, max_ratio: float) -> np.ndarray:
    """Positive scalings, log-uniform in [1/max_ratio, max_ratio]."""
    if max_ratio <= 1.0:
        return np.ones(size)
    r = np.log(max_ratio)
    return np.exp(rng.uniform(-r, r, size))


def random_permutation(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.permutation(n)


def block_permutation(rng: np.random.Generator, m_blocks: int, beta: int, gamma: float, rope_base: float) -> np.ndarray:
    """Algorithm 2's BlockPerm: a permutation of RoPE pair indices made of windows of size <= beta.

    zeta_i = base^(-2(i-1)/m) are the pair frequencies (1-based as in the paper). At block t the window size
    w in [1, c], c = min(beta, m - t), is drawn with probability softmax(gamma * (zeta_{t+w} - zeta_t)). The
    listing leaves gamma's role and the step of t implicit; we read gamma as the softmax sharpness and advance
    t by w. High-frequency pairs differ a lot in frequency, so w = 1 dominates there; low-frequency pairs are
    nearly interchangeable and get shuffled. Returns ``order``: new pair j takes old pair ``order[j]``.
    """
    order = np.arange(m_blocks)
    if beta <= 1 or m_blocks <= 1:
        return order
    zeta = float(rope_base) ** (-2.0 * np.arange(m_blocks) / m_blocks)  # zeta[k] is the paper's zeta_{k+1}
    t = 0  # 0-based; the paper's t = 1
    while t < m_blocks - 1:
        c = min(beta, m_blocks - 1 - t)
        logits = gamma * (zeta[t + 1 : t + c + 1] - zeta[t])
        u = np.exp(logits - logits.max())
        u /= u.sum()
        w = int(rng.choice(np.arange(1, c + 1), p=u))
        order[t : t + w] = t + rng.permutation(w)
        t += w
    return order
