"""Threshold audit over independent trials: the many-run tight method, as ε and as Gaussian DP.

Jagielski, Ullman & Oprea (NeurIPS 2020) and Nasr et al., "Tight auditing of differentially
private machine learning" (USENIX Security 2023): run the mechanism on many independent trials,
each with the canary in (a member) or out by a fair coin, score each trial, and test "member" by
score ≥ t. If M is (ε, δ)-DP w.r.t. **adding/removing one example** (the canary), every test's
false-positive rate FPR = P[score ≥ t | out] and false-negative rate FNR = P[score < t | in] obey

    FPR + e^ε · FNR ≥ 1 − δ   and   FNR + e^ε · FPR ≥ 1 − δ,

so ε ≥ log((1 − δ − FNR) / FPR) and ε ≥ log((1 − δ − FPR) / FNR) (`epsilon_from_rates`); if M is
μ-GDP (Dong, Roth & Su 2019), FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ), so μ ≥ Φ⁻¹(1 − FPR) − Φ⁻¹(FNR)
(`gdp_mu_from_rates`; symmetric in the two rates). Both are decreasing in each rate, so one-sided
Clopper–Pearson upper bounds on FPR and FNR (each at confidence 1 − β/2, jointly 1 − β by the
union bound) give lower bounds that hold with probability ≥ 1 − β.

Trials and their assumption. The rates' confidence intervals need the trials' outcomes to be
**independent** (not identical: for independent Bernoullis of different rates the Clopper–Pearson
bound on their mean stays conservative, Hoeffding 1956). Separate training runs are independent
trials exactly. Canaries of one run are independent trials when each canary's score depends only
on its own coin and noise — white-box Dirac canaries, each on a row no other example reads, with
each row's noise drawn independently — which is an assumption about the run the one-run bounds
(`one_run_audit`, `fdp_one_run`) do not need. Where it holds, this bound is far tighter: it
uses the whole score distribution, not r guesses against a binomial.

The threshold is chosen on one part of the trials (`choose`: the best bound there) and
the rates are counted on the others, so the threshold is fixed before the counted outcomes are
seen; the split must be drawn independently of the coins. Or it is fixed before any trial from
the claimed mechanism alone (`threshold_audit_at`; `claimed_mechanism_threshold` in
`auditing/scores.py` simulates the claim), and every trial is counted.

The Gaussian-DP bound's null is "M is μ-GDP": exact for DP-SGD with every example in every step,
approximate for subsampled runs (as in `fdp_one_run`); the (ε, δ) bound refutes any (ε, δ)
claim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy import special, stats

from widedp.auditing.fdp_one_run import gdp_epsilon
from widedp.auditing.one_run_audit import _check_confidence, _check_delta

OBJECTIVES = ("epsilon", "gdp")


@dataclasses.dataclass(frozen=True)
class ThresholdAudit:
    """One threshold test counted on the evaluation trials and its lower bounds."""

    objective: str  # what the threshold was chosen for: "epsilon" or "gdp"
    threshold: float  # "member" when score ≥ threshold
    members: int  # evaluation trials with the canary in
    non_members: int
    false_negatives: int  # members scored below the threshold
    false_positives: int  # non-members scored at or above it
    fnr_upper: float  # Clopper–Pearson upper bounds, each at 1 − β/2
    fpr_upper: float
    epsilon_lower_bound: float  # from the (ε, δ) inequalities at the upper rates
    mu_lower_bound: float  # from the μ-GDP tradeoff at the upper rates
    epsilon_lower_bound_gdp: Optional[float]  # gdp_epsilon(μ̂, δ); None at δ = 0
    confidence: float
    chosen_by: str = "half"  # "half": on the choosing trials; "claim": from the claimed mechanism, before any trial


def clopper_pearson_upper(successes: int, trials: int, confidence: float) -> float:
    """One-sided Clopper–Pearson upper bound on a Bernoulli rate: P[rate > bound] ≤ 1 − confidence.

    Args:
        successes: k, 0 ≤ k ≤ trials; trials: n ≥ 0 (n = 0 gives 1.0); confidence in (0, 1).
    """
    confidence = _check_confidence(confidence)
    k, n = int(successes), int(trials)
    if not 0 <= k <= n:
        raise ValueError(f"successes must be in [0, trials], got successes={successes}, trials={trials}")
    if k == n:
        return 1.0
    return float(stats.beta.ppf(confidence, k + 1, n - k))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The smallest ε an (ε, δ)-DP mechanism needs for a test with these rates (0.0 if none).

    Args:
        fpr, fnr: a test's false-positive and false-negative rates in [0, 1]; delta: δ in [0, 1).
    Returns:
        max(0, log((1 − δ − FNR) / FPR), log((1 − δ − FPR) / FNR)); ∞ when a rate is 0 and the
        other leaves mass above δ (no finite ε allows that test).
    """
    delta = _check_delta(delta)
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        top = 1.0 - delta - a
        if top <= 0.0:
            continue
        best = max(best, math.inf if b <= 0.0 else math.log(top / b))
    return best


