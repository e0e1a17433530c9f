"""benchmarks/engine_modelmix_adaptive.py's RESULTS section: verdicts from the seed ranges, and
ModelMix rows labelled as run at DP-SGD's settings (not the seed's tuning)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import engine_modelmix_adaptive as bench  # noqa: E402


def _doc(mix: list[float], steps: int = 400) -> dict:
    def row(variant, accs):
        return {"dataset": "ctr", "variant": variant, "target_epsilon": 1.0, "seeds": len(accs), "metric": "auc",
                "median": sorted(accs)[1], "min": min(accs), "max": max(accs), "noise_multiplier": 1.0,
                "clip_norm_median": None}

    return {"datasets": ["ctr"], "epsilons": [1.0], "seeds": [0, 1, 2], "widths": [2.0], "refined": [],
            "rows": [row("dpsgd", [0.70, 0.71, 0.72]), row("dpsgd-modelmix-w2", mix)],
            "records": [{"dataset": "ctr", "variant": "dpsgd-modelmix-w2", "steps": steps}]}


@pytest.mark.parametrize("mix, verdict", [([0.73, 0.74, 0.75], "**helps**"), ([0.60, 0.65, 0.69], "**hurts**"),
                                          ([0.69, 0.715, 0.73], "**level** (seed ranges overlap)")])
def test_verdict_from_the_seed_ranges(mix, verdict):
    _, goals = bench.results_section(_doc(mix))
    [(name, measured, got, why)] = goals
    assert got == verdict and "dpsgd-modelmix-w2" in name
    assert "not retuned for mixing" in why


def test_modelmix_rows_say_they_run_at_dpsgds_settings_with_their_steps():
    lines, _ = bench.results_section(_doc([0.73, 0.74, 0.75], steps=321))
    note = next(line for line in lines if line.startswith("Not the seed's tuning"))
    assert "321 steps on ctr" in note and "T = 3,400" in note
