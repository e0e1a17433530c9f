"""DP standardization statistics (trainer/data/dp_statistics.py): the release's privacy audit
beside a broken variant, its sensitivity attained by a real example, its post-processing
against numpy, and the converter recording and applying it.

Audit construction (add/remove one, the module's contract): D' is any data set, D adds one
example at the top of every clip range, which moves the moment-sum vector by v = (1, 1, …, 1)
(2F entries), |v| = √(2F) = Δ. Projected on v/|v| the release is a 1-D Gaussian with shift Δ
and noise σΔ (μ = 1/σ), and the half-space event {⟨out − sums(D'), v⟩/|v| ≥ σΔ·x*(ε)} is the
optimal event at ε: P_D − e^ε P_D' = δ(ε) exactly, so the audit is tight. The broken variant
sizes the noise for the means' part of Δ only (√F), forgetting the squares'."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from privacy_audit import EventCounts, epsilon_lower_bound, gaussian_delta, gaussian_optimal_threshold

from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.data import dp_statistics as dps
from widedp.trainer.data.dataset import open_dataset
from widedp.trainer.data.table import convert_table

SIGMA, EPS, TRIALS = 1.0, 1.0, 30_000  # expected eps_lb ≈ 0.8 (real), ≈ 1.6 (broken)
RANGES = [dps.ClipRange(0.0, 100.0), dps.ClipRange(-2.0, 6.0)]


def _neighbours():
    rng = np.random.default_rng(5)
    base = np.stack([rng.uniform(r.lo, r.hi, 40) for r in RANGES], axis=1)
    extreme = np.array([[r.hi for r in RANGES]])
    d_prime = dps.moment_sums(dps.normalized(base, RANGES))
    d = dps.moment_sums(dps.normalized(np.concatenate([base, extreme]), RANGES))
    return d, d_prime


def _audit(release, seed: int):
    d, d_prime = _neighbours()
    v = d - d_prime
    delta_l2 = dps.sensitivity(len(RANGES))
    assert np.linalg.norm(v) == pytest.approx(delta_l2)  # the worst case is attained by a real example
    unit = v / np.linalg.norm(v)
    t = SIGMA * delta_l2 * gaussian_optimal_threshold(EPS, 1.0 / SIGMA)
    counts = []
    for sums, key in ((d, seed), (d_prime, seed + 1)):
        rng = NoiseKey(key).generator()
        hits = sum(float((release(sums, SIGMA, rng) - d_prime) @ unit) >= t for _ in range(TRIALS))
        counts.append(EventCounts(hits, TRIALS))
    return epsilon_lower_bound(counts[0], counts[1], delta=gaussian_delta(EPS, 1.0 / SIGMA))


def _noise_for_the_means_only(sums, noise_multiplier, rng):
    """Broken: noise for sensitivity √F (the sums of u) instead of √(2F) (u and u²)."""
    return dps.noisy_moment_sums(sums, noise_multiplier / math.sqrt(2.0), rng)


def test_the_release_passes_the_audit_at_its_claimed_gaussian():
    result = _audit(dps.noisy_moment_sums, seed=901)
    print(f"\n[privacy audit] DP standardization statistics real: {result}")
    assert result.eps_lb <= EPS, str(result)
    assert result.eps_lb > EPS - 0.35, f"audit no longer near-tight: {result}"


def test_noise_sized_for_the_means_only_is_caught():
    result = _audit(_noise_for_the_means_only, seed=901)
    print(f"\n[privacy audit] DP standardization statistics broken (means only): {result}")
    assert result.eps_lb > EPS, str(result)


def test_no_example_moves_the_sums_by_more_than_the_sensitivity():
    rng = np.random.default_rng(0)
    lo, hi = np.array([r.lo for r in RANGES]), np.array([r.hi for r in RANGES])
    x = rng.uniform(lo - 1, hi + 1, size=(2000, len(RANGES))).clip(lo, hi)
    corners = np.array([[a, b] for a in (RANGES[0].lo, RANGES[0].hi) for b in (RANGES[1].lo, RANGES[1].hi)])
    rows = np.concatenate([x, corners])
    per_example = np.stack([dps.moment_sums(dps.normalized(r[None, :], RANGES)) for r in rows])
    norms = np.linalg.norm(per_example, axis=1)
    assert norms.max() == pytest.approx(dps.sensitivity(len(RANGES))) and (norms <= dps.sensitivity(2) + 1e-12).all()


def test_mean_and_std_are_numpys_up_to_the_noise():
    rng = np.random.default_rng(1)
    x = np.stack([rng.normal(30, 12, 200_000).clip(0, 100), rng.normal(1, 0.5, 200_000).clip(-2, 6)], axis=1)
    sums = dps.moment_sums(dps.normalized(x, RANGES))
    exact_mean, exact_std = dps.mean_and_std(sums, len(x), RANGES)
    np.testing.assert_allclose(exact_mean, x.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(exact_std, x.std(axis=0), rtol=1e-7)
    noisy_mean, noisy_std = dps.mean_and_std(dps.noisy_moment_sums(sums, 20.0, NoiseKey(3).generator()), len(x), RANGES)
    # noise sd on a mean: σ·√(2F)·m/n = 20·2·50/2e5 = 0.005 (column 0)
    assert abs(noisy_mean[0] - exact_mean[0]) < 0.05 and abs(noisy_std[0] - exact_std[0]) < 0.1
    with pytest.raises(ValueError, match="noise_multiplier must be finite and > 0"):
        dps.noisy_moment_sums(sums, 0.0, NoiseKey(3).generator())


SCHEMA = """
format = "parquet"
label = "y"
timestamp = "ts"
statistics_noise_multiplier = 5.0
[dense.age]
transform = ["clip", "standardize"]
clip = [0, 100]
[dense.price]
transform = ["log1p", "standardize"]
mean = 1.0
std = 2.0
[categorical.item]
hash_size = 16
"""


def test_the_converter_releases_records_and_applies_the_dp_statistics(tmp_path):
    rng = np.random.default_rng(2)
    n = 5000
    age = rng.normal(40, 15, n)
    price = rng.exponential(3.0, n)
    table = pa.table({"y": rng.integers(0, 2, n), "age": age, "price": price, "item": rng.integers(0, 50, n),
                      "ts": 1_700_000_000 + np.arange(n)})
    pq.write_table(table, tmp_path / "in.parquet")
    (tmp_path / "schema.toml").write_text(SCHEMA)
    cutoff = 1_700_000_000 + 4000
    meta = convert_table([tmp_path / "in.parquet"], tmp_path / "ds", schema=tmp_path / "schema.toml",
                         test_after=_iso(cutoff), statistics_noise_seed=7)
    on_disk = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    (entry,) = on_disk["privacy_events"]
    assert "age" in entry["description"] and "price" not in entry["description"]
    ((description, event),) = meta.privacy_events
    assert description == entry["description"] and type(event).__name__ == "GaussianDpEvent" and event.noise_multiplier == 5.0
    stats = on_disk["dense_statistics"]
    assert set(stats) == {"age"} and stats["age"]["estimated"] == "dp"
    # computed on the training examples only (those before the cutoff), close to their true values
    train_age = np.clip(age[:4000], 0, 100)
    assert abs(stats["age"]["mean"] - train_age.mean()) < 1.0 and abs(stats["age"]["std"] - train_age.std()) < 1.0
    # the same values standardize both splits; the public ones are kept as given
    train, test = open_dataset(tmp_path / "ds")
    for split, rows in ((train, slice(0, 4000)), (test, slice(4000, n))):
        dense = split.take(np.arange(len(split))).dense.numpy()
        want_age = (np.clip(age[rows], 0, 100) - stats["age"]["mean"]) / stats["age"]["std"]
        np.testing.assert_allclose(dense[:, 0], want_age, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dense[:, 1], (np.log1p(price[rows]) - 1.0) / 2.0, rtol=1e-5, atol=1e-5)


def _iso(seconds: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
