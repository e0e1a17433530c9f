"""Private recalibration of a binary model's probabilities: one noisy histogram of the training
set's logits by label, then Platt scaling (z ↦ a·clip(z) + b) fitted to it as post-processing.

Privacy assumption: add/remove-one neighbours over the whole training set (it runs once, after
the last step, on all n training examples — no sampling; the model it reads is the released
one). Each example falls in exactly one of `bins` logit bins (the model's logit clipped to
[-clip, clip], a public range) and adds 1 to that bin's total and y ∈ {0, 1} to its positives,
so one example moves the 2·bins-vector (totals, positives) by at most √2 in ℓ2. Both vectors
get N(0, (σ√2)²) on every bin: a Gaussian mechanism with noise multiplier σ,
`GaussianDpEvent(σ)`, charged once (docs/DESIGN.md §1: in the ledger before the model changes).
The bin edges, the clip, the fit and n are public; the fit reads only the noisy counts.
With a partitioned data set the trainers count their own parts (`TrainerRole.score_histogram`)
and the coordinator noises the sum: the same exact counts, so the same mechanism.
User level (privacy.unit = "user", add/remove one unit with all its examples): each example of a
unit with m examples is weighted 1/m, so a unit adds at most 1 to the totals and at most 1 to
the positives in ℓ1, hence at most √2 in ℓ2 again — the same mechanism and event, over units
(every unit weighs the same in the fit, n = U).

Why (RESULTS §6, calibration): the private models rank well but their probabilities are off in
two ways a histogram repairs. Per-example clipping biases the intercept — on ctr at ε = 1 the
mean predicted probability on the *training* set is 0.150 against a base rate of 0.255 (and
0.153 on test): when most examples are clipped each pushes the bias by about the same amount
whatever |p − y|, so the majority class wins — and the noise left in the embeddings adds
label-free logit variance (the Platt slope fitted on the training set is 0.60). Fitting (a, b)
on the training logits and applying them moved test logloss from 0.572 to 0.501 at an unchanged
AUC (the ordering is monotone in z).

The released model computes a·clip(z, ±LOGIT_CLIP) + b, the function the fit saw (every logit
beyond the range falls in an end bin, so the counts say nothing about z = 50 that they do not
say about z = 8): (a, b) are folded into the logit layer (W ← a·W, bias ← a·bias + b) and, as
a > 0, its output is clamped to [b − a·LOGIT_CLIP, b + a·LOGIT_CLIP] (`LogitRange`, a forward
hook on the layer, kept in checkpoints and in the exported program). Without the clamp a
diverged model's logits of ±10³ came out of the fold as certain wrong answers (a test log loss
of 1,154 on a public ratings set, where the clamped fold bounds every prediction by the fit's).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from widedp.accounting.events import GaussianDpEvent

log = logging.getLogger(__name__)

#: The public logit range: logits beyond ±LOGIT_CLIP fall in the end bins.
LOGIT_CLIP = 8.0
#: Equal-width bins over [-LOGIT_CLIP, LOGIT_CLIP].
BINS = 64
#: privacy.recalibration_noise_multiplier = "auto" (`auto_noise_multiplier`): the count noise's
#: std may reach this fraction of an average bin's count n / bins, ...
USEFUL_NOISE_RATIO = 0.01
#: ... and the release alone may spend up to this fraction of the target ε, ...
BUDGET_FRACTION = 0.05
#: ... unless that leaves the noisy base rate itself off: the "auto" rule spends up to
#: MAX_BUDGET_FRACTION of ε to bring the std of the noise on the total positives, σ·√2, down to
#: RATE_NOISE_TARGET of the n training units (the base rate's error, about that std over n,
#: costs a calibrated predictor ≈ Δp² / (2p(1 − p)) of log loss: 0.0004 at p = 0.5 and 0.001
#: at p = 0.1 for a std of 0.01 — a few hundred users need far more than 5% of ε for it).
RATE_NOISE_TARGET = 0.01
MAX_BUDGET_FRACTION = 0.5
#: The histogram's bins: the most of BINS, BINS/2, …, MIN_BINS at which the noise on the total
#: count, σ·√2·√bins, stays within MAX_TOTAL_NOISE_RATIO of n (`auto_bins`; public values).
#: Fewer, wider bins carry less noise in all, which matters more to a weak model's fit than the
#: resolution of 64 (docs/DESIGN.md §1.5b; tests/test_recalibration.py pairs the rules); 64
#: stay where the noise allows them.
MIN_BINS = 8
#: ℓ2 sensitivity of the (totals, positives) histogram under add/remove-one.
SENSITIVITY = math.sqrt(2.0)
#: Above this ratio of the noise on the histogram's total count, σ·√2·√bins, to the number of
#: training units n, the summary notes that the fit's intercept is mostly noise (a model with no
#: signal, fitted at this ratio, stays within 0.005 of the base rate's log loss on average;
#: tests/test_recalibration.py). A note, not a skip: a skipped release was measured worse (18,407
#: users at ε = 1, ratio 0.034: +0.016 over the base rate without it, −0.003 with it), as the
#: uncalibrated model is usually further off than the noisy fit.
MAX_TOTAL_NOISE_RATIO = 0.0075


@dataclasses.dataclass(frozen=True)
class NoisyHistogram:
    """The released counts per logit bin (`centers`), and the event that released them."""

    centers: np.ndarray
    totals: np.ndarray
    positives: np.ndarray
    event: GaussianDpEvent


def bin_edges(bins: int = BINS, clip: float = LOGIT_CLIP) -> np.ndarray:
    return np.linspace(-clip, clip, bins + 1)


def exact_histogram(logits, labels, bins: int = BINS, clip: float = LOGIT_CLIP,
                    weights=None) -> tuple[np.ndarray, np.ndarray]:
    """(totals, positives) per bin of the clipped logits: what the mechanism adds noise to.
    `weights` (user level): each example's weight, 1/m for a unit of m examples (default 1)."""
    z = np.clip(np.asarray(logits, dtype=np.float64), -clip, clip)
    y = np.asarray(labels, dtype=np.float64)
    if z.shape != y.shape or z.ndim != 1:
        raise ValueError(f"logits and labels must be 1-D and aligned, got shapes {z.shape} and {y.shape}")
    if y.size and not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1 (recalibration is for binary models)")
    w = np.ones_like(z) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != z.shape or (w.size and not (np.all(w >= 0) and np.all(w <= 1))):
        raise ValueError(f"weights must be in [0, 1], one per logit ({z.size}), got shape {w.shape}")
    index = np.minimum(((z + clip) / (2 * clip) * bins).astype(np.int64), bins - 1)
    totals = np.bincount(index, weights=w, minlength=bins)
    positives = np.bincount(index, weights=w * y, minlength=bins)
    return totals, positives


