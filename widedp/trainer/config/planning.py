"""A run's privacy plan from its config: the sampling rate, δ, k, and σ and the selector's
parameters — explicit or calibrated to the target ε (docs/DESIGN.md §3).

Values the config leaves at "auto" are derived here, each by one stated rule; the result,
`PrivacyInfo`, records every derived value and how it was obtained (for summary.json, the
privacy report and the benchmarks), so nothing downstream re-derives one.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Optional, Sequence

from widedp.accounting.calibration import UnreachableTargetError
from widedp.accounting import events as ev
from widedp.selection import k_from_fraction
from widedp.selection.calibration import calibrate
from widedp.selection.fest import auto_fest_noise_multiplier
from widedp.selection.registry import NO_SELECTION, get_selector
from widedp.trainer.engine.adaptive_clip import adaptive_clip_from_config
from widedp.trainer.config import Config
from widedp.trainer.engine import PrivacyPlan
from widedp.trainer.models import DenseModel, model_class
from widedp.trainer.engine.recalibration import auto_bins, auto_noise_multiplier, noise_note
from widedp.trainer.engine.step_noise import step_noise_event
from widedp.trainer.config.table_policy import TablePolicy, resolve_table_policy


def default_delta(n: int) -> float:
    """δ when privacy.delta is "auto": min(1/(10n), n^-1.1), clearly below 1/n at every n.

    δ = 1/n admits mechanisms that publish one random example outright ((0, 1/n)-DP), so δ
    must be well below 1/n. 1/(10n) keeps a 10× margin at practical sizes; n^-1.1 makes δ
    o(1/n) as n grows (it takes over beyond n = 10^10). The ε cost is logarithmic in 1/δ.
    """
    return min(0.1 / n, float(n) ** -1.1)


@dataclasses.dataclass(frozen=True)
class PrivacyInfo:
    """What a run's privacy plan resolved to (every "auto" replaced by its value).

    `selection_epsilon` / `selection_sigma` / `threshold` are the selector's values under the
    config's names, None where the selector has no such parameter; `selection_params` is the
    selector's whole typed Params as a dict (None without selection)."""

    sample_rate: float
    delta: float
    accountant: str
    calibrated: bool = False
    # privacy.unit: "example", or "user" (then sample_rate, δ and every n-derived value are over
    # the num_units users, each contributing at most max_examples_per_unit examples per step)
    unit: str = "example"
    num_units: Optional[int] = None
    max_examples_per_unit: Optional[int] = None
    # privacy.unit = "user": "users" (units sampled) or "examples" (each user's ≤ k examples kept
    # once, example-level steps; every event accounted for a group of group_size = k)
    user_sampling: Optional[str] = None
    group_size: Optional[int] = None
    noise_multiplier: Optional[float] = None
    k: Optional[int] = None
    selection_epsilon: Optional[float] = None
    selection_sigma: Optional[float] = None
    threshold: Optional[float] = None
    threshold_rule: Optional[str] = None
    selection_params: Optional[dict] = None
    table_policy: Optional[dict] = None  # sparse mode: {"dense": [...], "sparse": [...], "rule": ...}
    # privacy.clip_norm = "adaptive": DP-STAT's public parameters (candidates, count noise, τ)
    adaptive_clip: Optional[dict] = None
    mix_width: Optional[float] = None  # train.modelmix: the enforced gap in update sensitivities
    mix_coordinates: Optional[int] = None  # train.modelmix: k of the refined clipping (1: ℓ2 only)
    fest_noise_rule: Optional[str] = None  # privacy.fest_noise_multiplier = "auto": how σ was sized
    # train.recalibrate (private runs of binary models): {"noise_multiplier", "rule"}; its
    # GaussianDpEvent is planned inside the target ε with the one-time events
    recalibration: Optional[dict] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def table_policy(cfg: Config, table_rows: Mapping[str, int], n: int,
                 feature_tables: Optional[Mapping[str, str]] = None,
                 feature_max_ids: Optional[Mapping[str, Optional[int]]] = None) -> Optional[TablePolicy]:
    """A sparse run's per-table policy (trainer/config/table_policy.py) from the config, the tables'
    sizes, the expected batch size min(batch_size, n) and, per table, the most ids one example
    puts into it (the sum over the features reading it of `feature_max_ids`, public metadata;
    None if any is unbounded); None outside sparse mode."""
    if cfg.train.mode != "sparse":
        return None
    p = cfg.privacy
    per_table: Optional[dict[str, Optional[int]]] = None
    if feature_tables is not None and feature_max_ids is not None:
        per_table = {}
        for feature, table in feature_tables.items():
            bound, sofar = feature_max_ids.get(feature), per_table.get(table, 0)
            per_table[table] = None if bound is None or sofar is None else sofar + int(bound)
    return resolve_table_policy(table_rows, expected_batch_size=min(cfg.train.batch_size, n),
                                default=p.table_default, dense_max_rows=p.resolved("dense_max_rows"),
                                overrides=p.tables, ids_per_example=per_table)


