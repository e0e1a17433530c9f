"""Seed A's Algorithm 2: DP-ERM with sparse gradients via NumericSparse, for wide linear models.

Privacy assumption: **add/remove-one example** neighbours (the project default). The seed
states Alg 2 for replace-one (its ℓ∞ sensitivity 2c₂m/n); a replacement is one removal plus one
addition, so an add/remove-(ε, δ) guarantee gives replace-one (2ε, (1 + e^ε)δ).

Per step t (seed §4.1, Alg 2), with q = 1/m:
1. Sampling. The seed partitions the data into m groups and picks one uniformly. We draw a
   **fresh** random partition every step (each example gets an independent uniform group label;
   then one of the m groups is picked uniformly): the picked group is then exactly a Poisson
   sample at rate q = 1/m — every example is in it independently with probability 1/m,
   independently of earlier steps. That is the sampling our accountants and the amplification
   lemma treat (`PoissonSampledDpEvent`). By default we do *not* keep one fixed partition for all
   T steps (the fixed mode below does, with its own accounting):
   with a fixed partition the steps that pick the same group reuse the same examples, so whether
   x participates is not a fresh independent coin per step, and an adversary who can tell the
   groups apart from the outputs (e.g. groups touching different features) learns which steps
   used x's group. Conditioned on that, a step's output distribution is (1-q)R + qA against
   (1-q)R + qB with R arbitrary, which only gives (ε', qδ') per step — no ε amplification — so
   neither Lemma 1 (which needs a fresh uniform sample each step) nor a Poisson accountant would
   be sound for it. Only the *utility* analysis (assumption (1)) uses the partition's structure;
   the privacy analysis never does (seed §4.1: "without being necessary for its privacy").
   Sampled as K ~ Binomial(n, q) then K rows uniformly without replacement: the same law.
2. Group gradient u = (m/n)·Σ_{i∈group} clip(∇ℓ(w_t; z_i)), each per-example gradient clipped
   to ℓ∞ norm c₂ (for a linear model ∇ℓ = φ'·x, so this clips the scalar φ'). The divisor n/m
   is fixed before the run from `public_n` (default X.shape[0], i.e. the dataset size is treated
   as public, as DP-SGD's expected batch size is). Adding or removing one example changes the
   sum by one clipped gradient, so the **ℓ∞ sensitivity of u is s = c₂·m/n** whatever the
   features are.
3. Δ_t = NumericSparse(u, α, c₁, ε', δ') over all d coordinates (`selection.numeric_sparse`,
   untouched coordinates are tested too, in O(1) per gap), and w_{t+1} = Π_W(w_t − η(Δ_t + λw_t))
   updating the answered coordinates with their released noisy values (the ridge term λw_t and
   the projection Π onto the ℓ2 ball of `radius` are data-independent post-processing).

Parameters as the seed sets them: ε' = ε·m/(2√(2T log(2/δ))), δ' = δm/(2T), and the default
threshold α is Lemma 4's α = 20·s·(log d + log(4c₁n))·√(c₁ log(2/δ'))/ε' with β = 1/n (the seed's
printed 40c₂m/(nε')·… is this with its replace-one s = 2c₂m/n; ours is add/remove, s = c₂m/n).

Accounting returned (`DpErmResult.accounting`), all at the same δ:
- `theorem1_printed`: the seed's Theorem 1 claim for the ε' used, ε = 2ε'√(2T log(2/δ))/m. Its
  proof uses Lemma 1 as stated (amplified ε = qε'), which under-counts: Poisson sampling gives
  exactly log(1 + q(e^{ε'} − 1)) > qε' (`accounting.paper.poisson_amplification`). **Not a
  guarantee**; reported to compare with the paper, with its condition m ≥ 10√T.
- `theorem1_corrected`: the same proof with the correct amplification, per step
  (log(1 + q(e^{ε'} − 1)), qδ'), then Lemma 2 (KOV strong composition) over T steps with slack
  δ/2: a valid (ε, Tqδ' + δ/2 = δ) bound whatever m and T are.
- `rdp`: our RDP accountant on T × PoissonSampled(q, SparseVectorDpEvent) — each NumericSparse
  round pure-DP, Zhu & Wang's Poisson-subsampled RDP bound, Balle et al.'s conversion. Valid.
- the other registered accountants: their ε where they support the history, else the string
  "unsupported: <reason>" (PLD/PRV only treat Gaussians; the paper accountant is Theorem 3 of
  Alg 3, whose δ bookkeeping does not fit Alg 2).
`epsilon` is the smallest *valid* bound (never the printed claim).

Thm 1's condition m ≥ 10√T: we **warn** (UserWarning) and report `theorem1_condition_met`
rather than refuse, because the bound we return does not rely on it (the corrected chain and
RDP hold for every m, T); only the printed claim needs it, and it is flagged as not a guarantee
anyway. Note that with m ≥ 10√T the seed's ε' = εm/(2√(2T log(2/δ))) ≥ 5ε/√(2 log(2/δ)), so for
ε ≳ 1 Lemma 1's own condition ε' ≤ 1 fails: the printed claim is then doubly unsupported.

**Fixed partition (`groups=...`), the seed's own Alg 2.** The seed's line 3 picks one of m
groups of a partition {D_1..D_m} fixed for the whole run; its utility theorem (Thm 2) needs that
partition to satisfy assumption (1) (every group's summed gradient has ≤ c₁ non-zero coordinates
for every w). Fresh random groups (the default above) do not satisfy (1) on ordinary sparse data,
so `groups` lets a caller pass the fixed partition (a list of m disjoint arrays of row indices,
chosen from public information before the run, e.g. a public user or source id; rows in no
group are never used). Choosing *which* partition is data-independent and public, but the
privacy does depend on the partition being **reused**: the argument above (no ε amplification
for the steps that pick x's group) applies, so the Poisson accounting of the default mode would
under-count and is NOT used. Instead, the fixed mode is charged with a bound that needs no
amplification, valid (add/remove-one, x in any group) because the sequence of picked groups is
drawn independently of the data:
- condition on the picks; only the K steps that pick x's group differ between D and D' (the
  others run on identical groups), so the run is a K-fold adaptive composition of NumericSparse,
  with RDP at most K·ρ(α), ρ the unsampled per-round curve;
- K ~ Binomial(T, 1/m), the same law under D and D'; by joint convexity of (P, Q) ↦ ∫P^αQ^{1-α}
  over the mixture on the picks,
  ε_RDP(α) ≤ (1/(α−1))·log E[e^{(α−1)Kρ(α)}] = T/(α−1)·log(1 − q + q·e^{(α−1)ρ(α)}), q = 1/m,
  converted to (ε, δ) as the RDP accountant does (`fixed_partition_epsilon`);
- `history` is then [(NumericSparse, T)] with no sampling (every step charged in full), a weaker
  but valid history for any accountant. The corrected Theorem 1 (Lemma 1 amplification) is
  reported "unsupported" for this mode.
The partition only changes which rows are averaged: the sensitivity (s = c₂m/n) and NumericSparse
are the same as in the default mode. With `calibration="rdp"` the fixed mode's ε' is chosen so
that `fixed_partition_epsilon` equals the target ε (so at the same ε it runs with a smaller ε',
i.e. more noise, than the default mode).

`diagnostics=True` additionally returns, per step, the support size (non-zeros) and the largest
|coordinate| of the group gradient u before NumericSparse, and the picked group (fixed mode):
these are **not private** (exact functions of the data), for checking assumption (1) in
benchmarks and tests only.

`calibration="rdp"` keeps δ' and α's formula but chooses ε' (by bisection) so that the RDP
accountant's ε equals the target ε — the honest way to run Alg 2 "at ε" (the seed's ε' spends
far less than ε under RDP, and more than ε under the corrected Theorem 1).

Randomness: every random draw comes from `rng`; production callers must seed it from OS entropy
(`np.random.default_rng()` with no seed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Optional, Sequence

import numpy as np
from scipy import optimize

from widedp.accounting import events as ev
from widedp.accounting.base import accountant_names, make_accountant
from widedp.accounting.calibration import svt_event
from widedp.accounting.paper import advanced_composition, poisson_amplification
from widedp.accounting import rdp as rdp_mod
from widedp.selection.sparse_vector import numeric_sparse
from widedp.sparse_learners import linear_models as lm

History = list[tuple[ev.DpEvent, int]]


@dataclasses.dataclass(frozen=True)
class DpErmResult:
    """What `dp_erm_sparse` returns.

    `w`: the final model (dense d-vector). `history`: the privacy events of the run, for any
    accountant ([(PoissonSampled(1/m, SparseVectorDpEvent), T)]; fixed mode: [(SparseVectorDpEvent, T)],
    every step charged unsampled). `epsilon`, `delta`: the
    smallest valid bound among `accounting` (see the module docstring). `epsilon_prime`,
    `delta_prime`, `threshold`, `sensitivity`: the per-step NumericSparse parameters used.
    `answered`: number of coordinates updated at each step. `partition`: "fresh" (a fresh random
    partition per step, Poisson accounting) or "fixed" (the caller's `groups`, accounted by
    `fixed_partition_epsilon`). `diagnostics` (only with `diagnostics=True`; NOT private):
    per-step `support` (non-zeros of the group gradient), `max_abs` (its largest |coordinate|),
    `group_size` (rows averaged) and, in the fixed mode, `picked` (the group's index).
    """

    w: np.ndarray
    history: History
    epsilon: float
    delta: float
    accounting: dict[str, Any]
    theorem1_condition_met: bool
    epsilon_prime: float
    delta_prime: float
    threshold: float
    sensitivity: float
    answered: np.ndarray
    partition: str = "fresh"
    diagnostics: Optional[dict[str, np.ndarray]] = None


def seed_epsilon_prime(epsilon: float, delta: float, num_groups: int, steps: int) -> tuple[float, float]:
    """(ε', δ') of Alg 2 as the seed sets them: εm/(2√(2T log(2/δ))), δm/(2T)."""
    return epsilon * num_groups / (2.0 * math.sqrt(2.0 * steps * math.log(2.0 / delta))), delta * num_groups / (2.0 * steps)


def lemma4_threshold(sensitivity: float, dim: int, max_answers: int, n: int, epsilon_prime: float,
                     delta_prime: float) -> float:
    """Lemma 4's α with β = 1/n: 20·s·(log d + log(4c₁n))·√(c₁ log(2/δ'))/ε'."""
    return (20.0 * sensitivity * (math.log(dim) + math.log(4.0 * max_answers * n))
            * math.sqrt(max_answers * math.log(2.0 / delta_prime)) / epsilon_prime)


