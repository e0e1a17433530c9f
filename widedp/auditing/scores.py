"""What the auditor computes from a released model, white box: one score per canary, and the
numbers of guesses fixed before any score is seen.

`white_box_scores` (one-run audit): how far each canary's own rows moved (or moved against its
injected gradient); `phrase_log_perplexities` (exposure test): each phrase's log-perplexity under
a CBOW model's tables; `tie_broken`: scores made distinct by the auditor's random order, never
by array order. Arrays in, arrays out; the rows are read from the run by trainer/run/audit.py.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def phrase_log_perplexities(inputs: np.ndarray, outputs: np.ndarray, phrases: np.ndarray) -> np.ndarray:
    """P(c) = −log Pr(c1 | c0) − log Pr(c2 | c0, c1) (nats) per phrase [N, 3] under the CBOW
    model: Pr(w | context) = softmax_w(o_w · h), h = the mean of the context words' input rows
    (the model's own pooling), over every output row (seed §6.5)."""
    phrases = np.asarray(phrases, dtype=np.int64)

    def log_prob(h: np.ndarray, word: np.ndarray) -> np.ndarray:
        logits = h @ outputs.T  # [N, V]
        top = logits.max(1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(1))
        return logits[np.arange(word.size), word] - log_z

    h1 = inputs[phrases[:, 0]]
    h2 = (inputs[phrases[:, 0]] + inputs[phrases[:, 1]]) / 2
    return -log_prob(h1, phrases[:, 1]) - log_prob(h2, phrases[:, 2])


def white_box_scores(initial: np.ndarray, final: np.ndarray, directions: Optional[np.ndarray] = None) -> np.ndarray:
    """`initial`, `final`: [m, len(features)·D], each canary's rows side by side. Example
    canaries: ‖final rows − initial rows‖₂ per canary. Gradient canaries: how far the rows moved
    against the injected gradient, ⟨initial − final, u_i⟩ (a descent step moves them along −u_i;
    the noise's share of this projection is one-dimensional)."""
    if directions is None:
        return np.linalg.norm(final - initial, axis=1)
    return np.einsum("ij,ij->i", initial - final, directions.reshape(directions.shape[0], -1))


def guess_counts(count: int, member_fraction: float, non_member_fraction: float) -> tuple[int, int]:
    """(k+, k−) = (⌊member_fraction · m⌋, ⌊non_member_fraction · m⌋), fixed before any score
    is seen; at least one guess in all."""
    for name, value in (("--member-guesses", member_fraction), ("--non-member-guesses", non_member_fraction)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")
    k_pos, k_neg = int(member_fraction * count), int(non_member_fraction * count)
    if k_pos + k_neg < 1 or k_pos + k_neg > count:
        raise ValueError(f"--member-guesses + --non-member-guesses must make 1 to {count} guesses, "
                         f"got {k_pos} + {k_neg}")
    return k_pos, k_neg


def tie_broken(scores: np.ndarray, tie_break: np.ndarray) -> np.ndarray:
    """Scores made distinct without changing their order: equal scores ordered by `tie_break`
    (a random permutation): the rank of (score, tie_break) as a float."""
    order = np.lexsort((tie_break, scores))
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.arange(scores.size)
    return ranks
