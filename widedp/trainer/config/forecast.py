"""A forecast before training: can this run's rows outgrow their noise? From public values only.

A row's update at one step is the clipped sum of the sampled units that use it, plus Gaussian
noise of std σ·S1 on each of its D coordinates, divided by b. A unit contributes at most S1 (its
clipped gradient's norm), so a row used by a share f of each step's units gets at most b·f·S1 of
signal a step and σ·S1·√D of noise; over T steps signal adds up linearly and noise as √T. The
row's accumulated signal reaches its noise only when

    f ≥ f_min = σ·√D / (b·√T)

(`min_unit_share`: the smallest share of each step's batch a row must be used by; its inverse,
b·√T / (σ·√D), is the signal-to-noise ratio of a row every unit uses, `row_snr`). Every
quantity is public (σ from the plan, b = the expected batch in the run's unit, T, D), nothing
depends on the data. The bound is optimistic — gradients are not all aligned and not all of
norm S1 — so a run whose f_min is large cannot learn any but its most used rows.

The warning threshold (`WARN_MIN_UNIT_SHARE`) is measured, not derived: on the click-log grids
of benchmarks/user_level.py (278 to 18,407 users, ε ∈ {1, 3, 8}, sparse and DP-SGD, user and
example level, D = 16; benchmarks/forecast_check.py and docs/RESULTS.md §23), no run with f_min
above 0.003 beat the base rate's test log loss by 0.001 (the best of them ended at the base rate:
the recalibrated intercept of a model with no signal). It was set on those click logs alone (one
generator family, one embedding width): on other data it is a plain warning, not a guarantee
either way; many runs below it fail too (the bound sees only the noise).
"""

from __future__ import annotations

import math
from typing import Optional

#: f_min above which a run is flagged as unlikely to learn (module docstring: measured on one grid).
WARN_MIN_UNIT_SHARE = 0.003


def forecast_of(engine, info, steps: int, train_set) -> dict:
    """`forecast` of a built engine (`widedp train`'s run, `make_private`'s trainer): σ from its
    plan (`PrivacyInfo`), b = its expected batch in the run's unit, D = its tables' width, n =
    the users when users are sampled, else the training examples."""
    by_users = info.unit == "user" and info.user_sampling != "examples"
    units = int(info.num_units) if by_users and info.num_units else len(train_set)
    return forecast(noise_multiplier=info.noise_multiplier if engine.ledger is not None else None,
                    expected_batch_size=float(engine.b), steps=int(steps), embedding_dim=int(engine.layout.dim),
                    units=units, unit="user" if by_users else "example")


def forecast(*, noise_multiplier: Optional[float], expected_batch_size: float, steps: int, embedding_dim: int,
             units: int, unit: str = "example") -> dict:
    """The forecast of a private run (module docstring), or of a non-private one (nothing to say).

    Args:
        noise_multiplier: σ of the gradient noise (None: a non-private run).
        expected_batch_size: b, the expected units (examples or users) per step.
        steps: T.
        embedding_dim: D, the embedding width (the coordinates a row's noise falls on).
        units: n, the training units (examples or users: public, like n).
        unit: "example" or "user" (for the message).
    Returns:
        {"row_snr", "min_unit_share", "min_units", "unlikely_to_learn", "rule", "warning"}:
        `min_units` is f_min · n, the fewest units a row must be used by (if each used it once).
    """
    if noise_multiplier is None:
        return {"unlikely_to_learn": False, "rule": "non-private: no noise to forecast"}
    if not (expected_batch_size > 0 and steps >= 1 and embedding_dim >= 1 and units >= 1):
        raise ValueError(f"a forecast needs b > 0, T >= 1, D >= 1 and n >= 1, got b = {expected_batch_size}, "
                         f"T = {steps}, D = {embedding_dim}, n = {units}")
    share = noise_multiplier * math.sqrt(embedding_dim) / (expected_batch_size * math.sqrt(steps))
    flagged = share > WARN_MIN_UNIT_SHARE
    units_name = "users" if unit == "user" else "examples"
    out = {"row_snr": 1.0 / share if share > 0 else math.inf, "min_unit_share": share,
           "min_units": share * units, "unlikely_to_learn": flagged,
           "rule": (f"f_min = σ·√D / (b·√T) = {noise_multiplier:.4g}·√{embedding_dim} / ({expected_batch_size:.4g}·√{steps}) "
                    f"= {share:.3g}; warned above {WARN_MIN_UNIT_SHARE:g} (docs/DESIGN.md §1.13)")}
    if flagged:
        out["warning"] = (f"this run is unlikely to learn: a row's signal reaches its noise only if at least "
                          f"{share:.1%} of each step's {units_name} use it (f_min = {share:.3g} > "
                          f"{WARN_MIN_UNIT_SHARE:g}; about {share * units:,.0f} of the {units:,} {units_name}). "
                          f"More {units_name}, more steps at a larger batch, a larger ε, or a smaller "
                          f"model.embedding_dim lower it")
    return out
