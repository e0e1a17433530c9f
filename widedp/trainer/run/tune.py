"""`widedp tune`: private hyper-parameter selection charged to the data set's budget.

Privacy assumption (accounting/tuning.py states the bound): the tuning draws, from a keyed
secret generator (128-bit root from the OS CSPRNG, never a seed), (1) a split of the training
data into a training part and a validation part — every example (at user level: every user)
lands in the validation part independently with probability `validation_fraction`, so adding
or removing one unit changes only that unit's side; (2) the number of trials K from a public
distribution (default: logarithmic, E[K] = 10); (3) for each trial, a candidate uniformly from
the user's grid. Each trial is a private `widedp train` run of the candidate on the training
part at the per-trial target ε_t, followed by a **noised** validation score: Σ over the
validation units of the clipped per-unit score (in [0, L]; at user level each user's mean over
their examples) plus N(0, (σ_s·L)²), divided by the (public, like n) number of validation
units. Only the trial with the lowest noised score is released — its model, its candidate, its
noised score — with the ε of the whole tuning; the other trials' directories are deleted when
they are beaten, and K is not part of the release (the data set's budget file, inside the trust
boundary, has one line per trial). ε_t is the largest value whose tuning ε (the data set's
one-time events composed once with the best-of-K event `RandomTrialsDpEvent`, RDP accountant)
stays within the target; each candidate's trial event is the events its run plans (built with
the engine's own planner on the training part) and the score's Gaussian. After each trial, its
ledger must be covered by its planned event at every order, or the tuning stops.

The tuning's ledger (TUNE_DIR/ledger.json) and its budget line are written before the first
trial runs, so a crash leaves the whole target charged and nothing released. A tuning is never
resumed; a trial is never resumed (trainer/run/train.py refuses it).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.accounting.calibration import calibrate
from widedp.accounting.rdp import DEFAULT_ORDERS, rdp_curve
from widedp.accounting.tuning import TrialCount
from widedp.selection.keyed_random import NoiseKey
from widedp.trainer.config import Config, load_config
from widedp.trainer.run import budget as dataset_budget

log = logging.getLogger(__name__)

TUNING_FILE = "tuning.json"
ACCOUNTANT = "rdp"  # the best-of-K bound is an RDP bound
DISTRIBUTION_NAMES = {"logarithmic": ("truncated_negative_binomial", 0.0), "geometric": ("truncated_negative_binomial", 1.0),
                      "poisson": ("poisson", 0.0)}
SCORES = ("brier", "loss")
#: A warning when the noised score's std exceeds this fraction of its range (the clip): Brier
#: scores of the candidates of one grid differ by a few thousandths.
SCORE_NOISE_WARN = 0.002


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    """What `widedp tune` searches and how it charges.

    Args:
        config: the base config file; `sets`: its `--set` overrides.
        grid: {config key: [values]}; the candidates are the cartesian product.
        target_epsilon: the whole tuning's ε (default: the config's privacy.target_epsilon).
        expected_trials: E[K]; distribution: "logarithmic" (default), "geometric", "poisson", or
            "tnb:η" (a truncated negative binomial with that η ≥ 0).
        validation_fraction: each unit's probability of landing in the validation part.
        score: "brier" (binary models: (σ(z) − y)², L = 1) or "loss" (the model's per-example
            loss clipped to [0, score_clip]); lower is better.
        score_share: the score's Gaussian alone spends this share of target ε (at the tuning's δ).
    """

    config: Optional[str]
    sets: tuple = ()
    grid: tuple = ()  # ((key, (values...)), ...)
    target_epsilon: Optional[float] = None
    expected_trials: float = 10.0
    distribution: str = "logarithmic"
    validation_fraction: float = 0.2
    score: Optional[str] = None
    score_clip: float = 10.0
    score_share: float = 0.05

    def candidates(self) -> list[list[str]]:
        if not self.grid:
            return [[]]
        keys = [k for k, _ in self.grid]
        return [[f"{k}={v}" for k, v in zip(keys, values)] for values in itertools.product(*[v for _, v in self.grid])]

    def trial_count(self) -> TrialCount:
        name = self.distribution
        if name.startswith("tnb:"):
            try:
                eta = float(name[4:])
            except ValueError:
                raise ValueError(f"--distribution {name!r}: tnb:ETA needs a number ETA >= 0") from None
            return TrialCount.with_mean(self.expected_trials, "truncated_negative_binomial", eta)
        if name not in DISTRIBUTION_NAMES:
            raise ValueError(f"--distribution must be one of {sorted(DISTRIBUTION_NAMES)} or tnb:ETA, got {name!r}")
        kind, eta = DISTRIBUTION_NAMES[name]
        return TrialCount.with_mean(self.expected_trials, kind, eta)


def parse_grid(items: Sequence[str]) -> tuple:
    """`--grid section.key=v1,v2,...` items as ((key, (v1, v2, ...)), ...); names a malformed one."""
    out, seen = [], set()
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or "." not in key or not values.strip():
            raise ValueError(f"--grid {item!r}: expected SECTION.KEY=V1,V2,...")
        if key in seen:
            raise ValueError(f"--grid {item!r}: {key} is given twice")
        if key in ("privacy.target_epsilon", "data.path", "data.validation_fraction", "privacy.unit", "privacy.delta",
                   "privacy.reproducible", "train.mode"):
            raise ValueError(f"--grid {item!r}: {key} is fixed for the whole tuning (it sets what ε means or what is "
                             "tuned on); set it in the config")
        seen.add(key)
        out.append((key, tuple(v.strip() for v in values.split(","))))
    return tuple(out)


@dataclasses.dataclass
class Trial:
    """What `trainer.run.train.train` needs to run one trial (`trial=`)."""

    tuning_id: str
    train_positions: np.ndarray  # the training part: positions into the training split
    validation_positions: np.ndarray
    score_noise: float  # σ_s
    score_name: str
    score_clip: float
    rng: np.random.Generator  # the score's noise (keyed, secret)
    candidate: list
    validation_units: Optional[np.ndarray] = None  # user level: each validation example's unit
    validation: Any = None  # the validation part of the training split (set by `train_part`)

    def train_part(self, split):
        from widedp.trainer.data.format.dataset import SplitSubset

        if len(split) != self.train_positions.size + self.validation_positions.size:
            raise RuntimeError(f"the training split has {len(split)} examples, the tuning split "
                               f"{self.train_positions.size + self.validation_positions.size}")
        self.validation = SplitSubset(split, self.validation_positions)
        return SplitSubset(split, self.train_positions)

    def marker(self) -> dict:
        return {"tuning_id": self.tuning_id, "candidate": self.candidate,
                "note": "a trial of widedp tune: released only if its tuning chose it, with the tuning's ε (tuning.json)"}

    @torch.no_grad()
    def score(self, run) -> dict:
        """The noised validation score of the released model (module docstring)."""
        from widedp.trainer.engine.evaluation import outputs

        out = outputs(run.engine, self.validation, run.config.train.eval_batch_size)
        if out is None:
            raise ValueError("the validation part is empty: raise --validation-fraction")
        z, y = out
        per_example = unit_scores(run.engine.model, z, y, self.score_name, self.score_clip)
        total, count = sum_per_unit(per_example, self.validation_units)
        noised = (total + float(self.rng.normal(0.0, self.score_noise * self.score_clip))) / count
        return {"noised_validation_score": noised, "score": self.score_name, "score_clip": self.score_clip,
                "tuning_id": self.tuning_id}


def unit_scores(model, outputs: torch.Tensor, labels: torch.Tensor, score: str, clip: float) -> np.ndarray:
    """Each validation example's score in [0, clip]: "brier" (σ(z) − y)² (clip 1), or "loss"."""
    if score == "brier":
        values = (torch.sigmoid(outputs.double()) - labels.double()) ** 2
    else:
        values = model.loss(outputs, labels).double()
    return np.clip(values.numpy(), 0.0, clip)


