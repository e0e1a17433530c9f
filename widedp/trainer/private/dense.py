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

from typing import Callable, Mapping, Optional

import torch
from torch import nn

from widedp.trainer.models.base import DenseModel
from widedp.trainer.private.features import EmbeddingInputs, split_inputs
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
    """`module(embeddings, dense[, lengths]) -> outputs` and `loss_fn(outputs, labels) -> [B]` as
    a DenseModel over the engine's pooled bags (trainer/private/features.py).

    Args:
        module: the user's dense network. It is called as `module(embeddings, dense)`, or
            `module(embeddings, dense, lengths)` when there are sequence features:
            `embeddings` is a dict {feature: [B, D_t]} for a pooled feature and
            {feature: [B, L, D_t]} for a sequence feature (position p: the example's p-th
            kept id; zeros past its length), each at its table's width D_t (`pooled_as =
            "dict"`), or the [B, F, D] tensor in feature order (`"tensor"`: pooled features of
            one width only); `dense` is [B, num_dense]; `lengths` {sequence feature: [B] int64}.
        loss_fn: per-example losses [B] of (outputs, labels) — `reduction="none"`.
        inputs: the user's embedding inputs and the engine's layout of them
            (`features.embedding_inputs`); the engine's dense features are the user's, then
            the sequences' kept lengths.
        metrics_fn: held-out metrics of (all outputs, all labels); None: `binary_metrics`
            (outputs are logits [n]).
        pooled_as: "dict" or "tensor", see `module`.
        logit_layer: the module's `nn.Linear` whose one output is the logit the module returns
            (train.recalibrate folds z ↦ a·z + b into it and clamps its output to the fitted
            range with a forward hook; `check_logit_layer` verifies it).
    """

    def __init__(self, module: nn.Module, loss_fn: LossFn, inputs: EmbeddingInputs,
                 metrics_fn: Optional[MetricsFn] = None, pooled_as: str = "dict",
                 logit_layer: Optional[nn.Linear] = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"dense_module must be a torch.nn.Module, got {type(module).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (outputs, labels) -> per-example losses, got {loss_fn!r}")
        if pooled_as not in POOLED_FORMS:
            raise ValueError(f"pooled_as must be one of {POOLED_FORMS}, got {pooled_as!r}")
        self.module = module
        self.loss_fn, self.metrics_fn, self.pooled_as = loss_fn, metrics_fn, pooled_as
        self.inputs, self.features = inputs, inputs.engine_features
        if pooled_as == "tensor" and not inputs.uniform:
            raise ValueError('pooled_as = "tensor" needs pooled features of one embedding width; with sequence '
                             'features or tables of different widths use pooled_as = "dict"')
        if logit_layer is not None:
            if not isinstance(logit_layer, nn.Linear) or logit_layer.out_features != 1 or logit_layer.bias is None:
                raise ValueError("logit_layer must be an nn.Linear with one output and a bias (the logit's last layer)")
            if not any(m is logit_layer for m in module.modules()):
                raise ValueError("logit_layer is not a submodule of dense_module")
        self._logit_layer = logit_layer

    def logit_layer(self) -> Optional[nn.Linear]:
        return self._logit_layer

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        if self.pooled_as == "tensor":
            return self.module(pooled, dense)
        if self.inputs.uniform:
            return self.module({f: pooled[:, i] for i, f in enumerate(self.features)}, dense)
        embeddings, dense, lengths = split_inputs(self.inputs, pooled, dense, dense.shape[1] - len(self.inputs.sequences))
        if self.inputs.sequences:
            return self.module(embeddings, dense, lengths)
        return self.module(embeddings, dense)

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
def check_logit_layer(model: UserDenseModel, pooled: torch.Tensor, dense: torch.Tensor) -> None:
    """Refuse a `logit_layer` whose output is not the module's output: with W ← 2W, b ← 2b + 1
    the outputs must become 2z + 1 (what recalibration's z ↦ a·z + b folding assumes). Restores
    the layer. Public-shape work on a few training examples; nothing is released."""
    layer = model.logit_layer()
    if layer is None or dense.shape[0] == 0:
        return
    before = model(pooled, dense).double()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    try:
        layer.weight.mul_(2.0)
        layer.bias.mul_(2.0).add_(1.0)
        after = model(pooled, dense).double()
    finally:
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    if before.shape != after.shape or not torch.allclose(after, 2 * before + 1, rtol=1e-4, atol=1e-4):
        raise ValueError("logit_layer's output is not the logit dense_module returns (scaling the layer does not "
                         "scale the outputs alike): train.recalibrate could not fold z -> a*z + b into it")


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
