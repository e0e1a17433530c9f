"""The selector registry: every row selector the trainer, the CLI and calibration know by name.

In the style of Opacus's `@register_grad_sampler`: a selector is a class registered under its
config/CLI name with `@register_selector("name")`; a name can be registered once (a second
registration raises ValueError naming both classes). Everything that dispatches on a selector
name reads this registry (trainer config validation, `widedp --selection` choices and argument
checks, `selection.calibration.calibrate` (which builds the step's event for the
selector-blind `accounting.calibrate`), `trainer.config.planning.plan_privacy`, `trainer.engine.Engine`,
the benchmarks), never a list of names of its own.

"none" (DP-SGD: no selection, every row noised) is deliberately *not* a selector: it has no
parameters, no event and no `select`. `NO_SELECTION = "none"` is the one name for it; the CLI
and `calibrate` accept it beside the registry's names, the trainer spells it
`train.mode = "dpsgd"`.

Adding a selector is one new file plus its tests. The file defines:
  1. `Params`: a frozen dataclass with only the fields that selector needs, each with its real
     meaning. Field metadata (use `param(...)`) says where a value comes from:
       config="name"   the key in the trainer's source (`privacy.<name>`, plus "k" resolved from
                       privacy.gamma and "delta" the run's δ); omitted: not configurable (its
                       default is used);
       cli="name"      the `widedp epsilon/calibrate` argument dest (e.g. "selection_epsilon" for
                       --selection-epsilon); omitted: the CLI does not need it (default used);
       budget=True     the value is what calibration computes (`from_budget`); with an explicit
                       privacy.noise_multiplier the config must give it (> 0);
       record=True     the field goes into `Calibration.selection_params`.
     Fields the CLI may omit must have defaults.
  2. The selector class, decorated `@register_selector("name")`, subclassing `Selector`, with
     `Params = <that dataclass>` and
       `event(params) -> DpEvent`: the per-step selection event (NoOpDpEvent when the step's
           selection is data independent);
       `select(context, params, rng) -> Selection`: the selection over the whole vocabulary
           from a `SelectionContext` (it computes its own scores and sensitivity); its
           `Selection.event` must equal `event(params)` (the engine checks it every step);
       `from_budget(rho, inputs) -> Params`: parameters spending zCDP ρ per (unsampled) step
           (only when `spends_per_step`; a selector with `spends_per_step = False` costs
           nothing per step and is never asked);
     and optionally `one_time_event` / `one_time_select` (a selection made once before
     training, e.g. DP-FEST), `shard_statistic` / `shard_select` / `merge` (the selection
     made on the shards that own the rows, docs/DESIGN.md §2.2) and `auto_threshold` (a
     data-independent default for a `threshold` field left at 0, which is what the trainer's
     privacy.threshold = "auto" gives).
  The file goes in `selection/selectors/` (every module there is imported, so registered, when
  the registry is first read); a selector defined elsewhere registers when its module is imported.
Its tests: tests/test_selector_registry.py already checks every registered selector's
`event(params)` against what its `select` returns (give its config keys a value in
tests/engine_fixtures.PLAN_DEFAULTS); add tests of its mechanism (distribution, privacy) beside
the others (tests/test_selection_reference.py, tests/test_privacy_selectors.py).

Pure library: numpy/scipy and `accounting` only, no trainer/Ray imports.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping, Optional

import numpy as np

from widedp.accounting.events import DpEvent
from widedp.selection.result import Selection

NO_SELECTION = "none"


def param(default: Any = dataclasses.MISSING, *, config: Optional[str] = None, cli: Optional[str] = None,
          budget: bool = False, record: bool = False) -> Any:
    """A Params field with its provenance (see the module docstring)."""
    meta = {"config": config, "cli": cli, "budget": budget, "record": record}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SelectionContext:
    """What the engine knows at selection time, for any selector to compute its own inputs.

    `touched_ids`: global ids of the touched rows (sorted, unique); `row_norms`: ‖G_r‖₂ of
    the clipped, b-normalized row sums on them (aligned); `num_rows`: vocabulary size p;
    `clip_norm` S1 and `expected_batch_size` b (one example moves ‖G_r‖ by ≤ S1/b);
    `example_rows()`: (offsets, global row ids) per example of the batch (jagged; computed on
    demand, for count-based selectors); `fixed_rows`: rows fixed once before training (FEST).
    """

    num_rows: int
    touched_ids: np.ndarray
    row_norms: np.ndarray
    clip_norm: float
    expected_batch_size: float
    example_rows: Optional[Callable[[], tuple[np.ndarray, np.ndarray]]] = None
    fixed_rows: Optional[np.ndarray] = None

    def score_sensitivity(self, score_clip: float) -> tuple[np.ndarray, float]:
        """(utilities min(‖G_r‖, S0), their sensitivity min(S1/b, S0)) under add/remove-one."""
        return norm_utilities(self.row_norms, score_clip, self.clip_norm, self.expected_batch_size)


def norm_utilities(row_norms, score_clip: float, clip_norm: float,
                   expected_batch_size: float) -> tuple[np.ndarray, float]:
    """(utilities min(‖G_r‖, S0), their sensitivity min(S1/b, S0)) under add/remove-one, from
    the norms ‖G_r‖ of the clipped, b-normalized row sums (one example moves each by ≤ S1/b):
    the one formula for the coordinator (`SelectionContext.score_sensitivity`) and the shards."""
    return np.minimum(row_norms, score_clip), min(clip_norm / expected_batch_size, score_clip)


@dataclasses.dataclass(frozen=True)
class BudgetInputs:
    """What calibration knows besides ρ: rows per step k, SVT's answer limit c, its δ and mode."""

    k: Optional[int] = None
    max_answers: Optional[int] = None
    delta: float = 0.0
    release_values: bool = False


