"""Differentially private mean estimation for sparse data (seed D: "Upper Bounds for Mean
Estimation" — the projection mechanism of Nikolov, Talwar and Zhang 2013 and Gaussian ℓ1-recovery),
with the plain Gaussian and Laplace mechanisms as baselines.

Privacy assumption: the data are points z_i ∈ R^d, each s-sparse (‖z_i‖₀ ≤ s) with ‖z_i‖₂ ≤ L;
every function checks both and names the first row that violates them. The released quantity is
Σ z_i / n with **n public and required** (`n`, keyword-only, no default): the size of the data
set, fixed before the data are looked at. Every estimator normalises by this n, never by the
number of rows it is given — a neighbour is normalised by the same n, so one example moves
Σ z_i by z_i and the estimate by z_i / n.

Why n may not come from the rows: with n = rows, D (n rows) is normalised by n and its
neighbour D ∪ {z} by n + 1, so the mean moves by z/(n+1) − Σ_D z_i/(n(n+1)), up to
2L/(n+1) in norm — about twice the L/n the noise is calibrated to — and the two noise
scales differ as well. Measured (tests/test_sparse_mean_estimation.py, n = 1, D' = {−z} against
D = {−z, z}, 5,000 trials a side, claimed ε = 1): ε lower bounds with n = the rows 1.65
(Laplace), 1.66 (projection, Laplace noise), 2.16 (Gaussian), 2.45 (projection, Gaussian
noise), 2.72 (Gaussian sketch); with the public n 0.70, 0.75, −0.03, 0.06, −0.05.

Neighbouring relation and accepted row counts (the convention):
  * `relation="add-remove"` (the default, the project's unit of privacy): the data set has the
    public n rows and a neighbour has one example more or less, so `Z` must have n − 1, n or
    n + 1 rows; any other count is refused (ValueError naming `n`: n is then not the size of
    the data set). Any two accepted add/remove neighbours have the same normaliser n and differ
    by one row z, so the ℓ2 sensitivity is exactly L/n and the ℓ1 sensitivity L√s/n
    (‖z‖₁ ≤ √s‖z‖₂ for s-sparse z). The refusal depends only on the row count, and the data
    set of n rows and all its neighbours are accepted, so it tells nothing about any example
    of the data set the guarantee is stated for.
  * `relation="replace-one"` (the poster's): data set and neighbour both have exactly n rows
    (a row count ≠ n is refused); one row is swapped for another, z − z' with ‖z − z'‖₂ ≤ 2L,
    so both sensitivities double: 2L/n and 2L√s/n.
We default to add-remove because every accountant in `accounting/` composes add/remove events;
with replace-one the calibrations reproduce the poster's constants exactly (σ = 2L√s/(nε),
σ² = 8L² ln(1.25/δ)/(nε)², σ² = 18L² ln(2.5/δ)/(nε)²; see the tests). Events are stated in units
of the sensitivity under the chosen relation (`noise_multiplier` = noise scale / sensitivity); a
replace-one event is also a valid, conservative add/remove event (the add/remove sensitivity is
half).

Randomness: every function takes `rng` (a numpy Generator). Tests pass seeded ones; production
callers must pass a generator seeded from OS entropy (`np.random.default_rng()` with no seed).
Floating-point effects (e.g. Mironov 2012's attack on textbook Laplace sampling) are out of scope,
as everywhere in widedp.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import scipy.sparse as sp
from dp_accounting import dp_event
from scipy.optimize import linprog

from widedp.accounting.gaussian_profile import gaussian_delta as profile_delta
from widedp.sparse_learners.projection import project_l1_ball

RELATIONS = {"add-remove": 1.0, "replace-one": 2.0}


# ---- validation ---------------------------------------------------------------------------------


def relation_factor(relation: str) -> float:
    """Sensitivity factor of a neighbouring relation: 1 for add-remove, 2 for replace-one."""
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {sorted(RELATIONS)}, got {relation!r}")
    return RELATIONS[relation]


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _delta(value, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"delta must be a number, got {value!r}")
    ok = (0 <= value < 1) if allow_zero else (0 < value < 1)
    if not ok:
        raise ValueError(f"delta must be in {'[0, 1)' if allow_zero else '(0, 1)'}, got {value!r}")
    return float(value)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _rng(rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator (production: np.random.default_rng()), got {type(rng).__name__}")
    return rng


def validate_sparse_rows(Z, s: Optional[int], L: float, name: str = "Z") -> sp.csr_matrix:
    """`Z` (scipy.sparse matrix or dense 2-d array, rows = examples) as canonical float64 CSR after
    checking every row: finite, at most `s` nonzeros (skipped when s is None), ‖row‖₂ ≤ L. Raises
    ValueError naming the first offending row. Never densifies a sparse input."""
    if sp.issparse(Z):
        X = sp.csr_matrix(Z, dtype=np.float64, copy=True)
    else:
        arr = np.asarray(Z, dtype=np.float64)
        if arr.ndim != 2:
            raise ValueError(f"{name} must be a 2-d array or scipy.sparse matrix (rows = examples), got shape {arr.shape}")
        X = sp.csr_matrix(arr)
    if X.shape[1] < 1:
        raise ValueError(f"{name} must have at least one column (d >= 1)")
    X.sum_duplicates()
    if not np.all(np.isfinite(X.data)):
        rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
        raise ValueError(f"row {int(rows[~np.isfinite(X.data)][0])} of {name} has a non-finite entry")
    X.eliminate_zeros()
    counts = np.diff(X.indptr)
    if s is not None:
        bad = np.nonzero(counts > s)[0]
        if bad.size:
            raise ValueError(f"row {int(bad[0])} of {name} has {int(counts[bad[0]])} nonzeros > s = {s} "
                             f"({bad.size} rows violate the sparsity bound)")
    rows = np.repeat(np.arange(X.shape[0]), counts)
    norms = np.sqrt(np.bincount(rows, weights=X.data * X.data, minlength=X.shape[0]))
    bad = np.nonzero(norms > L)[0]
    if bad.size:
        raise ValueError(f"row {int(bad[0])} of {name} has ℓ2 norm {norms[bad[0]]:.17g} > L = {L!r} "
                         f"({bad.size} rows violate the norm bound; clip them first)")
    return X


def _public_n(n, X: sp.csr_matrix, relation: str, name: str = "Z") -> int:
    """The public n after checking that `X`'s row count is one the relation allows for it:
    n − 1, n or n + 1 under add-remove (the data set and its neighbours), exactly n under
    replace-one (see the module docstring)."""
    relation_factor(relation)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be the data set's public size, an integer >= 1 fixed before looking at the data "
                         f"(never the row count of the private data), got {n!r}")
    n, rows = int(n), int(X.shape[0])
    allowed = (n - 1, n, n + 1) if relation == "add-remove" else (n,)
    if rows not in allowed:
        expect = "n - 1, n or n + 1 (the data set of n rows or a neighbour)" if relation == "add-remove" else "exactly n"
        raise ValueError(f"{name} has {rows} rows but n = {n}: under {relation} it must have {expect}; "
                         f"pass n = the data set's public size")
    return n


# ---- sensitivities and calibration -------------------------------------------------------------


def l2_sensitivity(L: float, n: int, relation: str = "add-remove") -> float:
    """ℓ2 sensitivity of z̄ = Σ z_i / n (n public, the same for both neighbours) for ‖z_i‖₂ ≤ L:
    L/n (add-remove), 2L/n (replace-one)."""
    return relation_factor(relation) * L / n


def l1_sensitivity(L: float, s: int, n: int, relation: str = "add-remove") -> float:
    """ℓ1 sensitivity of z̄ for s-sparse z_i with ‖z_i‖₂ ≤ L: ‖z_i‖₁ ≤ √s·L, so L√s/n
    (add-remove), 2L√s/n (replace-one)."""
    return relation_factor(relation) * L * math.sqrt(s) / n


def gaussian_delta(epsilon: float, noise_multiplier: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism with noise std = noise_multiplier × ℓ2 sensitivity
    (Balle and Wang 2018, Thm 8, μ = 1/noise_multiplier)."""
    return profile_delta(epsilon, 1.0 / noise_multiplier)


