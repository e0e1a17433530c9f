"""CBOW word2vec with negative sampling (seed §6.1: window 4, 8 negatives, dim 100).

Sparse features (cbow dataset schema): `context` (mean-pooled bag from table "input"),
`target` and `neg_0..neg_7` (single ids from table "output"). The dense part has no
parameters: loss_j = -log σ(h·o_target) - Σ_i log σ(-h·o_neg_i), h the mean context vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from widedp.trainer.models.base import DenseModel


class CBOW(DenseModel):
    def __init__(self, features: list[str], embedding_dim: int, **_):
        super().__init__()
        if features[:2] != ["context", "target"] or not all(f.startswith("neg_") for f in features[2:]):
            raise ValueError(f"CBOW expects features [context, target, neg_0, ...], got {features}")
        self.embedding_dim = embedding_dim
        # A zero-size parameter keeps torch.func/optimizers happy with a parameter-free model.
        self.register_parameter("unused", torch.nn.Parameter(torch.zeros(0)))

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        h = pooled[:, 0, :]  # [B, D]
        outs = pooled[:, 1:, :]  # [B, 1 + negatives, D]
        return torch.einsum("bd,bkd->bk", h, outs)  # logits: target first, then negatives

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return -F.logsigmoid(outputs[:, 0]) - F.logsigmoid(-outputs[:, 1:]).sum(dim=1)

    def metrics(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        loss = self.loss(outputs, labels)
        acc = (outputs[:, 0:1] > outputs[:, 1:]).float().mean()  # target beats a negative
        return {"loss": float(loss.mean()), "pairwise_accuracy": float(acc)}