def sum_per_unit(per_example: np.ndarray, units: Optional[np.ndarray]) -> tuple[float, int]:
    """(Σ over units of the unit's score, number of units): example level, each example a unit;
    user level, a user's score is the mean over their examples, so one user moves the sum by at
    most the clip."""
    if units is None:
        return float(per_example.sum()), int(per_example.size)
    _, inverse, counts = np.unique(units, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=per_example)
    return float((sums / counts).sum()), int(counts.size)


def split_units(n: int, units: Optional[np.ndarray], fraction: float, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """(training positions, validation positions): each unit (each example at example level)
    lands in the validation part independently with probability `fraction`."""
    if units is None:
        held = rng.random(n) < fraction
    else:
        uniq, inverse = np.unique(units, return_inverse=True)
        held = (rng.random(uniq.size) < fraction)[inverse]
    return np.flatnonzero(~held), np.flatnonzero(held)


PLANNING = ("cluster.backend=local",)  # a planning build starts no Ray actors


def _trial_cfg(spec: TuneSpec, candidate: list, epsilon: float, extra: Sequence[str] = ()) -> Config:
    cfg = load_config(spec.config, [*spec.sets, *candidate, f"privacy.target_epsilon={epsilon!r}",
                                    "data.validation_fraction=0", *extra])
    cfg.validate()
    return cfg


def _planned(cfg: Config, trial: Trial) -> Optional[tuple[list, list, float]]:
    """(the data set's one-time events as the run charges them, the run's other planned events,
    δ) of a candidate at its target ε, from the engine's own planner (None: unreachable)."""
    from widedp.accounting import UnreachableTargetError
    from widedp.trainer.run.train import _charged_data_events, _planned_one_time, _planned_recalibration, build_run

    try:
        run = build_run(cfg, trial.train_part)
    except UnreachableTargetError:
        return None
    with run:
        engine = run.engine
        if engine.ledger is None:
            raise ValueError("widedp tune trains private runs only (train.mode = nonprivate has no ε to charge)")
        data = _charged_data_events(cfg, engine, run.meta)
        steps = [] if engine.step_event is None else [ev.SelfComposedDpEvent(engine.step_event, cfg.train.steps)]
        return data, _planned_one_time(engine) + steps + _planned_recalibration(run.privacy), engine.ledger.delta


def _curve(events: list) -> np.ndarray:
    return rdp_curve(ev.ComposedDpEvent(list(events)), DEFAULT_ORDERS)


def _tuning_epsilon(data: list, candidates: list, count: TrialCount, delta: float) -> tuple[float, ev.DpEvent]:
    from widedp.accounting import UnsupportedEventError

    event = ev.RandomTrialsDpEvent(candidates, count.distribution, eta=count.eta, gamma=count.gamma, mu=count.mu)
    ledger = PrivacyLedger(ACCOUNTANT, delta)
    try:
        for e in [*data, event]:
            ledger.record(e)
    except UnsupportedEventError as exc:
        raise ValueError(f"widedp tune composes its trials with the RDP accountant (the best-of-K bound is an RDP "
                         f"bound), which cannot take this run's events: {exc}. At user level, sample users "
                         f"(privacy.user_sampling = \"users\"): sampled groups only the PLD accountant composes") from None
    return ledger.epsilon(), event


def tune(spec: TuneSpec, out_dir: Path, progress: bool = False) -> dict:
    """Run the tuning (module docstring) into `out_dir`; returns tuning.json's content."""
    from widedp.trainer.run.train import _ensure_dataset, atomic_write_json, train

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"--run-dir {out_dir}: not empty (a tuning never writes into a directory that holds anything)")
    base = load_config(spec.config, [*spec.sets, "data.validation_fraction=0"])
    base.validate()
    target = float(spec.target_epsilon if spec.target_epsilon is not None else base.privacy.target_epsilon)
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"--target-epsilon must be a finite number > 0, got {target!r}")
    if base.train.mode == "nonprivate":
        raise ValueError("widedp tune trains private runs only: train.mode = nonprivate has no ε to charge")
    if base.privacy.reproducible:
        raise ValueError("widedp tune needs secret randomness (K, the split, the candidates): privacy.reproducible = "
                         "true is refused")
    if base.train.debug_metrics:
        raise ValueError("train.debug_metrics = true writes raw statistics of every trial: refused by widedp tune")
    if not (0 < spec.validation_fraction < 1):
        raise ValueError(f"--validation-fraction must be in (0, 1), got {spec.validation_fraction}")
    if not (0 < spec.score_share < 1):
        raise ValueError(f"--score-share must be in (0, 1), got {spec.score_share}")
    count = spec.trial_count()
    candidates = spec.candidates()
    from widedp.trainer.models import model_class
    from widedp.trainer.models.base import DenseModel

    binary = getattr(model_class(base.model.name), "logit_layer") is not DenseModel.logit_layer
    score = spec.score or ("brier" if binary else "loss")
    if score not in SCORES or (score == "brier" and not binary):
        raise ValueError(f"--score must be one of {SCORES} ('brier' for binary models only), got {score!r}")
    clip = 1.0 if score == "brier" else float(spec.score_clip)
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"--score-clip must be a finite number > 0, got {spec.score_clip!r}")
    for candidate in candidates:  # every candidate is a valid config before anything runs
        _trial_cfg(spec, candidate, target)

    key = NoiseKey.fresh(secure=base.privacy.secure_mode)
    train_split, _ = _ensure_dataset(base)
    dataset_budget.head(base.data.path)  # a damaged or deleted budget is refused before anything runs
    units = train_split.units() if base.privacy.unit == "user" else None
    if base.privacy.unit == "user" and units is None:
        raise ValueError(f"{base.data.path}: privacy.unit = \"user\" needs a data set with a unit column")
    train_pos, val_pos = split_units(len(train_split), units, spec.validation_fraction, key.generator("tune", "split"))
    tuning_id = uuid.uuid4().hex
    choice_rng, score_rng = key.generator("tune", "candidates"), key.generator("tune", "score")

    score_sigma = 0.0  # set below, before any trial runs

    def trial_for(candidate: list) -> Trial:
        return Trial(tuning_id, train_pos, val_pos, score_sigma, score, clip, score_rng, candidate,
                     None if units is None else units[val_pos])

    # δ and the data events from one planning build at the whole target; σ_s from its share
    first = _planned(_trial_cfg(spec, candidates[0], target, PLANNING), trial_for(candidates[0]))
    if first is None:
        raise ValueError(f"the target ε = {target:g} is unreachable for one trial of {candidates[0] or 'the config'}")
    data_events, _, delta = first
    score_sigma = calibrate(lambda s: ev.GaussianDpEvent(s), spec.score_share * target, delta, accountant=ACCOUNTANT)
    score_event = ev.GaussianDpEvent(score_sigma)
    validation_units = int(val_pos.size if units is None else np.unique(units[val_pos]).size)
    if validation_units == 0:
        raise ValueError("the validation part is empty: raise --validation-fraction (or train on more data)")
    score_noise_std = score_sigma * clip / validation_units  # public: σ_s, the clip and the part's size
    if score_noise_std > SCORE_NOISE_WARN * clip:
        log.warning("the noised validation score has std %.3g (σ_s = %.3g, clip %g, %d validation units): above %g "
                    "of its range, candidates that differ by less are chosen between by the noise — raise "
                    "--score-share or --validation-fraction, or tune on more data", score_noise_std, score_sigma, clip,
                    validation_units, SCORE_NOISE_WARN)

    def at(epsilon: float) -> Optional[tuple[float, ev.DpEvent, list]]:
        planned = []
        for candidate in candidates:
            p = _planned(_trial_cfg(spec, candidate, epsilon, PLANNING), trial_for(candidate))
            if p is None:
                return None
            if p[0] != data_events or p[2] != delta:
                raise RuntimeError("the candidates' runs charge different one-time events or δ: tune them apart")
            planned.append(p[1])
        eps, event = _tuning_epsilon(data_events, [ev.ComposedDpEvent([*p, score_event]) for p in planned], count, delta)
        return eps, event, planned

    lo, hi, best = math.log(target / 200), math.log(target), None
    for _ in range(9):  # the largest ε_t (to ~2%) whose tuning ε fits the target
        mid = 0.5 * (lo + hi)
        got = at(math.exp(mid))
        if got is not None and got[0] <= target:
            lo, best = mid, (math.exp(mid), *got)
        else:
            hi = mid
    if best is None:
        raise ValueError(f"no per-trial target reaches a tuning ε ≤ {target:g} (E[K] = {count.expected:g}, "
                         f"{len(candidates)} candidates): raise --target-epsilon or lower --expected-trials")
    trial_epsilon, tuning_epsilon, tuning_event, planned = best

    # charged before anything runs: the ledger, then the data set's budget line
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger = PrivacyLedger(ACCOUNTANT, delta, header={"tuning_id": tuning_id})
    for e in [*data_events, tuning_event]:
        ledger.record(e)
    ledger.save(out_dir / "ledger.json")
    started = dataset_budget.now()

    def budget_line(status: str) -> dict:
        return dataset_budget.run_record(
            run_id=tuning_id, run_dir=out_dir, mode=base.train.mode, target_epsilon=target, delta=delta,
            accountant=ACCOUNTANT, epsilon=ledger.epsilon(), events_charged=ledger.steps, steps=0, started=started,
            status=status, privacy_unit=base.privacy.unit, kind="tuning")

    dataset_budget.append(base.data.path, budget_line("running"))
    public = {
        "tuning_id": tuning_id, "epsilon": tuning_epsilon, "delta": delta, "target_epsilon": target,
        "accountant": ACCOUNTANT, "privacy_unit": base.privacy.unit, "trial_epsilon": trial_epsilon,
        "trials": {"distribution": count.describe(), **count.to_dict(), "expected": count.expected},
        "candidates": candidates, "validation_fraction": spec.validation_fraction,
        "score": {"name": score, "clip": clip, "noise_multiplier": score_sigma, "share": spec.score_share,
                  "noise_std": score_noise_std, "validation_units": validation_units, "lower_is_better": True},
        "config": spec.config, "sets": list(spec.sets),
        "privacy_note": ("the released model is the best of a secret random number of private trials "
                         "(Papernot & Steinke 2022); its ε is this tuning's, which bounds every trial together; "
                         "the number of trials and the other trials are not released"),
    }
    k = count.sample(key.generator("tune", "count"))
    best_trial: Optional[tuple[float, Path, list]] = None
    try:
        for _ in range(k):
            c = int(choice_rng.integers(len(candidates)))
            trial = trial_for(candidates[c])
            run_dir = out_dir / f"trial-{uuid.uuid4().hex[:12]}"  # no index: the names do not count the trials
            summary = train(_trial_cfg(spec, candidates[c], trial_epsilon), run_dir, progress=progress, trial=trial)
            _check_trial_ledger(run_dir, data_events, planned[c])
            s = float(summary["tuning"]["noised_validation_score"])
            if best_trial is None or s < best_trial[0]:
                if best_trial is not None:
                    shutil.rmtree(best_trial[1])
                best_trial = (s, run_dir, candidates[c])
            else:
                shutil.rmtree(run_dir)
    except BaseException:
        for trial_dir in out_dir.glob("trial-*"):
            shutil.rmtree(trial_dir, ignore_errors=True)  # nothing of an unfinished tuning is released
        dataset_budget.append(base.data.path, budget_line("failed"))
        raise
    if best_trial is None:
        result = {**public, "chosen": None, "released": "nothing (the number of trials drawn was 0)"}
    else:
        score_value, run_dir, candidate = best_trial
        chosen_dir = run_dir
        result = {**public, "chosen": {"run_dir": str(chosen_dir), "candidate": candidate,
                                       "noised_validation_score": score_value}}
        atomic_write_json(chosen_dir / TUNING_FILE, result)
    atomic_write_json(out_dir / TUNING_FILE, result)
    dataset_budget.append(base.data.path, budget_line("finished"))
    return result


def _check_trial_ledger(run_dir: Path, data_events: list, planned: list) -> None:
    """The trial's ledger holds the data events first, and the rest is covered, at every order,
    by the trial's planned event (without the score, which the tuning adds)."""
    ledger = PrivacyLedger.load(run_dir / "ledger.json")
    history = ledger.history
    head = [e for e, _ in history[:len(data_events)]]
    if head != list(data_events):
        raise RuntimeError(f"{run_dir}: the trial's ledger does not start with the data set's one-time events")
    spent = [ev.SelfComposedDpEvent(e, c) if c != 1 else e for e, c in history[len(data_events):]]
    have = _curve(spent) if spent else np.zeros(len(DEFAULT_ORDERS))
    allowed = _curve(planned) if planned else np.zeros(len(DEFAULT_ORDERS))
    if np.any(have > allowed * (1 + 1e-9) + 1e-12):
        raise RuntimeError(f"{run_dir}: the trial spent more than its tuning planned (the tuning's ε would not bound it)")
