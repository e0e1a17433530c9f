"""The per-table privacy policy of sparse mode (trainer/config/table_policy.py): the public rule, the
config keys, the compact id space the selectors see, and what a run plans and reports.

The engine's behaviour with dense tables (equal to the slow reference; all-dense equals
DP-SGD bit for bit; no dense table equals the unchanged sparse step) is in tests/test_engine.py
§4b."""

from __future__ import annotations

import json

import numpy as np
import pytest

from widedp.trainer.config import ConfigError, load_config
from widedp.trainer.config.planning import plan_run
from widedp.trainer.config.table_policy import resolve_table_policy
from widedp.trainer.engine.vocabulary import SparseVocabulary

ROWS = {"small": 7, "edge": 1024, "above": 1025, "big": 2_000_000}


def test_auto_rule_makes_exactly_the_tables_up_to_the_batch_size_dense():
    policy = resolve_table_policy(ROWS, expected_batch_size=1024)
    assert policy.dense == ("small", "edge") and policy.sparse == ("above", "big")
    assert "b = 1024" in policy.rule and "edge 1024" in policy.rule


def test_auto_rule_counts_the_ids_one_example_can_put_into_a_table():
    """dense iff rows ≤ b·m_t: a table a batch can cover. A list feature of max_length 20 can
    touch 20 rows per example; a table read by two single-id features 2; unbounded counts 1."""
    rows = {"one_hot": 1025, "history": 20_000, "shared": 2048, "unbounded": 1025, "huge": 2_000_000}
    per_table = {"one_hot": 1, "history": 20, "shared": 2, "unbounded": None, "huge": 20}
    policy = resolve_table_policy(rows, expected_batch_size=1024, ids_per_example=per_table)
    assert policy.dense == ("history", "shared") and policy.sparse == ("one_hot", "unbounded", "huge")
    assert "history 20480" in policy.rule and "unbounded 1024" in policy.rule
    # an explicit privacy.dense_max_rows is one bound for every table, as before
    fixed = resolve_table_policy(rows, expected_batch_size=1024, ids_per_example=per_table, dense_max_rows=2048)
    assert fixed.dense == ("one_hot", "shared", "unbounded") and "privacy.dense_max_rows)" in fixed.rule


def test_the_bound_per_table_is_the_sum_over_its_features_and_unbounded_wins(tmp_path):
    """planning.table_policy adds the features' bounds per table (public metadata)."""
    from widedp.trainer.config.planning import table_policy

    cfg = _config(tmp_path, '[privacy]\ntable_default = "auto"\n')  # b = 100
    rows = {"item": 2000, "campaign": 150, "input": 150, "context_only": 700}
    features = {"ad": "item", "history": "item", "campaign": "campaign", "context": "input", "extra": "input",
                "words": "context_only"}
    bounds = {"ad": 1, "history": 20, "campaign": 1, "context": 8, "extra": None, "words": 8}
    policy = table_policy(cfg, rows, 10_000, features, bounds)
    # item: 2000 ≤ 100·(1 + 20); campaign 150 > 100·1; input: "extra" is unbounded, so 1 id:
    # 150 > 100; context_only 700 ≤ 100·8
    assert policy.dense == ("item", "context_only") and policy.sparse == ("campaign", "input")
    assert table_policy(cfg, rows, 10_000).dense == ()  # without the metadata: b·1 for every table


def test_dense_max_rows_moves_the_boundary_and_overrides_win():
    policy = resolve_table_policy(ROWS, expected_batch_size=1024, dense_max_rows=10,
                                  overrides={"small": "sparse", "big": "dense"})
    assert policy.dense == ("big",) and policy.sparse == ("small", "edge", "above")
    assert "small = sparse" in policy.rule


@pytest.mark.parametrize("default", ["dense", "sparse"])
def test_a_fixed_default_applies_to_every_table(default):
    policy = resolve_table_policy(ROWS, expected_batch_size=1024, default=default)
    assert getattr(policy, default) == tuple(ROWS) and not getattr(policy, "sparse" if default == "dense" else "dense")