def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """Noise std / ℓ2 sensitivity for (ε, δ)-DP: the classic √(2 ln(1.25/δ))/ε of the poster
    (Dwork and Roth 2014, Thm A.1, proved for ε < 1), raised to the exact analytic-Gaussian
    multiplier (Balle and Wang 2018) in the rare case ε ≥ 1 where the classic one would not give
    (ε, δ). So for ε < 1 it is exactly the poster's constant, and it is never too small."""
    epsilon = _positive(epsilon, "epsilon")
    delta = _delta(delta, allow_zero=False)
    classic = math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    if gaussian_delta(epsilon, classic) <= delta:
        return classic
    lo, hi = classic, 2.0 * classic
    while gaussian_delta(epsilon, hi) > delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(100):  # δ(ε) decreases in the multiplier: bisect to the smallest valid one
        mid = 0.5 * (lo + hi)
        if gaussian_delta(epsilon, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _mean(X: sp.csr_matrix, n: int) -> np.ndarray:
    return np.bincount(X.indices, weights=X.data, minlength=X.shape[1]) / n


# ---- mechanisms ------------------------------------------------------------------------------------


def gaussian_mean(Z, *, n: int, L: float, epsilon: float, delta: float, rng: np.random.Generator,
                  relation: str = "add-remove", s: Optional[int] = None) -> tuple[np.ndarray, dp_event.DpEvent]:
    """The plain Gaussian mechanism (baseline): z̄ + N(0, σ² I_d) on all d coordinates.

    Neighbouring relation: `relation` (add-remove by default), n public and required
    (`Z` has n − 1, n or n + 1 rows under add-remove, exactly n under replace-one). Sensitivity: ℓ2,
    Δ₂ = L/n (add-remove) or 2L/n (replace-one); sparsity is not used (`s`, if given, is only
    checked). σ = Δ₂ · `gaussian_noise_multiplier(ε, δ)`.
    Returns (estimate, GaussianDpEvent(σ/Δ₂)): (ε, δ)-DP for `relation`; an accountant's ε at δ
    for the event (e.g. `make_accountant("pld")`) is ≤ ε. `rng`: seed from OS entropy in production.
    """
    L, epsilon = _positive(L, "L"), _positive(epsilon, "epsilon")
    delta, rng = _delta(delta, allow_zero=False), _rng(rng)
    X = validate_sparse_rows(Z, None if s is None else _positive_int(s, "s"), L)
    n = _public_n(n, X, relation)
    multiplier = gaussian_noise_multiplier(epsilon, delta)
    sigma = multiplier * l2_sensitivity(L, n, relation)
    return _mean(X, n) + rng.normal(0.0, sigma, size=X.shape[1]), dp_event.GaussianDpEvent(multiplier)


def laplace_mean(Z, *, n: int, s: int, L: float, epsilon: float, rng: np.random.Generator,
                 relation: str = "add-remove") -> tuple[np.ndarray, dp_event.DpEvent]:
    """The plain Laplace mechanism (baseline): z̄ + Lap(b)^{⊗d}, b = Δ₁/ε.

    Neighbouring relation: `relation` (add-remove by default), n public and required
    (`Z` has n − 1, n or n + 1 rows under add-remove, exactly n under replace-one). Sensitivity: ℓ1,
    Δ₁ = L√s/n (add-remove) or 2L√s/n (replace-one; b is then the poster's 2L√s/(nε)).
    Returns (estimate, LaplaceDpEvent(1/ε)) — noise multiplier b/Δ₁: pure ε-DP for `relation`
    (δ = 0; Dwork and Roth 2014, Thm 3.6); the `rdp` accountant composes it. `rng`: seed from
    OS entropy in production.
    """
    s, L, epsilon, rng = _positive_int(s, "s"), _positive(L, "L"), _positive(epsilon, "epsilon"), _rng(rng)
    X = validate_sparse_rows(Z, s, L)
    n = _public_n(n, X, relation)
    b = l1_sensitivity(L, s, n, relation) / epsilon
    return _mean(X, n) + rng.laplace(0.0, b, size=X.shape[1]), dp_event.LaplaceDpEvent(1.0 / epsilon)


def projection_mechanism(Z, *, n: int, s: int, L: float, epsilon: float, rng: np.random.Generator, delta: float = 0.0,
                         relation: str = "add-remove") -> tuple[np.ndarray, dp_event.DpEvent]:
    """The projection mechanism (Nikolov, Talwar and Zhang 2013; the poster's first algorithm):
    ẑ = the Euclidean projection of z̄ + ξ onto the ℓ1 ball of radius L√s, with
    ξ ~ Lap(Δ₁/ε)^{⊗d} if δ = 0, N(0, σ² I_d) if δ > 0. The ball contains z̄ = Σ z_i / n whenever
    `Z` has at most n rows (‖z_i‖₁ ≤ √s L); a neighbour with n + 1 rows may lie outside it by at
    most L√s/n in ℓ1, which costs accuracy only (the projection is post-processing).

    Neighbouring relation: `relation` (add-remove by default), n public and required
    (`Z` has n − 1, n or n + 1 rows under add-remove, exactly n under replace-one). Sensitivity: δ = 0 — ℓ1,
    Δ₁ = L√s/n (replace-one 2L√s/n, the poster's σ = 2L√s/(nε)); δ > 0 — ℓ2, Δ₂ = L/n
    (replace-one 2L/n, the poster's σ² = 8L² ln(1.25/δ)/(nε)²). The projection is post-processing.
    Returns (estimate, event): δ = 0 → LaplaceDpEvent(1/ε), pure ε-DP; δ > 0 →
    GaussianDpEvent(σ/Δ₂), (ε, δ)-DP (accountant's ε at δ ≤ ε). `rng`: seed from OS entropy in
    production.
    """
    s, L, epsilon, rng = _positive_int(s, "s"), _positive(L, "L"), _positive(epsilon, "epsilon"), _rng(rng)
    delta = _delta(delta, allow_zero=True)
    X = validate_sparse_rows(Z, s, L)
    n = _public_n(n, X, relation)
    d = X.shape[1]
    event: dp_event.DpEvent
    if delta == 0.0:
        noise = rng.laplace(0.0, l1_sensitivity(L, s, n, relation) / epsilon, size=d)
        event = dp_event.LaplaceDpEvent(1.0 / epsilon)
    else:
        multiplier = gaussian_noise_multiplier(epsilon, delta)
        noise = rng.normal(0.0, multiplier * l2_sensitivity(L, n, relation), size=d)
        event = dp_event.GaussianDpEvent(multiplier)
    return project_l1_ball(_mean(X, n) + noise, L * math.sqrt(s)), event


def default_sketch_rows(n: int, d: int, s: int, epsilon: float, delta: float) -> int:
    """The poster's m = nε·√(s ln(d/s) / ln(1/δ)), rounded up, at least 1 and capped at d (more
    rows than unknowns would make Az = b infeasible; see `l1_recover`); d ≤ s gives m = d."""
    if d <= s:
        return d
    m = n * epsilon * math.sqrt(s * math.log(d / s) / math.log(1.0 / delta))
    return int(min(d, max(1, math.ceil(m))))


def gaussian_sketch(Z, *, n: int, s: int, L: float, epsilon: float, delta: float, rng: np.random.Generator,
                    m: Optional[int] = None, clip: Optional[float] = None,
                    relation: str = "add-remove") -> tuple[np.ndarray, np.ndarray, dp_event.DpEvent]:
    """The private part of Gaussian ℓ1-recovery: (A, b, event) with A ~ N(0, 1/m)^{m×d} (public,
    drawn from `rng` before any noise and independent of the data) and
    b = (1/n)·Σ clip_C(A z_i) + N(0, σ² I_m), clip_C(y) = y·min(1, C/‖y‖₂).

    Why the clip: the poster releases b = A z̄ + ξ with σ² = 18L² ln(2.5/δ)/(nε)², which is private
    only if ‖A z‖₂ ≤ 1.5‖z‖₂ on the sparse differences — true with high probability over A, not
    checkable. Reading the constant: 18 L² ln(2.5/δ) = 2 ln(1.25/(δ/2)) · (2 · 1.5 L)², i.e. the
    classic Gaussian at δ/2 for a replace-one ℓ2 sensitivity 2·(1.5L)/n — an isometry constant
    1.5, with the other δ/2 for A failing it. Clipping every example's sketch to C (default 1.5·L)
    makes the ℓ2 sensitivity of the average **exactly** C/n (add-remove; 2C/n replace-one) for
    every A, so privacy holds always, not w.h.p.; when A is the near-isometry the poster assumes,
    the clip never binds and b is the poster's. We keep the poster's ln(2.5/δ) (noise multiplier
    `gaussian_noise_multiplier(ε, δ/2)`) so replace-one reproduces its σ exactly; the unused δ/2
    makes the event slightly conservative (its accounted ε at δ is < ε).

    `m`: rows of the sketch (default `default_sketch_rows`, the poster's m capped at d; an
    explicit m > d is refused). Neighbouring relation: `relation`, n public and required
    (`Z` has n − 1, n or n + 1 rows under add-remove, exactly n under replace-one). Sensitivity: ℓ2,
    C/n (add-remove), 2C/n (replace-one). Event: GaussianDpEvent(σ/Δ₂), (ε, δ)-DP.
    Cost: A is dense m×d and the n×m sketches are dense; Z is never densified.
    `rng`: seed from OS entropy in production.
    """
    s, L, epsilon, rng = _positive_int(s, "s"), _positive(L, "L"), _positive(epsilon, "epsilon"), _rng(rng)
    delta = _delta(delta, allow_zero=False)
    C = 1.5 * L if clip is None else _positive(clip, "clip")
    X = validate_sparse_rows(Z, s, L)
    n = _public_n(n, X, relation)
    d = X.shape[1]
    if m is None:
        m = default_sketch_rows(n, d, s, epsilon, delta)
    m = _positive_int(m, "m")
    if m > d:
        raise ValueError(f"m = {m} sketch rows exceed d = {d}: Az = b would be infeasible for almost every noise draw")
    A = rng.normal(0.0, 1.0 / math.sqrt(m), size=(m, d))
    sketches = np.asarray(X @ A.T)  # n_rows × m, dense; row i = A z_i
    norms = np.linalg.norm(sketches, axis=1)
    scale = np.minimum(1.0, C / np.maximum(norms, np.finfo(float).tiny))
    clipped_mean = (sketches * scale[:, None]).sum(axis=0) / n
    multiplier = gaussian_noise_multiplier(epsilon, delta / 2.0)
    sigma = multiplier * relation_factor(relation) * C / n
    return A, clipped_mean + rng.normal(0.0, sigma, size=m), dp_event.GaussianDpEvent(multiplier)


def l1_recover(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖z‖₁ s.t. Az = b (basis pursuit) as the LP min Σ(u + v) s.t. A(u - v) = b, u, v ≥ 0,
    solved by `scipy.optimize.linprog(method="highs")` — HiGHS, a maintained LP solver that ships
    with scipy (already a widedp dependency). Post-processing (no data access).

    Feasibility: with m ≤ d rows, a Gaussian A has full row rank m with probability 1, so Az = b
    has a solution for every b; `gaussian_sketch` refuses m > d. If HiGHS still reports failure
    (numerical trouble), RuntimeError with its message: there is no silent fallback.
    """
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or b.shape != (A.shape[0],):
        raise ValueError(f"A must be m×d and b of length m, got A {A.shape}, b {b.shape}")
    m, d = A.shape
    res = linprog(np.ones(2 * d), A_eq=np.hstack([A, -A]), b_eq=b, bounds=(0, None), method="highs")
    if res.status != 0 or res.x is None:
        raise RuntimeError(f"ℓ1 recovery LP (m = {m}, d = {d}) failed: HiGHS status {res.status}: {res.message}")
    return res.x[:d] - res.x[d:]


def gaussian_l1_recovery(Z, *, n: int, s: int, L: float, epsilon: float, delta: float, rng: np.random.Generator,
                         m: Optional[int] = None, clip: Optional[float] = None,
                         relation: str = "add-remove") -> tuple[np.ndarray, dp_event.DpEvent]:
    """Gaussian ℓ1-recovery (the poster's second algorithm, for δ > 0): z̃ = argmin{‖z‖₁ : Az = b}
    with (A, b) from `gaussian_sketch` (same arguments, same rng draws) and the LP of `l1_recover`.

    Neighbouring relation: `relation`, n public and required
    (`Z` has n − 1, n or n + 1 rows under add-remove, exactly n under replace-one). Sensitivity: ℓ2 of the clipped sketch average,
    C/n (add-remove) or 2C/n (replace-one), C = `clip` (default 1.5·L). The LP is post-processing.
    Returns (estimate, GaussianDpEvent(σ/Δ₂)): (ε, δ)-DP, always (not w.h.p. over A).
    `rng`: seed from OS entropy in production.
    """
    A, b, event = gaussian_sketch(Z, s=s, L=L, epsilon=epsilon, delta=delta, rng=rng, m=m, clip=clip, n=n,
                                  relation=relation)
    return l1_recover(A, b), event
