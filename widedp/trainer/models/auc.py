"""ROC AUC of binary labels from scores, exact, by ranks (the Mann–Whitney U statistic).

AUC = P(s⁺ > s⁻) + ½·P(s⁺ = s⁻) over a positive and a negative example drawn uniformly: with
r_i the rank of example i among all scores (1-based, tied scores sharing the average of their
ranks), AUC = (Σ_{i positive} r_i − n⁺(n⁺ + 1)/2) / (n⁺·n⁻). This is the area under the ROC
curve with one point per distinct score and linear interpolation between them (what
torchmetrics' `binary_auroc` and scikit-learn's `roc_auc_score` compute), in O(n log n) and
with torch alone: importing torchmetrics costs ~2 s of start-up in every process that
evaluates. tests/test_auc.py holds it to an O(n⁺·n⁻) pairwise count and to torchmetrics.
"""

from __future__ import annotations

import torch


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of `scores` [n] for 0/1 `labels` [n] (any monotone transform of the scores gives
    the same value). Needs both classes present."""
    scores = scores.detach().reshape(-1).to(torch.float64)
    positive = labels.detach().reshape(-1) > 0.5
    if scores.numel() != positive.numel():
        raise ValueError(f"scores and labels differ in size: {scores.numel()} vs {positive.numel()}")
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both a positive and a negative example")
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    # average rank of each group of tied scores: first rank of the group + (size − 1)/2
    ends = torch.cumsum(counts, 0).to(torch.float64)
    average_rank = ends - (counts.to(torch.float64) - 1.0) / 2.0
    ranks = torch.empty_like(scores)
    ranks[order] = average_rank[inverse]
    u = float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


__all__ = ["binary_auc"]
