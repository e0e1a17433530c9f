"""DLRM-style CTR model: bottom MLP on 13 dense features, one embedding per categorical
feature (pooled on the shards), an interaction, top MLP; held-out logloss, AUC and calibration
(ECE and the base-rate predictor's logloss: trainer/models/calibration_metrics.py).

Interactions (the two of the original DLRM's ``arch_interaction_op``):
  ``dot``  top MLP input = [x, (v_i · v_j)_{i<j}] over v = (x, pooled_1..F): pairwise dots only.
  ``cat``  top MLP input = [x, pooled_1, ..., pooled_F]: embeddings enter linearly, so a
           per-id additive effect (a "wide" term, logit = Σ_f θ_f[id]) is one linear layer
           away. With ``dot`` an embedding's gradient is scaled by the other vectors (small at
           init), which under per-example clipping leaves the embeddings almost no share of S1.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from widedp.trainer.models.auc import binary_auc
from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.calibration_metrics import calibration_metrics


def _mlp(sizes: Sequence[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


from widedp.trainer.names import INTERACTIONS  # noqa: E402  (the one list: config checks it before torch loads)


class DLRM(DenseModel):
    pairs: torch.Tensor  # buffer (register_buffer in __init__): the i < j index pairs of `dot`

    def __init__(self, features: list[str], embedding_dim: int, num_dense: int = 13,
                 bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (64,), interaction: str = "dot", **_):
        super().__init__()
        if interaction not in INTERACTIONS:
            raise ValueError(f"model.interaction must be one of {INTERACTIONS}, got {interaction!r}")
        self.interaction = interaction
        d = embedding_dim
        self.bottom = _mlp([num_dense, *bottom_mlp, d], final_activation=True)
        n = len(features) + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        width = d + (n * (n - 1) // 2 if interaction == "dot" else (n - 1) * d)
        self.top = _mlp([width, *top_mlp, 1], final_activation=False)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, D]
        if self.interaction == "cat":
            return self.top(torch.cat([x, pooled.flatten(1)], dim=1)).squeeze(-1)
        vectors = torch.cat([x.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        inter = gram[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(-1)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, labels, reduction="none")

    def logit_layer(self) -> nn.Linear:
        last = self.top[-1]
        assert isinstance(last, nn.Linear) and last.out_features == 1
        return last

    def metrics(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Over the evaluated (held-out) set: "logloss" (mean BCE), "auc" (when both classes
        occur), "ece" (Σ_b (n_b/n)·|mean(y)_b − mean(p)_b| over 15 equal-width bins of p = σ(z))
        and "base_rate_logloss" (the logloss of predicting this set's mean label: what "logloss"
        must beat). Definitions: trainer/models/calibration_metrics.py."""
        out = {"logloss": float(self.loss(outputs, labels).mean())}
        if labels.numel() and 0 < labels.sum() < labels.numel():
            out["auc"] = binary_auc(outputs, labels)  # ranks: σ is monotone
        out.update(calibration_metrics(outputs, labels))
        return out