def alg2_history(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int,
                 steps: int) -> History:
    """The events of T Alg 2 steps: PoissonSampled(1/m, NumericSparse(ε', δ', c₁) releasing values).

    Relation add/remove-one; the SparseVectorDpEvent's noise scales are in units of the group
    gradient's ℓ∞ sensitivity, so the history does not depend on s."""
    step = ev.PoissonSampledDpEvent(1.0 / num_groups, svt_event(epsilon_prime, delta_prime, max_answers,
                                                                release_values=True))
    return [(step, steps)]


def alg2_accounting(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int, steps: int,
                    delta: float) -> dict[str, Any]:
    """Every bound we have for an Alg 2 run (see the module docstring), at total δ.

    Relation add/remove-one. Keys: `theorem1_printed` (not a guarantee), `theorem1_corrected`,
    and one key per registered accountant other than `paper` (its ε, or "unsupported: why").
    `theorem1_corrected` needs Tqδ' < δ (true for the seed's δ' = δm/(2T): Tqδ' = δ/2)."""
    return dict(_alg2_accounting(float(epsilon_prime), float(delta_prime), int(max_answers), int(num_groups),
                                 int(steps), float(delta)))


@functools.lru_cache(maxsize=256)  # pure function of numbers; the audit calls it thousands of times
def _alg2_accounting(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int, steps: int,
                     delta: float) -> dict[str, Any]:
    T, m = steps, num_groups
    q = 1.0 / m
    out: dict[str, Any] = {
        "theorem1_printed": 2.0 * epsilon_prime * math.sqrt(2.0 * T * math.log(2.0 / delta)) / m,
        "theorem1_printed_note": "seed Thm 1 with Lemma 1 as stated (amplified ε = qε'): under-counts, NOT a guarantee",
        "lemma1_condition_epsilon_prime_le_1": epsilon_prime <= 1.0,
    }
    slack = delta - T * q * delta_prime
    if slack > 0:
        eps_step = poisson_amplification(epsilon_prime, q)
        out["theorem1_corrected"] = advanced_composition(eps_step, T, slack)
    else:
        out["theorem1_corrected"] = f"unsupported: T·q·δ' = {T * q * delta_prime:.3g} leaves no slack below δ = {delta}"
    history = alg2_history(epsilon_prime, delta_prime, max_answers, m, T)
    out.update(_accountants_epsilon(history, delta, "unsupported: Theorem 3 is Alg 3's bound (δ = 2Tqδ'); "
                                                    "Alg 2 uses Theorem 1"))
    return out


