"""What the auditor computes from a released model, white box: one score per canary, and the
numbers of guesses fixed before any score is seen.

`white_box_scores` (one-run audit): how far each canary's own rows moved (or moved against its
injected gradient); `phrase_log_perplexities` (exposure test): each phrase's log-perplexity under
a CBOW model's tables; `tie_broken`: scores made distinct by the auditor's random order, never
by array order; `step_projections`, `robust_step_scales` and
`subsampled_gaussian_log_likelihood_ratios` (the intermediate-release audit): each step's noisy
update of a gradient canary's rows and the likelihood-ratio score of the claimed mechanism.
Arrays in, arrays out; the rows are read from the run by trainer/run/audit.py.
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


# ---- intermediate releases: each step's noisy update of every canary's rows -----------------------
#
# The threat model of `widedp audit --observe steps`: the auditor sees the model after every
# step (each step's release), not only the final one. Gradient canary i's rows then give one
# projection per step, p_{i,t} = ⟨w_{t−1} − w_t, u_i⟩ over its own rows (u_i its secret unit
# direction). For DP-SGD with SGD (no momentum) the step adds −η_t(Σ clipped + σ S1 z)/b, so
# p_{i,t} = (η_t S1 / b)(c_{i,t} + σ z_{i,t}) with c_{i,t} ≈ 1 when canary i is a member and was
# sampled in step t (probability q) and 0 otherwise, z standard normal: divided by the step's
# noise scale s_t = η_t σ S1 / b it is y_{i,t} = c_{i,t}/σ + z_{i,t}.


def step_projections(rows_by_step: np.ndarray, directions: np.ndarray) -> np.ndarray:
    """p [m, T]: ⟨w_{t−1} − w_t, u_i⟩ per canary and step.

    Args:
        rows_by_step: [T + 1, m, len(features)·D], every canary's rows before the first step
            and after each step, as released.
        directions: [m, len(features), D] (or [m, len(features)·D]), unit per canary.
    """
    rows = np.asarray(rows_by_step, dtype=np.float64)
    u = np.asarray(directions, dtype=np.float64).reshape(rows.shape[1], -1)
    if rows.ndim != 3 or rows.shape[0] < 2 or u.shape != rows.shape[1:]:
        raise ValueError(f"rows_by_step must be [T + 1 >= 2, m, width] and directions [m, width], got "
                         f"{rows.shape} and {np.asarray(directions).shape}")
    return np.einsum("tij,ij->it", rows[:-1] - rows[1:], u)


def robust_step_scales(projections: np.ndarray) -> np.ndarray:
    """ŝ_t [T]: each step's noise scale estimated from the released projections alone (never the
    membership coins): 1.4826 · the median absolute deviation over canaries, robust to the few
    (≤ q/2 of them) that carry a member's shift. A step whose projections are all equal (no
    canary row moved) gets ŝ = 0."""
    p = np.asarray(projections, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] < 2:
        raise ValueError(f"projections must be [m >= 2, T], got shape {p.shape}")
    centre = np.median(p, axis=0)
    return 1.4826 * np.median(np.abs(p - centre), axis=0)


def subsampled_gaussian_log_likelihood_ratios(normalized: np.ndarray, sample_rate: float,
                                              noise_multiplier: float) -> np.ndarray:
    """Per canary, Σ_t log[((1 − q) φ(y_t) + q φ(y_t − 1/σ)) / φ(y_t)]
    = Σ_t log(1 − q + q·exp(y_t/σ − 1/(2σ²))): the log-likelihood ratio of "member" against
    "not a member" for the observations y_{i,t} = c_{i,t}/σ + z of the module's model, the most
    powerful test of the claimed mechanism for one canary (Neyman–Pearson). A score: it may be
    computed for any mechanism; it is the optimal one for the claimed mechanism.

    Args:
        normalized: y [m, T], each step's projections divided by its noise scale.
        sample_rate: q in (0, 1], the claimed Poisson rate.
        noise_multiplier: σ > 0, the claimed noise multiplier.

    Returns:
        [m] float64 scores, higher = more likely a member.
    """
    y = np.asarray(normalized, dtype=np.float64)
    q, sigma = float(sample_rate), float(noise_multiplier)
    if y.ndim != 2:
        raise ValueError(f"normalized must be [m, T], got shape {y.shape}")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if not (np.isfinite(sigma) and sigma > 0.0):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    shifted = np.log(q) + y / sigma - 0.5 / sigma ** 2
    per_step = shifted if q == 1.0 else np.logaddexp(np.log1p(-q), shifted)
    return per_step.sum(axis=1)


def claimed_mechanism_threshold(sample_rate: float, noise_multiplier: float, steps: int, members: int,
                                non_members: int, rng: np.random.Generator, simulated: int = 200_000,
                                confidence: float = 0.975) -> float:
    """A threshold on `subsampled_gaussian_log_likelihood_ratios` fixed from the claimed mechanism
    alone, before any score is seen: the one whose Gaussian-DP bound would be largest if the run
    were exactly the claim. Each of `simulated` trials per class draws y_t = c_t/σ + z_t over
    `steps` steps (c_t ~ Bernoulli(q) for a member, 0 otherwise; z_t standard normal); the
    rates at each candidate threshold are the simulated ones, read as Clopper–Pearson upper
    bounds at `confidence` over the audit's own counts (`members`, `non_members`), so that the
    choice weighs the slack those counts leave. Any fixed threshold gives a valid bound; this
    one gives the most power against the claim (threshold_audit.threshold_audit_at).

    Args:
        sample_rate: q in (0, 1]; noise_multiplier: σ > 0; steps: T ≥ 1.
        members, non_members: the counted trials of each class (≥ 1).
        rng: a generator independent of the audit's coins.
    Returns:
        The threshold (a score value).
    """
    from scipy import special

    from widedp.auditing.threshold_audit import _upper_rates

    q, sigma, T = float(sample_rate), float(noise_multiplier), int(steps)
    if T < 1 or members < 1 or non_members < 1:
        raise ValueError(f"steps, members and non_members must be >= 1, got {steps}, {members}, {non_members}")
    rows = max(1, simulated // T)  # trials per chunk: about `simulated` draws of y at a time
    chunks_m, chunks_n = [], []
    for start in range(0, simulated, rows):
        size = min(rows, simulated - start)
        present = rng.random((size, T)) < q
        chunks_m.append(subsampled_gaussian_log_likelihood_ratios(present / sigma + rng.standard_normal((size, T)),
                                                                  q, sigma))
        chunks_n.append(subsampled_gaussian_log_likelihood_ratios(rng.standard_normal((size, T)), q, sigma))
    member_scores, other_scores = np.sort(np.concatenate(chunks_m)), np.sort(np.concatenate(chunks_n))
    candidates = np.quantile(np.concatenate([member_scores, other_scores]), np.linspace(0.001, 0.999, 999))
    fnr = np.searchsorted(member_scores, candidates, side="left") / member_scores.size
    fpr = (other_scores.size - np.searchsorted(other_scores, candidates, side="left")) / other_scores.size

    value = (special.ndtri(1.0 - _upper_rates(np.rint(fpr * non_members), non_members, confidence))
             - special.ndtri(_upper_rates(np.rint(fnr * members), members, confidence)))
    # the bound is flat near its best: the middle of the near-best candidates, not the simulation's noisy argmax
    near = candidates[value >= value.max() - 1e-3]
    return float(np.median(near))


def selected_step_scores(rows_by_step: np.ndarray, projections: np.ndarray) -> np.ndarray:
    """Per canary of a sparse run audited as it executes: the number of steps its rows moved —
    were selected: a sparse step writes back the selected rows only — plus arctan(Σ_t p_t / ŝ)/π
    ∈ (−½, ½) over those steps (p_t its update along u_i, ŝ the robust scale of every moved
    canary's updates), so the selection channel ranks first and the values only break its ties.

    Args:
        rows_by_step: [T + 1, m, width] every canary's rows before the first step and after each.
        projections: [m, T] `step_projections` of the same rows.
    Returns:
        [m] float64 scores, higher = more likely a member.
    """
    rows = np.asarray(rows_by_step, dtype=np.float64)
    p = np.asarray(projections, dtype=np.float64)
    if rows.ndim != 3 or rows.shape[0] < 2 or p.shape != (rows.shape[1], rows.shape[0] - 1):
        raise ValueError(f"rows_by_step must be [T + 1 >= 2, m, width] and projections [m, T], got {rows.shape} "
                         f"and {p.shape}")
    moved = np.any(rows[1:] != rows[:-1], axis=2).T  # [m, T]
    values = p[moved]
    scale = 1.4826 * float(np.median(np.abs(values - np.median(values)))) if values.size >= 2 else 0.0
    tie = np.arctan(np.where(moved, p, 0.0).sum(axis=1) / scale) / np.pi if scale > 0 else np.zeros(p.shape[0])
    return moved.sum(axis=1) + tie
