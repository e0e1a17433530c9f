"""The one-run audit of whole training runs (trainer/run/audit.py), with teeth: canaries with rows
of their own, trained once; the ε lower bound stays at or below the ledger's claim for correct
runs and rises above it for non-private and deliberately broken ones (DP-SGD with its noise
off while the ledger is told σ; a selection that takes every touched row, or one that never
selects an untouched row, while charging the real selector's event).

DP-SGD with σ ÷ 10 is not caught by example canaries at this size: a canary's row gradient
here is ~0.1 against S1 = 3, so after 40 steps its row moves ~0.014 while σ/10 noise moves
every row ~0.13 (measured: 97 of 200 guesses right). Gradient canaries (`canary_kind =
"gradient"`: the canary's pooled gradient set to 1000·S1 along a secret direction, so its
clipped gradient is ≈ S1 on its own row) catch it, on a configuration where a canary that is a
member is sampled in most steps (q ≈ ½, 10 steps, σ = 5, SGD: Adam's per-coordinate
normalization would hide the noise scale from the row's movement)"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import widedp.trainer.engine.noise_stage as engine_module
from widedp.auditing.canaries import GRADIENT_CANARY_SCALE, as_gradient_canaries, make_canaries
from widedp.trainer.run.audit import WithCanaries, one_run_audit, write_audit
from widedp.trainer.config import load_config
from widedp.trainer.data.format.dataset import open_dataset

from test_train_cli import TINY as CLI_TINY

# 40 steps of batch 64 from ~3,500 examples; σ explicit (no calibration): claimed ε ≈ 1–2.
AUDIT = [*CLI_TINY, "train.steps=40",
         "privacy.noise_multiplier=1.2", "privacy.selection_epsilon=0.05"]
CANARIES = 1000


def _cfg(ctr_dir, *extra):
    return load_config(None, [f"data.path={ctr_dir}", *AUDIT, *extra]).validate()


def _audit(cfg, broken=None, seed=7, non_member_fraction=0.1):
    return one_run_audit(cfg, canaries=CANARIES, member_fraction=0.1, non_member_fraction=non_member_fraction,
                         confidence=0.95, seed=seed, broken=broken)


def test_the_canary_split_returns_base_and_canary_examples_in_the_order_given(ctr_dir):
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    canaries = make_canaries(train.meta, 50, None, np.random.default_rng(1))
    split = WithCanaries(train, canaries)
    n, members = len(train), np.flatnonzero(canaries.included)
    assert len(split) == n + members.size and 10 < members.size < 40
    first = train.meta.features[0]
    assert split.meta.table_sizes[train.meta.feature_tables[first]] == train.meta.table_sizes[canaries.tables[0]] + 50
    idx = np.array([n + 2, 5, n, 0, n + members.size - 1, 7])
    batch = split.take(idx)
    F = len(train.meta.features)
    lengths = batch.sparse.lengths().numpy().reshape(F, -1)
    values = batch.sparse.values().numpy()
    # Base examples: one id per feature; a CTR canary: its own row in the first feature, empty bags elsewhere.
    np.testing.assert_array_equal(lengths[:, [1, 3, 5]], 1)
    np.testing.assert_array_equal(lengths[0, [0, 2, 4]], 1)
    np.testing.assert_array_equal(lengths[1:, [0, 2, 4]], 0)
    starts = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])[:-1].reshape(F, -1)
    base = train.take(np.array([5, 0, 7]))
    base_values = base.sparse.values().numpy().reshape(F, -1)
    np.testing.assert_array_equal(values[starts[:, [1, 3, 5]]], base_values)
    for col, canary in zip([0, 2, 4], members[[2, 0, members.size - 1]]):
        assert values[starts[0, col]] == canaries.first_rows[0] + canary  # its own row
    np.testing.assert_array_equal(batch.dense[[0, 2, 4]].numpy(), 0)
    np.testing.assert_array_equal(batch.dense[[1, 3, 5]].numpy(), base.dense.numpy())
    np.testing.assert_array_equal(batch.labels[[0, 2, 4]].numpy(), 1)
    offsets, ids = split.feature_rows(first)
    assert offsets.size == len(split) + 1 and np.array_equal(ids[n:], canaries.first_rows[0] + members)
    with pytest.raises(IndexError, match="out of range"):
        split.take(np.array([len(split)]))


def test_no_real_example_touches_a_canary_row(ctr_dir):
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    canaries = make_canaries(train.meta, 20, None, np.random.default_rng(2))
    for f in train.meta.features:
        _, ids = train.feature_rows(f)
        if train.meta.feature_tables[f] == canaries.tables[0]:
            assert ids.max() < canaries.first_rows[0]


def test_nonprivate_training_is_flagged(ctr_dir):
    record = _audit(_cfg(ctr_dir, "train.mode=nonprivate"), non_member_fraction=0.0)
    assert record["epsilon_lower_bound"] >= 1.0, record


@pytest.mark.parametrize("mode", ["dpsgd", "sparse"])
def test_correct_private_runs_stay_at_or_below_the_claimed_epsilon(ctr_dir, mode):
    record = _audit(_cfg(ctr_dir, f"train.mode={mode}"))
    assert record["claimed_epsilon"] < 3.0 and not record["stopped_by_budget"]
    assert record["epsilon_lower_bound"] <= record["claimed_epsilon"], record


def test_dpsgd_with_its_noise_off_is_caught(ctr_dir):
    """The ledger is told σ, the steps draw no noise: the canaries' rows move only if members."""
    record = _audit(_cfg(ctr_dir, "train.mode=dpsgd"), broken="noise-off", non_member_fraction=0.0)
    assert record["broken"] == "noise-off"
    assert record["epsilon_lower_bound"] > 2 * record["claimed_epsilon"], record