def recalibration_plan(cfg: Config, n: int, delta: float, group_size: int = 1) -> Optional[dict]:
    """train.recalibrate's σ for a private run of a binary model (explicit, or
    `recalibration.auto_noise_multiplier` from n and the target ε), else None. Either way the plan
    carries the histogram's bins (`recalibration.auto_bins`) and the noise's share of the counts
    (`recalibration.noise_note`, public values) and, above `MAX_TOTAL_NOISE_RATIO`, a note that the fit's intercept is mostly noise."""
    if cfg.train.mode == "nonprivate" or not cfg.train.recalibrate:
        return None
    if getattr(model_class(cfg.model.name), "logit_layer") is DenseModel.logit_layer:
        return None  # no single logit to recalibrate (CBOW)
    if cfg.privacy.accountant == "paper":
        return None  # Theorem 3 composes T identical steps only: no event after them
    explicit = cfg.privacy.resolved("recalibration_noise_multiplier")
    if explicit is not None:
        bins = auto_bins(float(explicit) / group_size, n)
        return {"noise_multiplier": float(explicit), "rule": "privacy.recalibration_noise_multiplier",
                "bins": bins, **noise_note(float(explicit) / group_size, n, bins)}
    sigma, rule = auto_noise_multiplier(n, cfg.privacy.target_epsilon, delta, cfg.privacy.accountant)
    bins = auto_bins(sigma, n)  # the unit-level σ: a group's σ·k counts k per user
    note = {"bins": bins, **noise_note(sigma, n, bins)}
    if group_size > 1:  # charged for a group of k, i.e. as Gaussian(σ/k): k·σ spends what σ did
        sigma, rule = sigma * group_size, f"{rule}, × {group_size} (groups of privacy.max_examples_per_user)"
    return {"noise_multiplier": sigma, "rule": rule, **note}


def plan_run(cfg: Config, n: int, table_rows: Mapping[str, int], data_events: Sequence[ev.DpEvent] = (),
             feature_tables: Optional[Mapping[str, str]] = None, num_units: Optional[int] = None,
             data_event_units: Optional[Sequence[str]] = None,
             feature_max_ids: Optional[Mapping[str, Optional[int]]] = None
             ) -> tuple[Optional[PrivacyPlan], PrivacyInfo, Optional[TablePolicy]]:
    """A run's table policy and privacy plan: the selection runs over the sparse tables' rows.
    `feature_tables` ({feature: table}, public metadata) gives the false-positive budget's
    scale: one row per feature of a sparse table per example. `num_units`: the users when the
    training examples are each user's kept ones (privacy.user_sampling = "examples").
    `data_event_units`: per data event, "user" when it bounds a whole user (charged as it is,
    `data_event_charged`), else "example". `feature_max_ids`: per feature, the most ids one
    example holds (`DatasetMeta.max_ids_per_example`), for the "auto" dense-table rule."""
    policy = table_policy(cfg, table_rows, n, feature_tables, feature_max_ids)
    sparse = policy.sparse if policy else tuple(table_rows)
    selectable = sum(int(table_rows[name]) for name in sparse)
    rows_per_example = None if feature_tables is None else sum(t in sparse for t in feature_tables.values())
    plan, info = plan_privacy(cfg, n, selectable, data_events, policy, rows_per_example=rows_per_example,
                              num_units=num_units, data_event_units=data_event_units)
    return plan, info, policy


