"""Privacy events: immutable records of exactly what accounting needs.

We reuse `dp_accounting`'s DpEvent classes wherever one fits (Gaussian, Laplace, Poisson
sampling, composition, no-op) and define our own only for selectors that have no
counterpart there. Every event is stated for the **add/remove-one** neighbouring relation
(the unit of privacy is one training example). Our own event classes say so in a class-level
`neighboring_relation` (dp_accounting's `NeighboringRelation` enum); dp_accounting's events carry
none — they are relation-agnostic (their parameters mean the same under any relation once the
sensitivity is stated for it) — so `relation_of` returns None for them and accountants treat
them as matching. An accountant refuses an event (anywhere inside a history entry) whose class
states another relation than its own.

Events here describe a mechanism applied to the *whole* dataset (or to the sampled batch
when wrapped in `PoissonSampledDpEvent`); accountants decide what they can compose and say
"unsupported" otherwise.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Iterator, Optional

import attr

# dp_accounting's event modules without its package __init__ (the whole library, ~1-2 s): a
# process that only builds or records events never loads PLD/RDP or scipy.signal/stats.
from widedp.accounting import _dp_event_light  # noqa: F401  (must precede the dp_accounting imports)
# Re-exported so users of widedp need one import for every event type. Imported by name (not
# assigned to variables) so type checkers see classes usable in annotations and as base classes.
from dp_accounting.dp_event import (
    ComposedDpEvent,
    DpEvent,
    GaussianDpEvent,
    LaplaceDpEvent,
    NonPrivateDpEvent,
    NoOpDpEvent,
    PoissonSampledDpEvent,
    SelfComposedDpEvent,
    ZCDpEvent,
)
from dp_accounting.privacy_accountant import NeighboringRelation

from widedp.accounting.modelmix import ModelMixDpEvent  # seed B's event (defined beside its RDP bound)

ADD_OR_REMOVE_ONE = NeighboringRelation.ADD_OR_REMOVE_ONE


def _positive(instance, attribute, value):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a finite number > 0, got {value!r}")


def _probability(instance, attribute, value):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a number in (0, 1), got {value!r}")


def _positive_int(instance, attribute, value):
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an integer >= 1, got {value!r}")


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ExponentialTopKDpEvent(DpEvent):
    """k sequential draws without replacement of the exponential mechanism (seed Alg 4, peeling).

    Each draw picks row r with probability proportional to exp(epsilon_per_draw * u_r / (2Δ)),
    where Δ is the add/remove ℓ∞ sensitivity of the utility vector u. Each draw is
    epsilon_per_draw-DP and, more precisely, epsilon_per_draw-bounded-range (Durfee & Rogers
    2019), which gives epsilon_per_draw²/8-zCDP per draw (Cesar & Rogers 2021). The one-shot
    Gumbel top-k is the same output distribution (as a set).
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE

    epsilon_per_draw: float = attr.ib(validator=_positive)
    k: int = attr.ib(validator=_positive_int)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class NoisyMaxTopKDpEvent(DpEvent):
    """k rounds of report-noisy-max with fresh Laplace noise (peeling).

    Each round adds Lap(2Δ/epsilon_per_draw) to every remaining row's utility (Δ the add/remove
    ℓ∞ sensitivity) and reports the argmax: each round is pure epsilon_per_draw-DP for
    arbitrary (non-monotone) utilities (Dwork & Roth 2014, §3.3).
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE

    epsilon_per_draw: float = attr.ib(validator=_positive)
    k: int = attr.ib(validator=_positive_int)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SparseVectorDpEvent(DpEvent):
    """NumericSparse (seed Alg 1): up to `max_answers` rounds of AboveThreshold.

    Noise scales are in units of the ℓ∞ sensitivity s of the query vector:
    `threshold_noise` = Laplace scale of the threshold noise / s, `query_noise` = Laplace scale
    of each query's noise / s, `value_noise` = Laplace scale of each released value / s
    (None when only the selection is released). Each round is pure DP with
    ε_round = 1/threshold_noise + 2/query_noise (+ 1/value_noise) (Dwork & Roth 2014, Thm 3.23
    proof: shift the threshold noise by s and the answering query's noise by 2s).
    `epsilon`, `delta` are the (ε, δ) that Alg 1 claims for the whole run (its calibration).
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE

    threshold_noise: float = attr.ib(validator=_positive)
    query_noise: float = attr.ib(validator=_positive)
    value_noise: Optional[float]
    max_answers: int = attr.ib(validator=_positive_int)
    epsilon: float = attr.ib(validator=_positive)
    delta: float = attr.ib(validator=_positive)

    @property
    def epsilon_per_round(self) -> float:
        eps = 1.0 / self.threshold_noise + 2.0 / self.query_noise
        if self.value_noise is not None:
            eps += 1.0 / self.value_noise
        return eps


@attr.s(frozen=True, slots=True, auto_attribs=True)
class GaussianPartitionSelectionDpEvent(DpEvent):
    """Gaussian partition selection ("DP set union"; Korolova et al. 2009, Gopi et al. 2020,
    Desfontaines et al. 2022), e.g. `selection.partition.gaussian_partition_selection`.

    Neighbouring relation: add/remove one document (a document is one unit of privacy; each
    contributes weight 1 to at most m distinct keys, so the key-count vector has ℓ2
    sensitivity √m). Mechanism: N(0, (σ·√m)²) on the count of every key present in the data,
    release the keys (and noisy counts) above a threshold τ.

    Guarantee, for neighbours D ⊂ D' = D + {x} and K = the keys of D:
    * on K both outputs are post-processing of one Gaussian mechanism with noise multiplier
      σ = `noise_multiplier` w.r.t. its ℓ2 sensitivity (D' adds ≤ √m in ℓ2 to K's counts);
    * a key of x outside K has count exactly 1, so it is released with probability
      Φ̄((τ-1)/(σ√m)); τ is chosen so that, over the ≤ m such keys, the event "a key outside
      K is released" has probability p ≤ `unseen_delta`, independently of the noise on K.
    So M(D') = (1-p)·G(D') + p·B (G the Gaussian part) and, for every event E and ε,
    P[M(D) ∈ E] - e^ε P[M(D') ∈ E] ≤ (1-p)(G(D)(E) - e^ε G(D')(E)) + p ≤ δ_G(ε) + p and
    P[M(D') ∈ E] - e^ε P[M(D) ∈ E] ≤ δ_G(ε) + p: (ε, δ_G(ε) + unseen_delta)-DP, where δ_G is
    the Gaussian's privacy curve. The same mixture argument holds after composing with any
    later (adaptive) mechanisms, so accountants compose the Gaussian part
    (`GaussianDpEvent(noise_multiplier)`) with the rest of the history and add
    `unseen_delta` to δ once per occurrence (`accounting.base.split_additive_delta`).
    This needs the event at the top level of a history, applied once to the whole data set
    with parameters fixed in advance; under subsampling (PoissonSampledDpEvent) the additive
    δ would have to be amplified too, so accountants refuse that.
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE

    noise_multiplier: float = attr.ib(validator=_positive)
    unseen_delta: float = attr.ib(validator=_probability)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class GroupDpEvent(DpEvent):
    """`event`'s mechanism, accounted for neighbours that differ by a *group* of up to
    `group_size` (k) examples at once: add/remove one user who holds at most k examples of the
    data set (user-level DP by example-level sampling, privacy.user_sampling = "examples").

    What accountants may assume (Ganesh 2024, "Tight group-level DP guarantees for DP-SGD with
    sampling via mixture of Gaussians mechanisms", Thm. 3.1 for Poisson sampling): for a
    Gaussian mechanism with ℓ2 sensitivity 1 per example, a group of k moves the sum by at most
    k, so `GroupDpEvent(GaussianDpEvent(σ), k)` is `GaussianDpEvent(σ/k)`; under Poisson sampling
    at rate q each of the k examples is sampled independently, and the dominating pair of one
    step is the mixture of Gaussians Σ_j Binom(j; k, q)·N(j, σ²) against N(0, σ²) (remove; the
    mirror for add). Only the PLD accountant (dp_accounting's mixture-of-Gaussians PLD) composes
    sampled groups; the others refuse them. k = 1 is the event itself.
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE  # one group (user)

    event: DpEvent = attr.ib()
    group_size: int = attr.ib(validator=_positive_int)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class RandomTrialsDpEvent(DpEvent):
    """Private selection among a random number K of trials (`widedp tune`,
    accounting/tuning.py): K drawn from a public distribution and kept secret, each trial one of
    `candidates` (drawn uniformly; each candidate's event is the whole trial: its training run
    and its noised score), and only the best trial released. Only the RDP accountant composes
    it (Papernot & Steinke 2022, Thm 2 and 6); its parameters are `tuning.TrialCount`'s.
    """

    neighboring_relation: ClassVar[NeighboringRelation] = ADD_OR_REMOVE_ONE

    candidates: list = attr.ib()
    distribution: str = attr.ib()
    eta: float = attr.ib(default=0.0)
    gamma: float = attr.ib(default=0.0)
    mu: float = attr.ib(default=0.0)

    @candidates.validator
    def _check_candidates(self, attribute, value):
        if not (isinstance(value, (list, tuple)) and value and all(isinstance(e, DpEvent) for e in value)):
            raise ValueError(f"RandomTrialsDpEvent.candidates must be a non-empty list of events, got {value!r}")


def grouped(event: DpEvent, group_size: int) -> DpEvent:
    """`event` accounted for groups of `group_size` (`GroupDpEvent`); the event itself at 1."""
    return event if group_size == 1 else GroupDpEvent(event, int(group_size))


# Events that carry an additive δ next to a Gaussian part; accountants split them with
# `accounting.base.split_additive_delta`.
# Typed by the one class so far: `base.split_event` reads `noise_multiplier` and `unseen_delta`,
# which every such event must have.
ADDITIVE_DELTA_EVENTS: tuple[type[GaussianPartitionSelectionDpEvent], ...] = (GaussianPartitionSelectionDpEvent,)


# --------------------------------------------------------------------------------------------
# Serialization (for the persisted ledger). A registry, not an if-chain: new event types add
# one line here.
# --------------------------------------------------------------------------------------------

EVENT_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        GaussianDpEvent,
        LaplaceDpEvent,
        PoissonSampledDpEvent,
        ComposedDpEvent,
        SelfComposedDpEvent,
        NoOpDpEvent,
        NonPrivateDpEvent,
        ZCDpEvent,
        ExponentialTopKDpEvent,
        NoisyMaxTopKDpEvent,
        SparseVectorDpEvent,
        GaussianPartitionSelectionDpEvent,
        ModelMixDpEvent,
        GroupDpEvent,
        RandomTrialsDpEvent,
    )
}


def event_to_dict(event: DpEvent) -> dict[str, Any]:
    """JSON-ready dict of an event (nested events included)."""
    name = type(event).__name__
    if name not in EVENT_TYPES:
        raise TypeError(f"cannot serialize event type {name}: not in accounting.events.EVENT_TYPES")
    out: dict[str, Any] = {"type": name}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, DpEvent):
            value = event_to_dict(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], DpEvent):
            value = [event_to_dict(v) for v in value]
        out[field.name] = value
    return out


