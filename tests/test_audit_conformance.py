"""Conformance audits (auditing/conformance.py; trainer/run/audit.py `conformance`): the run's
randomness tested against the distribution its claim states — its sampling against Poisson(q),
Gaussian thresholding's selections of rows nobody reads against Φ̄(τ/(σ_sel·C1)). Each real
mechanism passes at the tests' level and each broken one is caught: batches cut from a shuffle
accounted as Poisson (Chua et al. 2024), fixed-size batches, the selection's noise σ_sel/2 while
the ledger is told σ_sel. The ε lower bounds cannot catch the first and the last at these sizes
(RESULTS §27 measures why); the tests of the library first, then whole runs."""

from __future__ import annotations

import numpy as np
import pytest

from widedp.auditing.conformance import (binomial_dispersion_test, combined_refutation, poisson_sampling_test,
                                         threshold_selection_rate, threshold_selection_test)
from widedp.trainer.config import load_config
from widedp.trainer.run.audit import one_run_audit

from test_train_cli import TINY as CLI_TINY


def _poisson_counts(rng, units, steps, q):
    return rng.binomial(steps, q, units)


def _shuffled_counts(rng, units, steps, batches_per_epoch):
    """Each unit once per epoch: full epochs, then the ones whose batch came in a partial epoch."""
    full, rest = divmod(steps, batches_per_epoch)
    return full + (rng.integers(0, batches_per_epoch, units) < rest)


def test_the_dispersion_test_is_exact_at_its_level_under_poisson_sampling():
    """500 correct runs of 300 units over 10 steps at q = 0.3: refuted at level 0.05 in ≤ 8%
    (binomial 95% band around 5% is 3.2–7.0%); the p-values are uniform (KS)."""
    from scipy import stats

    rng = np.random.default_rng(0)
    p = np.array([binomial_dispersion_test(_poisson_counts(rng, 300, 10, 0.3), 10, 0.3, rng, null_draws=399)["p_value"]
                  for _ in range(500)])
    assert 0.02 <= np.mean(p <= 0.05) <= 0.08, np.mean(p <= 0.05)
    assert stats.kstest(p, "uniform").pvalue > 1e-3


def test_the_dispersion_test_catches_shuffled_batches_and_too_much_spread():
    rng = np.random.default_rng(1)
    shuffled = _shuffled_counts(rng, 300, 10, 3)  # q = 1/3, every unit once per epoch
    assert binomial_dispersion_test(shuffled, 10, 1 / 3, rng)["p_value"] <= 0.001
    over = rng.binomial(10, rng.choice([0.05, 0.6], 300))  # mean ≈ q but two kinds of units
    assert binomial_dispersion_test(over, 10, 0.325, rng)["p_value"] <= 0.001
    assert binomial_dispersion_test(np.full(5, 10), 10, 1.0, rng)["p_value"] == 1.0  # q = 1: nothing to test


def test_the_sampling_test_catches_fixed_size_batches_whose_units_look_poisson():
    """Fixed batches of b = q·N drawn afresh each step: each unit's count is Binomial(T, q) as
    under Poisson, but every step's size is b: the per-step half refutes it."""
    rng = np.random.default_rng(2)
    N, q, T = 2000, 0.25, 20
    members = np.zeros(N, np.int64)
    for _ in range(T):
        members[rng.choice(N, int(q * N), replace=False)] += 1
    out = poisson_sampling_test(members[:500], T, [int(q * N)] * T, N, q, rng)
    assert out["per_unit"]["p_value"] > out["level"] and out["per_step"]["p_value"] <= 0.001 and out["refuted"]
    poisson = poisson_sampling_test(rng.binomial(T, q, 500), T, rng.binomial(N, q, T), N, q, np.random.default_rng(3))
    assert not poisson["refuted"], poisson


def test_the_threshold_selection_test_is_exact_at_its_level_and_catches_half_the_noise():
    rng = np.random.default_rng(4)
    tau, sigma, clip = 1.0, 6.0, 1.0
    p = threshold_selection_rate(tau, sigma, clip)
    assert p == pytest.approx(0.4338, abs=1e-4)
    trials = 5000
    refuted = [threshold_selection_test(int(rng.binomial(trials, p)), trials, tau, sigma, clip)["refuted"]
               for _ in range(400)]
    assert np.mean(refuted) <= 0.08, np.mean(refuted)
    halved = threshold_selection_rate(tau, sigma / 2, clip)  # what σ_sel/2 selects
    assert threshold_selection_test(int(rng.binomial(trials, halved)), trials, tau, sigma, clip)["p_value"] < 1e-6
    # observed once at the end: selected in at least one of s steps
    ever = 1 - (1 - p) ** 10
    out = threshold_selection_test(int(rng.binomial(500, ever)), 500, tau, sigma, clip, steps_per_trial=10)
    assert out["expected_rate"] == pytest.approx(ever)