class Selector:
    """Base class of registered selectors (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = type(None)
    #: False: the per-step selection is data independent (its event is a no-op), so calibration
    #: gives it no budget share and `from_budget` is never called.
    spends_per_step: ClassVar[bool] = True

    def event(self, params: Any) -> DpEvent:
        raise NotImplementedError

    def select(self, context: SelectionContext, params: Any, rng: np.random.Generator) -> Selection:
        raise NotImplementedError

    def from_budget(self, rho: float, inputs: BudgetInputs) -> Any:
        raise ValueError(f"selection {self.name!r} spends nothing per step: it has no budget to calibrate")

    def check_budget_inputs(self, inputs: BudgetInputs) -> None:
        """Raise ValueError if calibration lacks an input `from_budget` needs."""

    #: Selection on the shards (docs/DESIGN.md §2.2): the per-row statistic each shard computes
    #: over its own rows for `shard_select`. None: the selector runs on the coordinator over the
    #: whole vocabulary (`select`). The statistics:
    #:   "counts"          contribution counts: Σ_j w_j over the distinct (example j, row) pairs,
    #:                     every example weighted by `selection.threshold.contribution_weights`
    #:                     computed over *all* its rows (ℓ2 sensitivity C1; thresholding);
    #:   "example_counts"  how many examples touch the row: unit weight per distinct
    #:                     (example, row) pair — em-count's utility, sensitivity 1 per row;
    #:   "norms"           ‖G_r‖₂ of the clipped, b-normalized row sums the shard holds (`em`'s
    #:                     utility min(‖G_r‖, S0), sensitivity min(S1/b, S0): shard_select needs
    #:                     `clip_norm` S1 and `expected_batch_size` b).
    shard_statistic: ClassVar[Optional[str]] = None

    def shard_select(self, touched: np.ndarray, scores: np.ndarray, num_rows: int, params: Any,
                     rng: np.random.Generator, *, clip_norm: Optional[float] = None,
                     expected_batch_size: Optional[float] = None) -> Any:
        """One shard's part of the step's selection over its own rows [0, num_rows), in local ids
        (`touched`: sorted unique local ids with a nonzero statistic, `scores` the statistic,
        aligned; `rng`: the shard's own stream, independent of the other shards'). The part is
        either an id array (thresholding: the rows that passed) or a
        `selection.partitioned.ShardCandidates` (top-k: the shard's candidates with their noisy
        values, internal to the run); the shard maps its local ids to global ids before `merge`
        (`ShardCandidates.remap`). `clip_norm` S1 and `expected_batch_size` b: for selectors
        whose sensitivity depends on them ("norms"); the others ignore them."""
        raise NotImplementedError(f"selection {self.name!r} does not run on the shards")

    def merge(self, parts: list, params: Any, fixed_rows: Optional[np.ndarray]) -> Selection:
        """The step's selection from the shards' parts (mapped to global ids, disjoint): the
        same output distribution as `select` over the whole vocabulary, and the same event.
        `fixed_rows`: global ids of rows fixed once before training (FEST), or None."""
        raise NotImplementedError(f"selection {self.name!r} does not run on the shards")

    def one_time_event(self, params: Any) -> Optional[DpEvent]:
        """The event of a selection made once before training (charged before it is used)."""
        return None

    def one_time_select(self, offsets: np.ndarray, ids: np.ndarray, num_rows: int, params: Any,
                        rng: np.random.Generator) -> Selection:
        raise NotImplementedError(f"selection {self.name!r} has no one-time selection")

    def auto_threshold(self, params: Any, *, k: int, num_rows: int, clip_norm: float,
                       batch_size: int, false_positive_rows: Optional[float] = None) -> Optional[tuple[float, str]]:
        """(value, rule) for a `threshold` field left at 0 ("auto" in the config), or None (no such field).
        `false_positive_rows`: the expected number of pure-noise rows per step the run allows
        (public: from b and the rows an example can touch), for selectors whose rule uses it."""
        return None

    # ---- generic, from the Params metadata ---------------------------------------------------
    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls.Params)

    @classmethod
    def config_fields(cls) -> dict[str, str]:
        """{Params field: config key} of the fields the trainer's config sets."""
        return {f.name: f.metadata["config"] for f in cls.fields() if f.metadata.get("config")}

    @classmethod
    def cli_fields(cls) -> dict[str, str]:
        """{Params field: CLI argument dest} of the fields `widedp epsilon` needs."""
        return {f.name: f.metadata["cli"] for f in cls.fields() if f.metadata.get("cli")}

    @classmethod
    def budget_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.fields() if f.metadata.get("budget"))

    @classmethod
    def record(cls, params: Any) -> dict:
        """The calibration record of `params` (`Calibration.selection_params`)."""
        return {f.name: getattr(params, f.name) for f in cls.fields() if f.metadata.get("record")}

    @classmethod
    def params_from(cls, source: Mapping[str, Any], kind: str, *, require: tuple[str, ...] = ()) -> Any:
        """Params from a mapping keyed by config keys (`kind="config"`) or CLI dests ("cli").

        Fields without a `kind` name (or whose value is None) take their default. A field in
        `require` that is missing, None or ≤ 0 raises `MissingParameter` naming its key."""
        values: dict[str, Any] = {}
        names = cls.config_fields() if kind == "config" else cls.cli_fields()
        missing = []
        for field, key in names.items():
            value = source.get(key)
            if field in require and (value is None or (not isinstance(value, bool) and value <= 0)):
                missing.append(key)
                continue
            if value is not None:
                values[field] = value
        if missing:
            raise MissingParameter(cls.name, kind, tuple(missing))
        return cls.Params(**values)


