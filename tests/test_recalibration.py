"""train.recalibrate: the noisy logit histogram (one Gaussian mechanism, sensitivity √2) and the
Platt fit on it, as specifications — the fast path against a loop, the audit of the real
mechanism against broken ones, the fit against known answers, and a run that uses it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from widedp.trainer.engine import recalibration
from widedp.trainer.engine.recalibration import exact_histogram, fit_platt, noisy_histogram

AUDIT_SIGMA = 1.0  # μ = 1/σ = 1 for the real mechanism (GaussianDpEvent(σ))
AUDIT_EPS = 1.0
AUDIT_TRIALS = 60_000
AUDIT_BINS = 4


def _reference_histogram(logits, labels, bins, clip):
    """The obvious loop: each example's clipped logit to its bin, +1 total, +y positives."""
    totals, positives = [0.0] * bins, [0.0] * bins
    width = 2 * clip / bins
    for z, y in zip(logits, labels):
        z = min(max(float(z), -clip), clip)
        index = min(int((z + clip) / width), bins - 1)
        totals[index] += 1
        positives[index] += float(y)
    return np.array(totals), np.array(positives)


def test_histogram_agrees_with_the_loop_at_every_bin_and_edge():
    rng = np.random.default_rng(3)
    logits = np.concatenate([rng.normal(0, 5, 3000), [-8.0, 8.0, -100.0, 100.0, 0.0, 7.999999, -7.75]])
    labels = (rng.random(logits.size) < 0.3).astype(float)
    for bins in (1, 7, 64):
        fast = exact_histogram(logits, labels, bins, 8.0)
        slow = _reference_histogram(logits, labels, bins, 8.0)
        np.testing.assert_array_equal(fast[0], slow[0])
        np.testing.assert_allclose(fast[1], slow[1])
        assert fast[0].sum() == logits.size


def test_histogram_refuses_non_binary_labels_and_misaligned_inputs():
    with pytest.raises(ValueError, match="0 or 1"):
        exact_histogram([0.0, 1.0], [0.0, 0.5])
    with pytest.raises(ValueError, match="aligned"):
        exact_histogram([0.0, 1.0], [0.0])
    with pytest.raises(ValueError, match="noise multiplier"):
        noisy_histogram([0.0], [1.0], 0.0, np.random.default_rng(0))


def _releases(with_extra: bool, seed: int) -> np.ndarray:
    """The projection (total + positives)/√2 of the bin the differing example lands in, over
    AUDIT_TRIALS runs of the mechanism on D (3 examples) or D' = D + one positive in bin 2."""
    logits, labels = [-7.0, -1.0, 5.0], [0.0, 1.0, 0.0]
    if with_extra:
        logits, labels = logits + [1.0], labels + [1.0]  # bin 2 of 4 over [-8, 8]
    rng = np.random.default_rng(seed)
    out = np.empty(AUDIT_TRIALS)
    for i in range(AUDIT_TRIALS):
        hist = noisy_histogram(logits, labels, AUDIT_SIGMA, rng, bins=AUDIT_BINS)
        out[i] = (hist.totals[2] + hist.positives[2]) / math.sqrt(2.0)
    return out


def _audit():
    from privacy_audit import EventCounts, epsilon_lower_bound, gaussian_delta, gaussian_optimal_threshold

    mu = 1.0 / AUDIT_SIGMA
    # D' shifts the projection by √2 (1 on the total, 1 on the positives) over noise std σ√2:
    # the lower mean is the projection of D's exact counts (bin 2: no example), 0.
    threshold = AUDIT_SIGMA * math.sqrt(2.0) * gaussian_optimal_threshold(AUDIT_EPS, mu)
    on_d = EventCounts(int(np.sum(_releases(True, 11) >= threshold)), AUDIT_TRIALS)
    on_dp = EventCounts(int(np.sum(_releases(False, 12) >= threshold)), AUDIT_TRIALS)
    return epsilon_lower_bound(on_d, on_dp, delta=gaussian_delta(AUDIT_EPS, mu))


