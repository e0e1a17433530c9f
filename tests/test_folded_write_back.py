"""The folded write-back (`ShardGroup.defer`, `cluster.fold_write_back`): each step's update of
the selected rows (and DP-SGD's dense-table update) travels to the shards with the next call
instead of a round of its own. Specification: one shard round fewer per step, and the run —
parameters, averages, ledger, every answer read in between (evaluation lookups, checkpoints) —
equal bit for bit to the eager order's. In-process here (the group logic is the same); the
Ray cases (compiled plane, an actor killed while an update waits) are in tests/test_engine.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine_fixtures import ListSampler, engine_params, make_engine, poisson_batches, tiny_ctr
from widedp.trainer.engine.shard_group import InProcessShardGroup

STEPS = 5


def _run(fold: bool, mode: str, dense_tables=()):
    """An engine over a fixed list of batches: its per-step shard rounds, the state_dict taken
    after step 2 (a checkpoint), an evaluation after step 3, and the final parameters."""
    ds = tiny_ctr(n=64)
    batches = poisson_batches(len(ds), 0.3, 5, STEPS)
    engine = make_engine(ds, num_shards=2, mode=mode, selection="threshold", sampler=ListSampler(batches),
                         optimizer="adagrad", dense_tables=dense_tables, ema_decay=0.5, q=0.3,
                         plan_overrides={"threshold": 0.5} if mode == "sparse" else None, fold_write_back=fold)
    rounds = []
    checkpoint = evaluation = None
    for step in range(1, STEPS + 1):
        made = _rounds(engine.shards)
        assert engine.step() is not None
        rounds.append(_rounds(engine.shards) - made)
        if step == 2:
            checkpoint = engine.state_dict()
        if step == 3:
            evaluation = engine.evaluate(ds, batch_size=16)
    tables, dense = engine_params(engine)
    return rounds, checkpoint, evaluation, tables, dense, engine.ledger.state_dict()


def _rounds(group) -> int:
    return getattr(group, "_rounds_made", 0)


@pytest.fixture(autouse=True)
def count_rounds(monkeypatch):
    """Count the group's rounds: each `call` is one round, however many deferred calls it carries."""
    original = InProcessShardGroup.call

    def counted(self, method, per_shard_args):
        self._rounds_made = getattr(self, "_rounds_made", 0) + 1
        return original(self, method, per_shard_args)

    monkeypatch.setattr(InProcessShardGroup, "call", counted)


@pytest.mark.parametrize("mode,dense_tables", [("sparse", ()), ("sparse", (1,)), ("dpsgd", ())],
                         ids=["sparse", "sparse-with-a-dense-table", "dpsgd"])
def test_folding_saves_a_round_per_step_and_changes_nothing_else(mode, dense_tables):
    eager = _run(False, mode, dense_tables)
    folded = _run(True, mode, dense_tables)
    # sparse with a dense table releases twice per step (selected rows, dense table): two rounds saved
    saved = 2 if dense_tables else 1
    assert [e - f for e, f in zip(eager[0], folded[0])] == [saved] * STEPS
    # the checkpoint after step 2 holds step 2's update (state_dict carried it), the evaluation
    # after step 3 saw step 3's
    assert eager[1]["step"] == folded[1]["step"] == 2
    for a, b in zip(eager[1]["shards"], folded[1]["shards"]):
        for x, y in zip(a["weights"], b["weights"]):
            np.testing.assert_array_equal(x, y)
    assert eager[2] == folded[2]
    for name in eager[3]:
        assert bool((eager[3][name] == folded[3][name]).all()), name
    for name in eager[4]:
        assert bool((eager[4][name] == folded[4][name]).all()), name
    assert eager[5] == folded[5]


def test_the_eager_run_would_differ_if_the_deferred_update_were_dropped():
    """The comparison above can fail: a group that forgets what it deferred ends elsewhere."""
    eager = _run(False, "sparse")

    original = InProcessShardGroup.defer

    def dropping(self, method, per_shard_args):
        if not self.fold_write_back:
            return original(self, method, per_shard_args)

    try:
        InProcessShardGroup.defer = dropping  # type: ignore[method-assign]
        broken = _run(True, "sparse")
    finally:
        InProcessShardGroup.defer = original  # type: ignore[method-assign]
    assert any(not bool((eager[3][n] == broken[3][n]).all()) for n in eager[3])


def test_defer_takes_only_state_changing_calls_and_one_argument_tuple_per_shard():
    ds = tiny_ctr(n=16)
    engine = make_engine(ds, num_shards=2, fold_write_back=True)
    with pytest.raises(ValueError, match="only state-changing shard calls can be deferred, got 'lookup'"):
        engine.shards.defer("lookup", [(), ()])
    with pytest.raises(ValueError, match=r"defer\('apply_rows'\): 1 argument tuples for 2 shards"):
        engine.shards.defer("apply_rows", [()])


def test_with_trainers_calling_the_shards_directly_nothing_waits_in_the_group():
    """Trainer actors' calls bypass the group, so a deferred update could be missed by them:
    with `direct_callers` set, `defer` runs the call at once."""
    ds = tiny_ctr(n=16)
    engine = make_engine(ds, num_shards=2, fold_write_back=True)
    engine.shards.direct_callers = True
    before = _rounds(engine.shards)
    args = [(np.empty(0, np.int64), np.empty(0, np.int64), np.zeros((0, 4), np.float32), 1.0, 1)] * 2
    engine.shards.defer("apply_rows", args)
    assert engine.shards.pending_calls == () and _rounds(engine.shards) == before + 1
    engine.shards.direct_callers = False
    engine.shards.defer("apply_rows", args)
    assert engine.shards.pending_calls == ("apply_rows",) and _rounds(engine.shards) == before + 1
