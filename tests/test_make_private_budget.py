"""`make_private` on a widedp data set counts in that data set's budget
(DATASET/privacy_budget.jsonl, trainer/run/budget.py) like a `widedp train` run: a "running" line
at its target before its first step, its spent ε when it closes, non-private runs as infinite;
a damaged budget is refused before anything is trained."""

import json
import math

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from widedp.trainer.cli import main
from widedp.trainer.data import open_dataset, synth_ctr
from widedp.trainer.private import KJTDataset, make_private
from widedp.trainer.run import budget as dataset_budget

from test_ledger_chain import _train


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data"
    synth_ctr(path, num_examples=2000, table_sizes=300, seed=5)
    return path


def _user_data(path):
    train, _ = open_dataset(path)
    meta = train.meta
    tables = sorted(set(meta.feature_tables.values()))
    configs = [EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=meta.table_sizes[t],
                                  feature_names=[f for f in meta.features if meta.feature_tables[f] == t])
               for t in tables]
    return KJTDataset.from_split(train), configs, len(meta.features)


class Tower(nn.Module):
    def __init__(self, features, dense):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4 * features + dense, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, pooled, dense):
        return self.mlp(torch.cat([*pooled.values(), dense], 1)).squeeze(-1)


def bce(out, y):
    return nn.functional.binary_cross_entropy_with_logits(out, y, reduction="none")


def _lines(path):
    return [json.loads(x) for x in (path / dataset_budget.BUDGET_FILE).read_text().splitlines()]


def test_a_make_private_run_is_counted_in_the_data_sets_budget(capsys, tmp_path, data):
    cli = _train(capsys, data, tmp_path / "cli", "train.steps=3")  # a widedp train run on the same data set
    train, configs, features = _user_data(data)
    assert train.dataset_path == data
    with make_private(configs, Tower(features, train.num_dense), bce, train, target_epsilon=3.0, batch_size=100,
                      steps=4, config=["train.selection=threshold"]) as trainer:
        running = _lines(data)[-1]
        assert running["status"] == "running" and running["target_epsilon"] == 3.0 and running["steps"] == 0
        trainer.train()
        spent = trainer.epsilon()
    finished = _lines(data)[-1]
    assert finished["run_id"] == running["run_id"] and finished["status"] == "finished"
    assert finished["epsilon"] == pytest.approx(spent) and finished["steps"] == 4 and finished["voids"] == []
    assert main(["budget", str(data)]) == 0
    budget = json.loads(capsys.readouterr().out)
    assert len(budget["runs"]) == 2
    assert budget["total_epsilon"] == pytest.approx(cli["epsilon"] + spent)
    # a non-private model trained on the data set makes the total infinite, with the reason listed
    with make_private(configs, Tower(features, train.num_dense), bce, train, mode="nonprivate", batch_size=100,
                      steps=1) as trainer:
        trainer.train()
    assert main(["budget", str(data)]) == 0
    budget = json.loads(capsys.readouterr().out)
    # (the CLI's strict JSON writes the infinite total as null)
    assert budget["total_epsilon"] is None and "train.mode = nonprivate" in json.dumps(budget)
    assert math.isinf(dataset_budget.summary(data)["total_epsilon"])


def test_a_run_that_fails_or_stops_early_is_recorded_so(tmp_path, data):
    train, configs, features = _user_data(data)
    with pytest.raises(RuntimeError, match="boom"):
        with make_private(configs, Tower(features, train.num_dense), bce, train, target_epsilon=3.0, batch_size=100,
                          steps=4) as trainer:
            trainer.train(steps=1)
            raise RuntimeError("boom")
    assert _lines(data)[-1]["status"] == "failed" and _lines(data)[-1]["steps"] == 1
    with make_private(configs, Tower(features, train.num_dense), bce, train, target_epsilon=3.0, batch_size=100,
                      steps=4) as trainer:
        trainer.train(steps=2)
    assert _lines(data)[-1]["status"] == "interrupted" and _lines(data)[-1]["steps"] == 2


def test_a_damaged_budget_is_refused_before_training(tmp_path, data):
    train, configs, features = _user_data(data)
    with make_private(configs, Tower(features, train.num_dense), bce, train, target_epsilon=3.0, batch_size=100,
                      steps=1) as trainer:
        trainer.train()
    budget_file = data / dataset_budget.BUDGET_FILE
    budget_file.write_text(budget_file.read_text().splitlines()[0] + "\n")  # truncated
    with pytest.raises(dataset_budget.BudgetError, match="privacy_budget"):
        make_private(configs, Tower(features, train.num_dense), bce, train, target_epsilon=3.0, batch_size=100,
                     steps=1)