# q ≈ ½ (≈ 2,400 training examples + ≈ 500 member canaries), 10 steps, σ = 5, plain SGD: ε ≈ 1.2.
GRADIENT_AUDIT = ["train.steps=10", "train.batch_size=1450", "privacy.noise_multiplier=5", "train.optimizer=sgd",
                  "train.mode=dpsgd"]


def test_gradient_canaries_replace_exactly_the_canaries_pooled_gradients(ctr_dir):
    """G·u_i on the canary's own feature, 0 on its other features; real examples untouched;
    example canaries (no directions) pass the gradients through as they are."""
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    plain = make_canaries(train.meta, 30, None, np.random.default_rng(4))
    canaries = as_gradient_canaries(plain, 4, 3.0, np.random.default_rng(5))
    assert canaries.directions.shape == (30, 1, 4)
    np.testing.assert_allclose(np.linalg.norm(canaries.directions[:, 0], axis=1), 1.0, rtol=1e-6)
    assert canaries.gradient_norm == GRADIENT_CANARY_SCALE * 3.0
    split = WithCanaries(train, canaries)
    n, members = len(train), np.flatnonzero(canaries.included)
    idx = np.array([0, n + 1, 9, n])
    features = list(train.meta.features)
    grads = np.random.default_rng(6).normal(size=(idx.size, len(features), 4)).astype(np.float32)
    out = split.override_pooled_grads(idx, grads, features)
    np.testing.assert_array_equal(out[[0, 2]], grads[[0, 2]])
    for row, member in ((1, members[1]), (3, members[0])):
        np.testing.assert_allclose(out[row, 0], 3000.0 * canaries.directions[member, 0], rtol=1e-6)
        np.testing.assert_array_equal(out[row, 1:], 0.0)
    assert WithCanaries(train, plain).override_pooled_grads(idx, grads, features) is grads


def test_dpsgd_with_sigma_divided_by_10_is_caught_by_gradient_canaries(ctr_dir):
    """Measured over 10 runs each: σ/10 gives 195–200 of 200 guesses right, bound 2.88–4.11,
    against ≈ 1.18 claimed; the correct run 115–134 right, bound 0.05–0.45."""
    cfg = _cfg(ctr_dir, *GRADIENT_AUDIT)
    broken = one_run_audit(cfg, canaries=CANARIES, seed=7, broken="sigma-over-10", canary_kind="gradient")
    assert broken["canary_kind"] == "gradient" and broken["steps"] == 10
    assert broken["epsilon_lower_bound"] > broken["claimed_epsilon"] + 1.0, broken["correct"]
    correct = one_run_audit(cfg, canaries=CANARIES, seed=7, canary_kind="gradient")
    assert correct["claimed_epsilon"] < 1.5
    assert correct["epsilon_lower_bound"] <= correct["claimed_epsilon"], correct["correct"]


# Every example in every step (b above n: q = 1), 10 steps of plain SGD, σ calibrated to ε = 4:
# the claim is exactly μ-GDP (μ = √10/σ), the null of the Gaussian-DP bound.
# Reproducible noise (a fixed noise seed, tests only): a correct run's bound comes within a few
# percent of its claim and may exceed it in up to 5% of runs by design (95% confidence; the
# benchmark counts how often), so a suite assertion that it stays below needs the same noise
# every time; the measured spreads over fresh noise are in the docstrings and RESULTS §27.
FULL_BATCH_AUDIT = ["train.steps=10", "train.batch_size=100000", "privacy.target_epsilon=4",
                    "privacy.noise_multiplier=auto", "train.optimizer=sgd", "train.mode=dpsgd",
                    "privacy.reproducible=true", "privacy.noise_seed=3"]
STEP_CANARIES = 10_000


def _step_audit(cfg, broken=None, seed=7, channel="as-run"):
    return one_run_audit(cfg, canaries=STEP_CANARIES, member_fraction=0.05, non_member_fraction=0.0, confidence=0.95,
                         seed=seed, broken=broken, canary_kind="gradient", observe="steps", channel=channel)


def test_a_correct_full_batch_dpsgd_run_audited_every_step_reaches_half_its_claim_and_stays_below_it(ctr_dir):
    """Measured over 6 runs (10,000 gradient canaries, 500 member guesses): Gaussian-DP bound
    2.07–2.60 (0.52–0.65 of the claimed 3.99), (ε, δ) bound 1.59–1.97; at the suite's noise seed
    2.39, and the threshold bound 3.55."""
    record = _step_audit(_cfg(ctr_dir, *FULL_BATCH_AUDIT))
    assert record["observe"] == "steps" and record["threat_model"].startswith("intermediate releases")
    assert record["sample_rate"] == 1.0 and record["gdp_null"].startswith("exact") and record["steps"] == 10
    assert 3.9 < record["claimed_epsilon"] <= 4.0
    assert record["epsilon_lower_bound"] <= record["claimed_epsilon"], record
    assert record["epsilon_lower_bound_gdp"] <= record["claimed_epsilon"], record
    assert record["epsilon_lower_bound_gdp"] >= 0.4 * record["claimed_epsilon"], record
    threshold = record["threshold_audit"]["gdp"]
    assert threshold["members"] + threshold["non_members"] < record["canaries"], threshold  # the counted half only
    assert threshold["epsilon_lower_bound_gdp"] <= record["claimed_epsilon"], threshold
    assert threshold["epsilon_lower_bound_gdp"] >= 0.6 * record["claimed_epsilon"], threshold


