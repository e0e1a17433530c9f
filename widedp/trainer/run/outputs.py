"""What a training run writes and prints, decided by the threat model (docs/THREAT_MODEL.md).

Every number a run shows by default is one of:
  (a) data-independent: the config, the step counter, ε from the ledger, the *expected*
      batch size, rates derived from it;
  (b) the output of a mechanism charged to the ledger: rows selected per step is a function
      of the step's private selection (post-processing);
  (c) computed on the held-out test split (`test_metrics`), assumed disjoint from training, or
      on the validation split carved from the training data and never trained on
      (`validation_metrics`, only with data.validation_fraction > 0).
Raw training statistics — the batch loss, realized batch sizes, touched-row counts and the
bytes moved (a function of both) — reveal membership directly (a loss that moves only when a
target example is sampled) and are written only with `train.debug_metrics = true`; the
summary's `privacy_caveats` then states that the privacy report does not cover them.
Wall-clock timings are listed as a caveat in every run (a weak side channel on batch sizes).

Every metrics.jsonl record goes through one function, `RunRecorder.log`, to every sink: the
file itself and, with `train.tensorboard = true`, `TensorBoardSink` (RUN_DIR/tensorboard/),
which writes the record's numbers and nothing else, so the two hold the same (tag, step, value)s.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from widedp.trainer import strict_json
from widedp.trainer.config import TENSORBOARD_MISSING  # noqa: F401  (re-exported: the recorder's message)

# Per-step and summary keys that carry raw training statistics (debug opt-in only).
DEBUG_STEP_KEYS = ("loss", "batch_size", "rows_touched")
DEBUG_SUMMARY_KEYS = ("examples", "rows_touched_mean", "bytes_to_shards", "bytes_from_shards", "train_loss_mean")

CAVEAT_N_PUBLIC = ("The training-set size n is treated as public (as in Opacus and every DP-SGD library): "
                   "sample_rate = b/n and the default δ = min(1/(10n), n^-1.1) reveal it.")
CAVEAT_TIMINGS = ("Wall-clock timings (examples_per_sec, step_time_ms_median, phase_ms_median) are system "
                  "measurements outside the guarantee: step times vary weakly with realized batch sizes and "
                  "touched rows. examples_per_sec is computed from the expected batch size.")
CAVEAT_TEST_SPLIT = ("test_metrics (and eval lines in metrics.jsonl) are computed on the held-out test split, "
                     "assumed not to be training data; they describe that split and are not covered by ε.")
CAVEAT_UNIT_COLUMN = ("The data set names a privacy unit per example (its `unit` column, e.g. a user id), but "
                      "this run's guarantee is per example (privacy.unit = \"example\"): a unit with m training "
                      "examples is protected only as a group of m, at best (m·ε, m·e^((m−1)ε)·δ) by group "
                      "privacy. Set privacy.unit = \"user\" for a guarantee per unit.")
CAVEAT_USER_LEVEL = ("Privacy unit: user (the data set's unit column). ε and δ hold for adding or removing one "
                     "user with all of their examples; n, the sampling rate and the default δ are over users, and "
                     "the number of users is treated as public like n. Each sampled user contributes at most "
                     "privacy.max_examples_per_user examples per step (a random subset), clipped as one gradient.")
CAVEAT_USER_LEVEL_BY_EXAMPLES = (
    "Privacy unit: user (the data set's unit column), by example sampling: each user kept at most "
    "privacy.max_examples_per_user of their examples (a secret random subset, chosen once); the steps are "
    "example-level DP-SGD and every event is accounted for a group of that many examples (the PLD of the mixture "
    "of Gaussians, Ganesh 2024). ε and δ hold for adding or removing one user with all of their examples; δ's "
    "default is over users, whose number is treated as public like n, and so is the number of kept examples "
    "(sample_rate = b / kept examples reveals it; summary user_level.kept_examples states it).")
CAVEAT_VALIDATION_SPLIT = ("validation_metrics are computed on the validation split (data.validation_fraction of "
                           "the training data, held out and never trained on); ε covers the remaining training "
                           "examples only, and validation_metrics, like test_metrics, are not covered by ε; "
                           "hyperparameters chosen on them (benchmarks/tune.py) are not charged to ε either.")
CAVEAT_DEBUG = ("train.debug_metrics = true (in at least one session of this run; it holds for the whole run): "
                "metrics.jsonl, summary.json and the progress output carry raw, "
                "un-noised training statistics (" + ", ".join(DEBUG_STEP_KEYS + DEBUG_SUMMARY_KEYS) + "). "
                "The privacy report is VOID for those outputs: do not publish them.")
CAVEAT_DEBUG_TENSORBOARD = ("train.tensorboard = true with train.debug_metrics = true: the event files in "
                            "tensorboard/ mirror metrics.jsonl and so carry the same raw training statistics; the "
                            "privacy report is VOID for them too: do not publish them.")
CAVEAT_NONPRIVATE = "mode = nonprivate: no privacy guarantee at all (ε = inf)."


def scalar_items(line: dict, prefix: str = "") -> list[tuple[str, float]]:
    """A metrics.jsonl record's numbers as (tag, value): each key but "step" is a tag, a nested
    table's keys are "outer/inner" (test_metrics/auc); None, booleans and strings are not numbers."""
    out: list[tuple[str, float]] = []
    for key, value in line.items():
        if not prefix and key == "step":
            continue
        if isinstance(value, dict):
            out += scalar_items(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
            out.append((prefix + key, float(value)))
    return out


class JsonlSink:
    """metrics.jsonl: one JSON line per record, appended (a resumed run continues the file)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, line: dict) -> None:
        with open(self.path, "a") as f:
            f.write(strict_json.dumps(line) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """metrics.jsonl's records as TensorBoard scalars in `log_dir` (torch.utils.tensorboard's
    SummaryWriter): per record, `scalar_items` as (tag, the record's step, the value in double
    precision), nothing else. Each session (a resume too) adds an event file of its own; the
    steps continue the run's.

    The first record of a session first brings the event files up to metrics.jsonl (which
    already holds that record, `RunRecorder.log` writes it first): records of sessions that ran
    without TensorBoard, or whose events a crash cut off, are written then, so turning
    TensorBoard on at `--resume` mirrors the whole run. Raw training statistics an earlier debug
    session left in metrics.jsonl are not copied by a session without train.debug_metrics.

    Every event is stamped with the time this session opened its writer, not the time of its
    step: metrics.jsonl holds no per-step wall-clock times, and neither does this."""

    def __init__(self, log_dir: Path, metrics_path: Path, debug_metrics: bool):
        try:  # imported here: only runs that ask for TensorBoard pay for (and need) the package
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(f"{TENSORBOARD_MISSING} ({exc})") from None
        self.metrics_path, self.debug = metrics_path, bool(debug_metrics)
        self._written: Optional[Counter] = Counter(_scalar_key(*x) for x in event_file_scalars(log_dir))
        self.walltime = time.time()
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, line: dict) -> None:
        if self._written is not None:  # this session's first record: catch up with metrics.jsonl
            written, self._written = self._written, None
            for record in _jsonl_records(self.metrics_path):
                missing = []
                for tag, value in scalar_items(record):
                    key = _scalar_key(tag, record["step"], value)
                    if written[key] > 0:
                        written[key] -= 1
                    elif self.debug or tag not in DEBUG_STEP_KEYS:
                        missing.append((tag, value))
                self._add(record["step"], missing)
        else:
            self._add(line["step"], scalar_items(line))
        self.writer.flush()  # on disk with its metrics.jsonl line

    def _add(self, step: int, items: list[tuple[str, float]]) -> None:
        for tag, value in items:
            self.writer.add_scalar(tag, value, global_step=int(step), walltime=self.walltime,
                                   new_style=True, double_precision=True)

    def close(self) -> None:
        self.writer.close()


def event_file_scalars(log_dir: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files in `log_dir` (none: [])."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = []
    for path in sorted(Path(log_dir).glob("*tfevents*")):
        for event in EventFileLoader(str(path)).Load():
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                if kind == "tensor":
                    out.append((v.tag, event.step, float(tensor_util.make_ndarray(v.tensor).item())))
                elif kind == "simple_value":
                    out.append((v.tag, event.step, float(v.simple_value)))
    return out


def _scalar_key(tag: str, step: int, value: float) -> tuple:
    return tag, int(step), "nan" if math.isnan(value) else float(value)


def _jsonl_records(path: Path) -> list[dict]:
    """metrics.jsonl's records (a line a crash cut off is no record)."""
    out = []
    for text in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