def test_the_histogram_passes_the_audit_at_its_claimed_gaussian():
    result = _audit()
    assert result.eps_lb <= AUDIT_EPS, str(result)
    assert result.eps_lb > AUDIT_EPS - 0.6, f"audit no longer near-tight: {result}"


def test_a_histogram_noised_for_sensitivity_one_is_caught(monkeypatch):
    """Broken: noise std σ instead of σ·√2 (forgetting that one example moves two counts)."""
    monkeypatch.setattr(recalibration, "SENSITIVITY", 1.0)
    result = _audit()
    assert result.eps_lb > AUDIT_EPS, str(result)


def test_platt_fit_recovers_a_known_miscalibration_from_exact_counts():
    rng = np.random.default_rng(0)
    z_true = rng.normal(-1.0, 1.2, 400_000)
    labels = (rng.random(z_true.size) < 1 / (1 + np.exp(-z_true))).astype(float)
    model = (z_true - 0.8) / 0.5  # the model's logit: scaled ×2 and shifted
    totals, positives = exact_histogram(model, labels, 256, 8.0)
    centers = (recalibration.bin_edges(256, 8.0)[:-1] + recalibration.bin_edges(256, 8.0)[1:]) / 2
    a, b = fit_platt(centers, totals, positives)
    assert a == pytest.approx(0.5, abs=0.02) and b == pytest.approx(0.8, abs=0.03)


def test_platt_fit_makes_no_change_without_both_classes():
    assert fit_platt([0.0, 1.0], [10.0, 10.0], [0.0, 0.0]) == (1.0, 0.0)
    assert fit_platt([0.0, 1.0], [10.0, 10.0], [10.0, 10.0]) == (1.0, 0.0)


def test_noisy_fit_lowers_the_logloss_of_an_overconfident_biased_model():
    rng = np.random.default_rng(1)
    z_true = rng.normal(-1.2, 1.0, 100_000)
    labels = (rng.random(z_true.size) < 1 / (1 + np.exp(-z_true))).astype(float)
    model = 2 * z_true - 1.5 + rng.normal(0, 0.5, z_true.size)
    hist = noisy_histogram(model, labels, 50.0, rng)
    a, b = fit_platt(hist.centers, hist.totals, hist.positives)

    def logloss(z):
        return float(np.mean(np.logaddexp(0, z) - labels * z))

    base = labels.mean()
    base_rate = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    assert logloss(model) > base_rate  # the miscalibrated model is worse than the base rate ...
    assert logloss(a * model + b) < logloss(z_true) + 0.01  # ... and recalibrated near the truth


def test_auto_noise_multiplier_takes_the_larger_of_its_two_rules_unless_the_base_rate_needs_more():
    """5% of ε or the usefulness rule where n is large; up to half of ε where the base rate needs it."""
    from widedp.accounting import make_accountant
    from widedp.accounting.events import GaussianDpEvent

    def spent(sigma):
        return make_accountant("rdp").epsilon([(GaussianDpEvent(sigma), 1)], 1e-6)

    mid_n, rule_mid = recalibration.auto_noise_multiplier(200_000, 1.0, 1e-6, "rdp")
    big_n, rule_big = recalibration.auto_noise_multiplier(10_000_000, 1.0, 1e-6, "rdp")
    assert "ε" in rule_mid and mid_n > 0.01 * (200_000 / 64) / math.sqrt(2)  # the budget rule wins ...
    assert spent(mid_n) == pytest.approx(recalibration.BUDGET_FRACTION, rel=1e-6)  # ... at 5% of ε
    assert big_n == pytest.approx(0.01 * (10_000_000 / 64) / math.sqrt(2))  # the usefulness rule wins
    # a thousand units: 5% of ε leaves the noisy base rate off, so the release spends more,
    # never above MAX_BUDGET_FRACTION of ε, and stops where the base rate's noise reaches its target
    small_n, rule_small = recalibration.auto_noise_multiplier(1_000, 1.0, 1e-6, "rdp")
    assert "base rate" in rule_small
    assert recalibration.BUDGET_FRACTION < spent(small_n) <= recalibration.MAX_BUDGET_FRACTION * (1 + 1e-9)
    rate_sigma = recalibration.RATE_NOISE_TARGET * 1_000 / math.sqrt(2)
    assert small_n >= rate_sigma * (1 - 1e-9)
    ample, _ = recalibration.auto_noise_multiplier(20_000, 8.0, 1e-6, "rdp")  # 20,000 units at ε = 8: ...
    assert spent(ample) < recalibration.MAX_BUDGET_FRACTION * 8.0  # ... the target is met below the cap
    assert ample == pytest.approx(recalibration.RATE_NOISE_TARGET * 20_000 / math.sqrt(2)) or \
        spent(ample) == pytest.approx(recalibration.BUDGET_FRACTION * 8.0, rel=1e-6)