@pytest.mark.parametrize("broken", ["sigma-over-2", "clip-doubled"])
def test_subtle_breaks_of_dpsgd_are_caught_by_the_every_step_audit(ctr_dir, broken):
    """σ/2 (the ledger told σ) and clipping to 2·S1 (the noise sized for S1): ε roughly doubles.
    Measured over 6 runs each: Gaussian-DP bound 5.10–7.30 (σ/2) and 4.67–5.77 (2·S1) against
    3.99 claimed — 494–500 of 500 member guesses right."""
    record = _step_audit(_cfg(ctr_dir, *FULL_BATCH_AUDIT), broken=broken)
    assert record["broken"] == broken
    assert record["gdp_exceeds_claim"] and record["epsilon_lower_bound_gdp"] > record["claimed_epsilon"] + 0.3, record


@pytest.mark.parametrize("broken", [None, "sigma-over-2"])
def test_at_a_claimed_epsilon_of_8_the_threshold_audit_catches_sigma_over_2_where_the_one_run_bound_cannot(
        ctr_dir, broken):
    """At ε = 8 the one-run bounds with 500 member guesses are capped below the claim (all 500
    right gives 7.3), so σ/2 is invisible to them; the threshold audit over the canaries as
    independent trials is not capped that way. Measured (benchmarks/audit_power.py, 2 runs each):
    correct 7.22 (0.91 of the claimed 7.98; 7.36 at the suite's noise seed), σ/2 17.8."""
    record = _step_audit(_cfg(ctr_dir, *FULL_BATCH_AUDIT, "privacy.target_epsilon=8"), broken=broken)
    claimed, threshold = record["claimed_epsilon"], record["threshold_audit"]["gdp"]["epsilon_lower_bound_gdp"]
    assert 7.9 < claimed <= 8.0
    assert record["epsilon_lower_bound_gdp"] <= claimed, record  # the one-run cap, broken or not
    if broken is None:
        assert 0.6 * claimed <= threshold <= claimed, record["threshold_audit"]
    else:
        assert threshold > claimed + 2.0, record["threshold_audit"]


SPARSE_VALUE_AUDIT = [*FULL_BATCH_AUDIT, "train.mode=sparse", "train.selection=threshold", "privacy.dense_max_rows=1"]


def test_the_value_channel_puts_every_canary_row_in_every_selection(ctr_dir):
    """As run, a sparse step moves a canary row only when its selection picks it: after one step
    almost every non-member's row is where it started (score exactly 0). With `--channel value`
    every canary row receives the step's noisy value, member or not."""
    cfg = _cfg(ctr_dir, *SPARSE_VALUE_AUDIT, "train.steps=1")
    runs = {channel: one_run_audit(cfg, canaries=200, member_fraction=0.1, non_member_fraction=0.0, seed=3,
                                   canary_kind="gradient", channel=channel) for channel in ("as-run", "value")}
    unmoved = {channel: int(np.sum(np.asarray(r["non_member_scores"]) == 0.0)) for channel, r in runs.items()}
    assert unmoved["value"] == 0 and unmoved["as-run"] >= 0.9 * len(runs["as-run"]["non_member_scores"]), unmoved
    assert runs["value"]["channel"] == "value" and runs["value"]["channel_audited"].startswith("the value channel")
    assert runs["as-run"]["value_claimed_epsilon"] is None
    # the canaries' rows added to the selection change nothing the ledger charges
    assert runs["value"]["claimed_epsilon"] == pytest.approx(runs["as-run"]["claimed_epsilon"], rel=1e-9)


def test_a_sparse_runs_value_channel_audited_every_step_reaches_half_its_claim_at_epsilon_8(ctr_dir):
    """Threshold selection, q = 1, 10 steps. Measured (seeds 7, 8): threshold GDP bound
    6.33–6.75 against 7.98 claimed (6.97 for the value events alone), one-run GDP 4.17–4.34 (at the
    suite's noise seed: 4.95); the run as it executes shows little (a canary's count of 1 rarely
    passes the calibrated τ)."""
    from widedp.auditing.fdp_one_run import gdp_epsilon

    record = _step_audit(_cfg(ctr_dir, *SPARSE_VALUE_AUDIT, "privacy.target_epsilon=8"), channel="value")
    claimed, value = record["claimed_epsilon"], record["value_claimed_epsilon"]
    # the value events alone: T Gaussian steps at q = 1 are exactly √T/σ-GDP, which the accountant
    # can only over-state; the selection's events make up the rest of the claim
    exact = gdp_epsilon(math.sqrt(record["steps"]) / record["noise_multiplier"], record["delta"])
    assert exact <= value * (1 + 1e-6) and value <= 1.05 * exact and value < claimed <= 8.0, (exact, value, claimed)
    threshold = record["threshold_audit"]["gdp"]["epsilon_lower_bound_gdp"]
    assert 0.5 * claimed <= threshold <= claimed, record["threshold_audit"]
    assert record["epsilon_lower_bound"] <= claimed and record["epsilon_lower_bound_gdp"] <= claimed, record


