"""Conformance tests: does a run's randomness have the distribution its privacy claim states?

An ε lower bound refutes a claim only when the break moves the privacy loss where a few
thousand trials can see it. Two breaks do not:

- **Shuffling accounted as Poisson** (Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha & Zhang,
  "How private are DP-SGD implementations?", ICML 2024). Batches cut from a shuffle put every
  example in exactly one batch per epoch; the ledger's `PoissonSampledDpEvent(q, …)` says each
  example is in each step's sample independently with probability q. The shuffled mechanism's
  extra loss is in the event "the example is absent from every step", whose probability under
  the claim is (1 − q)^T: it shows at small δ (Chua et al.'s bounds are analytic), not in the
  rates of a few thousand canaries (RESULTS §27 measures both).
- **The selection's σ composed wrongly** (the selection draws noise σ_sel/2 while its event in
  the ledger says σ_sel). The released selection is a thresholded, binary view of the noisy
  counts; near ε = 8 its loss stays inside the claim even when σ_sel is halved (DESIGN).

Both are visible directly in what the run's randomness produced. Each test here compares an
observed statistic with its exact distribution *under the claim*, so a correct run is refuted
with probability at most the test's level α = 1 − confidence (a Monte Carlo test with R null
draws is exact at level α when (R + 1)·α is an integer: Besag & Clifford 1989; otherwise it is
conservative to within 1/(R + 1); the two-sided ones double the smaller tail). A refutation says "this run's randomness is not the
mechanism its ledger states", not how large its ε is.

Privacy assumption of each test's null (what the claim states):
- `poisson_sampling_test`: each unit is in each step's sample independently with probability q
  (the ledger's Poisson sampling). Observed: each audited unit's number of sampled steps (i.i.d.
  Binomial(T, q) under the claim) and each step's number of sampled units (i.i.d.
  Binomial(N, q)).
- `threshold_selection_test`: each row that no example touched is selected in a step
  independently with probability Φ̄(τ / (σ_sel·C1)) (Gaussian thresholding of the counts,
  `selection.threshold`, noise N(0, (σ_sel·C1)²) on every row). Observed: how often the rows of
  units that are not in the data set (the audit's non-member canaries: rows nobody reads) were
  selected.

Import rule: as the rest of `auditing` (numpy and scipy only).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import stats

from widedp.auditing.one_run_audit import _check_confidence

#: Null draws of each Monte Carlo test (R + 1 = 2,000: the smallest two-sided p-value is 0.001).
NULL_DRAWS = 1999


def _int_array(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D array of integers, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64)


def _check_rate(rate: float, name: str) -> float:
    rate = float(rate)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {rate}")
    return rate


def binomial_dispersion_test(counts, trials: int, rate: float, rng: np.random.Generator,
                             null_draws: int = NULL_DRAWS) -> dict:
    """Two-sided Monte Carlo test that `counts` are i.i.d. Binomial(trials, rate) by their spread.

    Statistic D = Σ_i (c_i − trials·rate)² (null mean m·trials·rate·(1 − rate)) against
    `null_draws` copies of D drawn under the null; the equal-tailed p-value 2·min of the two
    one-sided Monte Carlo p-values (1 + #{draws ≤ D}) / (R + 1) and (1 + #{draws ≥ D}) / (R + 1)
    is valid at every m and trials.
    Too little spread (every unit sampled the same number of times, as batches cut from a
    shuffle do) and too much both refute.

    Args:
        counts: the observed counts c_1..c_m (integers in [0, trials]).
        trials: T ≥ 1; rate: q in (0, 1]; rng: the null draws' generator (public randomness).
    Returns:
        {"statistic", "null_mean", "p_value", "units", "trials", "rate"}; p_value 1.0 when the
        null has no spread (rate 1: every count is `trials`) and the counts match it.
    """
    c = _int_array(counts, "counts")
    if isinstance(trials, bool) or int(trials) != trials or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    trials, rate = int(trials), _check_rate(rate, "rate")
    if c.size and (c.min() < 0 or c.max() > trials):
        bad = int(c.min()) if c.min() < 0 else int(c.max())
        raise ValueError(f"counts must lie in [0, trials={trials}], got {bad}")
    mean = trials * rate
    statistic = float(np.sum((c - mean) ** 2))
    null_mean = c.size * trials * rate * (1.0 - rate)
    out = {"statistic": statistic, "null_mean": null_mean, "units": int(c.size), "trials": trials, "rate": rate}
    if c.size == 0 or rate == 1.0:
        out["p_value"] = 1.0 if statistic == 0.0 else 0.0
        return out
    draws = rng.binomial(trials, rate, size=(int(null_draws), c.size))
    null = np.sum((draws - mean) ** 2, axis=1)
    slack = 1e-9 * max(1.0, null_mean)  # ties within rounding count as ties
    below = (1 + np.count_nonzero(null <= statistic + slack)) / (null_draws + 1)
    above = (1 + np.count_nonzero(null >= statistic - slack)) / (null_draws + 1)
    out["p_value"] = float(min(1.0, 2.0 * min(below, above)))  # equal-tailed: D's null is skewed
    return out


def poisson_sampling_test(unit_step_counts, steps: int, units_per_step: Optional[Sequence[int]], population: int,
                          sample_rate: float, rng: np.random.Generator, confidence: float = 0.95) -> dict:
    """Whether a run's sampling is the Poisson sampling its ledger states (module docstring).

    Neighbouring relation: none — this tests the mechanism's randomness, not a pair of data sets.
    Two dispersion tests (`binomial_dispersion_test`), each at level (1 − confidence)/2, so the
    pair refutes a correct run with probability ≤ 1 − confidence: the audited units' numbers of
    sampled steps against Binomial(steps, q), and each step's number of sampled units against
    Binomial(population, q). `units_per_step` None: the per-unit test alone, at level
    1 − confidence (the step sizes are a statistic of the secret coins of every unit: the caller
    withholds them from a private run's record).

    Args:
        unit_step_counts: per audited unit (e.g. the member canaries), the number of steps it was
            in the sample; steps: T, the steps taken; units_per_step: the sample's size in units
            at each of the T steps; population: N, the units sampled from; sample_rate: q.
    Returns:
        {"per_unit": …, "per_step": …, "level": each test's level, "refuted": bool, "null": text}.
    """
    confidence = _check_confidence(confidence)
    if isinstance(population, bool) or int(population) != population or population < 1:
        raise ValueError(f"population must be an integer >= 1, got {population!r}")
    per_step = None
    if units_per_step is not None:
        sizes = _int_array(units_per_step, "units_per_step")
        if sizes.size != int(steps):
            raise ValueError(f"units_per_step has {sizes.size} entries for steps={steps}")
    level = (1.0 - confidence) / (1.0 if units_per_step is None else 2.0)
    per_unit = binomial_dispersion_test(unit_step_counts, int(steps), sample_rate, rng)
    if units_per_step is not None:
        per_step = binomial_dispersion_test(sizes, int(population), sample_rate, rng)
    return {"per_unit": per_unit, "per_step": per_step, "level": level,
            "refuted": bool(per_unit["p_value"] <= level or (per_step is not None and per_step["p_value"] <= level)),
            "null": "each unit in each step's sample independently with probability q (Poisson sampling, as the "
                    "ledger's PoissonSampledDpEvent states)"}


def threshold_selection_rate(threshold: float, noise_multiplier: float, contribution_clip: float) -> float:
    """P[an untouched row is selected] under Gaussian thresholding: Φ̄(τ / (σ_sel·C1)).

    Args:
        threshold: τ on the counts; noise_multiplier: σ_sel (> 0); contribution_clip: C1 (> 0).
    """
    if not noise_multiplier > 0 or not contribution_clip > 0:
        raise ValueError(f"noise_multiplier and contribution_clip must be > 0, got {noise_multiplier}, "
                         f"{contribution_clip}")
    return float(stats.norm.sf(float(threshold) / (float(noise_multiplier) * float(contribution_clip))))


def threshold_selection_test(selected: int, trials: int, threshold: float, noise_multiplier: float,
                             contribution_clip: float, confidence: float = 0.95,
                             steps_per_trial: int = 1) -> dict:
    """Whether untouched rows were selected as often as the stated Gaussian thresholding says.

    Neighbouring relation: none (a test of the selection's randomness). Each trial is one
    untouched row observed over `steps_per_trial` steps, "selected" when the row was selected in
    at least one of them: under the claim, independently with probability 1 − (1 − p)^s, p =
    `threshold_selection_rate`. (With s = 1 and one trial per row and step, every step counts.)
    Exact two-sided binomial test at level 1 − confidence.

    Args:
        selected: trials selected; trials: rows (× steps when s = 1) observed; threshold, noise
            multiplier, contribution clip: τ, σ_sel, C1 as the ledger and plan state them;
        steps_per_trial: s ≥ 1.
    Returns:
        {"selected", "trials", "expected_rate", "observed_rate", "p_value", "level", "refuted", "null"}.
    """
    confidence = _check_confidence(confidence)
    if isinstance(trials, bool) or int(trials) != trials or trials < 0:
        raise ValueError(f"trials must be an integer >= 0, got {trials!r}")
    if isinstance(selected, bool) or int(selected) != selected or not 0 <= selected <= trials:
        raise ValueError(f"selected must be an integer in [0, trials={trials}], got {selected!r}")
    if isinstance(steps_per_trial, bool) or int(steps_per_trial) != steps_per_trial or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial must be an integer >= 1, got {steps_per_trial!r}")
    p = threshold_selection_rate(threshold, noise_multiplier, contribution_clip)
    rate = -math.expm1(int(steps_per_trial) * math.log1p(-p)) if p < 1.0 else 1.0
    p_value = float(stats.binomtest(int(selected), int(trials), rate).pvalue) if trials else 1.0
    level = 1.0 - confidence
    return {"selected": int(selected), "trials": int(trials), "steps_per_trial": int(steps_per_trial),
            "expected_rate": rate, "observed_rate": (selected / trials) if trials else None,
            "p_value": p_value, "level": level, "refuted": bool(p_value <= level),
            "null": "an untouched row passes the threshold independently with probability Φ̄(τ/(σ_sel·C1)) in each "
                    "step (Gaussian noise of the stated σ_sel on every row's count)"}


def combined_refutation(tests: dict, confidence: float) -> dict:
    """Bonferroni over the conformance tests that ran: each was run at level α (its own
    `level`); the family refutes when any test's p-value ≤ α/k (k tests), so a correct run is
    refuted with probability ≤ α = 1 − confidence.

    Args:
        tests: name → a test's record (with "p_value", or "per_unit"/"per_step" p-values) or None.
    """
    confidence = _check_confidence(confidence)
    ran = {k: v for k, v in tests.items() if v is not None}
    alpha = 1.0 - confidence
    p_values: dict[str, float] = {}
    for name, record in ran.items():
        if "p_value" in record:
            p_values[name] = float(record["p_value"])
        elif record["per_step"] is None:  # the sampling test's per-unit half alone
            p_values[name] = float(record["per_unit"]["p_value"])
        else:  # the sampling test's two halves: its own Bonferroni (×2)
            p_values[name] = min(1.0, 2.0 * min(record["per_unit"]["p_value"], record["per_step"]["p_value"]))
    k = max(1, len(p_values))
    refuted = sorted(name for name, p in p_values.items() if p <= alpha / k)
    return {"tests": len(p_values), "p_values": p_values, "level": alpha / k, "refuted": refuted,
            "any_refuted": bool(refuted)}