@pytest.mark.parametrize("kwargs,message", [
    (dict(overrides={"smal": "dense"}), r"privacy\.tables\.smal: no table named 'smal'"),
    (dict(overrides={"small": "densely"}), r"privacy\.tables\.small must be one of"),
    (dict(default="some"), r"privacy\.table_default must be one of"),
    (dict(dense_max_rows=0), r"privacy\.dense_max_rows must be >= 1"),
])
def test_bad_policy_input_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_table_policy(ROWS, expected_batch_size=1024, **kwargs)


@pytest.mark.parametrize("dense", [(), (0,), (1,), (0, 2), (3,), (0, 1, 2)])
def test_sparse_vocabulary_maps_the_sparse_tables_rows_onto_one_id_space_and_back(dense):
    rows = np.array([3, 5, 2, 4])
    vocab = SparseVocabulary(rows, dense)
    offsets = np.concatenate([[0], np.cumsum(rows)])
    sparse_globals = np.array([offsets[t] + r for t in range(4) if t not in dense for r in range(rows[t])])
    assert vocab.num_rows == sparse_globals.size
    everything = np.arange(rows.sum())
    keep, compact = vocab.to_compact(everything)
    assert np.array_equal(everything[keep], sparse_globals)  # the sparse rows, in global order ...
    assert np.array_equal(compact, np.arange(sparse_globals.size))  # ... numbered 0, 1, 2, ...
    assert np.array_equal(vocab.to_global(compact), sparse_globals)
    # Jagged per-example rows keep their examples, lose the dense tables' rows, become compact.
    offsets, ids = np.array([0, 3, 3, 6]), np.array([0, 4, 13, 9, 8, 2])
    got_offsets, got_ids = vocab.restrict(offsets, ids)
    want = [[int(np.flatnonzero(sparse_globals == g)[0]) for g in ids[lo:hi] if g in sparse_globals]
            for lo, hi in zip(offsets[:-1], offsets[1:])]
    assert np.array_equal(got_offsets, np.concatenate([[0], np.cumsum([len(w) for w in want])]))
    assert got_ids.tolist() == [c for w in want for c in w]


def _config(tmp_path, body: str, *overrides: str):
    path = tmp_path / "c.toml"
    path.write_text(f'[data]\npath = "{tmp_path}"\n[train]\nmode = "sparse"\nselection = "threshold"\n'
                    f'batch_size = 100\n{body}')
    return load_config(str(path), list(overrides)).validate()


def test_config_reads_the_tables_section_and_set_merges_into_it(tmp_path):
    cfg = _config(tmp_path, '[privacy]\ntable_default = "auto"\ndense_max_rows = 50\n[privacy.tables]\na = "sparse"\n',
                  "privacy.tables.b=dense")
    assert cfg.privacy.tables == {"a": "sparse", "b": "dense"} and cfg.privacy.dense_max_rows == 50
    assert json.loads(json.dumps(cfg.to_dict()))["privacy"]["tables"] == {"a": "sparse", "b": "dense"}


@pytest.mark.parametrize("body,overrides,message", [
    ('[privacy.tables]\na = "dens"\n', (), r"privacy\.tables\.a must be one of"),
    ("", ("privacy.table_default=mixed",), r"privacy\.table_default must be one of"),
    ("", ("privacy.dense_max_rows=0",), r"privacy\.dense_max_rows must be > 0 or \"auto\""),
    ('[privacy]\ntables = 3\n', (), r"privacy\.tables must be a table"),
])
def test_bad_table_policy_config_names_the_key(tmp_path, body, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, body, *overrides)