class RunRecorder:
    """Collects step statistics and writes only what the threat model allows."""

    def __init__(self, *, expected_batch_size: float, metrics_path: Path, debug_metrics: bool,
                 randomness_note: str, reproducible: bool, private: bool, tensorboard_dir: Optional[Path] = None,
                 debug_in_run: Optional[bool] = None, debug_tensorboard_in_run: Optional[bool] = None):
        """`debug_metrics`: this session writes raw statistics. `debug_in_run`: some session of the
        run did (default: this one's) — the caveats and summary.json's "debug_metrics" are the
        run's, as its metrics files hold what every session wrote (trainer/config/semantics.py,
        STICKY); `debug_tensorboard_in_run` likewise for TensorBoard event files."""
        self.b = float(expected_batch_size)
        self.metrics_path = metrics_path
        # Every record goes to every sink (`log`), metrics.jsonl first (TensorBoardSink reads it).
        self.sinks: list = [JsonlSink(metrics_path)]
        if tensorboard_dir is not None:
            self.sinks.append(TensorBoardSink(tensorboard_dir, metrics_path, debug_metrics))
        self.tensorboard = tensorboard_dir is not None
        self.debug = bool(debug_metrics)
        self.debug_in_run = self.debug if debug_in_run is None else bool(debug_in_run) or self.debug
        self.debug_tensorboard_in_run = ((self.debug and self.tensorboard) if debug_tensorboard_in_run is None
                                         else bool(debug_tensorboard_in_run) or (self.debug and self.tensorboard))
        self.randomness_note = randomness_note
        self.reproducible = reproducible
        self.private = private
        self.step_times: list[float] = []
        self.selected: list[int] = []
        self.clip_norms: list[float] = []  # DP-STAT's S1 per step (privacy.clip_norm = "adaptive")
        self.phases: dict[str, list[float]] = {}
        self._last_epsilon: Optional[float] = None  # ε of the last metrics line (the progress bar's)
        # Raw statistics: kept in memory only; written only in debug mode.
        self._examples = 0
        self._touched: list[int] = []
        self._losses: list[float] = []

    # ---- per step ---------------------------------------------------------------------------------
    def on_step(self, stats, seconds: float) -> None:
        self.step_times.append(seconds)
        self.selected.append(stats.rows_selected)
        if getattr(stats, "adaptive_clip", False):
            self.clip_norms.append(stats.clip_norm)
        for name, sec in stats.phases.items():
            self.phases.setdefault(name, []).append(sec)
        self._examples += stats.batch_size
        self._touched.append(stats.rows_touched)
        if math.isfinite(stats.loss):
            self._losses.append(stats.loss)

    def metrics_line(self, stats) -> dict:
        # The exact ε after this step (computing it if the engine left it for later: StepStats.epsilon).
        line = {"step": stats.step, "epsilon": stats.epsilon, "rows_selected": stats.rows_selected}
        self._last_epsilon = stats.epsilon
        if getattr(stats, "adaptive_clip", False):  # DP-STAT's S1: a private output, covered by ε
            line["clip_norm"] = stats.clip_norm
        if self.debug:
            line.update(loss=stats.loss, batch_size=stats.batch_size, rows_touched=stats.rows_touched)
        return line

    def log(self, line: dict) -> None:
        """The one way a record leaves the run: to metrics.jsonl and every other sink alike, as
        metrics.jsonl holds it (strict JSON: a non-finite value is null, so no sink's number)."""
        record = strict_json.finite_or_none(line)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def progress_postfix(self, stats, elapsed: float) -> dict:
        # ε only where already computed (a log step), else the last logged one: computing it on
        # every step would cost an accountant call per step (~0.5 s with PLD).
        known = stats.epsilon_if_computed if hasattr(stats, "epsilon_if_computed") else stats.epsilon
        known = self._last_epsilon if known is None else known
        out = {"eps": f"{known:.3f}" if known is not None else "-",
               "ex_s": f"{self.b * len(self.step_times) / max(elapsed, 1e-9):.0f}"}
        if self.debug:
            out["loss"] = f"{stats.loss:.4f}"
        return out

    # ---- end of run ---------------------------------------------------------------------------------
    def caveats(self, data_event_descriptions: list[str], validation: bool = False,
                unit_column: bool = False, unit: str = "example", user_sampling: str = "users") -> list[str]:
        out = [] if self.private else [CAVEAT_NONPRIVATE]
        if self.reproducible:
            out.append(self.randomness_note)
        if self.debug_in_run:
            out.append(CAVEAT_DEBUG)
            if self.debug_tensorboard_in_run:
                out.append(CAVEAT_DEBUG_TENSORBOARD)
        out += [CAVEAT_N_PUBLIC, CAVEAT_TIMINGS, CAVEAT_TEST_SPLIT] + ([CAVEAT_VALIDATION_SPLIT] if validation else [])
        if unit == "user":
            out.append(CAVEAT_USER_LEVEL_BY_EXAMPLES if user_sampling == "examples" else CAVEAT_USER_LEVEL)
        elif unit_column:
            out.append(CAVEAT_UNIT_COLUMN)
        out += [f"Charged before training (in the ledger): {d}" for d in data_event_descriptions]
        return out

    def summary_fields(self, elapsed: float, shards, data_event_descriptions: list[str],
                       validation: bool = False, unit_column: bool = False, unit: str = "example",
                       user_sampling: str = "users") -> dict:
        """`unit_column`: the data set has a privacy-unit column (dataset.json `unit_column`),
        which an example-level run does not protect as a unit (CAVEAT_UNIT_COLUMN); `unit`: the
        run's privacy.unit ("example" or "user", CAVEAT_USER_LEVEL)."""
        steps = len(self.step_times)
        out = {
            "examples_per_sec": self.b * steps / elapsed if elapsed > 0 else 0.0,
            "expected_batch_size": self.b,
            "step_time_ms_median": 1e3 * statistics.median(self.step_times) if self.step_times else None,
            "rows_selected_mean": float(np.mean(self.selected)) if self.selected else 0.0,
            **({"clip_norm_median": float(np.median(self.clip_norms)), "clip_norm_last": float(self.clip_norms[-1])}
               if self.clip_norms else {}),
            "phase_ms_median": {k: 1e3 * statistics.median(v) for k, v in self.phases.items()},
            "randomness": self.randomness_note,
            "reproducible": self.reproducible,
            "debug_metrics": self.debug_in_run,
            "privacy_unit": unit,
            "privacy_caveats": self.caveats(data_event_descriptions, validation, unit_column, unit, user_sampling),
        }
        if self.debug:
            out.update({
                "examples": self._examples,
                "rows_touched_mean": float(np.mean(self._touched)) if self._touched else 0.0,
                "bytes_to_shards": shards.bytes_to_shards,
                "bytes_from_shards": shards.bytes_from_shards,
                "train_loss_mean": float(np.mean(self._losses)) if self._losses else None,
            })
        return out


