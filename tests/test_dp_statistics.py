"""DP standardization statistics (trainer/data/convert/dp_statistics.py): the release's privacy audit
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
from widedp.trainer.data.convert import dp_statistics as dps
from widedp.trainer.data.format.dataset import open_dataset
from widedp.trainer.data.convert.table import convert_table

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


# ---- per user (a data set with a unit column) ------------------------------------------------------
# Each user adds the mean of their examples' vectors (weights 1/m_u): one user moves the sums by
# ≤ Δ however many examples they have. Audit: D adds a user of M examples, every one at the top of
# the ranges, whose mean vector is (1, …, 1): the shift is again Δ along v, the same optimal event
# at the claimed ε. The broken variant weights each example 1 (the per-example sums, claimed per
# user): that user then moves the sums by M·Δ and the audit must see it.
M = 5


def _users(rng, users: int):
    per_user = rng.integers(1, 9, users)
    units = np.repeat(np.arange(users) * 7919 + 11, per_user)  # sparse, unordered-looking ids
    values = np.stack([rng.uniform(r.lo, r.hi, units.size) for r in RANGES], axis=1)
    order = rng.permutation(units.size)  # a user's examples are spread over the input
    return units[order], values[order]


def _user_sums(units, values, per_example: bool = False):
    if per_example:
        return dps.moment_sums(dps.normalized(values, RANGES))
    counts = dps.UnitCounts()
    counts.add(units)
    return dps.moment_sums(dps.normalized(values, RANGES), counts.weights(units))


def _user_audit(per_example: bool, seed: int):
    units, values = _users(np.random.default_rng(6), 30)
    heavy = np.full(M, -1)  # the added user: M examples at the top of every range
    extreme = np.tile([[r.hi for r in RANGES]], (M, 1))
    d_prime = _user_sums(units, values, per_example)
    d = _user_sums(np.concatenate([units, heavy]), np.concatenate([values, extreme]), per_example)
    delta_l2 = dps.sensitivity(len(RANGES))
    unit = np.ones_like(d) / np.sqrt(d.size)
    np.testing.assert_allclose(d - d_prime, unit * delta_l2 * (M if per_example else 1), atol=1e-9)
    t = SIGMA * delta_l2 * gaussian_optimal_threshold(EPS, 1.0 / SIGMA)
    counts = []
    for sums, key in ((d, seed), (d_prime, seed + 1)):
        rng = NoiseKey(key).generator()
        hits = sum(float((dps.noisy_moment_sums(sums, SIGMA, rng) - d_prime) @ unit) >= t for _ in range(TRIALS))
        counts.append(EventCounts(hits, TRIALS))
    return epsilon_lower_bound(counts[0], counts[1], delta=gaussian_delta(EPS, 1.0 / SIGMA))


def test_the_per_user_release_passes_the_audit_with_a_user_of_many_extreme_examples():
    result = _user_audit(per_example=False, seed=911)
    print(f"\n[privacy audit] per-user DP standardization statistics real: {result}")
    assert result.eps_lb <= EPS, str(result)
    assert result.eps_lb > EPS - 0.35, f"audit no longer near-tight: {result}"


def test_per_example_sums_claimed_per_user_are_caught():
    result = _user_audit(per_example=True, seed=911)
    print(f"\n[privacy audit] per-user DP standardization statistics broken (per-example sums): {result}")
    assert result.eps_lb > EPS, str(result)


def test_no_user_and_no_single_example_moves_the_per_user_sums_by_more_than_the_sensitivity():
    """The module's two bounds, checked on every neighbour of a data set with users: removing a
    whole user, and removing one example of a user (the event also holds at example level),
    including the adversarial pair of one example at each end of the ranges."""
    rng = np.random.default_rng(8)
    units, values = _users(rng, 40)
    corners = np.array([[r.hi for r in RANGES], [r.lo for r in RANGES]])  # one user: (1, 1) and (−1, 1) per column
    units, values = np.concatenate([units, [-5, -5]]), np.concatenate([values, corners])
    full = _user_sums(units, values)
    delta_l2 = dps.sensitivity(len(RANGES))
    moves_user = [np.linalg.norm(full - _user_sums(units[units != u], values[units != u])) for u in np.unique(units)]
    keep = np.ones(units.size, dtype=bool)
    moves_example = []
    for i in range(units.size):
        keep[i] = False
        moves_example.append(np.linalg.norm(full - _user_sums(units[keep], values[keep])))
        keep[i] = True
    assert max(moves_user) <= delta_l2 + 1e-9 and max(moves_example) <= delta_l2 + 1e-9
    # the pair's move is (v_x − v_o)/2 = (1, 0) per column: √F, half the room of √(2F) … not 0
    assert max(moves_example) >= math.sqrt(len(RANGES)) - 1e-9


def test_unit_counts_agree_with_a_counter_over_many_merges():
    from collections import Counter

    rng = np.random.default_rng(9)
    chunks = [rng.integers(-(1 << 40), 1 << 40, 30_000) for _ in range(4)]
    chunks += [rng.choice(chunks[0], 20_000) for _ in range(3)]  # repeats across chunks
    counts, reference = dps.UnitCounts(), Counter()
    for c in chunks:
        counts.add(c)
        reference.update(c.tolist())
    everything = np.concatenate(chunks)
    assert counts.num_units == len(reference) and counts.num_examples == everything.size
    np.testing.assert_array_equal(counts.weights(everything), [1.0 / reference[u] for u in everything.tolist()])
    missing = max(reference) + 1
    with pytest.raises(ValueError, match=f"unit {missing} was not counted"):
        counts.weights(np.array([missing]))


USER_SCHEMA = """
format = "parquet"
label = "y"
unit = "user"
timestamp = "ts"
statistics_noise_multiplier = 0.001
[dense.age]
transform = ["clip", "standardize"]
clip = [0, 100]
[categorical.item]
hash_size = 16
"""


def _heavy_user_table(tmp_path):
    """One user holds half the examples, all aged 90; 500 light users of 1–2 examples near 30:
    the users' mean (≈ 30) and the examples' mean (≈ 60) tell which one was released."""
    rng = np.random.default_rng(4)
    light = np.repeat(np.arange(1, 501), rng.integers(1, 3, 500))
    units = np.concatenate([light, np.zeros(light.size, dtype=np.int64)])
    age = np.concatenate([rng.normal(30, 5, light.size), np.full(light.size, 90.0)])
    order = rng.permutation(units.size)  # time order: users interleaved, some only in the last 10%
    units, age = units[order], age[order]
    n = units.size
    pq.write_table(pa.table({"y": rng.integers(0, 2, n), "age": age, "item": rng.integers(0, 50, n),
                             "user": units.astype(np.int64), "ts": 1_700_000_000 + np.arange(n)}),
                   tmp_path / "in.parquet")
    (tmp_path / "schema.toml").write_text(USER_SCHEMA)
    return units, age


def test_with_a_unit_column_the_converter_releases_per_user_statistics(tmp_path):
    units, age = _heavy_user_table(tmp_path)
    cut = int(0.9 * units.size)  # the statistics see the training examples only (before the cutoff)
    meta = convert_table([tmp_path / "in.parquet"], tmp_path / "ds", schema=tmp_path / "schema.toml",
                         test_after=_iso(1_700_000_000 + cut), chunk_rows=300,
                         statistics_noise_seed=7)  # a user's examples over many chunks
    assert np.setdiff1d(units[cut:], units[:cut]).size > 0  # users with test examples only
    units, age = units[:cut], age[:cut]
    on_disk = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    (entry,) = on_disk["privacy_events"]
    assert entry["unit"] == "user" and "users' mean values" in entry["description"]
    assert meta.privacy_event_units == ["user"] and on_disk["dense_statistics"]["age"]["unit"] == "user"
    # a slow reference: each user's mean age, then the mean and std over users
    per_user = {u: np.clip(age[units == u], 0, 100).mean() for u in np.unique(units)}
    user_means = np.array(list(per_user.values()))
    # the second moment is the users' mean of their mean u², not of their mean u squared
    per_user_sq = np.array([np.mean(np.square(np.clip(age[units == u], 0, 100))) for u in per_user])
    want_std = math.sqrt(per_user_sq.mean() - user_means.mean() ** 2)
    stats = on_disk["dense_statistics"]["age"]
    assert stats["mean"] == pytest.approx(user_means.mean(), abs=0.05) and stats["std"] == pytest.approx(want_std, abs=0.05)
    assert abs(stats["mean"] - np.clip(age, 0, 100).mean()) > 20  # not the examples' mean


def test_training_at_either_level_charges_the_per_user_statistics_as_they_are(tmp_path):
    from widedp.accounting import events as ev
    from widedp.accounting.ledger import PrivacyLedger
    from widedp.trainer.config import load_config
    from widedp.trainer.run.train import train

    _heavy_user_table(tmp_path)
    schema = tmp_path / "schema.toml"
    schema.write_text(USER_SCHEMA.replace("statistics_noise_multiplier = 0.001", "statistics_noise_multiplier = 2.0"))
    convert_table([tmp_path / "in.parquet"], tmp_path / "ds", schema=tmp_path / "schema.toml", statistics_noise_seed=7)
    base = [f"data.path={tmp_path / 'ds'}", "model.embedding_dim=4", "model.bottom_mlp=[4]", "model.top_mlp=[4]",
            "train.batch_size=64", "train.steps=2", "train.log_every=2", "cluster.backend=local", "train.mode=dpsgd",
            "privacy.noise_multiplier=3", "privacy.target_epsilon=50", "privacy.max_examples_per_user=4",
            "train.recalibrate=false", "privacy.k=4"]
    data_event = ev.GaussianDpEvent(2.0)
    for name, extra, step_type in (("example", ["privacy.accountant=rdp"], ev.PoissonSampledDpEvent),
                                   ("user", ["privacy.unit=user", "privacy.accountant=rdp"], ev.PoissonSampledDpEvent),
                                   ("by-examples", ["privacy.unit=user", "privacy.user_sampling=examples",
                                                    "privacy.accountant=pld"], ev.GroupDpEvent)):
        train(load_config(None, base + extra).validate(), tmp_path / name, progress=False)
        history = PrivacyLedger.load(tmp_path / name / "ledger.json").history
        assert history[0] == (data_event, 1), name  # charged once, as it is (never for a group)
        assert all(isinstance(e, step_type) for e, _ in history[1:]), (name, history)
    # resuming re-checks the ledger against the data set's events as charged
    train(load_config(None, base + ["privacy.unit=user", "privacy.user_sampling=examples", "privacy.accountant=pld",
                                    "train.steps=3"]).validate(), tmp_path / "by-examples", resume=True, progress=False)

    # the same data set with its entry marked example-level (as converted before per-user
    # statistics existed) is refused at user level: those bound one example, not one user
    meta_file = tmp_path / "ds" / "dataset.json"
    on_disk = json.loads(meta_file.read_text())
    del on_disk["privacy_events"][0]["unit"]
    meta_file.write_text(json.dumps(on_disk))
    with pytest.raises(ValueError, match="example-level DP"):
        train(load_config(None, base + ["privacy.unit=user", "privacy.accountant=rdp"]).validate(), tmp_path / "refused",
              progress=False)
    assert not (tmp_path / "refused").exists()
