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
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

import numpy as np

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
CAVEAT_VALIDATION_SPLIT = ("validation_metrics are computed on the validation split (data.validation_fraction of "
                           "the training data, held out and never trained on); ε covers the remaining training "
                           "examples only, and validation_metrics, like test_metrics, are not covered by ε; "
                           "hyperparameters chosen on them (benchmarks/tune.py) are not charged to ε either.")
CAVEAT_DEBUG = ("train.debug_metrics = true: metrics.jsonl, summary.json and the progress output carry raw, "
                "un-noised training statistics (" + ", ".join(DEBUG_STEP_KEYS + DEBUG_SUMMARY_KEYS) + "). "
                "The privacy report is VOID for those outputs: do not publish them.")
CAVEAT_NONPRIVATE = "mode = nonprivate: no privacy guarantee at all (ε = inf)."


class RunRecorder:
    """Collects step statistics and writes only what the threat model allows."""

    def __init__(self, *, expected_batch_size: float, metrics_path: Path, debug_metrics: bool,
                 randomness_note: str, reproducible: bool, private: bool):
        self.b = float(expected_batch_size)
        self.metrics_path = metrics_path
        self.debug = bool(debug_metrics)
        self.randomness_note = randomness_note
        self.reproducible = reproducible
        self.private = private
        self.step_times: list[float] = []
        self.selected: list[int] = []
        self.clip_norms: list[float] = []  # DP-STAT's S1 per step (privacy.clip_norm = "adaptive")
        self.phases: dict[str, list[float]] = {}
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
        line = {"step": stats.step, "epsilon": stats.epsilon, "rows_selected": stats.rows_selected}
        if getattr(stats, "adaptive_clip", False):  # DP-STAT's S1: a private output, covered by ε
            line["clip_norm"] = stats.clip_norm
        if self.debug:
            line.update(loss=stats.loss, batch_size=stats.batch_size, rows_touched=stats.rows_touched)
        return line

    def log(self, line: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def progress_postfix(self, stats, elapsed: float) -> dict:
        out = {"eps": f"{stats.epsilon:.3f}", "ex_s": f"{self.b * len(self.step_times) / max(elapsed, 1e-9):.0f}"}
        if self.debug:
            out["loss"] = f"{stats.loss:.4f}"
        return out

    # ---- end of run ---------------------------------------------------------------------------------
    def caveats(self, data_event_descriptions: list[str], validation: bool = False) -> list[str]:
        out = [] if self.private else [CAVEAT_NONPRIVATE]
        if self.reproducible:
            out.append(self.randomness_note)
        if self.debug:
            out.append(CAVEAT_DEBUG)
        out += [CAVEAT_N_PUBLIC, CAVEAT_TIMINGS, CAVEAT_TEST_SPLIT] + ([CAVEAT_VALIDATION_SPLIT] if validation else [])
        out += [f"Charged before training (in the ledger): {d}" for d in data_event_descriptions]
        return out

    def summary_fields(self, elapsed: float, shards, data_event_descriptions: list[str],
                       validation: bool = False) -> dict:
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
            "debug_metrics": self.debug,
            "privacy_caveats": self.caveats(data_event_descriptions, validation),
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