def test_sigma_over_2_on_a_sparse_runs_values_is_caught_by_the_value_channel(ctr_dir):
    """At a claimed ε = 3.99 (3.51 for the values). Measured (seeds 7, 8): threshold GDP bound
    6.96–7.65, one-run GDP 4.67–4.94."""
    record = _step_audit(_cfg(ctr_dir, *SPARSE_VALUE_AUDIT), broken="sigma-over-2", channel="value")
    threshold = record["threshold_audit"]["gdp"]["epsilon_lower_bound_gdp"]
    assert threshold > record["claimed_epsilon"] + 1.0, record["threshold_audit"]


def test_the_value_channel_is_refused_where_it_means_nothing_by_name(ctr_dir):
    with pytest.raises(ValueError, match="--channel value audits sparse mode.*'dpsgd'"):
        one_run_audit(_cfg(ctr_dir, "train.mode=dpsgd", "train.steps=1"), canaries=10, channel="value")
    sparse = _cfg(ctr_dir, "train.mode=sparse", "train.steps=1")
    with pytest.raises(ValueError, match="--broken skip-untouched"):
        one_run_audit(sparse, canaries=10, channel="value", broken="skip-untouched")
    with pytest.raises(ValueError, match="--channel must be one of"):
        one_run_audit(sparse, canaries=10, channel="values")
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    table = train.meta.feature_tables[train.meta.features[0]]
    dense = _cfg(ctr_dir, "train.mode=sparse", "train.steps=1", f"privacy.tables.{table}=dense")
    with pytest.raises(ValueError, match=f"--channel value needs the canaries' table.*privacy.tables.{table}"):
        one_run_audit(dense, canaries=10, channel="value")


@pytest.mark.parametrize("broken", [None, "sigma-over-2"])
def test_at_q_one_half_the_claims_own_curve_refutes_sigma_over_2_and_not_the_correct_run(ctr_dir, broken):
    """q ≈ ½, where the Gaussian-DP bounds are approximate and the (ε, δ) bound at the stated δ
    stays far below a claimed 4: the same jointly bounded rates tested against the run's own
    accountant at δ ∈ {stated, 10⁻³, 10⁻², 10⁻¹} refute σ/2. Measured (fresh noise, one run each):
    correct max ε̂/ε 0.71, σ/2 2.00 (ε̂ 1.65 against 0.82 claimed at δ = 0.1)."""
    record = _step_audit(_cfg(ctr_dir, *FULL_BATCH_AUDIT, "train.batch_size=3700"), broken=broken)
    curve = record["claim_curve"]
    assert 0.4 < record["sample_rate"] < 0.6 and curve["rates_from"] == "gdp_at_claimed_threshold"
    assert [p[0] for p in curve["points"]] == sorted({record["delta"], 1e-3, 1e-2, 1e-1})
    assert curve["points"][0][1] == pytest.approx(record["claimed_epsilon"])  # the stated δ's ε is the claim
    if broken is None:
        assert not curve["refuted"] and curve["ratio"] < 1.0, curve
    else:
        assert curve["refuted"] and curve["ratio"] > 1.5, curve
        assert record["epsilon_lower_bound"] < record["claimed_epsilon"]  # the stated δ alone does not see it


def test_delta_taken_as_one_over_n_is_caught_by_the_threshold_fixed_from_the_claim(ctr_dir):
    """σ calibrated, the budget checked and ε computed at δ = 1/n while the run states the auto δ
    (1/(10n)): the true ε at the stated δ is ~14% above the claim at ε = 8 — a subtle under-count.
    With 40,000 canaries and every step observed (q = 1), the threshold fixed from the claimed
    mechanism counts every canary. Measured over 8 runs of each: correct 7.59–7.86 against 7.98
    claimed, δ = 1/n 8.43–8.83 against 7.97; the half-split threshold bound caught 7 of 8.
    Reproducible noise (a fixed noise seed) makes the outcome the same on every run of the suite."""
    cfg = _cfg(ctr_dir, *FULL_BATCH_AUDIT, "privacy.target_epsilon=8", "privacy.reproducible=true",
               "privacy.noise_seed=11")
    runs = {broken: one_run_audit(cfg, canaries=40_000, member_fraction=0.05, non_member_fraction=0.0, seed=5,
                                  broken=broken, canary_kind="gradient", observe="steps")
            for broken in (None, "delta-one-over-n")}
    correct, broken = runs[None], runs["delta-one-over-n"]
    assert broken["delta"] == correct["delta"] and correct["delta"] < 1e-4  # the stated (auto) δ, both runs
    assert broken["noise_multiplier"] < 0.95 * correct["noise_multiplier"]  # calibrated at the larger δ
    assert 7.9 < broken["claimed_epsilon"] <= 8.0 and 7.9 < correct["claimed_epsilon"] <= 8.0
    fixed = {k: r["threshold_audit"]["gdp_at_claimed_threshold"] for k, r in runs.items()}
    assert fixed[None]["chosen_by"] == "claim" and fixed[None]["members"] + fixed[None]["non_members"] == 40_000
    assert fixed[None]["epsilon_lower_bound_gdp"] <= correct["claimed_epsilon"], fixed[None]
    assert fixed["delta-one-over-n"]["epsilon_lower_bound_gdp"] > broken["claimed_epsilon"] + 0.2, fixed