def eval_line(step: int, test_metrics: Optional[dict]) -> dict:
    """A metrics.jsonl line of held-out test metrics (category (c))."""
    return {"step": step, "test_metrics": test_metrics or {}}


# ---- a failed run leaves no empty run directory ----------------------------------------------------
# What a new run writes before it has recorded anything (trainer/run/train.py `_start`, the recorder):
# the config, an empty metrics.jsonl, its journal's session line (trainer/run/journal.py) and with
# train.tensorboard its writer's directory (event files that mirror metrics.jsonl, so they hold no
# scalar while it holds no record).
SCAFFOLD_FILES = ("config.json", "metrics.jsonl", "journal.jsonl")
SCAFFOLD_DIRS = ("tensorboard",)
# What makes a directory a run's record: never removed. The ledger above all: it only grows
# (docs/DESIGN.md §1), and a run dir holding one is kept whatever happened after.
RECORD_FILES = ("ledger.json", "checkpoint.pt", "summary.json")


def holds_a_record(run_dir: Path) -> bool:
    """Whether `run_dir` holds anything a failed run must keep: a ledger, a checkpoint, a
    summary, a metrics.jsonl record, a journal line other than its session's, or any file the
    run's own scaffold does not explain."""
    run_dir = Path(run_dir)
    for entry in run_dir.iterdir():
        name = entry.name
        if name in RECORD_FILES:
            return True
        if name == "metrics.jsonl":
            if not entry.is_file() or entry.read_text(errors="replace").strip():
                return True
        elif name == "journal.jsonl":
            from widedp.trainer.run.journal import journal_holds_a_record

            if not entry.is_file() or journal_holds_a_record(entry):
                return True
        elif name in SCAFFOLD_DIRS:
            if not entry.is_dir() or any(not (f.is_file() and "tfevents" in f.name) for f in entry.iterdir()):
                return True
        elif not (name in SCAFFOLD_FILES and entry.is_file()):
            return True
    return False


