"""A two-tower retrieval model over your own TorchRec EmbeddingBagCollection — a user tower
(the user's item history, device, dense features) and an item tower (the ad, its campaign),
scored by their dot product — trained with user-level DP by `widedp.make_private` on click logs
with users: sparse (noise only on privately selected rows), DP-SGD and non-private.

The loss is each example's own: the logistic loss of its logged click. In-batch negatives
would couple the examples of a batch (one example would move every other's gradient, and the
per-example clip would not bound it): `make_private` refuses such a loss. Held out: recall@10
of each clicked test example's ad among it and 99 ads of other test examples (a public seed),
and the click AUC; median [min, max] over seeds.

    .venv/bin/python examples/two_tower_retrieval.py            # 3,000 users, ε ∈ {1, 8}, 2 seeds
    .venv/bin/python examples/two_tower_retrieval.py --quick    # a smoke run (what make test runs)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

import widedp
from own_model_common import arguments, sweep

DIM = 16


class TwoTower(nn.Module):
    def __init__(self, num_dense: int, hidden: int = 32):
        super().__init__()
        self.user_tower = nn.Sequential(nn.Linear(2 * DIM + num_dense, hidden), nn.ReLU(), nn.Linear(hidden, DIM))
        self.item_tower = nn.Sequential(nn.Linear(2 * DIM, hidden), nn.ReLU(), nn.Linear(hidden, DIM))

    def user(self, pooled: dict, dense: torch.Tensor) -> torch.Tensor:
        return self.user_tower(torch.cat([pooled["history"], pooled["device"], dense], dim=1))

    def item(self, pooled: dict) -> torch.Tensor:
        return self.item_tower(torch.cat([pooled["ad"], pooled["campaign"]], dim=1))

    def forward(self, pooled: dict, dense: torch.Tensor) -> torch.Tensor:
        return (self.user(pooled, dense) * self.item(pooled)).sum(dim=1)  # the click logit


def embedding_tables(sizes: dict) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=sizes["item"],
                           feature_names=["ad", "history"], pooling=PoolingType.MEAN),  # shared by both towers
        EmbeddingBagConfig(name="campaign", embedding_dim=DIM, num_embeddings=sizes["campaign"],
                           feature_names=["campaign"]),
        EmbeddingBagConfig(name="device", embedding_dim=DIM, num_embeddings=sizes["device"], feature_names=["device"]),
    ])


def bce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")


@torch.no_grad()
def recall_at(ebc, model: TwoTower, test, k: int = 10, candidates: int = 100, seed: int = 0) -> float:
    """Of the clicked test examples, the fraction whose ad ranks in the top k among it and
    `candidates - 1` ads of other test examples."""
    batch = test.take(np.arange(len(test)))
    pooled = ebc(batch.sparse).to_dict()
    users, items = model.user(pooled, batch.dense), model.item(pooled)
    clicked = torch.nonzero(batch.labels > 0.5).flatten()
    others = torch.from_numpy(np.random.default_rng(seed).integers(0, len(test), (len(clicked), candidates - 1)))
    true = (users[clicked] * items[clicked]).sum(1)
    negatives = torch.einsum("nd,ncd->nc", users[clicked], items[others])
    return float(((negatives > true[:, None]).sum(1) < k).double().mean())


def train_one(train, test, sizes, mode, epsilon, args, settings) -> dict:
    ebc, model = embedding_tables(sizes), TwoTower(train.num_dense)
    with widedp.make_private(ebc, model, bce, train, mode=mode, target_epsilon=epsilon or 8.0,
                             batch_size=args.batch_size, steps=args.steps, config=settings) as trainer:
        trainer.train()
        metrics = trainer.evaluate(test)
        ebc.load_state_dict(trainer.embedding_state_dict())  # the released tables, back in the EBC
        return {"recall@10": recall_at(ebc, model, test), "auc": metrics["auc"], "epsilon": trainer.epsilon()}


if __name__ == "__main__":
    sweep(arguments(__doc__.splitlines()[0]), train_one)