def test_delta_one_over_n_is_refused_where_delta_is_not_auto_by_name(ctr_dir):
    with pytest.raises(ValueError, match="--broken delta-one-over-n replaces privacy.delta"):
        one_run_audit(_cfg(ctr_dir, "train.mode=dpsgd", "train.steps=1", "privacy.delta=1e-6"), canaries=10,
                      broken="delta-one-over-n")


def test_the_every_step_audit_refuses_example_canaries_and_nonprivate_runs_by_name(ctr_dir):
    cfg = _cfg(ctr_dir, "train.steps=1")
    with pytest.raises(ValueError, match="--observe steps .* --canary-kind gradient"):
        one_run_audit(cfg, canaries=10, observe="steps")
    with pytest.raises(ValueError, match="--observe must be one of"):
        one_run_audit(cfg, canaries=10, observe="sometimes")
    with pytest.raises(ValueError, match="nonprivate run"):
        one_run_audit(_cfg(ctr_dir, "train.steps=1", "train.mode=nonprivate"), canaries=10, observe="steps",
                      canary_kind="gradient")


def test_a_selection_that_takes_every_touched_row_is_caught(ctr_dir):
    """Measured over 9 runs: 93–97 of the 100 member guesses right (non-members' rows move too
    when the threshold passes pure noise), bound 1.90–2.47 against 1.06 claimed; failing the
    margin below needs ≤ 87 right."""
    record = _audit(_cfg(ctr_dir, "train.mode=sparse"), broken="every-touched-row", non_member_fraction=0.0)
    assert record["epsilon_lower_bound"] > record["claimed_epsilon"] + 0.4, record


# q ≈ ½, 10 steps, thresholding with a low τ = 1 against σ_sel = 6: a touched canary row passes
# in about half its steps, an untouched one in about a third (the false positives that keep the
# correct run private); claimed ε ≈ 1.6.
SKIP_UNTOUCHED_AUDIT = ["train.steps=10", "train.batch_size=1450", "privacy.noise_multiplier=5", "train.optimizer=sgd",
                        "train.mode=sparse", "train.selection=threshold", "privacy.selection_sigma=6",
                        "privacy.threshold=1"]


def test_a_selection_that_skips_untouched_rows_is_caught_and_the_correct_one_is_not(ctr_dir):
    """The mistake DESIGN §1 step 3 warns of: untouched rows are never selected, so a canary's
    row that moves was touched, i.e. the canary is a member. Measured (seeds 7, 8): 100 of 100
    member guesses right, bound 3.41 against 1.62 claimed; the correct selection 56–58 right,
    bound 0."""
    cfg = _cfg(ctr_dir, *SKIP_UNTOUCHED_AUDIT)
    broken = _audit(cfg, broken="skip-untouched", non_member_fraction=0.0)
    assert broken["broken"] == "skip-untouched"
    assert broken["epsilon_lower_bound"] > broken["claimed_epsilon"] + 1.0, broken
    correct = _audit(cfg, non_member_fraction=0.0)
    assert correct["claimed_epsilon"] < 2.0
    assert correct["epsilon_lower_bound"] <= correct["claimed_epsilon"], correct


def test_a_sparse_run_audited_every_step_as_it_runs_scores_the_selection_and_catches_skipped_untouched_rows(ctr_dir):
    """As run, a sparse step moves a canary row only when it selects it: the every-step score is
    the number of steps the row was selected, its values breaking ties. Measured (seed 7, 1,000
    gradient canaries): correct 0.0 (one-run and threshold) against 1.45 claimed; skip-untouched
    threshold GDP 18.9, one-run GDP 5.22 — non-members' rows never move."""
    cfg = _cfg(ctr_dir, *SKIP_UNTOUCHED_AUDIT)
    runs = {broken: one_run_audit(cfg, canaries=CANARIES, member_fraction=0.1, non_member_fraction=0.0, seed=7,
                                  broken=broken, canary_kind="gradient", observe="steps")
            for broken in (None, "skip-untouched")}
    correct, broken = runs[None], runs["skip-untouched"]
    assert correct["score"].startswith("white box, every step, sparse as run")
    assert "gdp_at_claimed_threshold" not in correct["threshold_audit"]  # not the claim's likelihood ratio
    claimed = correct["claimed_epsilon"]
    assert max(correct["epsilon_lower_bound_gdp"], correct["threshold_audit"]["gdp"]["epsilon_lower_bound_gdp"]) <= claimed
    assert max(broken["non_member_scores"]) == 0.0  # a non-member's row is touched by nobody: never selected
    assert broken["threshold_audit"]["gdp"]["epsilon_lower_bound_gdp"] > claimed + 2.0, broken["threshold_audit"]
    assert broken["epsilon_lower_bound_gdp"] > claimed + 1.0, broken["epsilon_lower_bound_gdp"]


def test_the_broken_variants_leave_the_engine_as_it_was(ctr_dir):
    cfg = _cfg(ctr_dir, "train.mode=sparse", "train.steps=2")
    before = engine_module.noisy_step
    one_run_audit(cfg, canaries=10, broken="noise-off", seed=1)
    assert engine_module.noisy_step is before
    with pytest.raises(ValueError, match="--broken must be one of"):
        one_run_audit(cfg, canaries=10, broken="sigma-off")


