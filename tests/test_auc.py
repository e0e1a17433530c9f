"""trainer/models/auc.py's rank AUC against the obvious pairwise count and against torchmetrics
(the implementation it replaces), ties included."""

from __future__ import annotations

import pytest
import torch

from widedp.trainer.models.auc import binary_auc


def _pairwise(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(s⁺ > s⁻) + ½·P(s⁺ = s⁻) by counting every (positive, negative) pair."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    wins = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    return float(wins.mean())


@pytest.mark.parametrize("distinct", [3, 40, 10_000])  # heavy ties … almost none
def test_rank_auc_is_the_pairwise_count_and_torchmetrics(distinct):
    from torchmetrics.functional.classification import binary_auroc

    g = torch.Generator().manual_seed(distinct)
    labels = (torch.rand(700, generator=g) < 0.3).float()
    scores = torch.randint(0, distinct, (700,), generator=g).double() + 0.8 * labels  # informative, tied
    got = binary_auc(scores, labels)
    assert got == pytest.approx(_pairwise(scores, labels), abs=1e-12)
    probabilities = scores / (distinct + 1)  # in [0, 1]: torchmetrics applies no σ
    assert got == pytest.approx(float(binary_auroc(probabilities.float(), labels.long())), abs=1e-6)
    assert binary_auc(-scores, labels) == pytest.approx(1.0 - got, abs=1e-12)


def test_rank_auc_refuses_one_class_and_mismatched_sizes():
    with pytest.raises(ValueError, match="both a positive and a negative"):
        binary_auc(torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match="differ in size"):
        binary_auc(torch.zeros(4), torch.ones(3))
