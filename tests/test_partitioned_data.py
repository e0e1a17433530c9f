"""Partitioned data sets (trainer/data/format/partitioned.py): written by `widedp convert partition`,
each part read and Poisson-sampled by the trainer that owns it, the coordinator holding none of
them. The union of the trainers' samples is tested against a global Poisson sample (and a broken
sampler whose parts share their coins is caught), the parts against the source row for row, and a
run on the parts against the same run on the whole data set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from widedp.auditing.conformance import binomial_dispersion_test
from widedp.trainer.config import load_config
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.dataset import concat_batches, open_dataset
from widedp.trainer.data.format.partitioned import (MANIFEST_FILE, PartsView, open_part, open_partitioned_test, part_of,
                                                    partitioned_identity, read_manifest, write_partitioned)
from widedp.trainer.data.partitioned_training import PartitionedTrainSet, TrainerShares
from widedp.trainer.data.sampler import PartitionSampler
from widedp.trainer.run.train import build_run

from test_train_cli import TINY


def _rows(split) -> np.ndarray:
    """Every example of a split as one sortable row: label, dense values, every feature's ids."""
    batch = split.take(np.arange(len(split)))
    lengths = batch.sparse.lengths().reshape(len(batch.sparse.keys()), batch.size).numpy()
    assert (lengths == 1).all()  # one id per feature (the CTR generator's layout)
    ids = batch.sparse.values().reshape(len(batch.sparse.keys()), batch.size).numpy().T
    return np.column_stack([batch.labels.numpy(), batch.dense.numpy(), ids])