def unit_weights(example_units: np.ndarray) -> np.ndarray:
    """1/m for each example of a unit with m examples (dense unit indices): a unit's weights sum to 1."""
    units = np.asarray(example_units, dtype=np.int64)
    return 1.0 / np.bincount(units)[units]


def noisy_histogram(logits, labels, noise_multiplier: float, rng: np.random.Generator,
                    bins: int = BINS, clip: float = LOGIT_CLIP, weights=None) -> NoisyHistogram:
    """The mechanism: `exact_histogram` + N(0, (σ·√2)²) on every count. Add/remove-one, ℓ2
    sensitivity √2 (one example: one bin's total by 1 and its positives by y ≤ 1; one unit
    with `weights` = `unit_weights`: ℓ1 ≤ 1 in each vector, so ℓ2 ≤ √2)."""
    return noisy_counts(*exact_histogram(logits, labels, bins, clip, weights), noise_multiplier, rng, clip)


def noisy_counts(totals, positives, noise_multiplier: float, rng: np.random.Generator,
                 clip: float = LOGIT_CLIP) -> NoisyHistogram:
    """The mechanism's noise on exact (totals, positives) per bin (`exact_histogram`'s, or the
    sum of the trainers' over a partitioned data set): N(0, (σ·√2)²) on every count."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"recalibration noise multiplier must be finite and > 0, got {noise_multiplier}")
    totals, positives = np.asarray(totals, dtype=np.float64), np.asarray(positives, dtype=np.float64)
    bins = totals.size
    std = noise_multiplier * SENSITIVITY
    noise = rng.normal(0.0, std, size=(2, bins))
    edges = bin_edges(bins, clip)
    return NoisyHistogram((edges[:-1] + edges[1:]) / 2, totals + noise[0], positives + noise[1],
                          GaussianDpEvent(noise_multiplier))


#: The least slope a fitted recalibration keeps: a slope ≤ 0 would flatten the model's ranking or
#: turn it upside down (on noisy counts of a weak model the free fit can come out negative).
MIN_SLOPE = 1e-3


def fit_platt(centers, totals, positives, iterations: int = 50) -> tuple[float, float]:
    """(a, b) minimizing the binned logloss Σ_bins [pos·softplus(-(a z + b)) + neg·softplus(a z + b)]
    with pos = clamp(positives, 0, totals), neg = totals − pos, totals clamped at 0 (noisy counts
    can be negative), subject to a ≥ MIN_SLOPE (the model's order is kept: when the free fit's
    slope is below it, a = MIN_SLOPE and b alone is fitted, which leaves the predictions near
    the base rate, still in the model's order): Newton's method on a convex problem,
    post-processing only. Returns (1, 0) (no change) when the counts carry no positives or no
    negatives."""
    z = np.asarray(centers, dtype=np.float64)
    n = np.clip(np.asarray(totals, dtype=np.float64), 0.0, None)
    pos = np.clip(np.asarray(positives, dtype=np.float64), 0.0, n)
    neg = n - pos
    if pos.sum() <= 0 or neg.sum() <= 0:
        return 1.0, 0.0
    u = np.stack([z, np.ones_like(z)], axis=1)
    scale = n.sum()

    def loss(theta: np.ndarray) -> float:
        s = u @ theta
        return float((n * np.logaddexp(0.0, s) - pos * s).sum() / scale)

    theta = np.array([1.0, 0.0])
    current = loss(theta)
    for _ in range(iterations):  # damped Newton: halve the step until the loss decreases
        p = 0.5 * (1.0 + np.tanh(0.5 * (u @ theta)))
        grad = u.T @ (n * p - pos) / scale
        hess = (u * (n * p * (1 - p))[:, None]).T @ u / scale + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        for _ in range(40):
            candidate = theta - step
            value = loss(candidate)
            if value <= current:
                break
            step = step / 2
        else:
            break
        theta, improvement, current = candidate, current - value, value
        if improvement < 1e-13:
            break
    a, b = float(theta[0]), float(theta[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return 1.0, 0.0
    if a >= MIN_SLOPE:
        return a, b
    return MIN_SLOPE, _fit_intercept(z, n, pos, MIN_SLOPE, b, iterations)


def _fit_intercept(z: np.ndarray, n: np.ndarray, pos: np.ndarray, a: float, b: float, iterations: int) -> float:
    """The b minimizing the binned logloss at a fixed slope a (a convex problem in one variable:
    Newton's method, damped)."""
    scale = n.sum()

    def loss(value: float) -> float:
        s = a * z + value
        return float((n * np.logaddexp(0.0, s) - pos * s).sum() / scale)

    current = loss(b)
    for _ in range(iterations):
        p = 0.5 * (1.0 + np.tanh(0.5 * (a * z + b)))
        grad = float((n * p - pos).sum() / scale)
        hess = float((n * p * (1 - p)).sum() / scale) + 1e-12
        step = grad / hess
        for _ in range(40):
            value = loss(b - step)
            if value <= current:
                break
            step /= 2
        else:
            break
        b, improvement, current = b - step, current - value, value
        if improvement < 1e-13:
            break
    return float(b) if math.isfinite(b) else 0.0


def auto_noise_multiplier(n: int, target_epsilon: float, delta: float, accountant: str,
                          bins: int = BINS) -> tuple[float, str]:
    """σ for privacy.recalibration_noise_multiplier = "auto", from public values:
      σ_useful     = USEFUL_NOISE_RATIO · (n / bins) / √2  (count noise std = that fraction of an
                     average bin's count)
      σ_affordable = the σ at which GaussianDpEvent(σ) alone spends BUDGET_FRACTION · ε at δ
      σ = max(σ_useful, σ_affordable) — as in DP-FEST's rule (selection.fest.auto_fest_noise_multiplier):
    as much noise as keeps the fit useful when that is cheap — unless σ is then above
      σ_rate       = RATE_NOISE_TARGET · n / √2  (the noise on the total positives, σ·√2, at
                     RATE_NOISE_TARGET of n: the base rate's own error),
    when the release may spend more, up to MAX_BUDGET_FRACTION · ε: σ = max(σ_rate, the σ
    spending MAX_BUDGET_FRACTION · ε). The training gets the rest of ε (the planner composes
    the release with the steps), so on a few hundred units — where the model has little to
    learn at small ε anyway (trainer/config/forecast.py) — most of it goes to the base rate."""
    from widedp.accounting.calibration import calibrate, one_time_gaussian_sigma

    if n < 1:
        raise ValueError(f"recalibration needs n >= 1 training examples, got {n}")
    useful = USEFUL_NOISE_RATIO * (n / bins) / SENSITIVITY
    sigma, affordable = one_time_gaussian_sigma(useful, BUDGET_FRACTION * target_epsilon, delta, accountant)
    spend = "≤" if affordable == useful else "="
    rule = (f"auto: max({USEFUL_NOISE_RATIO:g}·(n/{bins})/√2 = {useful:.4g}, σ spending "
            f"{BUDGET_FRACTION:g}·ε {spend} {affordable:.4g}) = {sigma:.4g}")
    rate = RATE_NOISE_TARGET * n / SENSITIVITY
    if sigma <= rate:
        return sigma, rule
    widest = calibrate(GaussianDpEvent, MAX_BUDGET_FRACTION * target_epsilon, delta, accountant=accountant)
    sigma = max(rate, widest)
    return sigma, (f"{rule}, above {RATE_NOISE_TARGET:g}·n/√2 = {rate:.4g} (the base rate's noise): "
                   f"max({rate:.4g}, σ spending {MAX_BUDGET_FRACTION:g}·ε = {widest:.4g}) = {sigma:.4g}")


def auto_bins(noise_multiplier: float, n: int) -> int:
    """The bins of the histogram (public values only): the largest of BINS, BINS/2, …, MIN_BINS
    whose total-count noise ratio σ·√2·√bins / n is at most MAX_TOTAL_NOISE_RATIO, else
    MIN_BINS."""
    bins = BINS
    while bins > MIN_BINS and total_noise_ratio(noise_multiplier, n, bins) > MAX_TOTAL_NOISE_RATIO:
        bins //= 2
    return bins


def total_noise_ratio(noise_multiplier: float, n: int, bins: int = BINS) -> float:
    """The std of the noise on the histogram's total count, σ·√2·√bins, over n (public)."""
    return noise_multiplier * SENSITIVITY * math.sqrt(bins) / max(int(n), 1)


def noise_note(noise_multiplier: float, n: int, bins: int = BINS) -> dict:
    """{"noise_ratio": σ·√2·√bins / n} and, above MAX_TOTAL_NOISE_RATIO, a "noise_note" saying the
    fit's intercept is mostly noise (public values only)."""
    ratio = total_noise_ratio(noise_multiplier, n, bins)
    out: dict = {"noise_ratio": ratio}
    if ratio > MAX_TOTAL_NOISE_RATIO:
        out["noise_note"] = (f"the noise on the histogram's total count (σ·√2·√{bins} = {ratio * max(int(n), 1):.4g}) "
                             f"is {ratio:.3g} of the {int(n)} training units, above {MAX_TOTAL_NOISE_RATIO:g}: the "
                             f"fitted intercept is mostly noise (more data or a larger ε would fix it)")
    return out


class LogitRange:
    """A forward hook clamping a logit layer's output to [low, high]: with (a, b) folded into the
    layer, clamp(a·z + b, b − a·c, b + a·c) = a·clip(z, ±c) + b for a > 0 (the recalibrated
    model's function). A class, not a closure: it pickles with the module and torch.export
    records it as one clamp."""

    def __init__(self, low: float, high: float):
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"a logit range needs finite low <= high, got [{low}, {high}]")
        self.low, self.high = float(low), float(high)

    def __call__(self, module, inputs, output):
        return output.clamp(self.low, self.high)

    def __repr__(self) -> str:
        return f"LogitRange({self.low:.6g}, {self.high:.6g})"


def logit_range(a: float, b: float, clip: float = LOGIT_CLIP) -> tuple[float, float]:
    """The output range of z ↦ a·clip(z, ±clip) + b for a > 0: (b − a·clip, b + a·clip)."""
    if not a > 0:
        raise ValueError(f"a recalibration's slope must be > 0, got {a}")
    return b - a * clip, b + a * clip


def install_logit_range(engine, bounds) -> None:
    """Clamp the output of the engine's logit layer to `bounds` = (low, high) from now on (None:
    remove the clamp). The hook sits on the model the engine evaluates and releases (for
    make_private, the user's own layer, whose weights hold the fold)."""
    handle = getattr(engine, "logit_range_hook", None)
    if handle is not None:
        handle.remove()
    engine.logit_range_hook, engine.logit_range = None, None
    if bounds is None:
        return
    layer = engine.model.logit_layer()
    if layer is None:
        raise ValueError(f"a logit range needs a model with a logit layer, not {type(engine.model).__name__}")
    low, high = (float(v) for v in bounds)
    engine.logit_range_hook = layer.register_forward_hook(LogitRange(low, high))
    engine.logit_range = (low, high)


def recalibrate_engine(engine, train_set, noise_multiplier: float, batch_size: int, bins: int = BINS) -> dict:
    """Run the mechanism on a trained engine: the released model's logits on every training
    example, the ledger charged (and persisted) with `GaussianDpEvent(σ)` *before* anything
    depends on the counts, the noisy histogram from the run's secret "recalibration" stream,
    Platt's (a, b) fitted to it and folded into the logit layer of the released parameters
    (W ← a·W, bias ← a·bias + b), whose output is then clamped to `logit_range(a, b)` (the
    released model computes a·clip(z) + b, the function fitted). `bins`: the plan's (`auto_bins`, public). Returns what summary.json reports (a, b are outputs of the
    mechanism, so they are released with the model)."""
    import torch

    layer = engine.model.logit_layer()
    if layer is None:
        raise ValueError(f"train.recalibrate needs a model with one logit output, not {type(engine.model).__name__}")
    undo_recalibration(engine)  # the fit reads the training iterate's logits, never an earlier fold's
    if getattr(train_set, "partitioned", False):
        # the trainers count their own parts (the coordinator holds no example); the sum of their
        # exact counts is the whole training set's, noised once below
        averaged = engine.dense.ema is not None
        engine.store_pending_noise()  # lazy DP-SGD noise: the rows read as released
        engine.shards.broadcast("ping")  # every write-back the coordinator sent unawaited is applied first
        params = {k: v.detach() for k, v in engine.dense.released_params(averaged).items()}
        parts = _trainers_counts(engine, params, averaged, batch_size, bins, bool(train_set.unit_level))
        exact = (sum(t for t, _ in parts), sum(p for _, p in parts))
        if not exact[0].sum() > 0:
            raise ValueError("train.recalibrate: the training split is empty")
    else:
        outputs = engine.outputs(train_set, batch_size)
        if outputs is None:
            raise ValueError("train.recalibrate: the training split is empty")
        logits, labels = (t.detach().double().numpy().ravel() for t in outputs)
        units = getattr(engine, "example_units", None)  # user level: each unit weighs 1 in all
        exact = exact_histogram(logits, labels, bins, weights=None if units is None else unit_weights(units))
    event = GaussianDpEvent(noise_multiplier)
    engine.budget.charge(event)  # ledger first (docs/DESIGN.md §1): a crash after this only over-counts
    hist = noisy_counts(*exact, noise_multiplier, engine.randomness.recalibration_rng(engine.step_count))
    a, b = fit_platt(hist.centers, hist.totals, hist.positives)
    params = engine.dense.released_params()
    names = {id(p): n for n, p in engine.model.named_parameters()}
    weight_name, bias_name = names[id(layer.weight)], names[id(layer.bias)]
    weight, bias = params[weight_name], params[bias_name]
    # the training iterate's logit layer, restored if training continues (`undo_recalibration`)
    engine.pre_recalibration = {weight_name: weight.detach().clone(), bias_name: bias.detach().clone()}
    with torch.no_grad():
        weight.mul_(a)
        bias.mul_(a).add_(b)
    bounds = logit_range(a, b)
    install_logit_range(engine, bounds)
    engine.recalibrated_at = engine.step_count
    out = {"noise_multiplier": noise_multiplier, "a": a, "b": b, "bins": int(hist.centers.size),
           "logit_clip": LOGIT_CLIP, "logit_range": list(bounds), "after_step": engine.step_count}
    if a <= MIN_SLOPE:  # the fit found no positive signal: the model's order kept, near the base rate
        out["slope_held_at_minimum"] = ("the fitted slope was not positive: a is held at "
                                        f"{MIN_SLOPE:g}, keeping the model's order, and b fitted alone")
    return out


def _trainers_counts(engine, params: dict, averaged: bool, batch_size: int, bins: int, unit_weighted: bool,
                     attempts: int = 3) -> list:
    """Every trainer's exact counts of its parts (`TrainerRole.score_histogram`); a trainer or
    shard actor lost meanwhile is restored and the counting started again (nothing depends on
    counts not yet noised, and nothing was charged: the counts are recomputed whole)."""
    from widedp.trainer.engine.shard_group import StepInterrupted

    for attempt in range(attempts):
        try:
            return engine.trainers.score_histograms(params, averaged, batch_size, bins, LOGIT_CLIP, unit_weighted)
        except StepInterrupted as lost:
            if attempt + 1 == attempts:
                raise
            shards: list = getattr(engine.shards, "restore_lost", lambda during: [])("the recalibration")
            trainers = engine.trainers.restore_lost()
            log.warning("train.recalibrate: %s; restored shard(s) %s and trainer(s) %s, counting again", lost,
                        shards or "none", trainers or "none")
    raise AssertionError("unreachable")


def undo_recalibration(engine) -> None:
    """Put back the logit layer the last recalibration folded (a, b) into, before training
    continues from a recalibrated checkpoint: the steps go on from the training iterate, as an
    uninterrupted run's would; the released model of the earlier session stays released (and
    charged)."""
    import torch

    install_logit_range(engine, None)
    saved = engine.pre_recalibration
    if saved is None:
        return
    params = engine.dense.released_params()
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)
    engine.pre_recalibration = None


__all__ = ["BINS", "LOGIT_CLIP", "LogitRange", "MAX_BUDGET_FRACTION", "MAX_TOTAL_NOISE_RATIO", "MIN_BINS", "MIN_SLOPE",
           "RATE_NOISE_TARGET", "auto_bins", "NoisyHistogram", "auto_noise_multiplier",
           "bin_edges", "exact_histogram", "fit_platt", "install_logit_range", "logit_range", "noise_note", "total_noise_ratio", "noisy_counts", "noisy_histogram", "recalibrate_engine", "undo_recalibration"]
