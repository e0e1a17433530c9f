"""The dense part of a wide model, run on the coordinator.

The embedding tables live on the shards; a model here sees only the *pooled* embeddings
[B, F, D] (one D-vector per sparse feature, pooled over its bag) and the dense features. It
defines the per-example loss (for per-example gradients via torch.func) and evaluation
metrics. Keeping the model free of embedding storage is what lets the same model run with
1, 2 or 100 shards.
"""

from __future__ import annotations

import abc
from typing import Optional

import torch
from torch import nn


class DenseModel(nn.Module, abc.ABC):
    """Subclasses implement `forward(pooled, dense) -> outputs` and `loss(outputs, labels)`."""

    @abc.abstractmethod
    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-example losses [B]."""

    def example_loss(self, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.forward(pooled, dense), labels)

    @abc.abstractmethod
    def metrics(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Test metrics over a whole evaluation set (outputs concatenated over batches)."""

    def logit_layer(self) -> Optional[nn.Linear]:
        """A binary model's last layer, whose one output is the logit (train.recalibrate folds
        z ↦ a·z + b into it and clamps its output to the fitted range); None for a model without one logit (e.g. CBOW's softmax)."""
        return None