def event_from_dict(data: dict[str, Any]) -> DpEvent:
    """Inverse of `event_to_dict`; raises ValueError naming the unknown type or field."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a serialized event: {data!r}")
    name = data["type"]
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown event type {name!r}; known: {sorted(EVENT_TYPES)}")
    kwargs = {}
    for field in attr.fields(cls):
        if field.name not in data:
            raise ValueError(f"serialized {name} lacks field {field.name!r}")
        value = data[field.name]
        if isinstance(value, dict) and "type" in value:
            value = event_from_dict(value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            value = [event_from_dict(v) for v in value]
        kwargs[field.name] = value
    return cls(**kwargs)


def gaussian_noise_multiplier(event: DpEvent) -> Optional[float]:
    """Effective noise multiplier if `event` is one Gaussian mechanism, else None.

    Gaussian mechanisms applied to the same data compose exactly into one Gaussian with
    σ_eff⁻² = Σ σ_i⁻² (their outputs are one Gaussian vector whose whitened sensitivity is
    √Σ σ_i⁻²; this holds for adaptive composition too, see GDP composition, Dong et al. 2019).
    NoOp events contribute nothing. Used by accountants that only know Gaussians (PLD, PRV).
    """
    if isinstance(event, GaussianDpEvent):
        return float(event.noise_multiplier) if event.noise_multiplier > 0 else 0.0
    if isinstance(event, NoOpDpEvent):
        return math.inf
    if isinstance(event, ComposedDpEvent):
        inv = 0.0
        for sub in event.events:
            s = gaussian_noise_multiplier(sub)
            if s is None:
                return None
            if s == 0.0:
                return 0.0
            inv += 0.0 if math.isinf(s) else s ** -2
        return math.inf if inv == 0.0 else inv ** -0.5
    if isinstance(event, GroupDpEvent):  # a group of k moves an unsampled Gaussian's mean by ≤ k
        s = gaussian_noise_multiplier(event.event)  # None when sampled: a mixture, not one Gaussian
        return s if s is None or s == 0.0 or math.isinf(s) else s / event.group_size
    if isinstance(event, SelfComposedDpEvent):
        s = gaussian_noise_multiplier(event.event)
        if s is None or s == 0.0 or math.isinf(s):
            return s
        if event.count == 0:  # composed zero times: nothing happens
            return math.inf
        return s / math.sqrt(event.count)
    return None


# --------------------------------------------------------------------------------------------
# Structure (for accountants' structural `supports` checks: no ε is computed here).
# --------------------------------------------------------------------------------------------

def relation_of(event: DpEvent) -> Optional[NeighboringRelation]:
    """The neighbouring relation `event`'s class is stated for; None = relation-agnostic
    (dp_accounting's own events, which accountants treat as matching any relation)."""
    relation = getattr(type(event), "neighboring_relation", None)
    return relation if isinstance(relation, NeighboringRelation) else None


def sub_events(event: DpEvent) -> Iterator[DpEvent]:
    """The events directly nested in `event` (any attrs-based wrapper: a field holding an event or
    a list/tuple of events)."""
    if not attr.has(type(event)):
        return
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        for sub in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(sub, DpEvent):
                yield sub


def walk(event: DpEvent) -> Iterator[DpEvent]:
    """`event` and every event nested in it, depth first."""
    yield event
    for sub in sub_events(event):
        yield from walk(sub)