def test_auto_bins_narrow_the_histogram_where_its_noise_would_dominate_the_counts():
    assert recalibration.auto_bins(1.0, 1_000_000) == recalibration.BINS
    assert recalibration.auto_bins(1e6, 1_000) == recalibration.MIN_BINS  # never below MIN_BINS
    for sigma, n in ((8.2, 18_407), (54.0, 18_407), (6.9, 2_925), (20.0, 50_000)):
        bins = recalibration.auto_bins(sigma, n)
        assert recalibration.MIN_BINS <= bins <= recalibration.BINS and bins & (bins - 1) == 0
        assert bins == recalibration.MIN_BINS or recalibration.total_noise_ratio(sigma, n, bins) <= recalibration.MAX_TOTAL_NOISE_RATIO
        assert bins == recalibration.BINS or recalibration.total_noise_ratio(sigma, n, 2 * bins) > recalibration.MAX_TOTAL_NOISE_RATIO


def _weak_model_excess(n: int, sigma: float, bins: int, repeats: int, rng) -> np.ndarray:
    """The test log loss lost to the base rate by a weak, miscalibrated model (logits 0.3 × the
    truth + N(0, 1.5²) − 1) recalibrated from noisy counts, per repeat."""
    out = []
    for _ in range(repeats):
        truth = rng.normal(0.0, 0.5, n) + math.log(0.45 / 0.55)
        labels = (rng.random(n) < 1 / (1 + np.exp(-truth))).astype(float)
        model = 0.3 * truth + rng.normal(0.0, 1.5, n) - 1.0
        hist = noisy_histogram(model, labels, sigma, rng, bins=bins)
        a, b = fit_platt(hist.centers, hist.totals, hist.positives)
        z = a * np.clip(model, -recalibration.LOGIT_CLIP, recalibration.LOGIT_CLIP) + b
        rate = labels.mean()
        out.append(float(np.mean(np.logaddexp(0, z) - labels * z)) + rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return np.array(out)


@pytest.mark.parametrize("n,eps", [(587, 1.0), (2_925, 1.0), (2_925, 8.0)])
def test_the_auto_rule_keeps_a_weak_model_within_the_base_rate_where_the_old_one_lost_to_it(n, eps):
    """A few hundred to a few thousand units: the "auto" σ and bins keep the recalibrated weak
    model within 0.005 of the base rate's log loss on average; the previous rule (σ at 5% of ε,
    64 bins) on the same data loses more — by more than 0.005 where the noise is large."""
    from widedp.accounting.calibration import calibrate
    from widedp.accounting.events import GaussianDpEvent

    rng = np.random.default_rng(7)
    delta = n ** -1.1
    sigma, _ = recalibration.auto_noise_multiplier(n, eps, delta, "pld")
    excess = _weak_model_excess(n, sigma, recalibration.auto_bins(sigma, n), 120, rng)
    old_sigma = calibrate(GaussianDpEvent, recalibration.BUDGET_FRACTION * eps, delta, accountant="pld")
    old = _weak_model_excess(n, old_sigma, recalibration.BINS, 120, rng)
    assert excess.mean() <= 0.005, excess.mean()
    assert old.mean() > excess.mean(), (old.mean(), excess.mean())
    if eps == 1.0:
        assert old.mean() > 0.005, old.mean()


@pytest.fixture(scope="module")
def recalibrated_run(tmp_path_factory):
    import widedp

    run_dir = tmp_path_factory.mktemp("recal") / "run"
    result = widedp.train("configs/quickstart.toml", run_dir, overrides=[
        "cluster.backend=local", "train.steps=20", "privacy.target_epsilon=4", "train.log_every=5"])
    return run_dir, result


def test_a_private_ctr_run_charges_and_reports_its_recalibration(recalibrated_run):
    run_dir, result = recalibrated_run
    summary = result.summary
    recal = summary["recalibration"]
    assert recal["applied"] and recal["after_step"] == 20 and math.isfinite(recal["a"])
    ledger = json.loads((run_dir / "ledger.json").read_text())
    events = [entry["event"] for entry in ledger["history"]]
    last = events[-1]
    assert last.get("noise_multiplier") == pytest.approx(recal["noise_multiplier"])
    assert summary["epsilon"] <= summary["target_epsilon"] * (1 + 1e-9)
    assert summary["events_charged"] == 20 + 1  # the steps and the histogram


def test_recalibration_is_not_run_twice_for_the_same_step(recalibrated_run, tmp_path):
    import widedp

    run_dir, result = recalibrated_run
    again = widedp.train("configs/quickstart.toml", run_dir, resume=True, overrides=[
        "cluster.backend=local", "train.steps=20", "privacy.target_epsilon=4", "train.log_every=5"])
    assert again.summary["recalibration"]["applied"] is False
    assert again.summary["events_charged"] == result.summary["events_charged"]


def test_platt_fit_keeps_the_models_order_when_the_counts_run_against_it():
    """Counts whose positives fall as the logit rises (a weak model under noise): the free fit's
    slope is negative, which would turn the ranking upside down; the fit keeps a = MIN_SLOPE and
    fits the intercept — the predictions sit near the base rate, in the model's order."""
    import math

    from widedp.trainer.engine.recalibration import MIN_SLOPE

    centers = np.linspace(-4, 4, 17)
    totals = np.full(17, 1000.0)
    positives = totals / (1 + np.exp(0.5 * centers + 1.0))  # p falls with z: the free slope is −0.5
    a, b = fit_platt(centers, totals, positives)
    assert a == MIN_SLOPE
    base = positives.sum() / totals.sum()
    # b is the intercept's optimum at that slope: the predictions average to the base rate
    p = 1 / (1 + np.exp(-(a * centers + b)))
    assert math.isclose(float((p * totals).sum() / totals.sum()), base, rel_tol=1e-6)
    # the free fit would have the negative slope (the same Newton problem without the floor)
    assert fit_platt(centers, totals, totals / (1 + np.exp(-0.5 * centers - 1.0)))[0] > 0.4


@pytest.mark.parametrize("noise_ratio", [0.001, recalibration.MAX_TOTAL_NOISE_RATIO])
def test_recalibrating_a_model_with_no_signal_never_ranks_below_chance_nor_loses_to_the_base_rate(noise_ratio):
    """A model whose logits are independent of the labels, recalibrated from noisy counts 200
    times, at low noise and at the most noise the "auto" rule lets through
    (MAX_TOTAL_NOISE_RATIO of n on the total count): the recalibrated AUC stays at 0.5 up to its
    sampling noise — never systematically below (the slope never turns negative) — and the
    logloss is no worse than the base rate's by more than 0.005 on average (0.015 at worst).
    The broken fit (no slope floor) on the same counts turns the ranking over, and at 20× the
    limit the fit loses to the base rate: why the rule skips such a release."""
    from widedp.trainer.models.auc import binary_auc
    import torch

    rng = np.random.default_rng(4)
    n, repeats = 4_000, 200
    labels = (rng.random(n) < 0.2).astype(float)
    base = labels.mean()
    base_rate = -(base * math.log(base) + (1 - base) * math.log(1 - base))

    def fits(sigma):
        aucs, excess, free_negative = [], [], 0
        for _ in range(repeats):
            model = rng.normal(0.0, 2.0, n)  # no signal
            hist = noisy_histogram(model, labels, sigma, rng)
            a, b = fit_platt(hist.centers, hist.totals, hist.positives)
            z = a * np.clip(model, -recalibration.LOGIT_CLIP, recalibration.LOGIT_CLIP) + b
            aucs.append(binary_auc(torch.from_numpy(z), torch.from_numpy(labels)))
            excess.append(float(np.mean(np.logaddexp(0, z) - labels * z)) - base_rate)
            free_negative += _free_platt(hist.centers, hist.totals, hist.positives)[0] < 0
        return np.array(aucs), np.array(excess), free_negative

    sigma = noise_ratio * n / (recalibration.SENSITIVITY * math.sqrt(recalibration.BINS))
    assert recalibration.total_noise_ratio(sigma, n) == pytest.approx(noise_ratio)
    assert "noise_note" not in recalibration.noise_note(sigma, n)
    aucs, excess, free_negative = fits(sigma)
    se = float(aucs.std() / math.sqrt(repeats))
    assert abs(float(aucs.mean()) - 0.5) < 4 * se + 1e-3, (aucs.mean(), se)
    assert excess.mean() <= 0.005 and excess.max() <= 0.015, (excess.mean(), excess.max())
    assert free_negative > repeats // 10  # without the floor, the noise turns the ranking over often
    if noise_ratio == recalibration.MAX_TOTAL_NOISE_RATIO:
        assert "noise_note" in recalibration.noise_note(20 * sigma, n)
        _, excess, _ = fits(20 * sigma)
        assert excess.mean() > 0.005  # far past the limit the fit does lose to the base rate


def test_the_recalibration_plan_notes_where_its_noise_dominates_the_counts():
    """From public values only: a few hundred users at ε = 1 get the note (the release still
    runs and is charged); 160,000 examples at ε = 1 do not."""
    from widedp.trainer.config import load_config
    from widedp.trainer.config.planning import recalibration_plan

    for n, eps, noted in ((800, 1.0, True), (800, 8.0, True), (160_000, 1.0, False), (50_000, 8.0, False)):
        cfg = load_config("configs/ctr.toml", [f"privacy.target_epsilon={eps}"])
        plan = recalibration_plan(cfg, n, min(0.1 / n, n ** -1.1))
        assert bool(plan.get("noise_note")) == noted, (n, eps, plan)
        assert plan["bins"] == recalibration.auto_bins(plan["noise_multiplier"], n)
        assert plan["noise_ratio"] == pytest.approx(recalibration.total_noise_ratio(plan["noise_multiplier"], n, plan["bins"]))
        if noted:
            assert "mostly noise" in plan["noise_note"] and f"{n} training units" in plan["noise_note"]


def _free_platt(centers, totals, positives, iterations: int = 100) -> tuple[float, float]:
    """The unconstrained binned Platt fit (the broken variant): plain Newton on (a, b)."""
    z = np.asarray(centers, dtype=np.float64)
    n = np.clip(np.asarray(totals, dtype=np.float64), 0.0, None)
    pos = np.clip(np.asarray(positives, dtype=np.float64), 0.0, n)
    a, b = 1.0, 0.0
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-(a * z + b)))
        g = np.array([np.sum((n * p - pos) * z), np.sum(n * p - pos)])
        w = n * p * (1 - p) + 1e-9
        h = np.array([[np.sum(w * z * z), np.sum(w * z)], [np.sum(w * z), np.sum(w)]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(h, g)
        a, b = a - step[0], b - step[1]
    return float(a), float(b)