def data_event_is_grouped(cfg: Config, unit: str) -> bool:
    """Whether a data-preparation event of `unit` is charged for a group of
    privacy.max_examples_per_user (user level by example sampling, an example-level event), or
    as it is (every other case: an example-level run, user sampling, which refuses
    example-level data events, or an event that bounds a whole user)."""
    return cfg.privacy.unit == "user" and cfg.privacy.user_sampling == "examples" and unit != "user"


def smallest_reachable_target(exc: UnreachableTargetError, cfg: Config, n: int, vocabulary: int,
                              data_events: Sequence[ev.DpEvent], policy: Optional[TablePolicy],
                              rows_per_example: Optional[int], num_units: Optional[int],
                              data_event_units: Optional[Sequence[str]]) -> UnreachableTargetError:
    """The refusal of an unreachable privacy.target_epsilon, naming a target this run *does*
    reach, found by planning at it (`plan_privacy`'s own rules). The floor a calibration reports
    is computed at the refused target, but an "auto" σ of a one-time event (the recalibration's,
    DP-FEST's) is sized as a share of the target, so at that floor those events cost more and the
    floor moves up; and the share's own calibration can be the one refused (its floor, for its
    share of the target). So: from each refusal, the next target scales the one refused by
    (its floor / the value it refused) — the floor itself for the steps' calibration, the share's
    floor over the share for a one-time σ —, rounded up to 3 digits and at least 0.1% higher;
    until one plans (after 40 tries, doubling). The floors grow by the shares (≤ 5% each), so
    this ends in a few tries; the value named — as the smallest and as the one to set — is one
    that planned (the smallest found, to the 0.1% steps and 3 digits of the search)."""
    from widedp.accounting.calibration import round_up

    def refusal(target: float) -> Optional[UnreachableTargetError]:
        trial = copy.deepcopy(cfg)
        trial.privacy.target_epsilon = target
        try:
            _plan_privacy(trial, n, vocabulary, data_events, policy, rows_per_example, num_units, data_event_units)
        except UnreachableTargetError as again:
            return again
        return None

    target = float(cfg.privacy.target_epsilon)
    current, err = target, exc
    for attempt in range(200):
        candidate = round_up(max(current * float(err.smallest) / float(err.target), current * 1.001,
                                 current * (2.0 if attempt >= 40 else 1.0)))
        again = refusal(float(candidate))
        if again is None:  # the value named is one that planned: the smallest found to 0.1%
            return UnreachableTargetError(target, float(candidate), "privacy.target_epsilon", candidate)
        current, err = float(candidate), again
    return err.renamed("privacy.target_epsilon")  # nothing planned up to 2^160 times the target


def plan_privacy(cfg: Config, n: int, vocabulary: int, data_events: Sequence[ev.DpEvent] = (),
                 policy: Optional[TablePolicy] = None, rows_per_example: Optional[int] = None,
                 num_units: Optional[int] = None, data_event_units: Optional[Sequence[str]] = None
                 ) -> tuple[Optional[PrivacyPlan], PrivacyInfo]:
    """`_plan_privacy`, with an unreachable privacy.target_epsilon — by the steps' calibration or
    by a one-time event's "auto" σ sized from it — refused naming a target that plans
    (`smallest_reachable_target`)."""
    try:
        return _plan_privacy(cfg, n, vocabulary, data_events, policy, rows_per_example, num_units, data_event_units)
    except UnreachableTargetError as exc:
        raise smallest_reachable_target(exc, cfg, n, vocabulary, data_events, policy, rows_per_example,
                                        num_units, data_event_units) from None


