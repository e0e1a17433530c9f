"""RESULTS sections of the own-model examples (benchmarks/own_model.py) and of the ghost-norm
transformer benchmark (benchmarks/ghost_transformer.py), each fed a small synthetic document:
the rendered numbers are the document's, every metric it holds is shown (a SASRec-style
example's hit-rate@10 / NDCG@10 too), and the goal row follows the recorded ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import ghost_transformer  # noqa: E402
import own_model  # noqa: E402


def _own_doc(path: str = "benchmarks/results/own_model_sasrec.json") -> dict:
    """A SASRec-like file: hit-rate@10 and NDCG@10, ε 1 and 8, a mode missing at ε = 1."""
    return {"_path": Path(path), "examples": {"train": 1234, "test": 56}, "steps": 300,
            "argv": ["--steps", "300", "--seeds", "0,1,2"],
            "runs": {"sparse": {"1": {"hit_rate@10": [0.21, 0.2, 0.235], "ndcg@10": [0.111, 0.1, 0.125],
                                      "epsilon": [0.99999, 0.99999, 0.99999], "seconds": [4.04, 3.5, 5.25]},
                                "8": {"hit_rate@10": [0.3, 0.29, 0.31], "ndcg@10": [0.17, 0.16, 0.18],
                                      "epsilon": [7.9999, 7.9999, 7.9999], "seconds": [4.0, 3.9, 4.1]}},
                     "dpsgd": {"8": {"hit_rate@10": [0.25, 0.24, 0.26], "ndcg@10": [0.14, 0.13, 0.15],
                                     "epsilon": [8.0, 8.0, 8.0], "seconds": [6.0, 5.9, 6.1]}},
                     "nonprivate": {"inf": {"hit_rate@10": [0.4, 0.39, 0.41], "ndcg@10": [0.22, 0.215, 0.23],
                                            "epsilon": [0.0, 0.0, 0.0], "seconds": [2.0, 1.9, 2.1]}}}}


def _table(lines: list[str], eps: str) -> list[str]:
    start = lines.index(f"ε = {eps}:")
    end = lines.index("", start + 2)
    return lines[start + 2:end]


def test_own_model_section_renders_median_and_range_per_mode_and_eps_with_nonprivate_beside():
    lines, goals = own_model.results_section(_own_doc())
    assert goals == []
    text = "\n".join(lines)
    assert "1,234 training and 56 test examples" in text and "seeds (0, 1, 2)" in text
    eps1, eps8 = _table(lines, "1"), _table(lines, "8")
    assert eps1[0] == "| metric | sparse, ε = 1 | DP-SGD, ε = 1 | non-private |"
    assert eps1[2] == "| hit-rate@10 | 0.210 [0.200–0.235] | – | 0.400 [0.390–0.410] |"
    assert eps1[3] == "| NDCG@10 | 0.111 [0.100–0.125] | – | 0.220 [0.215–0.230] |"
    assert eps1[4] == "| ε spent | 1 [1–1] | – | 0 [0–0] |"
    assert eps1[5] == "| seconds per run | 4.0 [3.5–5.2] | – | 2.0 [1.9–2.1] |"
    assert eps8[2] == "| hit-rate@10 | 0.300 [0.290–0.310] | 0.250 [0.240–0.260] | 0.400 [0.390–0.410] |"
    assert eps8[3] == "| NDCG@10 | 0.170 [0.160–0.180] | 0.140 [0.130–0.150] | 0.220 [0.215–0.230] |"


def test_own_model_section_reads_the_examples_json_as_written_by_the_script():
    """The files the examples print (no argv, no machine): AUC, logloss, ECE in the order held."""
    doc = {"_path": Path("benchmarks/results/own_model_dcn_ranking.json"), "examples": {"train": 10, "test": 5},
           "steps": 3, "runs": {"sparse": {"8": {"auc": [0.6, 0.55, 0.65], "logloss": [0.4, 0.39, 0.41],
                                                 "ece": [0.05, 0.04, 0.06]}},
                                "nonprivate": {"inf": {"auc": [0.7, 0.69, 0.71], "logloss": [0.3, 0.29, 0.31],
                                                       "ece": [0.02, 0.01, 0.03]}}}}
    lines, _ = own_model.results_section(doc)
    text = "\n".join(lines)
    assert "DCN-v2" in text and "examples/dcn_ranking.py" in text and "not recorded" in text
    assert [row.split(" | ")[0] for row in _table(lines, "8")[2:]] == ["| AUC", "| logloss", "| ECE"]
    assert _table(lines, "8")[2] == "| AUC | 0.600 [0.550–0.650] | 0.700 [0.690–0.710] |"


def test_own_model_section_renders_the_committed_files():
    paths = sorted(p for p in (BENCH / "results").glob("own_model_*.json") if p.stem != "own_model_opacus")
    assert len(paths) == 4  # the four examples' files (own_model_opacus.json is §20e's, its own renderer)
    for path in paths:
        doc = dict(json.loads(path.read_text()), _path=path)
        lines, _ = own_model.results_section(doc)
        row = doc["runs"]["nonprivate"]["inf"]
        metric = "auc" if "auc" in row else "perplexity"
        v = row[metric]
        assert f"{v[0]:.3f} [{v[1]:.3f}–{v[2]:.3f}]" in "\n".join(lines), (path.name, metric)


def _ghost_doc(ghost_ms: float, reference_ms: float, diff: float = 2e-7) -> dict:
    def row(model, batch, path, floor, ghost, ref, opacus):
        ms = {"floor": floor, "ghost": ghost, "reference": ref}
        if opacus:
            ms.update({"opacus-hooks": opacus, "opacus-ghost": 2 * opacus})
        ratios = {"ghost_over_floor": ghost / floor, "reference_over_floor": ref / floor,
                  "reference_over_ghost": ref / ghost,
                  **({"opacus_hooks_over_floor": opacus / floor, "opacus_ghost_over_floor": 2 * opacus / floor}
                     if opacus else {})}
        return {"model": model, "batch": batch, "length": 32, "width": 64, "heads": 4, "auto_path": path,
                "step_ms": ms, "ratios": ratios, "max_rel_norm_diff": diff if path == "ghost" else 0.0,
                "errors": {} if opacus else {"opacus-ghost": "TypeError: no key"}}

    return {"setting": {"length": 32, "width": 64, "heads": 4, "steps": 15, "warmup": 3, "clip": 1.0,
                        "norm_tolerance": 1e-4},
            "rows": [row("linear-attention", 64, "ghost", 10.0, 20.0, 30.0, 25.0),
                     row("linear-attention", 256, "ghost", 40.0, ghost_ms, reference_ms, 80.0),
                     row("multihead", 256, "reference", 50.0, 150.0, 150.0, None)]}


@pytest.mark.parametrize("ghost_ms,reference_ms,status", [(60.0, 90.0, "**met**"), (95.0, 90.0, "**missed**")])
def test_ghost_transformer_section_tables_ratios_fallback_and_goal(ghost_ms, reference_ms, status):
    lines, goals = ghost_transformer.results_section(_ghost_doc(ghost_ms, reference_ms))
    text = "\n".join(lines)
    row = next(line for line in lines if line.startswith("| linear-attention | 256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:8] == ["ghost", "40.0", f"{ghost_ms:.1f}", f"{reference_ms:.1f}", "80.0", "160"]
    assert cells[8:11] == [f"{ghost_ms / 40:.2f}×", f"{reference_ms / 40:.2f}×", f"{reference_ms / ghost_ms:.2f}×"]
    assert cells[11:] == ["2.00×", "4.00×", "2e-07"]
    assert "What falls back: multihead" in text and "torch.func reference" in text
    assert "multihead, B = 256, opacus-ghost: `TypeError: no key`" in text
    [(goal, measured, got, why)] = goals
    assert "B = 256" in goal and measured == f"reference / ghost = {reference_ms / ghost_ms:.2f}×" and got == status
    assert "2e-07" in why


def test_ghost_transformer_section_says_when_nothing_falls_back():
    doc = _ghost_doc(100.0, 150.0)
    doc["rows"] = doc["rows"][:2]
    lines, _ = ghost_transformer.results_section(doc)
    assert "Nothing fell back" in "\n".join(lines)
