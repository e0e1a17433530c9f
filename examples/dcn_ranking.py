"""A DCN-v2-style ranking model (Wang et al. 2021: cross layers x_{l+1} = x0 ⊙ (W x_l + b) + x_l
beside a deep MLP) over your own TorchRec EmbeddingBagCollection, trained with user-level DP by
`widedp.make_private` — sparse (noise only on privately selected rows), DP-SGD and non-private
— on click logs with users; held-out AUC, logloss and ECE, median [min, max] over seeds. The
private runs end with widedp's private recalibration (`logit_layer=`: a noisy histogram of the
training logits, Platt's z ↦ a·clip(z, ±8) + b folded into the last layer; inside the target ε).

    .venv/bin/python examples/dcn_ranking.py            # 3,000 users, ε ∈ {1, 8}, 2 seeds
    .venv/bin/python examples/dcn_ranking.py --quick    # a smoke run (what make test runs)
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

import widedp
from own_model_common import arguments, sweep

DIM = 16
FEATURES = ("ad", "history", "campaign", "device")


class DCNv2(nn.Module):
    """Cross network and deep network in parallel over [pooled embeddings, dense features]."""

    def __init__(self, num_dense: int, cross_layers: int = 2, hidden: int = 64):
        super().__init__()
        width = len(FEATURES) * DIM + num_dense
        self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(cross_layers))
        self.deep = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.logit = nn.Linear(width + hidden, 1)

    def forward(self, pooled: dict, dense: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([*(pooled[f] for f in FEATURES), dense], dim=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.logit(torch.cat([x, self.deep(x0)], dim=1)).squeeze(-1)


def embedding_tables(sizes: dict) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=sizes["item"],
                           feature_names=["ad", "history"], pooling=PoolingType.MEAN),  # one table, two features
        EmbeddingBagConfig(name="campaign", embedding_dim=DIM, num_embeddings=sizes["campaign"],
                           feature_names=["campaign"]),
        EmbeddingBagConfig(name="device", embedding_dim=DIM, num_embeddings=sizes["device"], feature_names=["device"]),
    ])


def bce(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")


def train_one(train, test, sizes, mode, epsilon, args, settings) -> dict:
    model = DCNv2(train.num_dense)
    with widedp.make_private(embedding_tables(sizes), model, bce, train, mode=mode,
                             target_epsilon=epsilon or 8.0, batch_size=args.batch_size, steps=args.steps,
                             config=settings, logit_layer=model.logit) as trainer:
        trainer.train()  # then train.recalibrate: private Platt scaling folded into model.logit
        metrics = trainer.evaluate(test)
        return {"auc": metrics["auc"], "logloss": metrics["logloss"], "ece": metrics["ece"],
                "epsilon": trainer.epsilon()}


if __name__ == "__main__":
    sweep(arguments(__doc__.splitlines()[0]), train_one)
