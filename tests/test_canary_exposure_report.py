"""RESULTS' canary exposure section (benchmarks/make_results.py `section_exposure`): the seed's
Algorithm 3 + EM rows and our fest-threshold sparse rows are labelled apart, the differences from
the seed's setting are read from the rows, and an unflagged non-private row is explained from the
run's own counts. Fabricated documents feed the renderer; `phrase_counts` and
`seed_selection_epsilon` (benchmarks/canary_exposure.py) are checked on a small synthetic set."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import make_results  # noqa: E402

SEED_SETTINGS = {"noise_multiplier": 0.5, "gamma": 0.001, "clip_norm": 15.0, "second_clip_norm": 0.05, "score_clip": 0.1,
                 "target_epsilon": 30.0, "selection_share_epsilon": 10.0, "noise_share_epsilon": 20.0, "delta": 1e-5,
                 "batch_size": 20, "optimizer": "adam", "lr": 0.001, "epochs": 20, "corpus": "Brown, vocab 1,000",
                 "train_examples": 200_000}


def _counts(n_c, corpus=80_000, steps=500, b=256):
    per_phrase = 11 * n_c
    n = corpus + 1000 * per_phrase
    q = b / n
    return {"corpus_examples": corpus, "window": 4, "examples_per_insertion": 11, "examples_per_phrase": per_phrase,
            "canary_examples": 1000 * per_phrase, "n": n, "batch_size": b, "sample_rate": q, "steps": steps,
            "expected_samples_per_example": steps * q, "expected_sampled_examples_per_phrase": steps * q * per_phrase,
            "phrase_share": per_phrase / n, "canary_share": 1000 * per_phrase / n, "examples_sampled_total": steps * b,
            "lr": 10.0, "optimizer": "sgd"}


def _row(mode, n_c, p, eps=8.0, **counts_kw):
    r = {"mode": mode, "insertions": n_c, "claimed_epsilon": eps if mode != "nonprivate" else math.inf,
         "delta": 1e-6, "p_value": p, "flagged": p < 0.01, "mean_exposure": 1.5, "median_exposure": 1.0,
         "ranks": list(range(1, 10001, 10)), "steps": 500, "counts": _counts(n_c, **counts_kw)}
    if mode == "sparse":
        r["selection"] = "fest-threshold"
    if mode == "alg3-em":
        r["selection"] = "em"
        r["privacy_settings"] = {"noise_multiplier": 0.5, "clip_norm": 15.0, "second_clip_norm": 0.05,
                                 "target_epsilon": 30.0, "selection": "em", "k": "auto", "gamma": 0.001,
                                 "score_clip": 0.1, "selection_epsilon": 3.25}
        r["seed_alg3"] = {"selection_epsilon": 3.11, "planned_epsilon": 29.997, "delta": 1e-6, "k": 2,
                          "selectable_rows": 2000, "expected_selections_per_row": 0.5, "noise_alone_epsilon": 5.4,
                          "selection_alone_epsilon": 8.5, "data_events": 0, "share_selection_epsilon": 3.23,
                          "share_total_epsilon": 37.8, "seed_settings": SEED_SETTINGS}
    return r


def _doc(rows, benchmark="canary_exposure"):
    return {"benchmark": benchmark, "config": "configs/cbow.toml", "corpus": "the config's", "canaries": 1000,
            "references": 10000, "placement": "text", "results": rows}


def _table(lines):
    return [line for line in lines if line.startswith("| ") and not line.startswith("| n_c")]


def test_seed_alg3_em_rows_and_our_fest_threshold_rows_are_labelled_apart():
    rows = [_row("nonprivate", 3, 1e-9), _row("dpsgd", 3, 0.5), _row("sparse", 3, 0.3),
            _row("alg3-em", 3, 0.6, eps=12.34), _row("alg3-em", 15, 0.001, eps=12.5)]
    lines, goals = make_results.section_exposure(_doc(rows))
    table = _table(lines)
    assert "| 3 | sparse (fest-threshold, ours) | 8 | 0.3 | no |" in "\n".join(table)
    assert "| 3 | Alg 3 + EM (seed) | 12.3 | 0.6 | no |" in "\n".join(table)
    labels = [line.split(" | ")[1] for line in table]
    assert labels == ["non-private", "DP-SGD", "sparse (fest-threshold, ours)", "Alg 3 + EM (seed)", "Alg 3 + EM (seed)"]
    text = "\n".join(lines)
    # our sparse mode is said not to be the seed's algorithm; the seed's settings are read from the rows
    assert "not the seed's Algorithm 3 + EM" in text
    assert "k = ⌊γ·rows⌋ = 2 of 2,000 rows" in text and "σ = 0.5" in text and "S0 = 0.1" in text
    assert "Differences from the seed's setting" in text
    for difference in ("- Model:", "- Corpus:", "- Steps, batch, optimizer:", "- ε and δ:", "- σ and S2:"):
        assert difference in text
    assert "(≈ 200,000 steps)" in text  # 20 epochs of 200K examples at b = 20, from the recorded seed settings
    assert "n_c 3: ε'' = 3.11 per draw, ledger ε 12.3" in text and "would be ε'' = 3.23 and ε 37.8 in all" in text
    # the ε-8 goal covers our rows only; the seed's rows have their own goal, met at n_c ≤ 9 here
    dp = [g for g in goals if "DP runs at ε ≤ 8" in g[0]][0]
    assert "Alg 3 + EM" not in dp[1] and "sparse (fest-threshold, ours) n_c 3" in dp[1]
    # the seed's rows are reported, not a goal: as run, not being flagged could not fail
    assert not [g for g in goals if "Alg 3 + EM" in g[0]]
    assert "**Alg 3 + EM (seed) is reported, not a goal.**" in text
    assert "n_c = 3: p 0.6 (not flagged), n_c = 15: p 0.001 (flagged)" in text


def test_seed_rows_are_never_a_goal_and_no_seed_rows_no_differences():
    lines, goals = make_results.section_exposure(_doc([_row("alg3-em", 9, 0.001, eps=12.0)]))
    assert not [g for g in goals if "Alg 3 + EM" in g[0]]
    assert "n_c = 9: p 0.001 (flagged)" in "\n".join(lines)
    lines, goals = make_results.section_exposure(_doc([_row("nonprivate", 3, 1e-9), _row("sparse", 3, 0.3)]))
    text = "\n".join(lines)
    assert "Differences from the seed's setting" not in text and "was not run in this file" in text
    assert not [g for g in goals if "Alg 3 + EM" in g[0]]


def test_unflagged_nonprivate_is_explained_from_the_runs_counts(tmp_path):
    kjv = [_row("nonprivate", 3, 0.073, corpus=523_000, steps=5000), _row("nonprivate", 9, 1e-60, corpus=523_000, steps=5000)]
    synthetic = _doc([_row("nonprivate", 3, 1e-22)])
    (tmp_path / "canary_exposure.json").write_text(json.dumps(synthetic))
    doc = dict(_doc(kjv, "canary_exposure_kjv"), _path=str(tmp_path / "canary_exposure_kjv.json"))
    lines, goals = make_results.section_exposure(doc)
    text = "\n".join(lines)
    c3, c9 = kjv[0]["counts"], kjv[1]["counts"]
    assert "**Why non-private is not flagged at n_c = 3** (p 0.073)" in text
    assert f"33 examples per phrase (3 × 11) among n = {c3['n']:,} (share {c3['phrase_share']:.2g})" in text
    assert make_results.f(c3["expected_samples_per_example"]) in text
    assert "flagged from n_c = 9 on" in text and f"{c9['phrase_share'] / c3['phrase_share']:.3g}× the share" in text
    s3 = synthetic["results"][0]["counts"]
    assert f"share {s3['phrase_share']:.2g} ({s3['phrase_share'] / c3['phrase_share']:.3g}× this row's)" in text
    assert "Every flagged non-private run above gives a phrase a larger share" in text
    assert [g for g in goals if "non-private flagged" in g[0]][0][2] == "**missed**"
    # every non-private row flagged: nothing to explain
    lines, _ = make_results.section_exposure(_doc([_row("nonprivate", 3, 1e-9)]))
    assert not any("Why non-private" in line for line in lines)


def test_an_unflagged_row_with_a_larger_share_than_a_flagged_one_is_not_explained_by_the_share():
    rows = [_row("nonprivate", 3, 0.2, corpus=10_000), _row("nonprivate", 9, 1e-9, corpus=900_000)]
    text = "\n".join(make_results.section_exposure(_doc(rows))[0])
    assert "the share alone does not explain the miss" in text
    assert "Every flagged non-private run above" not in text


@pytest.fixture()
def small_text_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WIDEDP_BENCH_DATA", str(tmp_path / "bench"))
    return [f"data.path={tmp_path / 'text'}", "data.synth_examples=2000", "cluster.backend=local", "train.steps=40"]


def test_phrase_counts_and_the_seed_selection_epsilon(small_text_config):
    import canary_exposure
    from widedp.trainer.config import load_config

    cfg = load_config("configs/cbow.toml", [*canary_exposure.mode_overrides("alg3-em"), *small_text_config])
    assert cfg.train.selection == "em" and cfg.privacy.noise_multiplier == 0.5 and cfg.privacy.gamma == 0.001
    counts = canary_exposure.phrase_counts(cfg, canaries=50, insertions=3, placement="text")
    assert counts["corpus_examples"] == 1600  # 2,000 examples, 20% test split
    assert counts["examples_per_phrase"] == 3 * (2 * counts["window"] + 3)
    assert counts["n"] == 1600 + 50 * counts["examples_per_phrase"]
    assert counts["sample_rate"] == pytest.approx(256 / counts["n"])
    assert counts["expected_samples_per_example"] == pytest.approx(40 * 256 / counts["n"])
    line = canary_exposure.phrase_counts(cfg, canaries=50, insertions=3, placement="line")
    assert line["examples_per_phrase"] == 9
    seed = canary_exposure.seed_selection_epsilon(cfg, counts)
    assert seed["k"] == 2 and seed["selectable_rows"] == 2000  # ⌊0.001 · 2,000⌋
    # the composed steps spend the seed's total ε = 30 (just below it), more than the noise alone
    assert seed["planned_epsilon"] == pytest.approx(30.0, rel=1e-3) and seed["planned_epsilon"] <= 30.0
    assert 0 < seed["noise_alone_epsilon"] < seed["planned_epsilon"] and seed["selection_epsilon"] > 0
    # the seed's selection share: ε = 10 for the selection alone, and what the composed steps then spend
    assert seed["share_total_epsilon"] > seed["noise_alone_epsilon"]
    assert seed["delta"] == pytest.approx(min(0.1 / counts["n"], counts["n"] ** -1.1))


def test_kept_rows_get_counts_with_n_from_their_runs_delta(small_text_config):
    import canary_exposure

    overrides = small_text_config
    rows = [{"mode": "nonprivate", "insertions": 3, "steps": 40, "delta": 0.0},
            {"mode": "dpsgd", "insertions": 3, "steps": 40, "delta": 0.1 / 9000},
            {"mode": "dpsgd", "insertions": 9, "steps": 40, "delta": 0.1 / (1600 + 50 * 99)},
            {"mode": "sparse", "insertions": 9, "steps": 40, "error": "boom"}]
    canary_exposure.add_counts(rows, "configs/cbow.toml", overrides, canaries=50, placement="text")
    # n_c 3: the runs trained on n = 9,000 (their δ), not the data set there now: counted from the δ
    for r in rows[:2]:
        assert r["counts"]["n"] == 9000 and r["counts"]["corpus_examples"] == 9000 - 50 * 33
        assert "n = 9,000 from the run's δ" in r["counts"]["note"]
        assert r["counts"]["expected_samples_per_example"] == pytest.approx(40 * 256 / 9000)
    # n_c 9: the δ agrees with the data set: counted as it is, no note
    assert rows[2]["counts"]["n"] == 1600 + 50 * 99 and "note" not in rows[2]["counts"]
    assert "counts" not in rows[3]