def _accountants_epsilon(history, delta: float, paper: str) -> dict[str, Any]:
    """ε of `history` at `delta` by every registered accountant, or why it does not apply
    ("paper": `paper`, the reason Theorem 3 does not)."""
    out: dict[str, Any] = {}
    for name in accountant_names():
        if name == "paper":
            out[name] = paper
            continue
        acc = make_accountant(name)
        found = acc.unsupported(history)
        if found is not None:
            out[name] = f"unsupported: {found[1].reason}"
            continue
        with warnings.catch_warnings():  # opacus warns when the best order is at the grid's edge
            warnings.simplefilter("ignore")
            out[name] = float(acc.epsilon(history, delta))
    return out


def best_valid_epsilon(accounting: dict[str, Any]) -> float:
    """The smallest numeric bound among the valid ones (everything except the printed claim)."""
    valid = [v for k, v in accounting.items()
             if not k.startswith("theorem1_printed") and isinstance(v, float) and not isinstance(v, bool)]
    return min(valid) if valid else math.inf


@functools.lru_cache(maxsize=256)
def rdp_epsilon_prime(epsilon: float, delta: float, max_answers: int, num_groups: int, steps: int,
                      delta_prime: float) -> float:
    """The ε' at which the RDP accountant's ε for the whole Alg 2 run equals `epsilon` (bisection)."""
    acc = make_accountant("rdp")

    def spent(log_eps_prime: float) -> float:
        hist = alg2_history(math.exp(log_eps_prime), delta_prime, max_answers, num_groups, steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(acc.epsilon(hist, delta)) - epsilon

    lo, hi = math.log(1e-4), math.log(1e4)
    if spent(lo) > 0:
        raise ValueError(f"epsilon={epsilon} is too small for T={steps} steps at rate 1/{num_groups} (RDP)")
    if spent(hi) < 0:
        return math.exp(hi)
    root = optimize.brentq(spent, lo, hi, xtol=1e-6)
    # brentq's root can sit a hair above the target: step down until it does not.
    eps_prime = math.exp(root)
    while spent(math.log(eps_prime)) > 0:
        eps_prime *= 1 - 1e-6
    return eps_prime


#: Orders for the fixed-partition bound: the RDP accountant's grid and its edge extensions (a bound
#: holds at every order, so the minimum over more orders is still a bound).
FIXED_PARTITION_ORDERS: tuple[float, ...] = tuple(sorted(set(rdp_mod.DEFAULT_ORDERS) | set(rdp_mod.EDGE_ORDERS_ABOVE)
                                                         | set(rdp_mod.EDGE_ORDERS_BELOW)))


def fixed_partition_rdp(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int, steps: int,
                        orders=FIXED_PARTITION_ORDERS) -> np.ndarray:
    """RDP curve of T Alg 2 steps over a FIXED partition of m groups (module docstring):
    T/(α−1)·log(1 − q + q·e^{(α−1)ρ(α)}), q = 1/m, ρ the curve of one unsampled NumericSparse
    round (ε', δ', c₁ releasing values). Add/remove-one; x may sit in any group."""
    a = np.asarray(orders, dtype=np.float64)
    rho = rdp_mod.rdp_curve(svt_event(epsilon_prime, delta_prime, max_answers, release_values=True), a)
    q = 1.0 / num_groups
    log_stay = math.log1p(-q) if q < 1.0 else -math.inf
    return steps / (a - 1.0) * np.logaddexp(log_stay, math.log(q) + (a - 1.0) * rho)


@functools.lru_cache(maxsize=256)
def fixed_partition_epsilon(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int, steps: int,
                            delta: float) -> float:
    """(ε at δ) of T Alg 2 steps over a fixed partition: `fixed_partition_rdp` converted as the RDP
    accountant converts (Balle et al. 2020, Thm 21), minimized over `FIXED_PARTITION_ORDERS`."""
    curve = fixed_partition_rdp(epsilon_prime, delta_prime, max_answers, num_groups, steps)
    return rdp_mod.rdp_to_epsilon(FIXED_PARTITION_ORDERS, curve, delta)[0]


def fixed_partition_history(epsilon_prime: float, delta_prime: float, max_answers: int, steps: int) -> History:
    """A valid (conservative) history for the fixed mode: every step charged as an unsampled
    NumericSparse round (no amplification at all)."""
    return [(svt_event(epsilon_prime, delta_prime, max_answers, release_values=True), steps)]


def fixed_partition_accounting(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int,
                               steps: int, delta: float) -> dict[str, Any]:
    """Every bound we have for an Alg 2 run over a fixed partition, at total δ (module docstring).

    Keys: `theorem1_printed` (the seed's claim, not a guarantee), `theorem1_corrected` (always
    "unsupported": Lemma 1's amplification needs a fresh sample per step), `rdp_fixed_partition`
    (the mixture bound, valid), and one key per registered accountant other than `paper` on the
    conservative `fixed_partition_history` (its ε, or "unsupported: why")."""
    return dict(_fixed_partition_accounting(float(epsilon_prime), float(delta_prime), int(max_answers),
                                            int(num_groups), int(steps), float(delta)))


@functools.lru_cache(maxsize=256)
def _fixed_partition_accounting(epsilon_prime: float, delta_prime: float, max_answers: int, num_groups: int,
                                steps: int, delta: float) -> dict[str, Any]:
    T, m = steps, num_groups
    out: dict[str, Any] = {
        "theorem1_printed": 2.0 * epsilon_prime * math.sqrt(2.0 * T * math.log(2.0 / delta)) / m,
        "theorem1_printed_note": "seed Thm 1 (Lemma 1 as stated): NOT a guarantee, and for a fixed partition its "
                                 "amplification step does not apply at all",
        "lemma1_condition_epsilon_prime_le_1": epsilon_prime <= 1.0,
        "theorem1_corrected": "unsupported: a fixed partition reuses its groups, so Lemma 1's amplification by "
                              "sampling does not apply (see rdp_fixed_partition)",
        "rdp_fixed_partition": fixed_partition_epsilon(epsilon_prime, delta_prime, max_answers, m, T, delta),
    }
    history = fixed_partition_history(epsilon_prime, delta_prime, max_answers, T)
    out.update(_accountants_epsilon(history, delta, "unsupported: Theorem 3 is Alg 3's bound; Alg 2 uses Theorem 1"))
    return out


@functools.lru_cache(maxsize=256)
def fixed_partition_epsilon_prime(epsilon: float, delta: float, max_answers: int, num_groups: int, steps: int,
                                  delta_prime: float) -> float:
    """The ε' at which `fixed_partition_epsilon` for the whole run equals `epsilon` (bisection)."""

    def spent(log_eps_prime: float) -> float:
        return fixed_partition_epsilon(math.exp(log_eps_prime), delta_prime, max_answers, num_groups, steps,
                                       delta) - epsilon

    lo, hi = math.log(1e-4), math.log(1e4)
    if spent(lo) > 0:
        raise ValueError(f"epsilon={epsilon} is too small for T={steps} steps over a fixed partition of "
                         f"{num_groups} groups")
    if spent(hi) < 0:
        return math.exp(hi)
    eps_prime = math.exp(optimize.brentq(spent, lo, hi, xtol=1e-6))
    while spent(math.log(eps_prime)) > 0:
        eps_prime *= 1 - 1e-6
    return eps_prime


def _check_groups(groups, m: int, n: int) -> list[np.ndarray]:
    """The caller's fixed partition as sorted int arrays; refuses overlaps and rows out of range."""
    if isinstance(groups, np.ndarray) or not isinstance(groups, Sequence):
        raise ValueError(f"groups must be a sequence of m = num_groups arrays of row indices, got {type(groups).__name__}")
    if len(groups) != m:
        raise ValueError(f"groups must hold num_groups = {m} groups, got {len(groups)}")
    out = []
    for i, g in enumerate(groups):
        a = np.asarray(g)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"groups[{i}] must be a 1-d array of integer row indices")
        a = np.sort(a.astype(np.int64))
        if a.size and (a[0] < 0 or a[-1] >= n):
            raise ValueError(f"groups[{i}] has row indices outside [0, {n})")
        out.append(a)
    allrows = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if np.unique(allrows).size != allrows.size:
        raise ValueError("groups must be disjoint (each row in at most one group): the accounting charges one group per row")
    return out


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _check_pos(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def dp_erm_sparse(
    X,
    y,
    *,
    epsilon: float,
    delta: float,
    num_groups: int,
    steps: int,
    max_answers: int,
    learning_rate: float,
    gradient_bound: float,
    rng: np.random.Generator,
    loss: str = "logistic",
    threshold: Optional[float] = None,
    calibration: str = "seed",
    l2: float = 0.0,
    radius: Optional[float] = None,
    w0: Optional[np.ndarray] = None,
    public_n: Optional[int] = None,
    groups: Optional[Sequence] = None,
    diagnostics: bool = False,
) -> DpErmResult:
    """Run Alg 2 on (X, y): T steps of NumericSparse on the average gradient of a random group.

    Neighbouring relation: add/remove-one example. Sensitivity: each per-example gradient is
    clipped to ℓ∞ norm `gradient_bound` c₂, so the group gradient (m/n)·Σ clip(∇ℓ) has ℓ∞
    sensitivity s = c₂·m/n (n = `public_n`, default X.shape[0], treated as public); NumericSparse
    is run with exactly that s. For the logistic loss |φ'| ≤ 1, so with c₂ ≥ max |X_ij| no
    gradient is ever clipped.

    X: scipy.sparse (n × d, CSR; rows never densified), y: labels (±1 or 0/1 for logistic).
    m = `num_groups` (sampling rate 1/m), T = `steps`, c₁ = `max_answers` per step, η =
    `learning_rate`, λ = `l2` (ridge term, post-processing), `radius`: project w onto that ℓ2
    ball after each step. `threshold`: α (default Lemma 4's, see `lemma4_threshold`).
    `calibration`: "seed" (ε' = εm/(2√(2T log(2/δ)))) or "rdp" (ε' such that the RDP accountant
    spends exactly ε; in the fixed mode, `fixed_partition_epsilon`).
    `groups`: None (default: a fresh random partition per step, Poisson accounting) or the seed's
    FIXED partition, m = `num_groups` disjoint arrays of row indices chosen from public
    information (each step picks one uniformly); privacy does not depend on which partition is
    passed, but reusing one partition forfeits amplification, so this mode is accounted by
    `fixed_partition_epsilon`, not by the Poisson history (module docstring).
    `diagnostics`: also return the per-step support size / largest coordinate of the group
    gradient (NOT private: for checking assumption (1) in benchmarks and tests).
    rng: production callers must seed it from OS entropy (`np.random.default_rng()`).

    Raises ValueError naming the parameter (or the row of X) that is invalid. Warns when Thm 1's
    condition m ≥ 10√T fails (the returned `epsilon` does not rely on it; see module docstring).
    """
    data = lm.check_data(X, y, loss)
    n, d = data.X.shape
    epsilon, delta = _check_pos("epsilon", epsilon), float(delta)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    m = _check_int("num_groups", num_groups, 1)
    T = _check_int("steps", steps, 1)
    c1 = _check_int("max_answers", max_answers, 1)
    if c1 > d:
        raise ValueError(f"max_answers must be <= d = {d}, got {c1}")
    eta = _check_pos("learning_rate", learning_rate)
    c2 = _check_pos("gradient_bound", gradient_bound)
    if l2 < 0 or not math.isfinite(l2):
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    if radius is not None:
        radius = _check_pos("radius", radius)
    n_pub = n if public_n is None else _check_int("public_n", public_n, 1)
    if m > n_pub:
        raise ValueError(f"num_groups must be <= n = {n_pub} (each group averages n/m examples), got {m}")
    if calibration not in ("seed", "rdp"):
        raise ValueError(f"calibration must be 'seed' or 'rdp', got {calibration!r}")
    if w0 is None:
        w = np.zeros(d)
    else:
        w = np.array(w0, dtype=np.float64)
        if w.shape != (d,) or not np.all(np.isfinite(w)):
            raise ValueError(f"w0 must be a finite vector of shape ({d},), got shape {w.shape}")
        w = lm.project_l2(w, radius)

    condition = m >= 10.0 * math.sqrt(T)
    if not condition:
        warnings.warn(f"Theorem 1's condition m >= 10*sqrt(T) fails (m={m}, 10*sqrt(T)={10 * math.sqrt(T):.1f}): "
                      "the seed's printed (epsilon, delta) claim does not apply; the returned epsilon is the "
                      "smallest valid bound (corrected Theorem 1 / RDP), which does not need it", UserWarning,
                      stacklevel=2)
    fixed = None if groups is None else _check_groups(groups, m, n)
    eps_prime, delta_prime = seed_epsilon_prime(epsilon, delta, m, T)
    if calibration == "rdp":
        eps_prime = (rdp_epsilon_prime(epsilon, delta, c1, m, T, delta_prime) if fixed is None
                     else fixed_partition_epsilon_prime(epsilon, delta, c1, m, T, delta_prime))
    s = c2 * m / n_pub
    alpha = lemma4_threshold(s, d, c1, n_pub, eps_prime, delta_prime) if threshold is None else float(threshold)
    if not math.isfinite(alpha):
        raise ValueError(f"threshold must be finite, got {threshold}")

    linf = lm.row_norms(data.X, "inf")
    q = 1.0 / m
    answered = np.zeros(T, dtype=np.int64)
    diag = {key: np.zeros(T, dtype=dt) for key, dt in (("support", np.int64), ("max_abs", np.float64),
                                                        ("group_size", np.int64), ("picked", np.int64))}
    for t in range(T):
        if fixed is None:
            k = int(rng.binomial(n, q))
            rows = np.sort(rng.choice(n, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)
        else:
            diag["picked"][t] = g = int(rng.integers(m))
            rows = fixed[g]
            k = rows.size
        scalars = lm.clip_scalars(lm.per_example_scalars(data, rows, w), linf[rows], c2) if k else np.zeros(0)
        ids, vals = lm.sparse_weighted_sum(data.X, rows, scalars)
        if diagnostics:
            diag["support"][t] = np.count_nonzero(vals)
            diag["max_abs"][t] = float(np.abs(vals).max()) * (m / n_pub) if vals.size else 0.0
            diag["group_size"][t] = k
        sel = numeric_sparse(ids, vals * (m / n_pub), d, alpha, c1, eps_prime, delta_prime, s, rng,
                             release_values=True)
        answered[t] = sel.ids.size
        if l2:
            w *= 1.0 - eta * l2
        if sel.ids.size and sel.values is not None:
            w[sel.ids] -= eta * sel.values
        w = lm.project_l2(w, radius)

    if fixed is None:
        accounting = alg2_accounting(eps_prime, delta_prime, c1, m, T, delta)
        history = alg2_history(eps_prime, delta_prime, c1, m, T)
        diag.pop("picked")
    else:
        accounting = fixed_partition_accounting(eps_prime, delta_prime, c1, m, T, delta)
        history = fixed_partition_history(eps_prime, delta_prime, c1, T)
    return DpErmResult(
        w=w, history=history, epsilon=best_valid_epsilon(accounting),
        delta=delta, accounting=accounting, theorem1_condition_met=bool(condition), epsilon_prime=eps_prime,
        delta_prime=delta_prime, threshold=alpha, sensitivity=s, answered=answered,
        partition="fresh" if fixed is None else "fixed", diagnostics=diag if diagnostics else None,
    )
