"""The many-machine step model of benchmarks/cluster_model.py (a pure function): what each term
means, checked on hand-made calibrations — and the RESULTS goal row computed from the checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cluster_model as cm  # noqa: E402

ROUNDS = cm.TRAINER_ROUNDS + cm.COORDINATOR_ROUNDS  # one trainer's rounds to every shard, then the coordinator's
CAL = {"batch": 1000.0, "trainer_cpu_s": 0.040, "shard_cpu_s": 0.020, "coordinator_cpu_s": 0.010,
       "machine_cpu_s": 0.100, "bytes_per_step": 8e6, "latency_s": {1: 0.002, 2: 0.003, 4: 0.005},
       "call_cpu_s": 0.001}


def test_at_the_calibration_point_the_model_returns_the_calibration():
    p = cm.predict(CAL, 1, 1, 1000, cores=2)
    assert p["cpu_s"] == pytest.approx(CAL["machine_cpu_s"])  # all the measured work, nothing invented
    assert p["critical_s"] == pytest.approx(ROUNDS * 0.002 + 0.040 + 0.020 + 0.010)
    assert p["step_s"] == pytest.approx(max(p["critical_s"], 0.100 / 2))
    assert p["calls"] == cm.TRAINER_ROUNDS + cm.COORDINATOR_ROUNDS + 1  # S = N = 1: each round one call, one task


def test_trainers_and_shards_split_their_own_work_and_add_calls():
    one, many = cm.predict(CAL, 1, 1, 1000), cm.predict(CAL, 4, 2, 1000)
    # the trainer's share halves, the shard's quarters, the coordinator's stays; λ(4) per round
    assert many["critical_s"] == pytest.approx(ROUNDS * 0.005 + 0.040 / 2 + 0.020 / 4 + 0.010)
    assert many["calls"] == cm.TRAINER_ROUNDS * 2 * 4 + cm.COORDINATOR_ROUNDS * 4 + 2
    # the same work in all, plus a CPU cost per extra call
    assert many["cpu_s"] - one["cpu_s"] == pytest.approx(CAL["call_cpu_s"] * (many["calls"] - one["calls"]))
    assert many["bytes_per_shard"] == pytest.approx(8e6 / 4) and many["bytes_per_trainer"] == pytest.approx(8e6 / 2)


def test_on_one_machine_the_step_is_at_least_all_its_work_over_the_cores():
    p = cm.predict(CAL, 4, 4, 8000, cores=2)
    assert p["step_s"] == pytest.approx(p["cpu_s"] / 2) and p["cpu_s"] / 2 > p["critical_s"]


def test_batch_and_width_scale_work_and_bytes_not_latency():
    base, wide = cm.predict(CAL, 2, 2, 1000), cm.predict(CAL, 2, 2, 2000, width=4)
    rounds = ROUNDS * cm.round_latency(CAL["latency_s"], 2)
    assert wide["critical_s"] - rounds == pytest.approx(8 * (base["critical_s"] - rounds))
    assert wide["bytes_per_shard"] == pytest.approx(8 * base["bytes_per_shard"])


def test_links_add_the_busiest_link_and_a_round_trip_per_round():
    p = cm.predict(CAL, 8, 2, 1000, link_bytes_per_s=1e9, rtt_s=1e-4)
    assert p["network_s"] == pytest.approx(8e6 / 2 / 1e9 + ROUNDS * 1e-4)  # the trainers' links are the busiest
    assert p["step_s"] == pytest.approx(p["critical_s"] + p["network_s"])


def test_round_latency_is_measured_where_measured_and_the_fitted_line_elsewhere():
    lam0, lam1 = cm.latency_line({1: 0.002, 2: 0.003, 4: 0.005})
    assert (lam0, lam1) == (pytest.approx(0.001), pytest.approx(0.001))
    assert cm.round_latency(CAL["latency_s"], 2) == 0.003
    assert cm.round_latency(CAL["latency_s"], 128) == pytest.approx(0.001 + 0.001 * 128)
    # a latency that falls with S is not extrapolated downward
    assert cm.latency_line({1: 0.004, 2: 0.003})[1] == 0.0


def test_criteo_shape_caps_each_table_at_the_hash_size():
    shape = cm.criteo_shape()
    assert shape["features"] == 26 and max(shape["rows"]) == cm.CRITEO_HASH
    assert sum(1 for r in shape["rows"] if r == cm.CRITEO_HASH) == 5  # the five tables above 40M
    assert shape["table_bytes"] == shape["total_rows"] * 128 * 4


def _doc(errors):
    checks = [{"shards": 1, "trainers": 1, "batch": 1000, "measured_s": 0.1, "predicted_s": 0.1, "critical_s": 0.1,
               "cpu_bound_s": 0.05, "error": 0.0, "machine_cpu_s": 0.1, "predicted_cpu_s": 0.1, "calibration": True}]
    for i, e in enumerate(errors):
        checks.append({**checks[0], "shards": 2, "trainers": i + 1, "predicted_s": 0.1 * (1 + e), "error": e,
                       "calibration": False})
    proj = [{"shards": 8, "trainers": 8, "gbps": 25, "step_s": 0.2, "examples_per_s": 3e5, "critical_s": 0.1,
             "network_s": 0.1, "bytes_per_shard": 1e6, "table_bytes_per_shard": 1e9}]
    return {"config": "configs/ctr.toml", "rows": 520000, "nodes": 3, "cores": 2, "batch": 4096, "grid": [1, 2],
            "calibration": {**CAL, "latency_s": {"1": 0.002}}, "ping": {"latency_s": {"1": 0.002}}, "checks": checks,
            "projections": proj, "criteo": cm.criteo_shape(), "rtt_s": 5e-5}


def test_the_goal_row_is_met_only_when_every_checked_point_is_within_a_quarter():
    _, goals = cm.results_section(_doc([0.10, -0.20]))
    assert goals[0][2] == "**met**" and "worst S = 2, N = 2: -20%" in goals[0][1]
    _, goals = cm.results_section(_doc([0.10, 0.30]))
    assert goals[0][2] == "**missed**" and "S = 2, N = 2: +30%" in goals[0][3]


def test_work_per_step_does_not_grow_with_the_batch_and_is_not_divided():
    """A role's CPU measured at two batches splits into a part per step and a part per example:
    only the latter grows with the batch and is shared among the actors of that role."""
    small = {"batch_mean": 250.0, "trainers": [{"cpu_ms_per_step": 16.0}], "shard_cpu_ms_per_step": [5.0],
             "coordinator_cpu_ms_per_step": 7.0, "machine_cpu_ms_per_step": 40.0}
    big = {"batch_mean": 1000.0, "trainers": [{"cpu_ms_per_step": 40.0}], "shard_cpu_ms_per_step": [20.0],
           "coordinator_cpu_ms_per_step": 10.0, "machine_cpu_ms_per_step": 100.0,
           "all_bytes_per_step": {"to": 4e6, "from": 4e6}}
    cal = cm.calibration(big, small, {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}})
    assert cal["fixed"] == {"trainer_cpu_s": pytest.approx(0.008), "shard_cpu_s": pytest.approx(0.0),
                            "coordinator_cpu_s": pytest.approx(0.006), "machine_cpu_s": pytest.approx(0.020)}
    p = cm.predict(cal, 1, 2, 4000)
    # trainer: 8 ms + 32 ms·4/2; shard 20 ms·4; coordinator 6 ms + 4 ms·4
    assert p["critical_s"] == pytest.approx(ROUNDS * 0.002 + (0.008 + 0.064) + 0.080 + (0.006 + 0.016))
    # the machine's work at this batch, the second trainer's own 8 ms per step, and κ per extra call
    assert p["cpu_s"] == pytest.approx(0.020 + 0.080 * 4 + 0.008 + 0.001 * (p["calls"] - (ROUNDS + 1)))
    # without the second batch every role is taken as per example (the pessimistic reading)
    whole = cm.predict(cm.calibration(big, None, {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}}), 1, 2, 4000)
    assert whole["critical_s"] > p["critical_s"]


def _point(shards, trainers, batch, trainer_ms, shard_ms, coordinator_ms, machine_ms):
    return {"num_shards": shards, "num_trainers": trainers, "batch_mean": batch,
            "trainers": [{"cpu_ms_per_step": trainer_ms}] * trainers, "shard_cpu_ms_per_step": [shard_ms] * shards,
            "coordinator_cpu_ms_per_step": coordinator_ms, "machine_cpu_ms_per_step": machine_ms,
            "step_ms_median": machine_ms, "all_bytes_per_step": {"to": 4e6, "from": 4e6}}  # a CPU-bound step on one core: slower than modelled wherever CPU is


def test_the_roles_cpu_adds_up_to_the_models_cpu_and_reads_the_measurement():
    cal = dict(CAL, fixed={"trainer_cpu_s": 0.008, "shard_cpu_s": 0.004, "coordinator_cpu_s": 0.006,
                           "machine_cpu_s": 0.030})
    for shards, trainers in ((1, 1), (2, 1), (4, 2), (4, 4)):
        [row] = cm.role_rows(cal, [_point(shards, trainers, 2000.0, 30.0, 12.0, 15.0, 200.0)])
        modelled = (trainers * row["trainer"][1] + shards * row["shard"][1] + row["coordinator"][1]
                    + row["rest"][1])
        assert modelled == pytest.approx(cm.predict(cal, shards, trainers, 2000.0)["cpu_s"])
        assert row["trainer"][0] == pytest.approx(0.030) and row["shard"][0] == pytest.approx(0.012)
        assert row["rest"][0] == pytest.approx(0.200 - trainers * 0.030 - shards * 0.012 - 0.015)


def test_the_miss_reason_names_the_coordinators_growth_and_the_contention():
    cal = dict(CAL, fixed={"trainer_cpu_s": 0.008, "shard_cpu_s": 0.004, "coordinator_cpu_s": 0.006,
                           "machine_cpu_s": 0.030})
    pts = [_point(1, 1, 1000.0, 40.0, 20.0, 10.0, 100.0), _point(1, 2, 1000.0, 24.0, 20.0, 18.0, 130.0),
           _point(2, 1, 1000.0, 40.0, 12.0, 10.0, 110.0), _point(2, 2, 1000.0, 40.0, 30.0, 30.0, 300.0)]
    doc = {"calibration": cal, "points": pts, "cores": 2.0, "grid": [1, 2], "checks": [], "projections": [],
           "config": "c", "rows": 10, "nodes": 3, "batch": 1000, "ping": {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}},
           "criteo": cm.criteo_shape(), "rtt_s": 5e-5}
    doc["calibration"] = dict(cal, small_batch=250.0)
    _, goals = cm.results_section(doc)
    assert goals[0][2] == "**missed**"
    why = goals[0][3]
    assert "12 measured at N = 1, 30 at N = 2" in why  # a shard's CPU for the same work under contention
    # S = 1, N = 2 is the second calibration point: the coordinator's 8 ms per extra trainer and the
    # machine's rest per extra call with payloads, (130 - 2·24 - 20 - 18) - (100 - 40 - 20 - 10) = 14 ms
    # over 3 extra calls (2 rounds to the shard and a task), come from it (so it is not checked, and the coordinator's growth is modelled)
    cal2 = cm.calibration(pts[0], None, doc["ping"], pts[1])
    assert cal2["coordinator_per_trainer_s"] == pytest.approx(0.008)
    assert cal2["call_cpu_s"] == pytest.approx(0.014 / 3)
    assert "from N = 1 to 2 at S = 1" not in why
    lines, _ = cm.results_section(doc)
    assert any("| 1 | 2 (calibration) |" in line for line in lines)


def test_the_call_and_trainer_slopes_are_taken_over_the_most_trainers_measured_at_one_shard():
    pts = {(1, 1): _point(1, 1, 1000.0, 40.0, 20.0, 10.0, 100.0), (1, 2): _point(1, 2, 1000.0, 24.0, 20.0, 30.0, 200.0),
           (1, 4): _point(1, 4, 1000.0, 12.0, 20.0, 22.0, 250.0), (2, 2): _point(2, 2, 1000.0, 20.0, 10.0, 30.0, 200.0)}
    second = cm._most_trainers(pts)
    assert (second["num_shards"], second["num_trainers"]) == (1, 4)
    assert cm._most_trainers({(1, 1): pts[(1, 1)], (2, 2): pts[(2, 2)]}) is None  # no S = 1, N > 1: none
    cal = cm.calibration(pts[(1, 1)], None, {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}}, second)
    assert cal["second_point"] == [1, 4]
    assert cal["coordinator_per_trainer_s"] == pytest.approx(0.012 / 3)  # 10 → 22 ms over 3 extra trainers
    # the rest: (250 - 4·12 - 20 - 22) - (100 - 40 - 20 - 10) = 130 ms over the 9 extra calls of N = 4
    assert cal["call_cpu_s"] == pytest.approx(0.130 / (cm.calls_per_step(1, 4) - cm.calls_per_step(1, 1)))
    with pytest.raises(ValueError, match="S = 1 with N >= 2"):
        cm.calibration(pts[(1, 1)], None, {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}}, pts[(2, 2)])


def test_a_repeated_point_is_its_median_run_whole_with_every_repeat_kept():
    runs = [{"step_ms_median": 300.0, "machine_cpu_ms_per_step": 900.0},
            {"step_ms_median": 180.0, "machine_cpu_ms_per_step": 400.0},
            {"step_ms_median": 200.0, "machine_cpu_ms_per_step": 500.0}]
    chosen = cm.median_run(runs)
    # the run in the middle, with its own CPU figure (not a mix of runs), and the repeats in order
    assert chosen["step_ms_median"] == 200.0 and chosen["machine_cpu_ms_per_step"] == 500.0
    assert chosen["repeat_step_ms"] == [300.0, 180.0, 200.0]
    assert "repeat_step_ms" not in runs[2]  # the measurement itself is left as it was
    assert cm.median_run(runs[:2])["step_ms_median"] == 180.0  # even count: the lower median
    with pytest.raises(ValueError):
        cm.median_run([])


def test_repeated_ping_rounds_take_the_median_per_shard_count():
    pings = [{"latency_s": {"1": 0.001, "2": 0.004}, "call_cpu_s": {"1": 1e-3, "2": 2e-3}},
             {"latency_s": {"1": 0.003, "2": 0.002}, "call_cpu_s": {"1": 3e-3, "2": 1e-3}},
             {"latency_s": {"1": 0.002, "2": 0.009}, "call_cpu_s": {"1": 2e-3, "2": 5e-3}}]
    merged = cm.median_ping(pings)
    assert merged["latency_s"] == {"1": 0.002, "2": 0.004} and merged["call_cpu_s"] == {"1": 2e-3, "2": 2e-3}
    assert merged["repeats"] == 3


def test_the_calibration_step_beyond_its_cpu_and_rounds_is_charged_per_byte_on_the_path():
    base = _point(1, 1, 1000.0, 40.0, 20.0, 10.0, 100.0)
    ping = {"latency_s": {"1": 0.002}, "call_cpu_s": {"1": 0.001}}
    bare = cm.calibration(dict(base, step_ms_median=0.0), None, ping)  # a step inside its critical path
    assert bare["transfer_s_per_byte"] == 0.0
    critical = cm.predict(bare, 1, 1, 1000.0)["critical_s"]  # 4 rounds·2 ms + 40 + 20 + 10 ms = 78 ms
    assert critical == pytest.approx(0.078)
    cal = cm.calibration(dict(base, step_ms_median=118.0), None, ping)  # 40 ms more, over 8 MB
    assert cal["transfer_s_per_byte"] == pytest.approx(0.040 / 8e6)
    # the calibration point is reproduced, and the busiest role's share of the bytes is charged:
    # at S = 4, N = 2 each trainer moves half of the step's bytes, 20 ms
    assert cm.predict(cal, 1, 1, 1000.0)["critical_s"] == pytest.approx(0.118)
    four_two = cm.predict(cal, 4, 2, 1000.0)
    assert four_two["transfer_s"] == pytest.approx(0.020)
    assert four_two["critical_s"] - cm.predict(bare, 4, 2, 1000.0)["critical_s"] == pytest.approx(0.020)