def _plan_privacy(cfg: Config, n: int, vocabulary: int, data_events: Sequence[ev.DpEvent] = (),
                 policy: Optional[TablePolicy] = None, rows_per_example: Optional[int] = None,
                 num_units: Optional[int] = None, data_event_units: Optional[Sequence[str]] = None
                 ) -> tuple[Optional[PrivacyPlan], PrivacyInfo]:
    """Privacy plan (None for nonprivate) and what it resolved to (calibrated or explicit σ, ε, δ).

    `n`: the training examples, or the users at privacy.unit = "user" (the caller counts them);
    `vocabulary`: the rows the selection runs over (every row of the sparse tables);
    `data_events`: one-time events of data preparation (e.g. a private vocabulary), charged
    before the first step; calibration leaves room for them inside the target ε. A sparse run
    whose `policy` makes every table dense selects nothing privately: it is planned (and
    charged) as DP-SGD. `rows_per_example`: the sparse-table features per example; with it and
    privacy.false_positive_ratio set, an "auto" threshold lets about
    false_positive_ratio · b · rows_per_example pure-noise rows pass per step (that fraction of
    the most rows a batch touches with one id per feature), else about k."""
    t, p = cfg.train, cfg.privacy
    q = min(1.0, t.batch_size / n)
    user = p.unit == "user"
    by_examples = user and p.user_sampling == "examples"
    group = p.max_examples_per_user if by_examples else 1
    units = (num_units if by_examples else n) if user else None
    if by_examples and num_units is None:
        raise ValueError("privacy.user_sampling = \"examples\" plans over the users' kept examples: give num_units")
    delta = p.resolved("delta") or default_delta(units if units is not None else n)
    base = PrivacyInfo(sample_rate=q, delta=delta, accountant=p.accountant,
                       table_policy=policy.to_dict() if policy is not None else None, unit=p.unit,
                       num_units=units, max_examples_per_unit=p.max_examples_per_user if user else None,
                       user_sampling=p.user_sampling if user else None, group_size=group if by_examples else None)
    if t.mode == "nonprivate":
        return None, base
    selector = get_selector(t.selection) if t.mode == "sparse" and vocabulary > 0 else None
    # k: rows per step of a selector; DP-SGD selects none (so gamma is not checked against a small table)
    k = p.resolved("k") or (k_from_fraction(p.gamma, vocabulary) if vocabulary > 0 and selector is not None else None)
    selection = selector.name if selector is not None else NO_SELECTION
    # What the selectors' Params read (their `config=` keys): privacy.* ("auto" as unset: the
    # Params default), k resolved from gamma, and δ.
    source: dict[str, Any] = {f.name: p.resolved(f.name) for f in dataclasses.fields(p)}
    source.update(k=k, delta=delta)
    fest_rule = None
    if selector is not None and "fest_noise_multiplier" in selector.config_fields().values() \
            and source.get("fest_noise_multiplier") is None and k is not None:
        source["fest_noise_multiplier"], fest_rule = auto_fest_noise_multiplier(
            n, p.fest_max_rows_per_example, k, p.target_epsilon, delta, p.accountant)
        if group > 1:  # charged for a group of k, i.e. as Gaussian(σ/k): k·σ spends what σ did
            source["fest_noise_multiplier"] *= group
            fest_rule = f"{fest_rule}, × {group} (groups of privacy.max_examples_per_user)"
    if selector is not None:  # budget fields left "auto" are 0 until calibration fills them in
        budget_keys = {selector.config_fields()[f] for f in selector.budget_fields()}
        source.update({key: 0.0 for key in budget_keys if source.get(key) is None})
    event_units = list(data_event_units) if data_event_units is not None else ["example"] * len(data_events)
    if len(event_units) != len(data_events):
        raise ValueError(f"data_event_units has {len(event_units)} entries for {len(data_events)} data events")
    grouped = [data_event_is_grouped(cfg, unit) for unit in event_units]
    extra = [(event, 1) for event, g in zip(data_events, grouped) if g]
    whole_unit = [(event, 1) for event, g in zip(data_events, grouped) if not g]  # charged as they are
    recalibration = recalibration_plan(cfg, n, delta, group)
    if recalibration is not None:
        extra.append((ev.GaussianDpEvent(recalibration["noise_multiplier"]), 1))
    params: Any = None
    if selector is not None:
        params = selector.params_from(source, "config")
        one_time = selector.one_time_event(params)
        if one_time is not None:
            extra.append((one_time, 1))
    b_expected = min(t.batch_size, n)
    adaptive = adaptive_clip_from_config(p, b_expected)
    mix_width = float(p.mix_width) if t.modelmix else 0.0
    mix_coordinates = int(p.mix_coordinates) if t.modelmix else 1

    def noise_event(sigma: float) -> ev.DpEvent:  # the engine's PrivacyPlan.noise_event, σ free
        return step_noise_event(sigma, adaptive.event if adaptive is not None else None, mix_width, mix_coordinates)

    explicit = p.resolved("noise_multiplier")
    calibrated = explicit is None
    sigma = 0.0 if explicit is None else float(explicit)
    if calibrated:
        try:
            out = calibrate(p.target_epsilon, delta, q, t.steps, selection=selection, fraction=p.selection_fraction,
                            accountant=p.accountant, k=k, max_answers=k, selection_delta=delta,
                            svt_release_values=False, extra_history=extra, noise_event=noise_event,
                            group_size=group, unit_history=whole_unit)
        except UnreachableTargetError as exc:  # renamed with a target that plans by `plan_privacy`
            raise exc from None
        sigma = out.noise_multiplier
        if selector is not None and out.selection_params:  # the calibrated fields replace the config's
            params = dataclasses.replace(params, **dict(out.selection_params))
    elif selector is not None:
        missing = [selector.config_fields()[f] for f in selector.budget_fields() if getattr(params, f) <= 0]
        if missing:
            raise ValueError(f"privacy.noise_multiplier is set: selection {selection!r} also needs "
                             + " and ".join(f"privacy.{m}" for m in missing))
    rule = None
    if selector is not None and getattr(params, "threshold", 1.0) <= 0:  # "auto": the selector's own rule
        assert k is not None  # a selector runs only over a non-empty vocabulary, where k is set
        b = min(t.batch_size, n)
        ratio = p.false_positive_ratio
        fp_rows = None if not rows_per_example or ratio is None else ratio * b * rows_per_example
        # an adaptive S1 is not known yet; the selectors' automatic thresholds are set in units
        # that do not depend on it (counts) or take the largest candidate (norm scores)
        clip = float(adaptive.candidates[-1]) if adaptive is not None else float(p.clip_norm)
        auto = selector.auto_threshold(params, k=k, num_rows=vocabulary, clip_norm=clip, batch_size=b,
                                       false_positive_rows=fp_rows)
        if auto is not None:
            params = dataclasses.replace(params, threshold=auto[0])
            rule = auto[1]
    plan = PrivacyPlan(noise_multiplier=sigma, clip_norm=None if adaptive is not None else float(p.clip_norm),
                       second_clip_norm=p.second_clip_norm, selection=selection, selection_params=params,
                       adaptive_clip=adaptive, mix_width=mix_width, mix_coordinates=mix_coordinates)
    # The config's names of the selector's parameters (summary.json keys).
    named = {key: getattr(params, f) for f, key in (selector.config_fields() if selector else {}).items()}
    info = dataclasses.replace(
        base, calibrated=calibrated, noise_multiplier=sigma, k=k, threshold=named.get("threshold"), threshold_rule=rule,
        selection_epsilon=named.get("selection_epsilon"), selection_sigma=named.get("selection_sigma"),
        selection_params=dataclasses.asdict(params) if params is not None else None,
        adaptive_clip=None if adaptive is None else {
            "min": adaptive.theta, "doublings": adaptive.num_doublings, "count_noise": adaptive.count_noise,
            "beta": adaptive.beta, "stop_width": adaptive.threshold, "max": float(adaptive.candidates[-1])},
        mix_width=mix_width or None, mix_coordinates=mix_coordinates if mix_width else None,
        fest_noise_rule=fest_rule, recalibration=recalibration)
    return plan, info