def remove_unrecorded_run_dir(run_dir: Path, created_parents: tuple[Path, ...] = ()) -> bool:
    """After a failed new run: remove `run_dir` (which that run created) if it holds no record
    (`holds_a_record`), then each of `created_parents` (deepest first, also created by that run)
    that is left empty. Returns whether `run_dir` was removed. Never raises for the file system:
    the failure being reported is the run's, not this clean-up's.

    The rule: a run dir created by this process that holds no ledger and no checkpoint (nor a
    summary or a metrics record) carries no information — nothing was charged, nothing released
    (every charge persists the ledger first: trainer/engine/engine.py `charge`) — and left in place it
    would block the same --run-dir ("holds a run"). A run dir with a ledger is never removed.
    The data set's privacy_budget.jsonl keeps the run's lines (append-only; its "failed" line
    then names a directory that no longer exists, with nothing spent)."""
    run_dir = Path(run_dir)
    try:
        if not run_dir.is_dir() or holds_a_record(run_dir):
            return False
        for name in SCAFFOLD_DIRS:
            if (run_dir / name).is_dir():
                for f in (run_dir / name).iterdir():
                    f.unlink()
                (run_dir / name).rmdir()
        for name in SCAFFOLD_FILES:
            (run_dir / name).unlink(missing_ok=True)
        run_dir.rmdir()
    except OSError:
        return False
    for parent in created_parents:
        try:
            parent.rmdir()
        except OSError:
            break
    return True