def gdp_mu_from_rates(fpr: float, fnr: float) -> float:
    """The smallest μ a μ-GDP mechanism needs for a test with these rates: max(0, Φ⁻¹(1 − FPR) − Φ⁻¹(FNR))
    (∞ when both rates are 0)."""
    if fpr <= 0.0 and fnr <= 0.0:
        return math.inf
    return max(0.0, float(special.ndtri(1.0 - fpr) - special.ndtri(fnr)))


def _rates_at_every_threshold(member_scores: np.ndarray, non_member_scores: np.ndarray):
    """Candidate thresholds (every distinct score) and the point rates (FPR, FNR) of "score ≥ t" at each."""
    thresholds = np.unique(np.concatenate([member_scores, non_member_scores]))
    members, others = np.sort(member_scores), np.sort(non_member_scores)
    fnr = np.searchsorted(members, thresholds, side="left") / max(members.size, 1)
    fpr = (others.size - np.searchsorted(others, thresholds, side="left")) / max(others.size, 1)
    return thresholds, fpr, fnr


def best_threshold(member_scores, non_member_scores, objective: str, delta: float = 0.0,
                   confidence: float = 0.975) -> float:
    """The score threshold whose rates give the largest bound of `objective` ("epsilon":
    `epsilon_from_rates` at `delta`; "gdp": `gdp_mu_from_rates`) on these scores, each rate read
    as its Clopper–Pearson upper bound at `confidence` (so that a threshold in a thin tail, whose
    point estimate is noisy, is not preferred for a ratio its counts cannot support).

    Args:
        member_scores, non_member_scores: 1-d scores (higher: more member-like), each non-empty.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    confidence = _check_confidence(confidence)
    members, others = _scores(member_scores, "member_scores"), _scores(non_member_scores, "non_member_scores")
    thresholds, fpr, fnr = _rates_at_every_threshold(members, others)
    fpr = _upper_rates(np.rint(fpr * others.size), others.size, confidence)
    fnr = _upper_rates(np.rint(fnr * members.size), members.size, confidence)
    if objective == "gdp":
        value = special.ndtri(1.0 - fpr) - special.ndtri(fnr)
    else:
        with np.errstate(divide="ignore"):
            value = np.maximum(np.log(np.maximum(1.0 - delta - fnr, 0.0) / fpr),
                               np.log(np.maximum(1.0 - delta - fpr, 0.0) / fnr))
    return float(thresholds[int(np.argmax(value))])


def _upper_rates(successes: np.ndarray, trials: int, confidence: float) -> np.ndarray:
    """`clopper_pearson_upper` of every count at once."""
    k = np.asarray(successes, dtype=np.float64)
    out = np.ones_like(k)
    below = k < trials
    out[below] = stats.beta.ppf(confidence, k[below] + 1, trials - k[below])
    return out


def _scores(values, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite numbers")
    return arr


def threshold_audit(scores, included, choose, delta: float, confidence: float, objective: str) -> ThresholdAudit:
    """Lower bounds on ε and μ from the test "score ≥ t" over independent trials (module docstring).

    Args:
        scores: [m] one score per trial (canary), higher = more member-like.
        included: [m] bool, the trial's coin (True: the canary was in).
        choose: [m] bool, the trials the threshold is chosen on (drawn independently of the coins);
            the rates are counted on the others.
        delta: the claim's δ in [0, 1); confidence in (0, 1): each bound exceeds the truth with
            probability ≤ 1 − confidence if the trials are independent.
        objective: "epsilon" or "gdp", what the threshold is chosen to maximise.
    Returns:
        ThresholdAudit (ε lower bound, μ lower bound and its ε at δ).
    """
    delta, confidence = _check_delta(delta), _check_confidence(confidence)
    s = _scores(scores, "scores")
    inc, pick = np.asarray(included, dtype=bool).reshape(-1), np.asarray(choose, dtype=bool).reshape(-1)
    if inc.size != s.size or pick.size != s.size:
        raise ValueError(f"scores, included and choose must have one entry per trial, got {s.size}, {inc.size}, {pick.size}")
    for part, name in ((pick, "choosing"), (~pick, "counting")):
        if not (inc & part).any() or not (~inc & part).any():
            raise ValueError(f"the {name} trials need members and non-members")
    each = 1.0 - (1.0 - confidence) / 2.0
    t = best_threshold(s[pick & inc], s[pick & ~inc], objective, delta, each)
    return _counted(t, s[~pick & inc], s[~pick & ~inc], delta, confidence, objective, "half")


def threshold_audit_at(scores, included, threshold: float, delta: float, confidence: float) -> ThresholdAudit:
    """Lower bounds on ε and μ from the test "score ≥ threshold" counted over every trial, the
    threshold fixed before any trial was run (from the claimed mechanism alone: it must not
    depend on the scores or the coins).

    Args:
        scores: [m] one score per trial, higher = more member-like; included: [m] bool coins.
        threshold: the pre-registered threshold; delta in [0, 1); confidence in (0, 1).
    Returns:
        ThresholdAudit with chosen_by = "claim" (objective "gdp": the bound it is meant for).
    """
    delta, confidence = _check_delta(delta), _check_confidence(confidence)
    s = _scores(scores, "scores")
    inc = np.asarray(included, dtype=bool).reshape(-1)
    if inc.size != s.size:
        raise ValueError(f"scores and included must have one entry per trial, got {s.size} and {inc.size}")
    if not inc.any() or inc.all():
        raise ValueError("the trials need members and non-members")
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    return _counted(float(threshold), s[inc], s[~inc], delta, confidence, "gdp", "claim")


def _counted(t: float, members: np.ndarray, others: np.ndarray, delta: float, confidence: float, objective: str,
             chosen_by: str) -> ThresholdAudit:
    """The rates of "score ≥ t" on the counted trials, each bounded by Clopper–Pearson at 1 − β/2."""
    each = 1.0 - (1.0 - confidence) / 2.0
    fn, fp = int((members < t).sum()), int((others >= t).sum())
    fnr_up, fpr_up = clopper_pearson_upper(fn, members.size, each), clopper_pearson_upper(fp, others.size, each)
    mu = gdp_mu_from_rates(fpr_up, fnr_up)
    return ThresholdAudit(objective=objective, threshold=t, members=int(members.size), non_members=int(others.size),
                          false_negatives=fn, false_positives=fp, fnr_upper=fnr_up, fpr_upper=fpr_up,
                          epsilon_lower_bound=epsilon_from_rates(fpr_up, fnr_up, delta), mu_lower_bound=mu,
                          epsilon_lower_bound_gdp=gdp_epsilon(mu, delta) if delta > 0 else None,
                          confidence=confidence, chosen_by=chosen_by)


def claim_curve_test(fpr_upper: float, fnr_upper: float, curve) -> dict:
    """The rates' upper bounds against every (ε_j, δ_j) the claim asserts (its accountant's curve):
    an (ε_j, δ_j)-DP mechanism allows no test whose rates give `epsilon_from_rates` > ε_j at δ_j,
    so one such pair refutes the claim. The rates' Clopper–Pearson bounds hold jointly (with
    probability ≥ the audit's confidence), so every pair is tested at once at that confidence —
    no multiplicity — and at q < 1, where the Gaussian-DP nulls are approximate, this is a
    refutation of the run's own claim at every δ of the curve, not only at its stated one.

    Args:
        fpr_upper, fnr_upper: the rates' upper bounds (ThresholdAudit.fpr_upper / fnr_upper).
        curve: [(ε_j, δ_j)], the claim at several δ (δ_j in (0, 1)); an accountant's ε_j < 0 at a
            large δ_j (its δ(0) is already below δ_j) is read as the claim (0, δ_j).
    Returns:
        {"ratio": max_j ε̂_j / ε_j, "delta", "epsilon_bound", "epsilon_claimed" (at that j),
         "refuted": whether some ε̂_j > ε_j, "points": [(δ_j, ε_j, ε̂_j)]}.
    """
    points = []
    for eps, delta in curve:
        if not (math.isfinite(eps) and 0.0 < delta < 1.0):
            raise ValueError(f"curve points must be (a finite ε, δ in (0, 1)), got ({eps!r}, {delta!r})")
        points.append((float(delta), max(0.0, float(eps)), epsilon_from_rates(fpr_upper, fnr_upper, delta)))
    if not points:
        raise ValueError("curve must hold at least one (ε, δ) point")

    def ratio(p):
        return math.inf if p[1] == 0.0 and p[2] > 0.0 else (p[2] / p[1] if p[1] > 0.0 else 0.0)

    worst = max(points, key=ratio)
    return {"ratio": ratio(worst), "delta": worst[0], "epsilon_claimed": worst[1], "epsilon_bound": worst[2],
            "refuted": any(p[2] > p[1] for p in points), "points": points}
