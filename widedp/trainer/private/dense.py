"""The user's dense network and loss in the engine's `DenseModel` contract.

Privacy assumption: the per-example clipping (docs/DESIGN.md §1) bounds one example's
contribution only if the loss is a sum of per-example terms, each depending on its own example
alone: ∂(Σ_k ℓ_k)/∂x_j = ∂ℓ_j/∂x_j. A loss that couples examples — in-batch negatives, a
softmax over the batch, BatchNorm in training mode — breaks that: one example then moves every
other example's gradient, and its sensitivity is no longer S1. `check_examples_independent`
refuses such a model on the first batch it sees (a probe, not a proof: it compares each
example's loss in a batch with its loss in half of that batch; a coupling it cannot see, e.g. one that only
acts through a statistic that happens to be equal, is the user's responsibility — the error text
and docs/THREAT_MODEL.md say so).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.calibration_metrics import calibration_metrics
from widedp.trainer.models.auc import binary_auc

POOLED_FORMS = ("dict", "tensor")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, float]]


class CoupledLossError(ValueError):
    """The loss of one example depends on the other examples of its batch."""


def binary_metrics(outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC (when both classes occur), logloss and calibration (ECE) of logits `outputs` [n]."""
    logits = outputs.reshape(-1).double()
    y = labels.reshape(-1).double()
    out = {"logloss": float(nn.functional.binary_cross_entropy_with_logits(logits, y))}
    if y.numel() and 0 < y.sum() < y.numel():
        out["auc"] = binary_auc(logits, y)
    out.update(calibration_metrics(logits, y))
    return out


class UserDenseModel(DenseModel):
    """`module(pooled, dense) -> outputs` and `loss_fn(outputs, labels) -> [B]` as a DenseModel.

    Args:
        module: the user's dense network. It is called as `module(pooled, dense)`: `pooled` is
            a dict {feature name: [B, D] pooled embedding} (`pooled_as = "dict"`) or the
            [B, F, D] tensor in `features` order (`"tensor"`); `dense` is [B, num_dense].
        loss_fn: per-example losses [B] of (outputs, labels) — `reduction="none"`.
        features: the pooled features in the order the engine holds them.
        metrics_fn: held-out metrics of (all outputs, all labels); None: `binary_metrics`
            (outputs are logits [n]).
        pooled_as: "dict" or "tensor", see `module`.
    """

    def __init__(self, module: nn.Module, loss_fn: LossFn, features: Sequence[str],
                 metrics_fn: Optional[MetricsFn] = None, pooled_as: str = "dict"):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"dense_module must be a torch.nn.Module, got {type(module).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (outputs, labels) -> per-example losses, got {loss_fn!r}")
        if pooled_as not in POOLED_FORMS:
            raise ValueError(f"pooled_as must be one of {POOLED_FORMS}, got {pooled_as!r}")
        self.module = module
        self.loss_fn, self.metrics_fn, self.pooled_as = loss_fn, metrics_fn, pooled_as
        self.features = tuple(features)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        if self.pooled_as == "tensor":
            return self.module(pooled, dense)
        return self.module({f: pooled[:, i] for i, f in enumerate(self.features)}, dense)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = self.loss_fn(outputs, labels)
        if not isinstance(losses, torch.Tensor) or losses.shape != (labels.shape[0],):
            shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
            raise ValueError(f"loss_fn must return one loss per example, shape [{labels.shape[0]}], got {shape}: "
                             "use reduction='none' (widedp clips and sums per example itself)")
        return losses

    def metrics(self, outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return dict(self.metrics_fn(outputs, labels)) if self.metrics_fn is not None else binary_metrics(outputs, labels)


@torch.no_grad()
def check_examples_independent(model: DenseModel, pooled: torch.Tensor, dense: torch.Tensor, labels: torch.Tensor,
                               rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Refuse a model whose per-example loss depends on the rest of the batch.

    Compares ℓ_j computed in the whole batch with ℓ_j computed in the batch's first half alone
    (a batch of its own, so a batch statistic or in-batch negatives change). Raises
    CoupledLossError naming the first example that differs, without its loss values (they are
    un-noised statistics of the training data)."""
    B = int(labels.shape[0])
    if B < 4:
        return
    h = B // 2
    together = model.example_loss(pooled, dense, labels)
    apart = model.example_loss(pooled[:h], dense[:h], labels[:h])
    close = torch.isclose(together[:h].double(), apart.double(), rtol=rtol, atol=atol)
    if not bool(close.all()):
        j = int((~close).nonzero()[0])
        raise CoupledLossError(
            f"the loss of training example {j} changes between a batch of {B} and a batch of its first {h} (the "
            "values are not shown: they are the training data's): the model or loss couples examples (in-batch negatives, a softmax over the batch, "
            "BatchNorm in training mode; dropout is not supported yet either). Per-example clipping would not "
            "bound one example's effect, so the ε would be false. Use a loss of each example alone: negatives "
            "drawn per example from a public distribution, or a sampled softmax over public candidates with the "
            "logQ correction; LayerNorm instead of BatchNorm")
