"""`widedp report` (trainer/release/report.py): what the plots are drawn from — ε per accountant over
*training steps* (valid bounds only), held-out metrics as points at their steps, rows noised
per step, non-private runs — checked on the series `render` returns, plus the PNGs being real
PNGs. Run dirs are built synthetically (summary.json, metrics.jsonl, ledger.json as
`widedp train` writes them); one tiny real DP-FEST run checks the mapping on a trainer's ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from widedp.accounting import PrivacyLedger, make_accountant, step_event
from widedp.accounting import events as ev
from widedp.trainer.cli import main
from widedp.trainer.release.report import render, step_mapping

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DELTA = 1e-5


def _valid_png(path) -> bool:
    import matplotlib.image

    path = Path(path)
    if not (path.exists() and path.read_bytes()[:8] == PNG_MAGIC):
        return False
    image = matplotlib.image.imread(path)  # decodes the whole file
    return image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def _run_dir(root: Path, name: str, *, steps: int, history=None, mode="dpsgd", eval_steps=(), final_metrics=None,
             rows=None, target_epsilon=3.0, resumed=False, extra_lines=()) -> Path:
    """A run dir as `widedp train` leaves it: ledger.json from `history` ([(event, count)]),
    metrics.jsonl with a metrics line per step (rows_selected) and eval lines at `eval_steps`."""
    d = root / name
    d.mkdir(parents=True)
    summary = {"mode": mode, "selection": None, "steps": steps, "delta": DELTA, "accountant": "rdp",
               "target_epsilon": target_epsilon, "resumed": resumed,
               "test_metrics": final_metrics if final_metrics is not None else {"logloss": 0.5, "auc": 0.7},
               "phase_ms_median": {"lookup": 1.0, "noise": 2.0}}
    if history is not None:
        ledger = PrivacyLedger("rdp", DELTA)
        for event, count in history:
            ledger.record(event, count)
        ledger.save(d / "ledger.json")
        summary["epsilon"] = ledger.epsilon()
        summary["events_charged"] = ledger.steps
    else:
        summary["epsilon"] = float("inf")
    (d / "summary.json").write_text(json.dumps(summary))
    lines = []
    for t in range(1, steps + 1):
        lines.append({"step": t, "epsilon": 0.0, "rows_selected": (rows or (lambda s: 10 * s))(t)})
        if t in eval_steps:
            lines.append({"step": t, "test_metrics": {"logloss": 1.0 / t, "auc": 0.5 + 0.01 * t}})
    lines += list(extra_lines)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def _eps(name, history):
    return make_accountant(name).epsilon(history, DELTA)


# ---- ε against training steps ------------------------------------------------------------------------

A = step_event(0.05, 2.0)
B = step_event(0.05, 3.0)
ONE_TIME = ev.GaussianDpEvent(5.0)


def test_two_events_per_step_and_a_one_time_charge_map_to_training_steps(tmp_path):
    T = 3
    run = _run_dir(tmp_path, "two", steps=T, history=[(ONE_TIME, 1)] + [(A, 1), (B, 1)] * T)
    result = render([run], curve_points=12)
    eps = result["series"]["two"]["epsilon"]
    # x values are training steps 0..T (0: before the first step), not charged events 0..2T+1
    assert eps["steps"] == list(range(T + 1)) and eps["x_label"] == "training step"
    assert eps["mapping"]["events_per_step"] == 2 and eps["mapping"]["one_time"] == {0: 1}
    assert eps["events_charged"] == [1 + 2 * t for t in range(T + 1)]
    for t, value in zip(eps["steps"], eps["accountants"]["rdp"]["epsilon"]):  # ε after step t: its events
        assert value == pytest.approx(_eps("rdp", [(ONE_TIME, 1)] + [(A, 1), (B, 1)] * t), rel=1e-9)
    for name in ("pld", "prv"):  # every accountant with a valid bound is plotted
        cur = eps["accountants"][name]
        assert cur["plotted"] and all(v is not None for v in cur["epsilon"])
        assert cur["epsilon"][-1] == pytest.approx(_eps(name, [(ONE_TIME, 1)] + [(A, 1), (B, 1)] * T), rel=1e-6)
    drawn = result["drawn"]["epsilon"]
    assert drawn["plotted"]["two"] == ["rdp", "pld", "prv"]
    assert "unsupported" in drawn["not_plotted"]["two"]["paper"]  # distinct events: no Theorem 3
    assert drawn["one_time_marks"] == [{"run": "two", "step": 0, "events": 1}]
    md = Path(result["markdown"]).read_text()
    assert "two: plotted: rdp, pld, prv (x: training step" in md
    assert "1 one-time event(s) charged before step 0, 2 event(s) per step" in md
    assert "not plotted: paper — unsupported" in md


def test_an_invalid_paper_bound_is_left_off_the_plot_and_said_so(tmp_path):
    history = [(step_event(0.05, 0.7), 40)]
    paper = make_accountant("paper").details(history, DELTA)
    assert not paper["valid"]  # the premise: Theorem 3's conditions fail for this run
    run = _run_dir(tmp_path, "bad", steps=40, history=history)
    result = render([run], curve_points=2)
    cur = result["series"]["bad"]["epsilon"]["accountants"]["paper"]
    assert not cur["plotted"] and all(v is None for v in cur["epsilon"])
    assert cur["reason"].startswith("conditions violated")
    for drawn in (result["drawn"]["epsilon"], result["drawn"]["summary"]["epsilon"]):
        assert "paper" not in drawn["plotted"]["bad"]
        assert "paper: not plotted (conditions violated)" in drawn["notes"]  # in the legend
    assert set(result["drawn"]["epsilon"]["plotted"]["bad"]) == {"rdp", "pld", "prv"}
    md = Path(result["markdown"]).read_text()
    assert "not plotted: paper — conditions violated" in md
    assert "(conditions violated: not a valid bound)" in md  # the table's paper cell
    saved = json.loads(Path(result["data"]).read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert saved["drawn"]["epsilon"]["not_plotted"]["bad"]["paper"].startswith("conditions violated")


def test_a_valid_paper_bound_is_plotted_beside_the_others(tmp_path):
    step = step_event(0.01, 10.0)
    T = 10
    assert make_accountant("paper").details([(step, T)], DELTA)["valid"]  # the premise
    run = _run_dir(tmp_path, "good", steps=T, history=[(step, T)])
    result = render([run], curve_points=4)
    eps = result["series"]["good"]["epsilon"]
    assert result["drawn"]["epsilon"]["plotted"]["good"] == ["rdp", "pld", "prv", "paper"]
    for t, value in zip(eps["steps"], eps["accountants"]["paper"]["epsilon"]):
        assert value == (0.0 if t == 0 else pytest.approx(_eps("paper", [(step, t)])))
    assert eps["steps"][0] == 0 and eps["steps"][-1] == T


def test_target_epsilon_is_drawn_and_the_summary_figure_has_four_panels(tmp_path):
    run = _run_dir(tmp_path, "r", steps=4, history=[(A, 4)], eval_steps=(2, 4), target_epsilon=2.5)
    result = render([run], curve_points=3, accountants=("rdp",))
    assert result["series"]["r"]["epsilon"]["target_epsilon"] == 2.5
    assert set(result["drawn"]["summary"]) == {"epsilon", "heldout", "loss", "rows_noised"}
    out = Path(result["markdown"]).parent
    assert Path(result["summary_plot"]) == out / "summary.png"
    for name in ("summary.png", "epsilon.png", "heldout.png", "loss.png", "rows_noised.png", "phases.png"):
        assert str(out / name) in result["plots"]
        assert _valid_png(out / name), name
        assert f"![{name}]({name})" in Path(result["markdown"]).read_text()


# ---- step mapping ------------------------------------------------------------------------------------

def test_step_charges_replayed_after_a_resume_are_never_under_counted():
    T = 6
    m = step_mapping([(ONE_TIME, 1), (A, T + 2)], T, resumed=True)
    assert m["mapped"] and m["events_per_step"] == 1 and m["extra_step_charges"] == 2
    assert m["events_by_step"][0] == 1 and m["events_by_step"][1] == 1 + 3  # the 2 extra at step 1
    assert m["events_by_step"][T] == 1 + T + 2  # the whole ledger at the last step
    # never resumed: a whole multiple of T identical events is that many events per step
    m = step_mapping([(A, 2 * T)], T, resumed=False)
    assert m["events_per_step"] == 2 and m["events_by_step"] == [2 * t for t in range(T + 1)]


def test_a_one_time_charge_between_steps_is_placed_at_its_step():
    m = step_mapping([(A, 2), (ONE_TIME, 1), (A, 2)], 4)
    assert m["mapped"] and m["one_time"] == {2: 1}
    assert m["events_by_step"] == [0, 1, 3, 4, 5]


def test_a_ledger_with_fewer_step_events_than_steps_is_plotted_against_events_and_says_so(tmp_path):
    run = _run_dir(tmp_path, "short", steps=8, history=[(A, 3)])
    result = render([run], curve_points=3, accountants=("rdp",))
    eps = result["series"]["short"]["epsilon"]
    assert not eps["mapping"]["mapped"] and eps["x_label"].startswith("charged ledger events")
    assert eps["steps"][-1] == 3
    assert "cannot be mapped to training steps" in Path(result["markdown"]).read_text()


# ---- held-out points, loss, rows ----------------------------------------------------------------------

def test_heldout_metrics_are_points_at_the_steps_the_evaluations_ran(tmp_path):
    # eval lines at steps 3 and 6, a replayed step 3 (resume) re-logged, the final evaluation at 8
    replay = {"step": 3, "test_metrics": {"logloss": 0.25, "auc": 0.9}}
    run = _run_dir(tmp_path, "h", steps=8, history=[(A, 8)], eval_steps=(3, 6), final_metrics={"logloss": 0.1, "auc": 0.8},
                   extra_lines=[replay])
    result = render([run], curve_points=3, accountants=("rdp",))
    h = result["series"]["h"]["heldout"]
    assert h["steps"] == [3, 6, 8] and h["source"] == ["metrics.jsonl", "metrics.jsonl", "summary.json"]
    assert h["metrics"]["auc"] == [0.9, 0.5 + 0.06, 0.8]  # the last line of a re-logged step wins
    panel = result["drawn"]["summary"]["heldout"]["h"]
    assert panel == {"metric": "auc", "steps": [3, 6, 8], "values": [0.9, 0.56, 0.8], "style": "points"}
    loss = result["drawn"]["summary"]["loss"]
    assert loss["heldout"]["h"]["metric"] == "logloss" and loss["heldout"]["h"]["style"] == "points"
    assert loss["train"] == {}  # not a debug run: no training batch loss
    assert "h: held-out evaluations at steps 3, 6, 8." in Path(result["markdown"]).read_text()
    assert set(result["drawn"]["heldout"]) == {"logloss", "auc"}


def test_rows_noised_per_step_come_from_the_logged_rows_selected(tmp_path):
    run = _run_dir(tmp_path, "rows", steps=5, history=[(A, 5)], rows=lambda t: 100 + t)
    result = render([run], curve_points=2, accountants=("rdp",))
    r = result["drawn"]["summary"]["rows_noised"]["rows"]
    assert r == {"steps": [1, 2, 3, 4, 5], "values": [101, 102, 103, 104, 105], "noised": True}


def test_a_debug_run_shows_its_training_batch_loss(tmp_path):
    debug = [{"step": t, "loss": 2.0 / t} for t in (1, 2, 3)]
    run = _run_dir(tmp_path, "dbg", steps=3, history=[(A, 3)], extra_lines=debug)
    result = render([run], curve_points=2, accountants=("rdp",))
    tl = result["series"]["dbg"]["train_loss"]
    assert tl["steps"] == [1, 2, 3] and tl["loss"] == [2.0, 1.0, 2.0 / 3]
    assert result["drawn"]["summary"]["loss"]["train"]["dbg"]["style"] == "line"


# ---- non-private runs ---------------------------------------------------------------------------------

def test_a_nonprivate_run_renders_without_epsilon_and_says_nonprivate(tmp_path):
    run = _run_dir(tmp_path, "np", steps=4, history=None, mode="nonprivate", eval_steps=(2, 4))
    result = render([run], curve_points=3)
    s = result["series"]["np"]
    assert not s["private"] and s["epsilon"] is None and "non-private" in s["epsilon_note"]
    out = Path(result["markdown"]).parent
    assert not (out / "epsilon.png").exists() and str(out / "epsilon.png") not in result["plots"]
    assert _valid_png(out / "summary.png") and _valid_png(out / "heldout.png")
    assert result["drawn"]["summary"]["epsilon"]["plotted"] == {}
    assert result["drawn"]["summary"]["rows_noised"]["np"]["noised"] is False
    md = Path(result["markdown"]).read_text()
    assert "np: non-private — no privacy guarantee (ε = ∞), no ε plotted." in md
    assert "∞ (non-private)" in md


def test_several_runs_overlay_private_and_nonprivate(tmp_path):
    a = _run_dir(tmp_path, "priv", steps=4, history=[(A, 4)], eval_steps=(2, 4))
    b = _run_dir(tmp_path, "np", steps=4, history=None, mode="nonprivate", eval_steps=(2, 4))
    result = render([a, b], tmp_path / "out", curve_points=3, accountants=("rdp", "paper"))
    drawn = result["drawn"]["epsilon"]
    assert "priv" in drawn["plotted"] and "np" not in drawn["plotted"]
    assert "np: non-private (no ε)" in drawn["notes"]
    assert set(result["drawn"]["summary"]["heldout"]) == {"priv", "np"}


# ---- the CLI --------------------------------------------------------------------------------------------

def test_cli_takes_run_dirs_positionally_and_with_repeated_run_dir(tmp_path, capsys):
    a, b, c = (_run_dir(tmp_path, n, steps=3, history=None, mode="nonprivate") for n in "abc")
    capsys.readouterr()
    assert main(["report", "--run-dir", str(a), "--run-dir", str(b), "--out", str(tmp_path / "o1"),
                 "--curve-points", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["runs"] == [str(a), str(b)] and "series" not in printed
    assert printed["summary_plot"] == str(tmp_path / "o1" / "summary.png") and _valid_png(printed["summary_plot"])
    assert main(["report", str(a), "--run-dir", str(c), "--curve-points", "2", "--out", str(tmp_path / "o2")]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == [str(a), str(c)]
    assert main(["report", str(a), "--curve-points", "2"]) == 0  # positional alone: RUN_DIR/report
    assert json.loads(capsys.readouterr().out)["markdown"] == str(a / "report" / "report.md")


def test_cli_help_mentions_run_dir(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--help"])
    assert exc.value.code == 0
    assert "--run-dir" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    ([], "RUN_DIR"),
    (["--curve-points", "1"], "--curve-points"),
    (["--accountants", "rdp,nope"], "--accountants"),
])
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, capsys, argv, needle):
    run = _run_dir(tmp_path, "x", steps=2, history=[(A, 2)])
    args = argv if not argv else [str(run), *argv]
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_damaged_metrics_file_is_named_with_its_line(tmp_path, capsys):
    run = _run_dir(tmp_path, "bad", steps=2, history=[(A, 2)])
    good = len((run / "metrics.jsonl").read_text().splitlines())
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "metrics.jsonl") in err and f"line {good + 1} " in err and err.count("\n") == 1


# ---- a real run's ledger ----------------------------------------------------------------------------------

def test_a_real_fest_run_charges_its_one_time_selection_before_step_0(tmp_path):
    from widedp.trainer.data import synth_ctr

    synth_ctr(tmp_path / "data", num_examples=1000, table_sizes=200, seed=1)
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{tmp_path / "data"}"\n[train]\nsteps = 4\neval_every = 2\n')
    tiny = ["model.embedding_dim=4", "model.bottom_mlp=[8]", "model.top_mlp=[8]", "train.batch_size=64",
            "train.log_every=1", "privacy.k=20", "cluster.backend=local", "cluster.num_shards=1",
            "train.mode=sparse", "train.selection=fest"]
    argv = ["train", "--config", str(config), "--run-dir", str(tmp_path / "fest"), "--no-progress"]
    assert main(argv + [x for t in tiny for x in ("--set", t)]) == 0
    result = render([tmp_path / "fest"], curve_points=4, accountants=("rdp", "paper"))
    eps = result["series"]["fest"]["epsilon"]
    ledger = PrivacyLedger.load(tmp_path / "fest" / "ledger.json")
    assert ledger.steps == 6  # the one-time selection + 4 steps + the recalibration after the last
    assert eps["steps"] == [0, 1, 2, 3, 4] and eps["mapping"]["one_time"] == {0: 1, 4: 1}
    assert eps["accountants"]["rdp"]["epsilon"][0] == pytest.approx(
        make_accountant("rdp").epsilon(ledger.history[:1], ledger.delta))
    assert eps["accountants"]["rdp"]["epsilon"][-1] == pytest.approx(
        make_accountant("rdp").epsilon(ledger.history, ledger.delta))  # whichever accountant recorded it
    assert result["series"]["fest"]["heldout"]["steps"] == [2, 4]
    assert result["drawn"]["summary"]["rows_noised"]["fest"]["steps"] == [1, 2, 3, 4]