def test_plan_selects_over_the_sparse_tables_only_and_an_all_dense_sparse_run_is_planned_as_dpsgd(tmp_path):
    tables = {"tiny": 10, "wide": 5000}
    cfg = _config(tmp_path, '[privacy]\ngamma = 0.1\n')
    plan, info, policy = plan_run(cfg, 10_000, tables)
    assert policy.dense == ("tiny",) and info.table_policy["dense"] == ["tiny"]
    assert plan.selection == "threshold" and info.k == 500  # gamma · 5000: the selectable rows
    dense_cfg = _config(tmp_path, '[privacy]\ntable_default = "dense"\n')
    plan, info, policy = plan_run(dense_cfg, 10_000, tables)
    assert plan.selection == "none" and plan.selection_params is None and policy.sparse == ()
    dpsgd_cfg = _config(tmp_path, "", "train.mode=dpsgd")
    dpsgd_plan, dpsgd_info, dpsgd_policy = plan_run(dpsgd_cfg, 10_000, tables)
    assert dpsgd_policy is None and dpsgd_plan.noise_multiplier == plan.noise_multiplier


def test_a_run_reports_its_table_policy(tmp_path, capsys):
    from widedp.trainer.cli import main

    config = tmp_path / "ctr.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "ctr"}"\n')
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", "--set", "data.synth=ctr",
                 "--set", "data.synth_examples=400", "--set", "data.synth_table_size=30",
                 "--set", "train.mode=sparse", "--set", "train.selection=threshold", "--set", "train.batch_size=40",
                 "--set", "train.steps=2", "--set", "cluster.backend=local", "--set", "privacy.dense_max_rows=30",
                 "--set", "privacy.tables.t_1=sparse", "--set", "privacy.k=5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    policy = summary["table_policy"]
    assert policy["sparse"] == ["t_1"] and "t_1" not in policy["dense"] and len(policy["dense"]) == 25
    assert summary["rows_selected_mean"] >= 25 * 30  # every dense row is noised every step


def test_auto_threshold_lets_the_false_positive_budget_of_noise_rows_pass(tmp_path):
    """τ = σ_sel·C1·Φ̄⁻¹(m/p), m = false_positive_ratio · b · (features of sparse tables): the
    expected number of pure-noise rows that pass is m, whatever k is."""
    from scipy import stats

    tables = {"tiny": 10, "wide": 50_000, "wider": 200_000}
    features = {"f0": "tiny", "f1": "wide", "f2": "wide", "f3": "wider"}  # 3 features on sparse tables
    cfg = _config(tmp_path, '[privacy]\nfalse_positive_ratio = 0.2\nk = 7\n')
    plan, info, _ = plan_run(cfg, 10_000, tables, feature_tables=features)
    sp = plan.selection_params
    m, p = 0.2 * 100 * 3, 250_000
    assert sp.threshold == pytest.approx(sp.noise_multiplier * sp.contribution_clip * stats.norm.isf(m / p))
    assert p * stats.norm.sf(sp.threshold / (sp.noise_multiplier * sp.contribution_clip)) == pytest.approx(m)
    assert "m/p" in info.threshold_rule
    _, without = plan_run(cfg, 10_000, tables)[:2]  # no feature metadata: about k rows (the old rule)
    assert "k/p" in without.threshold_rule
    default = _config(tmp_path, '[privacy]\nk = 7\n')  # false_positive_ratio = "none" (default): k
    plan, info, _ = plan_run(default, 10_000, tables, feature_tables=features)
    sp = plan.selection_params
    assert "k/p" in info.threshold_rule
    assert sp.threshold == pytest.approx(sp.noise_multiplier * sp.contribution_clip * stats.norm.isf(7 / p))


# ---- the dense-table noise: a statistical audit of what the shards release -----------------------
# A dense table's rows are released as W − lr·(clip(G) + N(0, std²)) on *every* row, the noise
# drawn on the shard (ShardUpdates.apply_dense_noise_update, the DP-SGD stream) with the std the
# Gaussian step returned (noisy_step(..., shard_noised=G)). Neighbours: in D every row of the
# table carries one example's gradient s = S1/b on coordinate 0, in D' no row is touched. With
# no S2 the rows are independent, so one release of an N-row table is N trials of the 1-D
# Gaussian mechanism with μ = 1/σ; the event {released_r ≥ s·σ·x*(ε)} is optimal at ε.
DENSE_SIGMA, DENSE_EPS, DENSE_ROWS = 1.0, 1.0, 100_000


