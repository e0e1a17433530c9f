"""`fest-threshold` (selection/selectors/fest_threshold.py): DP-FEST's fixed rows ∪ per-step
Gaussian thresholding. Its two mechanisms are the audited library functions (fest_top_k,
gaussian_threshold: tests/test_privacy_selectors.py); here: that the selector is exactly their
union, that its per-step selection — through the registered selector, fixed rows included —
passes the privacy audit and that a data-dependent "fixed" set is caught, and that the CLI and
calibration charge its one-time event once. Engine vs the slow reference: tests/test_engine.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from widedp.accounting.events import GaussianDpEvent
from privacy_audit import EventCounts, epsilon_lower_bound, gaussian_delta, gaussian_optimal_threshold
from widedp.selection import contribution_counts, fest_top_k, gaussian_threshold
from widedp.selection.registry import SelectionContext, get_selector
from widedp.selection.result import Selection
from widedp.trainer.cli import main

SELECTOR = get_selector("fest-threshold")


def _context(offsets, ids, num_rows, fixed):
    touched = np.unique(np.asarray(ids, dtype=np.int64))
    return SelectionContext(num_rows=num_rows, touched_ids=touched, row_norms=np.ones(touched.size),
                            clip_norm=1.0, expected_batch_size=10.0,
                            example_rows=lambda: (np.asarray(offsets, np.int64), np.asarray(ids, np.int64)),
                            fixed_rows=None if fixed is None else np.asarray(fixed, np.int64))


def test_select_is_the_fixed_rows_union_the_threshold_selection_with_the_same_draws():
    params = SELECTOR.Params(noise_multiplier=0.7, threshold=1.2, contribution_clip=1.0, k=3)
    offsets, ids = [0, 2, 5, 6], [1, 4, 1, 4, 9, 1]
    fixed = np.array([0, 7, 30])
    got = SELECTOR.select(_context(offsets, ids, 40, fixed), params, np.random.default_rng(5))
    rows, counts = contribution_counts(offsets, ids, 1.0, 40)
    want = gaussian_threshold(rows, counts, 40, 1.2, 0.7, 1.0, np.random.default_rng(5))
    assert np.array_equal(got.ids, np.union1d(fixed, want.ids)) and got.event == GaussianDpEvent(0.7)
    assert SELECTOR.one_time_event(params) == GaussianDpEvent(params.fest_noise_multiplier)
    one = SELECTOR.one_time_select(np.array(offsets), np.array(ids), 40, params, np.random.default_rng(2))
    ref = fest_top_k(np.array(offsets), np.array(ids), 40, 3, params.fest_noise_multiplier,
                     params.max_rows_per_example, np.random.default_rng(2))
    assert np.array_equal(one.ids, ref.ids) and one.event == ref.event


def test_select_refuses_to_run_before_the_one_time_selection():
    params = SELECTOR.Params(noise_multiplier=1.0, threshold=1.0, k=2)
    with pytest.raises(RuntimeError, match="one-time selection has not run"):
        SELECTOR.select(_context([0, 1], [3], 10, None), params, np.random.default_rng(0))


# Per-step audit, as tests/test_privacy_selectors.py §4 audits gaussian_threshold ("literal"):
# D has one example touching only row 0 (count C1 = 1), D' has none; the fixed rows {5, 9} do
# not contain row 0. Event {row 0 selected}, τ at the optimal point for ε, so the bound is tight.
SIGMA, EPS, TRIALS = 1.0, 1.0, 8_000


def _audit(selector_select, seed: int):
    params = SELECTOR.Params(noise_multiplier=SIGMA, threshold=SIGMA * gaussian_optimal_threshold(EPS, 1 / SIGMA),
                             contribution_clip=1.0, k=2)
    fixed = np.array([5, 9])
    d, dp = _context([0, 1], [0], 16, fixed), _context([0], [], 16, fixed)
    rng_d, rng_dp = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    on_d = sum(0 in selector_select(d, params, rng_d).ids for _ in range(TRIALS))
    on_dp = sum(0 in selector_select(dp, params, rng_dp).ids for _ in range(TRIALS))
    delta = gaussian_delta(EPS, 1 / SIGMA)
    return epsilon_lower_bound(EventCounts(on_d, TRIALS), EventCounts(on_dp, TRIALS), delta=delta)


def test_per_step_selection_with_fixed_rows_passes_the_audit():
    result = _audit(SELECTOR.select, seed=808)
    assert result.eps_lb <= EPS, str(result)


def test_fixed_rows_taken_from_the_batch_are_caught():
    """Broken: the "fixed" rows are the batch's touched rows (data dependent every step)."""

    def leaky(context, params, rng):
        passed = SELECTOR.select(context, params, rng)
        return Selection(np.union1d(passed.ids, context.touched_ids), passed.event)

    result = _audit(leaky, seed=808)
    assert result.eps_lb > EPS, str(result)


def test_cli_epsilon_charges_the_one_time_event_once(capsys):
    base = ["epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.01", "--steps", "200", "--delta", "1e-6"]

    def eps(*extra):
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)["epsilon"]

    threshold_only = eps("--selection", "threshold", "--selection-sigma", "3.0")
    with_fest = eps("--selection", "fest-threshold", "--selection-sigma", "3.0", "--fest-sigma", "5.0")
    # the threshold run is not charged a fest event just because --fest-sigma is given
    assert eps("--selection", "threshold", "--selection-sigma", "3.0", "--fest-sigma", "5.0") == threshold_only
    assert with_fest > threshold_only
