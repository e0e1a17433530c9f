"""A training process that dies mid-run, as under `kill -9`, for the tests of what a resume
must not forget: after step N has been released (charged in ledger.json and journal.jsonl,
its update applied) the process is gone — no checkpoint after the last scheduled one, no
"finished" line. And a run directory copied while it trains (`copy_at_step`)."""

import pytest

from widedp.trainer.run import train as train_module


class Killed(BaseException):
    """Not an Exception and not Ctrl-C: nothing in `train` handles it but its clean-up."""


def die_after_step(monkeypatch, step: int) -> None:
    """The next `widedp train` in this test dies right after releasing `step`."""
    on_step = train_module._TrainCallbacks.on_step

    def dying(self, engine, stats, seconds):
        stop = on_step(self, engine, stats, seconds)
        if stats.step == step:
            raise Killed(f"killed after step {step}")
        return stop

    monkeypatch.setattr(train_module._TrainCallbacks, "on_step", dying)


def copy_at_step(monkeypatch, run_dir, copy, step: int) -> None:
    """The next `widedp train` copies its run directory to `copy` right after releasing `step`
    (a copy taken while the run trains, or a backup restored later)."""
    import shutil

    on_step = train_module._TrainCallbacks.on_step

    def copying(self, engine, stats, seconds):
        stop = on_step(self, engine, stats, seconds)
        if stats.step == step and not copy.exists():
            shutil.copytree(run_dir, copy)
        return stop

    monkeypatch.setattr(train_module._TrainCallbacks, "on_step", copying)


def train_and_die(monkeypatch, main, argv, step: int) -> None:
    """Run `widedp train argv` to its death after `step`; undo the patch afterwards."""
    with monkeypatch.context() as m:
        die_after_step(m, step)
        with pytest.raises(Killed):
            main(argv)
