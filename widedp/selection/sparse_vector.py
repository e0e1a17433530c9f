"""Sparse vector technique: NumericSparse exactly as seed Alg 1, sparse in the vocabulary.

Privacy assumption: add/remove-one neighbours; `sensitivity` s bounds max_i |u_i(D) - u_i(D')|
(ℓ∞ sensitivity of the query vector). Rows are scanned in id order 0..p-1 as in Alg 1;
untouched rows have u_i = 0 and are tested like any other row.

Alg 1 (seed paper): ε1 = 0.95ε, ε2 = 0.05ε, σ(e) = s·√(32·c·log(2/δ))/e;
α̂ = α + Lap(σ(ε1)); for i = 1..p: if |u_i| + Lap(2σ(ε1)) ≥ α̂ then release
û_i = u_i + Lap(2σ(ε2)), count += 1, refresh α̂ = α + Lap(σ(ε1)); stop after c answers.

Selection mode (`release_values=False`, "above threshold"): only which rows passed is
released, no numeric values, so the whole ε goes to the threshold tests (ε1 = ε).
Emits `SparseVectorDpEvent` with the noise scales in units of s and Alg 1's (ε, δ) claim.
"""

from __future__ import annotations

import math

import numpy as np

from widedp.accounting.calibration import svt_event
from widedp.selection._sparse import check_count, check_positive, check_sparse_input
from widedp.selection.result import Selection


def numeric_sparse_scales(epsilon: float, delta: float, max_answers: int, sensitivity: float, release_values: bool):
    """(threshold scale, query scale, value scale or None) of Alg 1, in absolute units.

    Derived from the privacy event itself (`accounting.calibration.svt_event`, the one place
    Alg 1's calibration is written), so the noise the mechanism draws and the event it
    reports cannot drift apart."""
    unit = svt_event(epsilon, delta, max_answers, release_values=release_values)
    value_scale = unit.value_noise * sensitivity if unit.value_noise is not None else None
    return unit.threshold_noise * sensitivity, unit.query_noise * sensitivity, value_scale


def numeric_sparse(
    touched_ids,
    values,
    num_rows: int,
    threshold: float,
    max_answers: int,
    epsilon: float,
    delta: float,
    sensitivity: float,
    rng: np.random.Generator,
    release_values: bool = True,
) -> Selection:
    """Run NumericSparse over all num_rows rows; untouched rows cost O(1) per gap.

    Between two touched rows lies a run of untouched rows, each passing independently with
    probability π = P(Lap(2σ1) ≥ α̂) while α̂ is unchanged, so the first pass in a run of L
    rows is at offset Geometric(π) (if ≤ L). Rows are examined in windows of touched rows;
    after an answer the rest of the window is discarded and redrawn (its noise was never used,
    so redrawing leaves the distribution unchanged). Expected cost O(m + c) windows' work.
    Returns ids in scan (= id) order with `values` = released noisy values (or None).
    """
    sparse = check_sparse_input(touched_ids, values, num_rows, name="values")
    c = check_count("max_answers", max_answers, sparse.num_rows)
    epsilon = check_positive("epsilon", epsilon)
    sensitivity = check_positive("sensitivity", sensitivity)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be finite, got {threshold}")
    b_threshold, b_query, b_value = numeric_sparse_scales(epsilon, delta, c, sensitivity, release_values)

    p = sparse.num_rows
    ids, u = sparse.ids, sparse.scores
    abs_u = np.abs(u)
    m = ids.size
    answers_ids: list[int] = []
    answers_raw: list[float] = []

    alpha_hat = threshold + rng.laplace(0.0, b_threshold)
    cursor = 0  # next row id to examine
    pos = 0  # index of the next touched row not yet examined
    window = 64
    while len(answers_ids) < c and cursor < p:
        # P(Lap(b) >= a) = ½e^{-a/b} for a >= 0, 1 - ½e^{a/b} otherwise.
        pi = 0.5 * math.exp(-alpha_hat / b_query) if alpha_hat >= 0 else 1.0 - 0.5 * math.exp(alpha_hat / b_query)
        seg = ids[pos : pos + window]
        last = pos + window >= m
        # Gap g precedes touched row seg[g]; a final gap runs to p when the window reaches the end.
        gap_start = np.empty(seg.size + (1 if last else 0), dtype=np.int64)
        gap_end = np.empty_like(gap_start)
        gap_start[0] = cursor
        gap_start[1 : seg.size + 1 if last else seg.size] = seg[: seg.size if last else seg.size - 1] + 1
        gap_end[: seg.size] = seg
        if last:
            gap_end[-1] = p
        gap_len = gap_end - gap_start
        if pi > 0.0:
            offsets = rng.geometric(pi, size=gap_len.size)
            gap_hit = offsets <= gap_len
        else:  # α̂ so large that e^{-α̂/b} underflows: no untouched row can pass (prob < 1e-300)
            offsets = np.zeros(gap_len.size, dtype=np.int64)
            gap_hit = np.zeros(gap_len.size, dtype=bool)
        touched_pass = abs_u[pos : pos + seg.size] + rng.laplace(0.0, b_query, size=seg.size) >= alpha_hat
        # Scan order: gap_0, touched_0, gap_1, touched_1, ..., [final gap].
        first_gap = np.flatnonzero(gap_hit)
        first_touched = np.flatnonzero(touched_pass)
        g = 2 * first_gap[0] if first_gap.size else math.inf
        t = 2 * first_touched[0] + 1 if first_touched.size else math.inf
        if g == math.inf and t == math.inf:
            cursor = p if last else int(seg[-1]) + 1
            pos += seg.size
            window *= 2
            continue
        # The smaller of g, t is finite here (both infinite was handled above), so int() is exact.
        if g < t:
            gi = int(g) // 2
            row = int(gap_start[gi] + offsets[gi] - 1)
            answers_ids.append(row)
            answers_raw.append(0.0)
            pos += gi  # touched rows before this gap were examined (and failed)
        else:
            ti = (int(t) - 1) // 2
            row = int(seg[ti])
            answers_ids.append(row)
            answers_raw.append(float(u[pos + ti]))
            pos += ti + 1
        cursor = row + 1
        alpha_hat = threshold + rng.laplace(0.0, b_threshold)

    out_ids = np.asarray(answers_ids, dtype=np.int64)
    out_values = None
    if release_values:
        out_values = np.asarray(answers_raw) + rng.laplace(0.0, b_value, size=out_ids.size)
    return Selection(out_ids, svt_event(epsilon, float(delta), c, release_values=release_values), out_values)