def _sorted(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


@pytest.fixture(scope="module")
def parts_dir(ctr_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("partitioned") / "parts"
    write_partitioned(ctr_dir, out, 4, test_fraction=0.2, seed=0)
    return out


def test_parts_hold_the_training_split_row_for_row_and_the_test_split_is_open_datasets(ctr_dir, parts_dir):
    train, test = open_dataset(ctr_dir, test_fraction=0.2, seed=0)
    manifest = read_manifest(parts_dir)
    assert manifest.num_parts == 4 and manifest.num_examples == len(train) and manifest.test_examples == len(test)
    assert manifest.split == "random(test_fraction=0.2, seed=0)"
    parts = [open_part(parts_dir, j) for j in range(4)]
    assert [len(p) for p in parts] == [p.num_examples for p in manifest.parts] and min(len(p) for p in parts) > 0
    np.testing.assert_array_equal(_sorted(np.concatenate([_rows(p) for p in parts])), _sorted(_rows(train)))
    np.testing.assert_array_equal(_sorted(_rows(open_partitioned_test(parts_dir))), _sorted(_rows(test)))
    # an example's part is a public function of its row position alone
    np.testing.assert_array_equal(np.bincount(part_of(train.rows, 4), minlength=4), [len(p) for p in parts])


def test_a_unit_partition_keeps_each_users_examples_in_one_part(user_logs_dir, tmp_path):
    out = tmp_path / "by_unit"
    manifest = write_partitioned(user_logs_dir, out, 3, partition_by="unit")
    train, test = open_dataset(user_logs_dir)
    units = [open_part(out, j).units() for j in range(3)]
    assert sum(len(u) for u in units) == len(train) and manifest.test_examples == len(test)
    assert all(not set(units[a]) & set(units[b]) for a in range(3) for b in range(a + 1, 3))
    assert [p.num_units for p in manifest.parts] == [len(set(u)) for u in units]
    assert manifest.num_units == len(set(train.units()))
    # list features travel: a view over two parts gives part 0's then part 1's examples
    view = PartsView([open_part(out, 0), open_part(out, 1)])
    n0 = len(view.splits[0])
    idx = np.array([0, 3, n0 - 1, n0, n0 + 2])
    got = view.take(idx)
    want = concat_batches([view.splits[0].take(idx[:3]), view.splits[1].take(idx[3:] - n0)])
    for key in got.sparse.keys():
        assert torch.equal(got.sparse[key].values(), want.sparse[key].values())
        assert torch.equal(got.sparse[key].lengths(), want.sparse[key].lengths())
    assert torch.equal(got.labels, want.labels) and list(got.indices) == list(idx)


def test_concat_batches_keeps_each_features_bags_in_example_order(user_logs_dir):
    train, _ = open_dataset(user_logs_dir)
    a, b, c = train.take(np.arange(0, 5)), train.take(np.arange(5, 5)), train.take(np.arange(5, 12))
    whole = train.take(np.arange(0, 12))
    joined = concat_batches([a, b, c])
    assert joined.size == 12
    for key in whole.sparse.keys():
        assert torch.equal(joined.sparse[key].values(), whole.sparse[key].values())
        assert torch.equal(joined.sparse[key].lengths(), whole.sparse[key].lengths())
    assert torch.equal(joined.dense, whole.dense) and torch.equal(joined.labels, whole.labels)


def test_bad_input_is_refused_by_name_and_nothing_is_left_behind(ctr_dir, parts_dir, tmp_path):
    with pytest.raises(DataError, match="never overwritten"):
        write_partitioned(ctr_dir, parts_dir, 2)
    with pytest.raises(DataError, match="--parts"):
        write_partitioned(ctr_dir, tmp_path / "a", 0)
    with pytest.raises(DataError, match="unit column"):
        write_partitioned(ctr_dir, tmp_path / "b", 2, partition_by="unit")
    with pytest.raises(DataError, match="would hold no example"):
        write_partitioned(ctr_dir, tmp_path / "c", 100_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary directory, no half-written set
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST_FILE).write_text(json.dumps({"format": "widedp-partitioned", "version": 1,
                                                 "partition_by": "example", "num_parts": 1, "num_examples": 5,
                                                 "parts": [{"directory": "part-00000", "num_examples": 4}]}))
    with pytest.raises(DataError, match=rf"{MANIFEST_FILE}: num_examples 5 must be the sum"):
        read_manifest(bad)
    with pytest.raises(ValueError, match="only 4 parts"):
        PartitionedTrainSet(parts_dir).parts_of_trainer(0, 5)
    with pytest.raises(DataError, match="partitioned by unit"):
        PartitionedTrainSet(parts_dir, max_examples_per_unit=4)
    with pytest.raises(RuntimeError, match="never by the coordinator"):
        PartitionedTrainSet(parts_dir).take(np.arange(3))


def test_the_identity_changes_with_any_part(ctr_dir, tmp_path):
    out = tmp_path / "p"
    write_partitioned(ctr_dir, out, 2)
    before = partitioned_identity(out)
    assert partitioned_identity(out) == before
    data = out / "part-00001" / "data.parquet"
    data.write_bytes(data.read_bytes() + b"\0")
    assert partitioned_identity(out)["partitions_sha256"] != before["partitions_sha256"]


# ---- the union of the trainers' samples is a Poisson sample -------------------------------------------------

def _refuted(values, trials: int, q: float, level: float = 0.01) -> bool:
    """The dispersion test (auditing/conformance.py) of `values` against Binomial(trials, q) at `level`."""
    return binomial_dispersion_test(values, trials, q, np.random.default_rng(7))["p_value"] < level


def _union_counts(sizes: list[int], num_trainers: int, q: float, steps: int, generator, units=None, k=None):
    """(times each example was sampled, sample size per step) over `steps` steps of every
    trainer's `PartitionSampler` (parts j with j mod N = i), in global part order."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    samplers = []
    for i in range(num_trainers):
        mine = [j for j in range(len(sizes)) if j % num_trainers == i]
        samplers.append((mine, PartitionSampler([sizes[j] for j in mine], q, [generator(j) for j in mine],
                                                None if units is None else [units[j] for j in mine], k)))
    counts, per_step = np.zeros(offsets[-1], dtype=np.int64), []
    for _ in range(steps):
        size = 0
        for mine, sampler in samplers:
            local = sampler.sample()
            local_offsets = np.concatenate([[0], np.cumsum([sizes[j] for j in mine])])
            owner = np.searchsorted(local_offsets, local, side="right") - 1
            global_idx = offsets[np.asarray(mine)[owner]] + (local - local_offsets[owner])
            np.add.at(counts, global_idx, 1)
            size += local.size
        per_step.append(size)
    return counts, np.array(per_step)


def test_the_union_over_trainers_and_parts_is_a_global_poisson_sample():
    sizes, q, steps = [300, 250, 400, 350, 200], 0.1, 400
    seeds = np.random.SeedSequence(2026).spawn(len(sizes))
    counts, per_step = _union_counts(sizes, 2, q, steps, lambda j: np.random.default_rng(seeds[j]))
    assert not _refuted(counts, steps, q)  # each example: Binomial(T, q)
    assert not _refuted(per_step, sum(sizes), q)  # each step's size: Binomial(n, q)
    assert abs(counts.mean() / steps - q) < 4 * np.sqrt(q * (1 - q) / (steps * sum(sizes)))


def test_parts_that_share_their_coins_are_caught():
    """The broken sampler: every part keyed with the same seed (equal-size parts then draw the
    same positions every step) — each example is still sampled at rate q, but the step sizes are
    over-dispersed (five parts' sizes move together), and the test sees it."""
    sizes, q, steps = [400] * 5, 0.1, 400
    counts, per_step = _union_counts(sizes, 2, q, steps, lambda j: np.random.default_rng(11))
    assert abs(counts.mean() / steps - q) < 0.01  # each example's rate alone is still q
    assert _refuted(per_step, sum(sizes), q)


def test_user_level_union_samples_each_user_at_q_with_at_most_k_examples():
    rng = np.random.default_rng(3)
    part_units = [rng.integers(0, 60, size=n) + 1000 * j for j, n in enumerate([500, 300, 400])]
    q, steps, k = 0.2, 300, 3
    seeds = np.random.SeedSequence(5).spawn(3)
    sampler = PartitionSampler([len(u) for u in part_units], q, [np.random.default_rng(s) for s in seeds],
                               part_units, k)
    labels = np.concatenate(part_units)
    times = {u: 0 for u in np.unique(labels)}
    for _ in range(steps):
        examples, local, m = sampler.sample_units()
        sampled = labels[examples]
        assert m == np.unique(sampled).size and local.max(initial=-1) == m - 1
        assert np.bincount(local, minlength=m).max(initial=0) <= k
        for u in np.unique(sampled):
            times[u] += 1
    assert not _refuted(np.array(list(times.values())), steps, q)


def test_a_restored_trainer_samples_from_fresh_streams(parts_dir):
    key_draws = {}

    def generator(part, restart):
        key_draws[(part, restart)] = True
        return np.random.default_rng([part, restart])

    shares = TrainerShares(PartitionedTrainSet(parts_dir), 2, 0.1, generator)
    first, again = shares.share(1), shares.share(1, restart=1)
    assert first.parts == again.parts == [1, 3]
    assert first.generators[0].random() != again.generators[0].random()
    assert set(key_draws) == {(1, 0), (3, 0), (1, 1), (3, 1)}


# ---- a run on the parts ---------------------------------------------------------------------------------

def _trained(path, *extra) -> tuple:
    cfg = load_config(None, [f"data.path={path}", *TINY, "train.mode=dpsgd", "train.recalibrate=false",
                             "privacy.reproducible=true", "privacy.noise_seed=99", "privacy.noise_multiplier=1.0",
                             "privacy.target_epsilon=1e9", "data.test_fraction=0.2", *extra]).validate()
    with build_run(cfg) as run:
        run.run(3)
        engine = run.engine
        model = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
        tables = [s["weights"] for s in engine.shards.broadcast("state_dict")]
        return model, tables, engine


def test_a_run_on_the_parts_computes_what_the_run_on_the_whole_data_set_does(ctr_dir, parts_dir):
    """q = 1 (every example every step: the sample is fixed), DP-SGD with one noise seed: the
    two runs differ only in the order the trainers' sums are added."""
    n = read_manifest(parts_dir).num_examples
    whole_model, whole_tables, whole = _trained(ctr_dir, f"train.batch_size={n}")
    part_model, part_tables, parted = _trained(parts_dir, f"train.batch_size={n}", "cluster.num_trainers=2")
    assert parted.partitioned and not whole.partitioned and parted.sampler.num_examples == n
    for name, value in whole_model.items():
        torch.testing.assert_close(part_model[name], value, rtol=1e-4, atol=1e-5)
    for a, b in zip(part_tables, whole_tables):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-5)


def test_train_refuses_what_would_read_training_examples_at_the_coordinator(parts_dir):
    cfg = load_config(None, [f"data.path={parts_dir}", *TINY, "data.validation_fraction=0.1"]).validate()
    with pytest.raises(ValueError, match="partitioned data set .*data.validation_fraction"):
        build_run(cfg)
    cfg = load_config(None, [f"data.path={parts_dir}", *TINY, "train.recalibrate=false", "privacy.unit=user"]).validate()
    with pytest.raises(DataError, match="partitioned by unit"):
        build_run(cfg)


def test_convert_partition_cli_writes_and_reports(ctr_dir, tmp_path, capsys):
    from widedp.trainer.cli import main

    out = tmp_path / "cli_parts"
    assert main(["convert", "partition", str(ctr_dir), str(out), "--parts", "3", "--test-fraction", "0.2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parts"] == 3 and sum(report["part_examples"]) == report["num_examples"] == 2400
    assert main(["convert", "partition", str(ctr_dir), str(out), "--parts", "3"]) == 2
    assert "never overwritten" in capsys.readouterr().err


_DRIVER_NEVER_OPENS_A_PART = """
import sys
from pathlib import Path
from widedp.trainer.data.format import dataset, partitioned

def _refuse(*args, **kwargs):
    raise AssertionError("the coordinator opened a part of the training set")

real_columns = dataset.load_all_columns

def _test_split_only(directory, meta, **kwargs):  # any decode of examples but the test split's fails
    if Path(directory).name != "test":
        raise AssertionError(f"the coordinator decoded {directory}")
    return real_columns(directory, meta, **kwargs)

partitioned.open_part = _refuse  # this process only: the trainer actors import the modules afresh
dataset.load_all_columns = _test_split_only
from widedp.trainer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_trainer_actors_on_ray_read_their_own_parts_and_the_coordinator_none(parts_dir, tmp_path):
    import os
    import subprocess
    import sys

    run = tmp_path / "ray_parts"
    sets = [f"data.path={parts_dir}", *TINY, "train.recalibrate=true", "cluster.backend=ray",
            "cluster.num_trainers=2", "cluster.cpus_per_trainer=0.25", "cluster.cpus_per_shard=0.25",
            "train.steps=3", "privacy.target_epsilon=8"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    config = tmp_path / "parts.toml"
    config.write_text(f'[data]\npath = "{parts_dir}"\n')
    done = subprocess.run([sys.executable, "-c", _DRIVER_NEVER_OPENS_A_PART, "train", "--config", str(config),
                           "--no-progress", "--run-dir",
                           str(run), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["trainer_actors"] and summary["steps"] == 3
    assert summary["partitions"] == {"parts": 4, "partition_by": "example", "trainer_parts": [[0, 2], [1, 3]]}
    assert 0.0 < summary["test_metrics"]["auc"] < 1.0
    assert summary["recalibration"]["a"] > 0  # counted by the trainers: the coordinator decoded no part


@pytest.mark.parametrize("unit", ["example", "user", "example-ema-dpsgd"])
def test_the_trainers_recalibration_counts_are_the_whole_training_sets(ctr_dir, parts_dir, user_logs_dir, tmp_path,
                                                                       unit):
    """The recalibration's exact counts, added over the trainers' parts, against the slow obvious
    reference: the coordinator scoring every example of every part (user level: weighted 1/m)."""
    from widedp.trainer.engine.recalibration import BINS, LOGIT_CLIP, exact_histogram, unit_weights

    path, extra = parts_dir, ["privacy.target_epsilon=8"]
    averaged = unit == "example-ema-dpsgd"  # the averaged tables and dense parameters, lazy DP-SGD noise
    if averaged:
        extra += ["train.mode=dpsgd", "train.ema_decay=0.9"]
    if unit == "user":
        path = tmp_path / "users"
        write_partitioned(user_logs_dir, path, 3, partition_by="unit")
        extra = ["privacy.unit=user", "privacy.max_examples_per_user=4", "train.batch_size=80", "privacy.target_epsilon=8"]
    cfg = load_config(None, [f"data.path={path}", *TINY, "train.recalibrate=true", "cluster.num_trainers=2",
                             *extra]).validate()
    with build_run(cfg) as run:
        run.run(2)
        engine = run.engine
        engine.store_pending_noise()
        params = {k: v.detach() for k, v in engine.dense.released_params(averaged).items()}
        parts = engine.trainers.score_histograms(params, averaged, 256, BINS, LOGIT_CLIP, unit == "user")
        every = PartsView([open_part(path, j) for j in range(read_manifest(path).num_parts)])
        logits, labels = (t.double().numpy().ravel() for t in engine.outputs(every, 256, averaged=averaged))
        weights = None
        if unit == "user":
            weights = unit_weights(np.unique(every.units(), return_inverse=True)[1])
        totals, positives = exact_histogram(logits, labels, BINS, LOGIT_CLIP, weights)
        np.testing.assert_allclose(sum(t for t, _ in parts), totals, atol=1e-9)
        np.testing.assert_allclose(sum(p for _, p in parts), positives, atol=1e-9)
        assert totals.sum() == pytest.approx(read_manifest(path).num_units if unit == "user" else len(every))
        released = run.recalibrate()
        assert released["a"] > 0 and engine.recalibrated_at == 2


def test_a_trainer_lost_while_counting_is_restored_and_the_counts_taken_again(parts_dir):
    from widedp.trainer.engine.shard_group import StepInterrupted

    cfg = load_config(None, [f"data.path={parts_dir}", *TINY, "train.recalibrate=true", "cluster.num_trainers=2",
                             "privacy.target_epsilon=8"]).validate()
    with build_run(cfg) as run:
        run.run(2)
        engine, real, calls = run.engine, run.engine.trainers.score_histograms, []

        def lost_once(*args):
            calls.append(args)
            if len(calls) == 1:
                raise StepInterrupted("trainer 1 (Ray actor) died during 'score_histogram'")
            return real(*args)

        engine.trainers.score_histograms = lost_once
        charged = len(engine.ledger.state_dict()["history"])
        released = run.recalibrate()
        assert released["a"] > 0 and len(calls) == 2  # counted again after the loss
        history = engine.ledger.state_dict()["history"]
        assert len(history) == charged + 1 and history[-1]["count"] == 1  # charged once, after the counts


def test_user_level_run_on_unit_parts_samples_users_in_their_parts(user_logs_dir, tmp_path):
    out = tmp_path / "users"
    manifest = write_partitioned(user_logs_dir, out, 3, partition_by="unit")
    cfg = load_config(None, [f"data.path={out}", *TINY, "train.recalibrate=false", "privacy.unit=user",
                             "privacy.max_examples_per_user=4", "train.batch_size=80", "cluster.num_trainers=3",
                             "privacy.target_epsilon=8"]).validate()
    with build_run(cfg) as run:
        engine = run.engine
        assert engine.num_units == manifest.num_units and run.privacy.sample_rate == pytest.approx(80 / manifest.num_units)
        samples, B = engine._sample(__import__("widedp.trainer.engine.trainer_role", fromlist=["PhaseClock"]).PhaseClock())
        assert len(samples) == 3 and B == sum(s.examples.size for s in samples)
        for s in samples:
            assert np.bincount(s.units, minlength=s.num_units).max(initial=0) <= 4
        run.run(2)
        assert engine.step_count == 2


def test_a_reproducible_run_on_parts_resumes_to_the_same_model(parts_dir, tmp_path, capsys):
    from widedp.trainer.cli import main

    config = tmp_path / "parts.toml"
    config.write_text(f'[data]\npath = "{parts_dir}"\n')
    sets = [a for s in [*TINY, "train.recalibrate=false", "privacy.reproducible=true", "privacy.noise_seed=5",
                        "cluster.num_trainers=2", "privacy.target_epsilon=1e9",
                        "privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.05"] for a in ("--set", s)]
    assert main(["train", "--config", str(config), "--no-progress", "--run-dir", str(tmp_path / "a"), *sets,
                 "--set", "train.steps=5"]) == 0
    straight = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["train", "--config", str(config), "--no-progress", "--run-dir", str(tmp_path / "b"), *sets,
                 "--set", "train.steps=3"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress", "--set", "train.steps=5"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["resumed"] and resumed["steps"] == straight["steps"] == 5
    assert resumed["test_metrics"] == straight["test_metrics"]
    # the data set's budget lives beside its manifest and `widedp budget` reads it
    assert main(["budget", str(parts_dir)]) == 0
    budget = json.loads(capsys.readouterr().out)
    assert {str(tmp_path / "a"), str(tmp_path / "b")} <= {r["run_dir"] for r in budget["runs"]}


def test_the_engine_keys_every_part_with_a_stream_of_its_own(parts_dir):
    """The engine's wiring (trainer/engine/engine.py): each part of each trainer draws from the
    run's "sampler" key derived with its part index — four distinct Philox keys — and the union
    of the trainers' samples has Binomial(n, q) step sizes."""
    cfg = load_config(None, [f"data.path={parts_dir}", *TINY, "train.recalibrate=false", "cluster.num_trainers=2",
                             "train.batch_size=240", "privacy.target_epsilon=8"]).validate()
    with build_run(cfg) as run:
        engine = run.engine
        keys = [tuple(np.asarray(sampler._rng.bit_generator.state["state"]["key"]).tolist())
                for role in engine.trainers.roles for sampler in role.sampler.samplers]
        assert len(keys) == 4 and len(set(keys)) == 4
        sizes = [sum(part.size for part in engine.sampler.sample()) for _ in range(300)]
        assert not _refuted(np.array(sizes), len(engine.train_set), engine.q)


def test_manifests_that_would_sample_examples_twice_are_refused(tmp_path):
    def manifest(**changes):
        data = {"format": "widedp-partitioned", "version": 1, "partition_by": "example", "num_parts": 2,
                "num_examples": 8, "parts": [{"directory": "part-00000", "num_examples": 4},
                                              {"directory": "part-00001", "num_examples": 4}],
                "test_directory": "test", "test_examples": 2}
        data.update(changes)
        (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
        return tmp_path

    assert read_manifest(manifest()).num_parts == 2
    twice = [{"directory": "part-00000", "num_examples": 4}, {"directory": "part-00000/", "num_examples": 4}]
    with pytest.raises(DataError, match="same directory"):
        read_manifest(manifest(parts=twice))
    with pytest.raises(DataError, match="test_directory must be a directory inside the data set and not a part"):
        read_manifest(manifest(test_directory="part-00001"))
    with pytest.raises(DataError, match="num_units must be absent"):
        read_manifest(manifest(num_units=5))
    with pytest.raises(DataError, match="num_units must be"):
        read_manifest(manifest(parts=[{"directory": "part-00000", "num_examples": 4, "num_units": 3.5},
                                      {"directory": "part-00001", "num_examples": 4}]))


def test_a_user_split_over_two_parts_is_refused_when_a_trainer_opens_it(user_logs_dir, tmp_path):
    """A hand-merged unit partition (one part's directory swapped for another's): the trainer
    finds a unit whose hash names another part and refuses, naming the part."""
    out = tmp_path / "by_unit"
    write_partitioned(user_logs_dir, out, 2, partition_by="unit")
    (out / "part-00000").rename(out / "swap")
    (out / "part-00001").rename(out / "part-00000")
    (out / "swap").rename(out / "part-00001")
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["parts"].reverse()
    for j, p in enumerate(manifest["parts"]):
        p["directory"] = f"part-{j:05d}"
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    shares = PartitionedTrainSet(out, max_examples_per_unit=3).trainer_shares(
        1, 0.1, lambda part, restart: np.random.default_rng(part))
    with pytest.raises(DataError, match=r"part-00000: example 0 has unit .* a user's examples must all be in one part"):
        shares.share(0).open()


def test_partitioning_keeps_the_spending_on_record_and_a_tiny_test_fraction_is_refused(ctr_dir, tmp_path):
    source = tmp_path / "src"
    __import__("shutil").copytree(ctr_dir, source, ignore=__import__("shutil").ignore_patterns(".widedp-cache"))
    (source / "privacy_budget.jsonl").write_text('{"line": 1}\n')
    (source / "privacy_budget.head.json").write_text('{"lines": 1}')
    write_partitioned(source, tmp_path / "parts", 2)
    assert (tmp_path / "parts" / "privacy_budget.jsonl").read_text() == '{"line": 1}\n'
    assert (tmp_path / "parts" / "privacy_budget.head.json").read_text() == '{"lines": 1}'
    with pytest.raises(DataError, match="holds out no example"):
        write_partitioned(source, tmp_path / "new" / "deeper" / "parts", 2, test_fraction=1e-6)
    assert not (tmp_path / "new").exists()  # the parents it made are gone again


def test_a_trainer_killed_on_ray_is_restored_with_fresh_streams_and_the_step_redone(parts_dir):
    import ray

    started = not ray.is_initialized()
    cfg = load_config(None, [f"data.path={parts_dir}", *TINY, "train.recalibrate=false", "cluster.backend=ray",
                             "cluster.num_trainers=2", "cluster.cpus_per_trainer=0.25", "cluster.cpus_per_shard=0.25",
                             "privacy.reproducible=true", "privacy.noise_seed=3", "privacy.target_epsilon=8"]).validate()
    try:
        with build_run(cfg) as run:
            engine = run.engine

            def keys():
                return [[tuple(np.asarray(p["bit_generator"]["state"]["key"]).tolist()) for p in t["parts"]]
                        for t in engine.trainers.sampler_states()]

            engine.step()
            before = keys()
            ray.kill(engine.trainers.actors[1], no_restart=True)
            assert engine.step() is not None and engine.step_restarts == 1 and engine.trainers.restarts == 1
            after = keys()
            assert after[0] == before[0]  # the survivor goes on with its streams
            assert not set(after[1]) & set(before[1]) and not set(after[1]) & set(before[0])  # fresh ones
            assert engine.ledger.steps == 2
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def test_a_parts_memory_mapped_columns_are_advised_for_random_access(parts_dir):
    """Each mapping of a part's decoded cache (labels, dense values, ids) is advised MADV_RANDOM
    (trainer/data/format/store.py): a sampled row's page fault then reads its page, not the
    read-around window; columns decoded in memory have no mapping to advise."""
    from widedp.trainer.data.format.store import Columns, advise_random_access

    assert advise_random_access(open_part(parts_dir, 0)._cols) == 3
    in_memory = Columns(num_rows=2, labels=np.zeros(2, np.float32), dense=np.zeros((2, 1), np.float32),
                        fixed=np.zeros((2, 1), np.int64), fixed_features=["a"], jagged={})
    assert advise_random_access(in_memory) == 0


def test_convert_criteo_with_parts_equals_convert_then_partition(tmp_path, capsys):
    """`convert criteo ... --parts K`: the conversion written as K parts, row for row what
    `convert criteo` followed by `convert partition` gives; the temporary conversion is gone."""
    from widedp.trainer.cli import main

    rng = np.random.default_rng(4)
    lines = ["\t".join([str(int(rng.integers(0, 2)))] + [str(int(v)) for v in rng.integers(0, 50, 13)]
                       + [format(int(v), "x") for v in rng.integers(1, 1 << 20, 26)]) for _ in range(300)]
    tsv = tmp_path / "day.tsv"
    tsv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "direct"
    assert main(["convert", "criteo", str(tsv), str(out), "--hash-size", "64", "--parts", "3",
                 "--test-fraction", "0.2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parts"] == 3 and report["num_examples"] == 240 and report["test_examples"] == 60
    assert main(["convert", "criteo", str(tsv), str(tmp_path / "whole"), "--hash-size", "64"]) == 0
    write_partitioned(tmp_path / "whole", tmp_path / "two_steps", 3, test_fraction=0.2)
    for j in range(3):
        np.testing.assert_array_equal(_rows(open_part(out, j)), _rows(open_part(tmp_path / "two_steps", j)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.tsv", "direct", "two_steps", "whole"]
    assert main(["convert", "criteo", str(tsv), str(out), "--parts", "2"]) == 2  # never overwritten
    assert "never overwritten" in capsys.readouterr().err
    assert main(["convert", "criteo", str(tsv), str(tmp_path / "x"), "--test-fraction", "0.2"]) == 2
    assert "apply with --parts only" in capsys.readouterr().err
    assert main(["convert", "criteo", str(tsv), str(tmp_path / "y"), "--parts", "2", "--test-fraction", "1.5"]) == 2
    assert "--test-fraction must be in [0, 1)" in capsys.readouterr().err
    assert main(["convert", "criteo", str(tsv), str(tmp_path / "new" / "z"), "--parts", "400"]) == 2  # a part empty
    assert not (tmp_path / "new").exists()  # nothing of the failed conversion is left, its parent included
