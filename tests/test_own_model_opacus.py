"""RESULTS section of benchmarks/own_model_opacus.py (the own-model examples under Opacus beside
widedp and the floor), fed a small synthetic document — a sequence example (SASRec), two bag-only
examples (DCN, two-tower) and the LM: the rendered step times and ratios are the document's, what
Opacus could not run is shown with its message, the Opacus utility numbers are shown, a document
of a bag-only example alone renders (no goal row), and the one goal row follows the recorded LM
step times (it can be missed). And the plain-PyTorch twin of a bag-only example (DCN's
EmbeddingBagCollection: a MEAN-pooled table shared by two features, sum-pooled bags) gives the
TorchRec path's outputs, and a twin that does not is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
    dcn = _row("dcn_ranking", {"floor": 4.0, "opacus-ghost": 44.0, "opacus-hooks": 333.0, "widedp-sparse": 14.0,
                               "widedp-dpsgd": 28.0},
               tables={"item": [65536, 16], "campaign": [1024, 16], "device": [5, 16]},
               parameters={"tables": 1065040, "dense": 18093},
               twin_check={"examples": 931, "max_abs_diff": 6e-08, "max_abs_output": 0.5},
               utility={"target_epsilon": 8.0, "epsilon": 7.98, "delta": 1e-5, "sigma": 0.62, "steps": 100,
                        "expected_batch": 256, "clip": 3.0, "optimizer": "sgd", "lr": 0.52, "dense_lr": 0.174,
                        "metrics": {"auc": 0.7011}})
    two = _row("two_tower_retrieval", {"floor": 5.0, "opacus-ghost": 35.0, "widedp-sparse": 15.0,
                                       "widedp-dpsgd": 25.0},
               errors={"opacus-hooks": "RuntimeError: hooks broke"},
               utility={"target_epsilon": 8.0, "epsilon": 7.97, "delta": 1e-5, "sigma": 0.63, "steps": 100,
                        "expected_batch": 256, "clip": 3.0, "optimizer": "sgd", "lr": 0.52, "dense_lr": 0.174,
                        "metrics": {"auc": 0.6543, "recall@10": 0.3333}})
    return {"setting": {"batch": 256, "warmup": 3, "timing_steps": 20, "utility_steps": 100, "sigma": 1.0,
                        "clip": 1.0, "opacus_version": "1.6.0", "torch_threads": 2},
            "rows": {"transformer_lm": lm, "two_tower_retrieval": two, "sasrec_sequential": sasrec,
                     "dcn_ranking": dcn}}


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


def test_section_renders_the_bag_only_examples_in_the_examples_order():
    lines, _ = own_model_opacus.results_section(_doc())
    text = "\n".join(lines)
    heads = [text.index(f"**{own_model_opacus.NAMES[n]}**") for n in own_model_opacus.EXAMPLES]
    assert heads == sorted(heads)  # SASRec, DCN, two-tower, LM whatever the document's order
    dcn = text[heads[1]:heads[2]]
    assert "| Opacus ghost clipping | 44.0 | 11.00× |" in dcn and "| Opacus hooks (per-sample gradients) | 333 | 83.25× |" in dcn
    assert "| widedp sparse | 14.0 | 3.50× |" in dcn and "item [65,536 × 16]" in dcn
    assert "equal the TorchRec path's (max |diff| 6e-08)" in dcn and "931 test examples" in dcn
    assert "held out, click AUC 0.701." in dcn
    two = text[heads[2]:heads[3]]
    assert "| Opacus hooks (per-sample gradients) | – | – (see below) |" in two
    assert "Opacus hooks (per-sample gradients) could not run: `RuntimeError: hooks broke`" in two
    assert "click AUC 0.654, recall@10 0.333" in two
    assert "(SASRec-style ranker, DCN-v2 ranker, two-tower retrieval model) train at user level" in text


def test_a_bag_only_document_renders_without_a_goal():
    doc = _doc()
    doc["rows"] = {"dcn_ranking": doc["rows"]["dcn_ranking"]}
    lines, goals = own_model_opacus.results_section(doc)
    text = "\n".join(lines)
    assert goals == []
    assert "**DCN-v2 ranker (`examples/dcn_ranking.py`)**" in text and "SASRec" not in text
    assert "The click-log example (DCN-v2 ranker) trains at user level" in text
    assert "| Opacus ghost clipping | 44.0 | 11.00× |" in lines


def _click_data(n=300, seed=0):
    """ad, history (0..5 ids, some empty), campaign (1..2 ids), device: dcn_ranking's features."""
    from torchrec import KeyedJaggedTensor
    from widedp import KJTDataset

    rng = np.random.default_rng(seed)
    hist_len, camp_len = rng.integers(0, 6, n), rng.integers(1, 3, n)
    values = [rng.integers(0, 50, n), rng.integers(0, 50, int(hist_len.sum())), rng.integers(0, 20, int(camp_len.sum())),
              rng.integers(0, 4, n)]
    lengths = [np.ones(n, np.int64), hist_len, camp_len, np.ones(n, np.int64)]
    kjt = KeyedJaggedTensor(keys=["ad", "history", "campaign", "device"],
                            values=torch.from_numpy(np.concatenate(values)),
                            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)))
    return KJTDataset(kjt, torch.from_numpy((rng.random(n) < 0.3).astype(np.float32)),
                      dense=torch.from_numpy(rng.normal(size=(n, 3)).astype(np.float32)))