class MissingParameter(ValueError):
    """A selector's parameter was not given: `keys` are config keys or CLI dests."""

    def __init__(self, selection: str, kind: str, keys: tuple[str, ...]):
        self.selection, self.kind, self.keys = selection, kind, keys
        self.spelled = tuple(("--" + k.replace("_", "-")) if kind == "cli" else f"privacy.{k}" for k in keys)
        super().__init__(f"selection {selection!r} needs {' and '.join(self.spelled)}")


_REGISTRY: dict[str, Selector] = {}


def register_selector(name: str) -> Callable[[type], type]:
    """Class decorator: register an instance of the class under `name` (refuses overwriting)."""

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Selector)):
            raise TypeError(f"register_selector({name!r}) expects a Selector subclass, got {cls!r}")
        if name == NO_SELECTION:
            raise ValueError(f"{NO_SELECTION!r} means DP-SGD (no selection) and cannot be registered")
        if name in _REGISTRY:
            raise ValueError(f"selector {name!r} is already registered as {type(_REGISTRY[name]).__qualname__}; "
                             f"refusing to replace it with {cls.__qualname__}")
        if not (dataclasses.is_dataclass(cls.Params) and cls.Params.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__qualname__}.Params must be a frozen dataclass")
        cls.name = name
        _REGISTRY[name] = cls()
        return cls

    return decorate


def unregister_selector(name: str) -> None:
    """Remove `name` (for tests that register a toy selector)."""
    del _REGISTRY[name]


def _load() -> None:
    import widedp.selection.selectors  # noqa: F401  (registers the built-in selectors)


def get_selector(name: str) -> Selector:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selection {name!r}; choose one of {selector_names()}") from None


def selector_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    _load()
    return tuple(_REGISTRY)


def is_selector(name: str) -> bool:
    _load()
    return name in _REGISTRY


__all__ = ["BudgetInputs", "MissingParameter", "NO_SELECTION", "SelectionContext", "Selector", "get_selector",
           "is_selector", "norm_utilities", "param", "register_selector", "selector_names", "unregister_selector"]