def test_the_combined_refutation_holds_the_family_to_its_level():
    tests = {"a": {"p_value": 0.03}, "b": None,
             "s": {"per_unit": {"p_value": 0.5}, "per_step": {"p_value": 0.01}}}
    out = combined_refutation(tests, 0.95)
    assert out["tests"] == 2 and out["level"] == pytest.approx(0.025)
    assert out["p_values"] == {"a": 0.03, "s": 0.02} and out["refuted"] == ["s"]
    alone = combined_refutation({"s": {"per_unit": {"p_value": 0.04}, "per_step": None}}, 0.95)
    assert alone["p_values"] == {"s": 0.04} and alone["refuted"] == ["s"]
    unit_only = poisson_sampling_test([1, 2, 3], 10, None, 100, 0.2, np.random.default_rng(0))
    assert unit_only["per_step"] is None and unit_only["level"] == pytest.approx(0.05)


def test_the_conformance_tests_refuse_bad_input_by_name():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="counts must lie in"):
        binomial_dispersion_test([0, 11], 10, 0.5, rng)
    with pytest.raises(ValueError, match="rate must be in"):
        binomial_dispersion_test([0, 1], 10, 0.0, rng)
    with pytest.raises(ValueError, match="units_per_step has 2 entries for steps=3"):
        poisson_sampling_test([1], 3, [4, 5], 10, 0.5, rng)
    with pytest.raises(ValueError, match="selected must be an integer in"):
        threshold_selection_test(6, 5, 1.0, 1.0, 1.0)


# ---- whole runs ---------------------------------------------------------------------------------------
# q ≈ 0.4, 10 steps (about 4 epochs), thresholding with τ = 3 against σ_sel = 6: an untouched row
# passes in 31% of steps (in at least one of the 10 in 97.5% of runs); one noise seed, so the correct run's outcome is fixed (its p-values in
# the test's docstring).
CONFORMANCE_AUDIT = [*CLI_TINY, "train.steps=10", "train.batch_size=1450", "privacy.noise_multiplier=5",
                     "train.optimizer=sgd", "train.mode=sparse", "train.selection=threshold",
                     "privacy.selection_sigma=6", "privacy.threshold=3",
                     "privacy.reproducible=true", "privacy.noise_seed=3"]


def _conformance_audit(ctr_dir, broken=None, observe="final", *extra):
    cfg = load_config(None, [f"data.path={ctr_dir}", *CONFORMANCE_AUDIT, *extra]).validate()
    return one_run_audit(cfg, canaries=1000, member_fraction=0.1, non_member_fraction=0.0, seed=7, broken=broken,
                         canary_kind="gradient", observe=observe)


@pytest.mark.parametrize("observe", ["final", "steps"])
def test_a_correct_sparse_run_conforms_to_its_claim(ctr_dir, observe):
    record = _conformance_audit(ctr_dir, None, observe)
    conf = record["conformance"]
    assert conf["sampling"]["per_unit"]["units"] == record["members"]
    assert conf["sampling"]["per_step"]["trials"] == conf["sampling"]["per_step"]["trials"] > 3000
    selection = conf["selection"]
    assert selection["steps_per_trial"] == (1 if observe == "steps" else 10)
    assert selection["trials"] == (record["canaries"] - record["members"]) * (10 if observe == "steps" else 1)
    assert not record["conformance_refuted"], conf


def test_batches_cut_from_a_shuffle_and_accounted_as_poisson_are_caught(ctr_dir):
    record = _conformance_audit(ctr_dir, "shuffle-as-poisson")
    sampling = record["conformance"]["sampling"]
    assert sampling["per_step"]["p_value"] <= 0.001 and sampling["per_unit"]["p_value"] <= 0.001, sampling
    assert record["conformance_refuted"] and "sampling" in record["conformance"]["combined"]["refuted"]
    assert record["conformance"]["selection"]["p_value"] > 0.001  # the selection is untouched by it


@pytest.mark.parametrize("observe", ["final", "steps"])
def test_the_selections_noise_halved_while_the_ledger_is_told_sigma_is_caught(ctr_dir, observe):
    """An untouched row passes τ = 3 in 16% of steps at σ_sel/2 = 3 (in one of 10 in 82%), 31% at
    the stated 6 (97.5%)."""
    record = _conformance_audit(ctr_dir, "selection-sigma-over-2", observe)
    selection = record["conformance"]["selection"]
    assert selection["observed_rate"] < selection["expected_rate"] and selection["p_value"] <= 0.001, selection
    assert record["conformance"]["combined"]["refuted"] == ["selection"]


