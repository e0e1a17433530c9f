"""RESULTS section of benchmarks/own_model_opacus.py (the own-model examples under Opacus beside
widedp and the floor), fed a small synthetic document: the rendered step times and ratios are the
document's, what Opacus could not run is shown with its message, the Opacus utility numbers are
shown, and the one goal row follows the recorded LM step times (it can be missed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import own_model_opacus  # noqa: E402


def _row(name: str, ms: dict, **extra) -> dict:
    floor = ms["floor"]
    return {"example": name, "batch": 256, "examples": {"train": 12345, "test": 678}, "sizes": {},
            "data": "synthetic", "tables": extra.pop("tables", {"t": [1000, 16]}),
            "parameters": extra.pop("parameters", {"tables": 16000, "dense": 500}),
            "step_ms": ms, "ratios": {s: v / floor for s, v in ms.items()}, "errors": extra.pop("errors", {}),
            "as_written_errors": extra.pop("as_written_errors", {}), "workarounds": extra.pop("workarounds", {}),
            **extra}


def _doc(lm_sparse_ms: float = 40.0, lm_ghost_ms: float = 120.0) -> dict:
    sasrec = _row("sasrec_sequential", {"floor": 10.0, "opacus-ghost": 55.0, "opacus-hooks": 1234.5,
                                        "widedp-sparse": 25.0, "widedp-dpsgd": 30.0},
                  tables={"item": [131072, 16], "campaign": [2048, 16], "device": [5, 16]},
                  parameters={"tables": 2130000, "dense": 5297},
                  utility={"target_epsilon": 8.0, "epsilon": 7.99, "delta": 1e-5, "sigma": 0.61, "steps": 100,
                           "expected_batch": 256, "clip": 3.0, "optimizer": "sgd", "lr": 0.52, "dense_lr": 0.174,
                           "metrics": {"auc": 0.6123, "hit@10": 0.25, "ndcg@10": 0.125}})
    lm = _row("transformer_lm", {"floor": 20.0, "opacus-ghost": lm_ghost_ms, "widedp-sparse": lm_sparse_ms,
                                 "widedp-dpsgd": 90.0},
              tables={"input_words": [50000, 32], "output_words": [50000, 32], "output_bias": [50000, 1]},
              parameters={"tables": 3250000, "dense": 9000},
              errors={"opacus-hooks": "MemoryError: skipped: too big"},
              as_written_errors={"opacus-ghost": "RuntimeError: view size is not compatible"},
              workarounds={"opacus-ghost": "the ids made contiguous"},
              utility={"target_epsilon": 8.0, "epsilon": 8.0, "delta": 2e-6, "sigma": 0.7, "steps": 100,
                       "expected_batch": 256, "clip": 1.0, "optimizer": "adam", "lr": 0.01, "dense_lr": 0.002,
                       "metrics": {"perplexity": 4321.06}})
    return {"setting": {"batch": 256, "warmup": 3, "timing_steps": 20, "utility_steps": 100, "sigma": 1.0,
                        "clip": 1.0, "opacus_version": "1.6.0", "torch_threads": 2},
            "rows": {"sasrec_sequential": sasrec, "transformer_lm": lm}}


def test_section_renders_step_times_ratios_errors_and_utility():
    lines, goals = own_model_opacus.results_section(_doc())
    text = "\n".join(lines)
    assert "| plain PyTorch (non-private floor) | 10.0 | 1.00× |" in lines
    assert "| Opacus ghost clipping | 55.0 | 5.50× |" in lines
    assert "| Opacus hooks (per-sample gradients) | 1,234 | 123.45× |" in lines
    assert "| widedp sparse | 25.0 | 2.50× |" in lines
    assert "| widedp DP-SGD | 90.0 | 4.50× |" in lines
    assert "| Opacus hooks (per-sample gradients) | – | – (see below) |" in lines  # the LM's, not run
    assert "could not run: `MemoryError: skipped: too big`" in text
    assert "`RuntimeError: view size is not compatible`" in text and "the ids made contiguous" in text
    assert "item [131,072 × 16]" in text and "2,130,000 table parameters" in text
    assert "3,259,000 parameters, 3,250,000 of them in its three tables" in text
    assert "click AUC 0.612, hit-rate@10 0.250, NDCG@10 0.125" in text
    assert "perplexity (full softmax) 4,321.1" in text
    assert "ε = 7.99 at δ = 1e-05" in text and "**Poisson sampling on**" in text
    assert "**fixed batches**" in text
    assert len(goals) == 1


@pytest.mark.parametrize("sparse_ms, ghost_ms, status, times", [
    (40.0, 120.0, "**met**", "40.0 ms against 120 ms"), (150.0, 120.0, "**missed**", "150 ms against 120 ms")])
def test_goal_follows_the_lm_ratio(sparse_ms, ghost_ms, status, times):
    _, goals = own_model_opacus.results_section(_doc(sparse_ms, ghost_ms))
    (title, measured, got, why), = goals
    assert "transformer LM" in title
    assert got == status
    assert measured == f"Opacus ghost / widedp sparse = {ghost_ms / sparse_ms:.2f}×"
    assert times in why and "3,250,000 table parameters" in why


def test_no_goal_without_the_lm_opacus_ghost_time():
    doc = _doc()
    del doc["rows"]["transformer_lm"]["step_ms"]["opacus-ghost"]
    assert own_model_opacus.results_section(doc)[1] == []


def test_padded_ids_keep_the_first_ids_and_mask_the_rest():
    import torch
    from torchrec import JaggedTensor

    jt = JaggedTensor(values=torch.tensor([5, 6, 7, 8, 9, 3]), lengths=torch.tensor([3, 0, 2, 1]))
    ids, mask = own_model_opacus.padded(jt, 2)
    assert ids.tolist() == [[5, 6], [0, 0], [8, 9], [3, 0]]
    assert mask.tolist() == [[1, 1], [0, 0], [1, 1], [1, 0]]