def _dense_release(touched: bool, seed: int, apply) -> np.ndarray:
    import torch

    from widedp.selection.keyed_random import GaussianStream, NoiseKey
    from widedp.selection.noise import noisy_step
    from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec
    from widedp.trainer.engine.shard import EmbeddingShard

    layout = ShardLayout((TableSpec("t", DENSE_ROWS, 4),), (FeatureSpec("f", "t", "sum"),), 1)
    shard = EmbeddingShard(layout, 0, optimizer="sgd", lr=1.0, seed=0)
    before = shard.storage.weights(0).detach().clone()
    ids = np.arange(DENSE_ROWS) if touched else np.empty(0, np.int64)
    grads = torch.zeros((ids.size, 4), dtype=torch.float64)
    grads[:, 0] = 1.0  # S1/b with S1 = 1, b = 1
    step = noisy_step(torch.zeros((0, 4), dtype=torch.float64), {}, DENSE_SIGMA, 1.0, 1.0, None,
                      GaussianStream(NoiseKey(0)), shard_noised=grads)
    apply(shard, 0, NoiseKey(seed), step.std, np.zeros(ids.size, np.int64), ids, step.shard_rows.numpy(), (0,))
    return (before - shard.storage.weights(0).detach())[:, 0].numpy()  # lr = 1: the released update


def _audit_dense_table(apply):
    from privacy_audit import EventCounts, epsilon_lower_bound, gaussian_delta, gaussian_optimal_threshold

    mu = 1.0 / DENSE_SIGMA
    t = DENSE_SIGMA * gaussian_optimal_threshold(DENSE_EPS, mu)
    on_d = EventCounts(int(np.sum(_dense_release(True, 11, apply) >= t)), DENSE_ROWS)
    on_dp = EventCounts(int(np.sum(_dense_release(False, 12, apply) >= t)), DENSE_ROWS)
    return epsilon_lower_bound(on_d, on_dp, delta=gaussian_delta(DENSE_EPS, mu))


def _real_apply(shard, *args):
    shard.call("apply_dense_noise_update", *args)


def _std_halved(shard, step, seed, std, *args):
    shard.call("apply_dense_noise_update", step, seed, std / 2.0, *args)


def _untouched_rows_skipped(shard, step, seed, std, table_idx, ids, rows, tables):
    """Broken: noise (and updates) only on the rows the batch touched."""
    import torch

    from widedp.selection.keyed_random import GaussianStream
    from widedp.selection.noise import gaussian_noise

    update = torch.from_numpy(rows) + gaussian_noise(rows.shape, std, GaussianStream(seed))
    shard.call("apply_rows", table_idx, ids, update.numpy())


def test_dense_table_release_passes_the_audit():
    result = _audit_dense_table(_real_apply)
    assert result.eps_lb <= DENSE_EPS, str(result)
    assert result.eps_lb > DENSE_EPS - 0.6, f"audit no longer near-tight: {result}"


@pytest.mark.parametrize("broken", [_std_halved, _untouched_rows_skipped], ids=["std_halved", "untouched_skipped"])
def test_dense_table_release_broken_is_caught(broken):
    result = _audit_dense_table(broken)
    assert result.eps_lb > DENSE_EPS, str(result)


def test_engine_refuses_a_dense_table_index_that_does_not_exist():
    from engine_fixtures import make_engine, tiny_ctr

    with pytest.raises(ValueError, match=r"dense_tables \(5,\) must be table indices in \(0, 1\)"):
        make_engine(tiny_ctr(n=8), mode="sparse", selection="threshold", dense_tables=(5,))