def test_the_conformance_breaks_are_refused_where_they_mean_nothing_by_name(ctr_dir):
    with pytest.raises(ValueError, match="selection-sigma-over-2 .* train.selection"):
        _conformance_audit(ctr_dir, "selection-sigma-over-2", "final", "train.mode=dpsgd")
    with pytest.raises(ValueError, match="shuffle-as-poisson needs q < 1"):
        _conformance_audit(ctr_dir, "shuffle-as-poisson", "final", "train.batch_size=100000")


# ---- the many-run audit: one canary per independent run ---------------------------------------------
MANY_RUN = [*CLI_TINY, "train.steps=10", "train.batch_size=100000", "privacy.noise_multiplier=auto",
            "privacy.target_epsilon=1", "train.optimizer=sgd", "train.mode=dpsgd"]


@pytest.mark.parametrize("broken", [None, "noise-off"])
def test_the_many_run_audit_over_independent_runs_catches_noise_off_and_not_the_correct_run(ctr_dir, broken):
    """60 runs (q = 1, 10 steps, ε = 1), one trial each: noise off puts every member above every
    non-member (both halves' Clopper–Pearson rates at 0 of ~15: bound ≈ 1.9 (ε, δ), 4+ GDP)."""
    from widedp.trainer.run.audit import many_run_audit

    cfg = load_config(None, [f"data.path={ctr_dir}", *MANY_RUN]).validate()
    spent = []
    record = many_run_audit(cfg, 60, seed=3, broken=broken, on_run=spent.append)
    assert record["kind"] == "many-run" and record["runs"] == 60 and len(spent) == 60
    assert len(record["member_scores"]) + len(record["non_member_scores"]) == 60
    assert 0.9 < record["claimed_epsilon"] <= 1.0
    if broken is None:
        assert record["epsilon_lower_bound"] <= record["claimed_epsilon"], record["threshold_audit"]
    else:
        assert record["exceeds_claim"] and record["epsilon_lower_bound"] > 1.5, record["threshold_audit"]


def test_the_many_run_audit_refuses_runs_that_are_not_independent_by_name(ctr_dir):
    from widedp.trainer.run.audit import many_run_audit

    cfg = load_config(None, [f"data.path={ctr_dir}", *MANY_RUN, "privacy.reproducible=true"]).validate()
    with pytest.raises(ValueError, match="privacy.reproducible = true gives every run the same noise"):
        many_run_audit(cfg, 10)
    with pytest.raises(ValueError, match="--runs must be an integer >= 4"):
        many_run_audit(load_config(None, [f"data.path={ctr_dir}", *MANY_RUN]).validate(), 2)


def test_the_cli_runs_the_many_run_audit_charging_every_run_and_refuses_runs_with_exposure(ctr_dir, tmp_path, capsys):
    import json
    import shutil

    from widedp.trainer.cli import main
    from widedp.trainer.run.budget import read as read_budget

    data = tmp_path / "ctr"
    shutil.copytree(ctr_dir, data)  # its own budget file
    config = tmp_path / "audit.toml"
    config.write_text(f'[data]\npath = "{data}"\n')
    sets = [x for item in [*MANY_RUN, "train.steps=2"] for x in ("--set", item)]
    out = tmp_path / "many"
    assert main(["audit", "--config", str(config), *sets, "--runs", "4", "--canary-kind", "gradient",
                 "--out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "audit.json").read_text())
    assert shown["kind"] == saved["kind"] == "many-run" and saved["runs"] == 4
    assert sum(1 for r in read_budget(data) if r.get("audit")) == 4  # each run charged
    assert main(["audit", "--config", str(config), *sets, "--kind", "exposure", "--runs", "4"]) == 2
    assert "--runs applies to --kind one-run" in capsys.readouterr().err


def test_a_private_audit_withholds_the_step_sizes_unless_the_auditor_opts_in(ctr_dir):
    """Each step's sample size is an un-noised statistic of the secret coins of every example: a
    correct, non-reproducible audit tests the canaries' counts only, and says so."""
    extra = ("privacy.reproducible=false",)
    withheld = _conformance_audit(ctr_dir, None, "final", *extra)
    assert withheld["conformance"]["sampling"]["per_step"] is None
    assert withheld["conformance_step_sizes"] == "withheld"
    assert withheld["conformance"]["notes"]["sampling_step_sizes"].startswith("withheld")
    cfg = load_config(None, [f"data.path={ctr_dir}", *CONFORMANCE_AUDIT, *extra]).validate()
    opted = one_run_audit(cfg, canaries=1000, member_fraction=0.1, non_member_fraction=0.0, seed=7,
                          canary_kind="gradient", test_step_sizes=True)
    assert opted["conformance"]["sampling"]["per_step"]["trials"] > 3000
    assert opted["conformance_step_sizes"].startswith("tested") and "--test-step-sizes" in opted["conformance_step_sizes"]