def _dcn_twin(data):
    import dcn_ranking as dcn

    torch.manual_seed(0)
    ebc, model = dcn.embedding_tables({"item": 50, "campaign": 20, "device": 4}), dcn.DCNv2(3)
    widths = own_model_opacus.bag_widths(data, list(dcn.FEATURES))
    return own_model_opacus.PlainModel([ebc], model, {}, widths), ebc


def test_bag_only_twin_gives_the_torchrec_outputs():
    data = _click_data()
    plain, ebc = _dcn_twin(data)
    assert [name for name, _ in plain.layout] == ["item", "campaign", "device"]  # the shared table looked up once
    assert not plain.sequences  # called as dense_module(emb, dense), as widedp does
    assert [f for f, *_ in plain.layout[0][1]] == ["ad", "history"]
    assert plain.layout[0][1][1][3] == "mean" and plain.layout[1][1][0][3] == "sum"
    check = own_model_opacus.twin_check(plain, [ebc], data, {})
    assert check["examples"] == len(data) and check["max_abs_diff"] < 1e-5
    # and the outputs themselves, against the EBC called directly
    batch = data.with_features(["ad", "history", "campaign", "device"]).take(np.arange(len(data)))
    with torch.no_grad():
        expected = plain.dense_module(ebc(batch.sparse).to_dict(), batch.dense)
        got = plain(*own_model_opacus.tensors_of(plain, data)[:-1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_twin_that_differs_from_torchrec_is_refused():
    data = _click_data()
    plain, ebc = _dcn_twin(data)
    with torch.no_grad():
        plain.tables["item"].weight[7] += 1.0  # the twin's item row 7 no longer the EBC's
    with pytest.raises(RuntimeError, match="differ from the TorchRec path"):
        own_model_opacus.twin_check(plain, [ebc], data, {})


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


def test_section_renders_widedps_utility_runs_beside_opacus():
    doc = _doc()
    doc["rows"]["dcn_ranking"]["widedp_utility"] = {
        "sparse": {"epsilon": 7.999, "steps": 300, "metrics": {"auc": 0.6123}},
        "dpsgd": {"error": "RuntimeError: broke"}}
    text = "\n".join(own_model_opacus.results_section(doc)[0])
    assert ("widedp on the same model, data, expected batch, steps and target ε (example level, no recalibration): "
            "sparse click AUC 0.612 (ε = 8.00, 300 steps).") in text
    assert "widedp dpsgd utility run could not run: `RuntimeError: broke`" in text