def test_audit_writes_its_record_and_plot(ctr_dir, tmp_path):
    record = one_run_audit(_cfg(ctr_dir, "train.mode=sparse", "train.steps=5"), canaries=40, seed=1)
    shown = write_audit(record, tmp_path / "audit")
    saved = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert (tmp_path / "audit" / "audit.png").stat().st_size > 0
    assert saved["canaries"] == 40 and len(saved["member_scores"]) == saved["members"]
    assert "member_scores" not in shown and shown["claimed_epsilon"] == saved["claimed_epsilon"]
    assert torch.isfinite(torch.tensor(saved["epsilon_lower_bound"]))


def test_the_cli_writes_audit_json_and_refuses_a_bad_flag_by_name(ctr_dir, tmp_path, capsys):
    from widedp.trainer.cli import main

    config = tmp_path / "audit.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    sets = [x for item in [*AUDIT, "train.mode=nonprivate", "train.steps=10"] for x in ("--set", item)]
    out = tmp_path / "cli_audit"
    assert main(["audit", "--config", str(config), *sets, "--canaries", "200",
                 "--non-member-guesses", "0", "--out", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "audit.json").read_text())
    assert shown["out"] == str(out) and saved["kind"] == "one-run" and saved["canaries"] == 200
    assert saved["guesses_member"] == 20 and saved["guesses_non_member"] == 0
    assert main(["audit", "--config", str(config), *sets, "--canaries", "1"]) == 2
    assert "--canaries must be an integer >= 2" in capsys.readouterr().err
    private = [x for item in [*AUDIT, "train.mode=dpsgd", "train.steps=3", "train.optimizer=sgd"] for x in ("--set", item)]
    assert main(["audit", "--config", str(config), *private, "--canaries", "200", "--canary-kind", "gradient",
                 "--observe", "steps", "--non-member-guesses", "0", "--out", str(tmp_path / "steps")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["observe"] == "steps" and shown["steps"] == 3 and shown["epsilon_lower_bound_gdp"] >= 0.0
    assert main(["audit", "--config", str(config), *sets, "--observe", "everything"]) == 2
    assert "--observe" in capsys.readouterr().err


def test_audit_refuses_bad_parameters_naming_them(ctr_dir):
    cfg = _cfg(ctr_dir, "train.steps=1")
    with pytest.raises(ValueError, match="--canaries"):
        one_run_audit(cfg, canaries=1)
    with pytest.raises(ValueError, match="--confidence"):
        one_run_audit(cfg, canaries=10, confidence=1.0)
    with pytest.raises(ValueError, match="--member-guesses"):
        one_run_audit(cfg, canaries=10, member_fraction=1.5)
    with pytest.raises(ValueError, match="must make 1 to 10 guesses"):
        one_run_audit(cfg, canaries=10, member_fraction=0.0, non_member_fraction=0.0)
    with pytest.raises(ValueError, match="audit feature 'nope'"):
        one_run_audit(cfg, canaries=10, feature="nope")
    with pytest.raises(ValueError, match="--canary-kind must be one of"):
        one_run_audit(cfg, canaries=10, canary_kind="dirac")


# ---- the seed's canary exposure test (wide-network-dp §6.5) ---------------------------------------------
@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from widedp.trainer.data.synthetic.synth import synth_text

    path = tmp_path_factory.mktemp("text") / "cbow"
    synth_text(path, num_examples=4000, vocab=200, seed=5, negatives=2)
    return path


def test_phrase_log_perplexity_is_the_sum_of_the_models_next_word_log_probabilities():
    """The vectorized P(c) equals the slow per-phrase sum −log Pr(c1|c0) − log Pr(c2|c0,c1)
    with Pr(w | context) the softmax of o_w · mean(context input rows)."""
    from widedp.auditing.canary_exposure import log_perplexity
    from widedp.auditing.scores import phrase_log_perplexities

    rng = np.random.default_rng(0)
    inputs, outputs = rng.normal(size=(30, 5)), rng.normal(size=(30, 5))
    phrases = rng.integers(0, 30, (6, 3))

    def log_prob(context):  # the empty context (c0's term, not in the seed's P(c)): uniform
        logits = outputs @ inputs[list(context)].mean(0) if context else np.zeros(30)
        return logits - np.log(np.exp(logits).sum())

    want = [log_perplexity(log_prob, tuple(p)) - np.log(30) for p in phrases]
    np.testing.assert_allclose(phrase_log_perplexities(inputs, outputs, phrases), want, rtol=1e-12)


def test_each_inserted_phrase_is_three_examples_per_insertion(text_dir):
    from widedp.auditing.canaries import make_phrase_examples

    train, _ = open_dataset(text_dir, test_fraction=0.2, seed=0)
    examples = make_phrase_examples(train.meta, np.array([[3, 4, 5]]), 2, np.random.default_rng(0))
    assert examples.count == 6 and examples.included.all() and examples.tables == ()
    np.testing.assert_array_equal(examples.ids["target"][:3, 0], [3, 4, 5])
    np.testing.assert_array_equal(examples.ids["context"][:3], [[4, 5], [3, 5], [3, 4]])
    split = WithCanaries(train, examples)
    assert len(split) == len(train) + 6 and split.meta.table_sizes == train.meta.table_sizes
    with pytest.raises(ValueError, match="--kind exposure needs a CBOW"):
        make_phrase_examples(dataclasses.replace(train.meta, kind="ctr"), np.array([[1, 2, 3]]), 1,
                             np.random.default_rng(0))


def test_a_phrase_inserted_into_text_is_every_example_within_the_window_of_it(text_dir):
    """Placement "text" (seed §6.5): one insertion of (c0, c1, c2) between corpus words gives the
    2w + 3 examples within ±w of it, each with its ±w neighbours as context in text order —
    the same examples the corpus windowing makes of that stretch of text."""
    from widedp.auditing.canaries import make_phrase_examples
    from widedp.trainer.data.convert.text import cbow_examples

    train, _ = open_dataset(text_dir, test_fraction=0.2, seed=0)
    w = train.meta.extra["window"]
    corpus_words = np.array([500, 501, 502, 503, 504, 505, 506])  # not vocabulary ids: easy to tell apart
    examples = make_phrase_examples(train.meta, np.array([[3, 4, 5]]), 2, np.random.default_rng(0), "text",
                                    corpus_words)
    per = 2 * w + 3
    assert examples.count == 2 * per and examples.ids["context"].shape == (2 * per, 2 * w)
    targets, context = examples.ids["target"][:per, 0], examples.ids["context"][:per]
    np.testing.assert_array_equal(targets[w: w + 3], [3, 4, 5])
    assert np.isin(targets[:w], corpus_words).all() and np.isin(targets[w + 3:], corpus_words).all()
    # Rebuild the stretch of text (2w neighbours each side) and window it the corpus's way.
    text = np.concatenate([context[0, :w], targets, context[-1, w:]])
    lengths, values, windowed_targets = cbow_examples(text, np.zeros(text.size, np.int64), w, w + per, w)
    np.testing.assert_array_equal(windowed_targets, targets)
    np.testing.assert_array_equal(values.reshape(per, 2 * w), context)
    assert (lengths == 2 * w).all()
    with pytest.raises(ValueError, match="--placement must be one of"):
        make_phrase_examples(train.meta, np.array([[3, 4, 5]]), 1, np.random.default_rng(0), "margin")
    with pytest.raises(ValueError, match="needs the corpus's words"):
        make_phrase_examples(train.meta, np.array([[3, 4, 5]]), 1, np.random.default_rng(0), "text")


def _text_cfg(text_dir, *extra):
    return load_config("configs/cbow.toml", [f"data.path={text_dir}", "data.synth=", "cluster.backend=local",
                                             "model.embedding_dim=8", "train.batch_size=128", "train.steps=60",
                                             *extra]).validate()


def test_exposure_flags_nonprivate_training_and_not_a_private_run_at_one_insertion(text_dir):
    """Non-private: phrases inserted 9 times as lines of their own rank near the top (χ² p <
    1e-6). Private at ε = 1
    with one insertion (the example-level guarantee covers it): ranks look uniform — p > 1e-4,
    not the audit's 0.01, so that a correct run's own 1% false alarms do not fail CI."""
    from widedp.trainer.run.audit import exposure_audit

    loud = exposure_audit(_text_cfg(text_dir, "train.mode=nonprivate"), canaries=100, insertions=9, references=2000,
                          seed=3, placement="line")
    assert loud["flagged"] and loud["p_value"] < 1e-6 and loud["mean_exposure"] > 2, loud["p_value"]
    quiet = exposure_audit(_text_cfg(text_dir, "train.mode=dpsgd", "privacy.target_epsilon=1.0"), canaries=100,
                           insertions=1, references=2000, seed=3)
    assert quiet["p_value"] > 1e-4 and quiet["claimed_epsilon"] <= 1.0 + 1e-6, quiet["p_value"]


def test_exposure_flags_nonprivate_training_with_phrases_inserted_into_the_text(text_dir):
    """The seed's placement: each insertion is 11 examples whose contexts mix the phrase with
    corpus words (window 4). Measured over 6 runs of 200 steps: p 2e-6 to 1e-3."""
    from widedp.trainer.run.audit import exposure_audit

    loud = exposure_audit(_text_cfg(text_dir, "train.mode=nonprivate", "train.steps=200"), canaries=100,
                          insertions=9, references=2000, seed=3)
    assert loud["placement"] == "text" and loud["flagged"], loud["p_value"]


def test_exposure_refuses_a_ctr_data_set_by_name(ctr_dir):
    from widedp.trainer.run.audit import exposure_audit

    with pytest.raises(ValueError, match="--kind exposure needs a CBOW"):
        exposure_audit(_cfg(ctr_dir, "train.steps=1"), canaries=10, references=100)


def test_an_adaptive_s1_run_stays_within_its_claim_and_its_sigma_over_10_is_caught(ctr_dir):
    """privacy.clip_norm = "adaptive": DP-STAT's counts are charged with each step; the audit of
    the trained model (gradient canaries, clipped at each step's S1) stays at or below the claim,
    and the same run with σ/10 is caught. Measured (seeds 7–9): claimed 1.68–1.69, correct bound
    0.16–0.30, σ/10 bound 3.40–3.68 (198–199 of 200 right)."""
    cfg = _cfg(ctr_dir, *GRADIENT_AUDIT, "privacy.clip_norm=adaptive", "privacy.adaptive_clip_noise=20")
    correct = one_run_audit(cfg, canaries=CANARIES, seed=7, canary_kind="gradient")
    assert correct["claimed_epsilon"] < 2.0  # σ = 5 and the counts (noise 20, 13 of them): ≈ 1.7
    assert correct["epsilon_lower_bound"] <= correct["claimed_epsilon"], correct["correct"]
    broken = one_run_audit(cfg, canaries=CANARIES, seed=7, broken="sigma-over-10", canary_kind="gradient")
    assert broken["epsilon_lower_bound"] > broken["claimed_epsilon"] + 1.0, broken["correct"]


def test_all_feature_canaries_read_a_row_of_their_own_in_every_table_and_nothing_else(ctr_dir):
    """`--feature all`: canary i reads row first_rows[f] + i through every feature f; every
    table grows by m rows; a gradient canary's G·u_i spans all its features (‖u_i‖ = 1 over
    them together)."""
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    features = list(train.meta.features)
    canaries = make_canaries(train.meta, 30, "all", np.random.default_rng(3))
    assert canaries.features == tuple(features) and len(set(canaries.tables)) == len(features)
    split = WithCanaries(train, canaries)
    for table, first in zip(canaries.tables, canaries.first_rows):
        assert first == train.meta.table_sizes[table] and split.meta.table_sizes[table] == first + 30
    n, members = len(train), np.flatnonzero(canaries.included)
    batch = split.take(np.array([n + 1, 0, n]))
    F = len(features)
    lengths = batch.sparse.lengths().numpy().reshape(F, -1)
    np.testing.assert_array_equal(lengths, 1)
    values = batch.sparse.values().numpy().reshape(F, -1)
    np.testing.assert_array_equal(values[:, 0], np.array(canaries.first_rows) + members[1])
    np.testing.assert_array_equal(values[:, 2], np.array(canaries.first_rows) + members[0])
    gradient = as_gradient_canaries(canaries, 4, 2.0, np.random.default_rng(5))
    assert gradient.directions.shape == (30, F, 4)
    np.testing.assert_allclose(np.linalg.norm(gradient.directions.reshape(30, -1), axis=1), 1.0, rtol=1e-6)
    grads = np.ones((3, F, 4), np.float32)
    out = WithCanaries(train, gradient).override_pooled_grads(np.array([n + 1, 0, n]), grads, features)
    np.testing.assert_allclose(out[0], 2000.0 * gradient.directions[members[1]], rtol=1e-6)
    np.testing.assert_array_equal(out[1], 1.0)
    with pytest.raises(ValueError, match="share a table"):
        make_canaries(train.meta, 10, f"{features[0]},{features[0]}", np.random.default_rng(0))


def test_a_selection_rewrite_on_a_densely_noised_canary_table_is_refused_by_name(ctr_dir):
    """A dense table's rows are noised and updated every step, outside the selection: a broken
    selection could not show on its canaries, so the audit says so instead of passing."""
    train, _ = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    table = train.meta.feature_tables[train.meta.features[0]]
    cfg = _cfg(ctr_dir, "train.mode=sparse", "train.steps=1", f"privacy.tables.{table}=dense")
    with pytest.raises(ValueError, match=f"privacy.tables.{table}"):
        one_run_audit(cfg, canaries=10, broken="skip-untouched", seed=1)
    record = one_run_audit(cfg, canaries=10, seed=1)
    assert record["canary_table_policy"] == {table: "dense"}


def test_canaries_with_a_row_in_every_table_catch_a_selection_that_skips_untouched_rows(ctr_dir):
    """The config's own calibrated thresholding (ε = 8, auto τ), 200 steps, `--feature all`, 3%
    member guesses. Measured (seeds 7, 8): skip-untouched 30 of 30 right, bound 2.16; the
    correct selection 17 of 30, bound 0. The full-size CTR rows are in RESULTS §7b."""
    cfg = _cfg(ctr_dir, "train.steps=200", "train.mode=sparse", "train.selection=threshold",
               "privacy.target_epsilon=8", "privacy.noise_multiplier=auto", "privacy.selection_epsilon=auto")
    kwargs = dict(canaries=CANARIES, member_fraction=0.03, non_member_fraction=0.0, confidence=0.95, seed=7,
                  feature="all")
    broken = one_run_audit(cfg, broken="skip-untouched", **kwargs)
    assert broken["tables"] == [f"t_{i}" for i in range(26)] and broken["guesses"] == 30
    assert broken["epsilon_lower_bound"] >= 1.5, broken["correct"]
    correct = one_run_audit(cfg, **kwargs)
    assert correct["epsilon_lower_bound"] <= correct["claimed_epsilon"], correct["correct"]


def test_canary_rows_in_every_table_are_refused_for_a_cbow_data_set_by_name(text_dir):
    """A CBOW example reads the output table through its target and negatives, so it cannot
    touch only rows of its own: `--feature all` says so instead of building something else."""
    train, _ = open_dataset(text_dir, test_fraction=0.2, seed=0)
    with pytest.raises(ValueError, match="--feature all needs a CTR data set"):
        make_canaries(train.meta, 10, "all", np.random.default_rng(0))
    one = make_canaries(train.meta, 10, None, np.random.default_rng(0))
    assert one.features == ("context",) and one.ids["target"].shape == (10, 1)
