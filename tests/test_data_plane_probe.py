"""benchmarks/data_plane_probe.py: the payload sizes it derives from the recorded step's byte
accounting, the gloo exchange (a real two-process gloo group) and the RESULTS choice."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import data_plane_probe as dpp  # noqa: E402


def _record(batch: int, scale: float = 1.0) -> dict:
    per = {"lookup": {"to": 740_000.0, "from": 1_700_000.0}, "apply_rows": {"to": 160_000.0, "from": 0.0},
           "example_sq_norms": {"to": 1_700_000.0, "from": 32_000.0},
           "clipped_row_sums": {"to": 64_000.0, "from": 90_000.0}}
    return {"batch": batch, "batch_mean": batch, "num_shards": 4, "dim": 16, "tables": 26,
            "bytes_per_step": {m: {d: v * scale for d, v in dirs.items()} for m, dirs in per.items()}}


def test_payloads_split_ids_and_rows_over_the_shards_and_keep_per_example_arrays_whole():
    rec = _record(1024)
    one, four = dpp.round_payloads(rec, 1), dpp.round_payloads(rec, 4)
    # ids + the folded write-back's rows in, pooled rows out: split over S
    assert one["lookup"]["request"] == 900_000 and four["lookup"]["request"] == 225_000
    assert one["lookup"]["answer"] == 1_700_000 and four["lookup"]["answer"] == 425_000
    assert one["norms"]["request"] == 4 * four["norms"]["request"] == 1_700_000
    # one value per example of the shard: the record's per-shard size (its 4 shards) at every S
    assert one["norms"]["answer"] == four["norms"]["answer"] == 8_000
    assert one["row_sums"]["request"] == four["row_sums"]["request"] == 16_000
    assert one["row_sums"]["answer"] == 4 * four["row_sums"]["answer"] == 90_000
    # sizes follow the record: a 4x larger batch's record gives 4x the bytes
    big = dpp.round_payloads(_record(4096, scale=4.0), 2)
    two = dpp.round_payloads(rec, 2)
    assert all(big[r][side] == 4 * two[r][side] for r in dpp.ROUNDS for side in ("request", "answer"))
    with pytest.raises(ValueError, match="shards"):
        dpp.round_payloads(rec, 0)
    broken = _record(1024)
    del broken["bytes_per_step"]["apply_rows"]
    with pytest.raises(ValueError, match="apply_rows"):
        dpp.round_payloads(broken, 2)


def test_the_recorded_steps_are_the_ctr_model_s():
    for b in (1024, 4096, 16384):
        path = dpp.RESULTS_DIR / f"ray_batch_{b}.json"
        assert path.exists(), f"{path} is committed with the results (make_results.RUN_VARIANTS reruns it)"
        rec = dpp.record_for(b)
        chk = dpp.pooled_check(rec)  # pooled rows out = b·26·D float32
        assert chk["recorded"] == pytest.approx(chk["model"], rel=0.02)
        assert dpp.round_payloads(rec, 2)["lookup"]["answer"] == pytest.approx(chk["recorded"] / 2, rel=1e-6)


def test_echo_answer_has_the_size_asked_and_the_request_s_head():
    req = np.arange(100, dtype=np.uint8)
    cache: dict = {}
    ans = dpp.echo_answer(req, 1000, cache)
    assert ans.size == 1000 and bytes(ans[:64]) == bytes(req[:64]) and not ans[64:].any()
    again = dpp.echo_answer(req[::-1].copy(), 1000, cache)  # the kept buffer, the new request's head
    assert again is ans and again[0] == 99
    assert bytes(dpp.echo_answer(req, 10)) == bytes(req[:10])
    with pytest.raises(ValueError, match="nbytes"):
        dpp.echo_answer(req, -1)


def _serve(port: int, result) -> None:
    result.put(dpp.gloo_shard_loop(port, 1, 2))


def test_a_two_process_gloo_group_returns_exactly_the_answers():
    ctx = multiprocessing.get_context("spawn")
    port, result = dpp.free_port(), ctx.Queue()
    child = ctx.Process(target=_serve, args=(port, result), daemon=True)
    child.start()
    try:
        caller = dpp.GlooCaller(port, 2)
        rng = np.random.default_rng(1)
        cases = [(200_000, 3_000), (40, 40), (5_000, 700_000)]  # request bytes, answer bytes
        for req_bytes, ans_bytes in cases:
            req = rng.integers(0, 256, req_bytes, dtype=np.uint8)
            (ans,) = caller.round([req], [ans_bytes])
            expected = np.zeros(ans_bytes, dtype=np.uint8)
            head = min(dpp.HEAD_BYTES, req_bytes, ans_bytes)
            expected[:head] = req[:head]
            assert ans.size == ans_bytes and np.array_equal(ans, expected)
            other = req.copy()
            other[0] ^= 0xFF  # another request: another answer (the shard answers what it received)
            (ans2,) = caller.round([other], [ans_bytes])
            assert ans2[0] == other[0] != ans[0]
        with pytest.raises(ValueError, match="shards"):
            caller.round([req, req], [10, 10])
        caller.close()
        assert result.get(timeout=30) == 2 * len(cases)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def _row(transport: str, b: int, s: int, step_ms: float, idle: float = 0.0) -> dict:
    rounds = {r: {"request_bytes": 1000 * b, "answer_bytes": 500 * b, "ms_median": step_ms / 3, "ms_min": step_ms / 4,
                  "machine_cpu_ms": 1.0, "own_cpu_ms": 0.5} for r in dpp.ROUNDS}
    return {"transport": transport, "batch": b, "shards": s, "rounds": rounds, "step_ms_median": step_ms,
            "step_machine_cpu_ms": 3.0, "step_own_cpu_ms": 1.5, "steps_timed": 20, "idle_own_cores": idle}


def _doc(times: dict, idle: dict | None = None) -> dict:
    """times: {b: {transport: [step ms at S = 1, 2]}}; idle: {transport: cores}."""
    idle = idle or {}
    rows = [_row(t, b, s, ms, idle.get(t, 0.0)) for b, per in times.items() for t, v in per.items()
            for s, ms in zip((1, 2), v)]
    return {"rows": rows, "shards": [1, 2], "machine": {"logical_cores": 2}, "passes": 2,
            "records": {str(b): {"source": f"benchmarks/results/ray_batch_{b}.json",
                                 "recorded_step_ms": {"widedp-sparse-ray": 70.0, "widedp-sparse-ray-compiled": 80.0}}
                        for b in times}}


@pytest.mark.parametrize("winner", dpp.TRANSPORTS)
def test_the_choice_is_the_smallest_step_time_summed_over_s(winner):
    times = {b: {t: ([5.0, 6.0] if t == winner else [10.0, 12.0]) for t in dpp.TRANSPORTS} for b in (1024, 4096)}
    choice = dpp.choose(_doc(times)["rows"])
    assert {c["best"] for c in choice.values()} == {winner} == {c["best_quiet"] for c in choice.values()}
    assert choice[1024]["vs_calls"][winner] == pytest.approx(1.0 if winner == "calls" else 0.5)
    text = dpp.choice_text(choice)
    assert text.startswith("transport alone, " + dpp.TRANSPORT_LABELS[winner] + " at every b")
    assert "while no round is in flight" not in text
    assert ("no fault tolerance" in text) == (winner == "gloo")
    assert ("keep ordinary calls" in text) == (winner == "calls")


def test_a_transport_that_burns_cpu_while_idle_is_named_with_the_fastest_that_does_not():
    times = {b: {"calls": [10.0, 12.0], "compiled": [2.0, 3.0], "gloo": [4.0, 5.0]} for b in (1024, 16384)}
    doc = _doc(times, idle={"compiled": 1.9, "gloo": 0.02, "calls": 0.01})
    choice = dpp.choose(doc["rows"])
    assert all(c["best"] == "compiled" and c["best_quiet"] == "gloo" for c in choice.values())
    text = dpp.choice_text(choice)
    assert text.startswith("transport alone, compiled Ray graph (Ray's spinning reads) at every b (b = 1,024: 0.23×")
    assert "use 1.90 cores while no round is in flight (1.89 more than with ordinary calls)" in text
    assert "without it: torch.distributed (gloo) at every b (b = 1,024: 0.41×" in text and "no fault tolerance" in text
    _, goals = dpp.results_section(doc)
    assert "fastest below 0.1 idle cores beyond ordinary calls': torch.distributed (gloo)" in goals[1][3]
    # the same times with gloo polling too: ordinary calls are what is left
    choice = dpp.choose(_doc(times, idle={"compiled": 1.9, "gloo": 0.5})["rows"])
    assert {c["best_quiet"] for c in choice.values()} == {"calls"}
    assert "keep ordinary calls" in dpp.choice_text(choice)
    # idle CPU counts beyond ordinary calls' (Ray's daemons idle under every transport): polling
    # as much as calls' is quiet, 0.1 core more is not
    choice = dpp.choose(_doc(times, idle={"calls": 0.3, "compiled": 0.35, "gloo": 0.45})["rows"])
    assert {c["best_quiet"] for c in choice.values()} == {"compiled"}
    choice = dpp.choose(_doc(times, idle={"calls": 0.3, "compiled": 0.4, "gloo": 0.35})["rows"])
    assert {c["best_quiet"] for c in choice.values()} == {"gloo"}
    # every other transport polling a core: ordinary calls are left
    choice = dpp.choose(_doc(times, idle={"compiled": 1.0, "gloo": 1.0, "calls": 0.0})["rows"])
    assert {c["best_quiet"] for c in choice.values()} == {"calls"}


def test_a_choice_that_differs_by_batch_and_by_shards_is_said_so():
    times = {1024: {"calls": [4.0, 5.0], "compiled": [6.0, 7.0], "gloo": [5.0, 4.5]},  # calls by the sum
             16384: {"calls": [40.0, 50.0], "compiled": [45.0, 48.0], "gloo": [30.0, 35.0]}}
    doc = _doc(times)
    choice = dpp.choose(doc["rows"])
    assert choice[1024]["best"] == "calls" and choice[1024]["fastest_at"] == {1: "calls", 2: "gloo"}
    assert choice[16384]["best"] == "gloo" and choice[16384]["vs_calls"]["gloo"] == pytest.approx(65 / 90)
    text = dpp.choice_text(choice)
    assert text.startswith("transport alone, by b: b = 1,024: ordinary Ray actor calls")
    assert "no fault tolerance" in text
    lines, goals = dpp.results_section(doc)
    table = [ln for ln in lines if ln.startswith("| 16,384 | 2 |")]
    assert len(table) == 3 and "| 0.70 |" in table[2]  # gloo at S = 2: 35 / 50
    assert any("widedp-sparse-ray-compiled 80.0 ms" in ln for ln in lines)
    assert goals[0][0].startswith("torch.distributed (gloo) measured against the compiled graph and ordinary calls")
    assert goals[0][2] == "reported" and goals[0][3] == f"choice: {text}"
    assert [g[0] for g in goals[1:]] == ["b = 1,024: the fastest transport for one step's rounds",
                                         "b = 16,384: the fastest transport for one step's rounds"]
    assert goals[2][1].startswith("torch.distributed (gloo)") and "S = 1: torch.distributed (gloo)" in goals[2][3]


def test_a_transport_missing_at_some_s_is_compared_on_the_s_all_have():
    rows = _doc({1024: {"calls": [4.0, 5.0], "gloo": [3.0, 9.0]}})["rows"]
    rows = [r for r in rows if not (r["transport"] == "gloo" and r["shards"] == 2)]
    choice = dpp.choose(rows)
    assert choice[1024]["shards"] == [1] and choice[1024]["best"] == "gloo"


def _raw(transport: str, steps: list, cpu: float) -> dict:
    """One pass's raw record at b = 1024, S = 2: `steps` of three equal rounds."""
    return {"transport": transport, "batch": 1024, "shards": 2, "setup_s": 1.0, "settled_s": 1.0, "buffer_bytes": None,
            "request_bytes": {r: 10 for r in dpp.ROUNDS}, "answer_bytes": {r: 20 for r in dpp.ROUNDS},
            "round_s": {r: [t / 3 for t in steps] for r in dpp.ROUNDS},
            "machine_cpu_s": {r: cpu for r in dpp.ROUNDS}, "own_cpu_s": {r: cpu / 2 for r in dpp.ROUNDS},
            "processes": 9, "load_average": [1.0, 1.0, 1.0]}


def test_summarize_pools_the_passes():
    raw = [_raw("gloo", [0.010, 0.012, 0.011], cpu=0.03), _raw("gloo", [0.030, 0.031, 0.029, 0.032, 0.033], cpu=0.05)]
    idle = [{"transport": "gloo", "shards": 2, "seconds": 2.0, "own_cpu_s": 0.1, "machine_cpu_s": 0.3},
            {"transport": "gloo", "shards": 2, "seconds": 2.0, "own_cpu_s": 0.3, "machine_cpu_s": 0.5}]
    (row,) = dpp.summarize(raw, idle)
    assert row["passes"] == 2 and row["steps_timed"] == 8
    assert row["step_ms_median"] == pytest.approx(1e3 * (0.029 + 0.030) / 2)  # the median of all 8 steps
    assert row["step_ms_per_pass"] == pytest.approx([11.0, 31.0])
    assert row["step_machine_cpu_ms"] == pytest.approx(1e3 * 3 * 0.08 / 8)
    assert row["rounds"]["lookup"]["own_cpu_ms"] == pytest.approx(1e3 * 0.04 / 8)
    assert row["idle_own_cores"] == pytest.approx(0.1) and row["idle_machine_cores"] == pytest.approx(0.2)
