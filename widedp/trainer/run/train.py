"""`widedp train` and `widedp evaluate`: build a run from a config and drive the engine.

Run dir: config.json (the config the run started with), summary.json (docs/DESIGN.md §4 keys),
metrics.jsonl (one line per logged step), ledger.json (rewritten atomically after every charge,
before the update is released), journal.jsonl (appended after every charge and at every
session's start: trainer/run/journal.py) and checkpoint.pt (atomic; private; `--resume DIR`
continues it).

What a run's ε means is fixed when it first starts (trainer/config/semantics.py): the checkpoint
and the ledger's header record the FIXED settings (unit, user sampling, δ, accountant, secure
and reproducible mode, the data set, ...); `_restore` refuses a resume that changes one, naming
the key and both values, and every output reports the run's semantics — the sticky settings of
every session (debug statistics), the ledger's δ — not the last session's config.

The ledger only grows (docs/DESIGN.md §1). A checkpoint records the ledger's hash chain (events
charged, digest: accounting/ledger.py), the journal's head, the data set's identity and its
budget's head (trainer/run/budget.py), the run's semantics and lineage, and the events the
run planned. `--resume` (`_restore`, trainer/run/records.py `verified_records`) refuses, naming
the file: a ledger.json that is missing, shorter than the checkpoint's or than the journal's last
charge, not an extension of them, or whose events do not hash to its chain; a journal that is
missing or does not extend the checkpoint's head; a checkpoint that is not a readable widedp
checkpoint, or was written for other data; a data set budget that does not hold the run's
earlier lines (deleted, truncated, a copy of the data set) or records a ledger key the run's
records lack; for a keyed run (trainer/run/ledger_key.py), any record not signed with its key. It also rebuilds the events from
the plan and compares: the first events must be the data set's own one-time events
(dataset.json) in order, and every later one must be an event some session of this run planned
(the checkpoint's planned one-time and per-step events, and the current plan's) — exact for the
data events and the per-step events; for a one-time selection (DP-FEST) the event is checked,
not how many times it was charged. There is no way past a lost or edited ledger but a new run
with its own budget. A new run never writes into a directory that holds a run, and one session
at a time trains a run directory (the journal's lock). Every session appends its spending, with
the run's lineage, to the data set's privacy_budget.jsonl.

Ctrl-C finishes the step in progress (a second Ctrl-C stops at once), saves the checkpoint and
ends with `TrainingInterrupted` ("interrupted at step N; resume with ..."; the CLI exits 130).

What a run writes or prints follows docs/THREAT_MODEL.md (enforced in `trainer/run/outputs.py`):
by default nothing un-noised about the training data; `train.debug_metrics = true` adds raw
training statistics and says in the summary that the privacy report does not cover them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import json
import math
import os
import pickle
import signal
import threading
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from widedp.accounting import PrivacyLedger
from widedp.accounting import events as ev
from widedp.accounting.atomic import atomic_write_bytes
from widedp.trainer import strict_json
from widedp.trainer.run import budget as dataset_budget
from widedp.trainer.config import semantics as run_semantics
from widedp.trainer.config import Config, lazy_dpsgd_noise, saved_config
from widedp.trainer.data.format.partitioned import any_dataset_identity, is_partitioned, require_local
from widedp.trainer.data.format.remote import local_path
from widedp.trainer.data.format.dataset import split_rule
from widedp.trainer.engine import Engine, StepStats
from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec
from widedp.trainer.models import build_model
from widedp.trainer.config.planning import (PrivacyInfo, data_event_is_grouped, default_delta, plan_privacy,  # noqa: F401
                                     plan_run)  # (public here too)
from widedp.trainer.run.ledger_key import LedgerKey, LedgerKeyError, key_from_environment, require_key
from widedp.trainer.engine.randomness import PrivacyRandomness  # noqa: F401
from widedp.trainer.private.build import build_engine, connect_cluster, run_randomness  # noqa: F401 (public here too)
from widedp.trainer.config.forecast import forecast_of
from widedp.trainer.run.loop import Run
from widedp.trainer.run.journal import JOURNAL_FILE, STICKY_KEYS, ReleaseJournal
from widedp.trainer.run.journal import hold as hold_journal
from widedp.trainer.run.records import LedgerStore, recorded_semantics, sign_checkpoint_record, verified_records
from widedp.trainer.run.outputs import RunRecorder, eval_line, remove_unrecorded_run_dir
from widedp.selection.registry import get_selector

log = logging.getLogger(__name__)

# docs/DESIGN.md §4 keys of every summary.json (debug-only statistics are in run_outputs.DEBUG_SUMMARY_KEYS).
SUMMARY_KEYS = ("mode", "selection", "private", "epsilon", "delta", "accountant", "steps", "examples_per_sec",
                "step_time_ms_median", "rows_selected_mean", "num_shards", "test_metrics", "bayes_auc")


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (strict_json.dumps(obj, indent=1, default=_json_default) + "\n").encode())


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _ensure_dataset(cfg: Config):
    """The config's train/test splits; a `data.synth` set is generated at data.path first if
    absent (trainer/data/synthetic/generators.py), and a cached one must match the config.

    A data.path that holds a data set no generator made (its dataset.json records no `generator`,
    as every synthetic set's does: `widedp convert` output, the user's own data) is used as it is
    even when the config names data.synth (the shipped configs do); an info message says that
    data.synth is ignored. A synthetic set other than the one asked for is refused."""
    from widedp.trainer import data as data_mod
    from widedp.trainer.data.synthetic.generators import SYNTHETIC_DATASETS

    if is_partitioned(cfg.data.path):
        return _open_partitioned(cfg, cfg.data.path)
    require_local(cfg.data.path)  # a data set at a URI is a partitioned one
    path = local_path(cfg.data.path)
    synthetic = SYNTHETIC_DATASETS.get(cfg.data.synth) if cfg.data.synth else None
    if cfg.data.synth and synthetic is None:
        raise ValueError(f"data.synth must be empty or one of {sorted(SYNTHETIC_DATASETS)}, got {cfg.data.synth!r}")
    if not (path / "dataset.json").exists():
        if synthetic is None:
            raise ValueError(f"data.path {path} has no dataset.json (set data.synth to generate one)")
        synthetic.generate(path, cfg.data)
    elif synthetic is not None:
        try:
            recorded = json.loads((path / "dataset.json").read_text())
        except ValueError:
            recorded = None  # malformed: open_dataset names the file and the problem
        if isinstance(recorded, dict) and "generator" in recorded:  # a synthetic set: it must be the one asked for
            _check_synthetic_matches(path, synthetic.wanted(cfg.data), synthetic.recorded(recorded),
                                     recorded["generator"], cfg.data.synth)
        elif isinstance(recorded, dict):  # converted: the user's own data
            source = f" ({recorded['source']})" if recorded.get("source") else ""
            log.info("data.path %s holds a converted data set%s, not a synthetic one: training on it as it is "
                     "(data.synth = %r ignored)", path, source, cfg.data.synth)
    return data_mod.open_dataset(path, test_fraction=cfg.data.test_fraction, seed=cfg.data.seed)


def _open_partitioned(cfg: Config, path: str):
    """(the coordinator's handle on a partitioned training set, its test split): the trainers
    open their own parts; refused here, naming the setting, is what would read training
    examples at the coordinator."""
    from widedp.trainer.data.format.partitioned import open_partitioned_test
    from widedp.trainer.data.partitioned_training import PartitionedTrainSet

    unsupported = [(cfg.data.validation_fraction > 0, "data.validation_fraction > 0 (a validation split carved "
                    "from the training data at the coordinator)"),
                   (cfg.train.selection.startswith("fest") and cfg.train.mode == "sparse",
                    f"train.selection = {cfg.train.selection!r} (DP-FEST's one-time counts read the whole "
                    "training set)")]
    refused = [why for bad, why in unsupported if bad]
    if refused:
        raise ValueError(f"data.path {path} is a partitioned data set (each trainer reads only its own parts); "
                         f"not available with it: {'; '.join(refused)}")
    train_set = PartitionedTrainSet(path, cfg.privacy.max_examples_per_user if cfg.privacy.unit == "user" else None,
                                    stage_dir=cfg.data.stage_dir or None)
    log.info("data.path %s is a partitioned data set: its test split is the one written with it (%s); "
             "data.test_fraction and data.seed are not used", train_set.directory, train_set.manifest.split)
    test_set = open_partitioned_test(path, cfg.data.stage_dir or None, train_set.manifest_sha256)
    if test_set is None:
        raise ValueError(f"data.path {path}: the partitioned data set has no test split (partition a data set with "
                         "a test file, or with --test-fraction > 0)")
    return train_set, test_set


def _check_synthetic_matches(path: Path, want: dict, have: dict, generator: str = "", synth: str = "") -> None:
    """A cached synthetic data set must be the one the config asks for (else a changed
    synth_* key would silently train on the old data)."""
    diff = [f"{k}={have.get(k)} (config: {want[k]})" for k in want if have.get(k) != want[k]]
    if diff:
        made_by = f" (made by {generator})" if generator else ""
        asked = f"data.synth = {synth!r} and the config's data.synth_* keys ask for" if synth else "the config asks for"
        raise ValueError(f"data.path {path} holds a synthetic data set{made_by} other than the one {asked}: "
                         f"{', '.join(diff)}; point data.path elsewhere (or delete that directory) to generate the "
                         f"one asked for, or --set data.synth= (empty) to train on that data set as it is")


def _layout(meta, cfg: Config) -> ShardLayout:
    tables = tuple(TableSpec(name, int(rows), cfg.model.embedding_dim) for name, rows in meta.table_sizes.items())
    features = tuple(FeatureSpec(f, meta.feature_tables[f], meta.pooling[f]) for f in meta.features)
    return ShardLayout(tables, features, cfg.cluster.num_shards)


def build_run(cfg: Config, train_transform=None) -> Run:
    """Everything a run needs (trainer/run/loop.py `Run`): engine, splits, metadata, privacy plan.
    `train_transform(train_split) -> split`: applied to the training split before anything is
    planned from it (the one-run audit adds its canaries there, trainer/run/audit.py)."""
    from widedp.trainer.engine.memory import keep_freed_memory

    keep_freed_memory()  # the step's large buffers stay in the heap between steps (trainer/engine/memory.py)
    connect_cluster(cfg)  # connection problems surface before any data work
    train_set, test_set = _ensure_dataset(cfg)
    validation_set = None
    if cfg.data.validation_fraction > 0:
        from widedp.trainer.data.format.dataset import hold_out

        train_set, validation_set = hold_out(train_set, cfg.data.validation_fraction, cfg.data.seed)
    if train_transform is not None:
        if getattr(train_set, "partitioned", False):
            raise ValueError(f"data.path {cfg.data.path} is a partitioned data set: an audit's canaries are added to a "
                             "training set read at the coordinator; audit a data set of one part")
        train_set = train_transform(train_set)
    meta = train_set.meta
    layout = _layout(meta, cfg)
    torch.manual_seed(cfg.train.seed)  # the dense model's public initialization (train.seed): no privacy path
    model = build_model(cfg.model.name, features=list(meta.features), embedding_dim=cfg.model.embedding_dim,
                        num_dense=meta.num_dense, bottom_mlp=cfg.model.bottom_mlp, top_mlp=cfg.model.top_mlp,
                        interaction=cfg.model.interaction, kwargs=cfg.model.kwargs)
    n = len(train_set)
    if n == 0:
        raise ValueError(f"{cfg.data.path}: the training split is empty")
    example_units = _example_units(cfg, train_set, meta)
    built = build_engine(cfg, model, layout, train_set, table_sizes=meta.table_sizes, feature_tables=meta.feature_tables,
                         example_units=example_units, data_events=[e for _, e in meta.privacy_events],
                         data_event_units=meta.privacy_event_units, feature_max_ids=meta.max_ids_per_example())
    engine, info, train_set = built.engine, built.info, built.train_set
    return Run(cfg, engine, train_set, test_set, meta, info, validation_set)


def _example_units(cfg: Config, train_set, meta) -> Optional[np.ndarray]:
    """privacy.unit = "user": the dense unit index of every training example (from the data
    set's unit column); None at example level. Refuses a data set without a unit column, and,
    when users are sampled, one whose preparation released statistics with example-level DP
    (their events bound one example, not one user; user level by example sampling charges them
    for a group of k, which bounds only the kept examples: refused too, as those statistics saw
    every example of a user)."""
    if cfg.privacy.unit != "user":
        return None
    from widedp.trainer.data.sampler import unit_indices

    partitioned = getattr(train_set, "partitioned", False)  # its units stay in its parts (the trainers sample users)
    raw = None if partitioned else train_set.units() if hasattr(train_set, "units") else None
    if raw is None and not partitioned:
        raise ValueError(f"{cfg.data.path}: privacy.unit = \"user\" needs a data set with a unit column (the "
                         "schema's unit_column, `widedp convert table`); this one has none")
    per_example = [d for (d, _), unit in zip(meta.privacy_events, meta.privacy_event_units) if unit != "user"]
    if per_example:
        raise ValueError(f"{cfg.data.path}: its preparation released statistics with example-level DP "
                         f"({'; '.join(per_example)}); privacy.unit = \"user\" needs user-level ones: convert it "
                         "again with its unit column in the schema (per-user DP statistics) or with public statistics")
    return None if raw is None else unit_indices(raw)[0]


TRIAL_FILE = "tuning_trial.json"  # a trial of widedp tune: names its tuning (never resumed)

# Files whose presence means a directory holds a run (a new run refuses it).
RUN_FILES = ("checkpoint.pt", "ledger.json", "summary.json", "config.json", JOURNAL_FILE)
# 3: records semantics, lineage, sticky, journal_head, budget_head, privacy_info (and records_mac
# when keyed); 2: ledger_chain, dataset, planned_events, run_id
CHECKPOINT_FORMAT = 3


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C ended `train`; the message says where and how to resume (the CLI prints it, exit 130)."""


class RunState:
    """What a run carries across sessions in its checkpoint: its id, when it started, the
    identity of its data, every event some session of it planned (event dicts), what its ε
    means (`semantics`, fixed at its start: trainer/config/semantics.py), its lineage (the session
    segments of its journal), its sticky settings, and the heads of its journal and of the data
    set's budget after this session's line."""

    def __init__(self, run_id: str, started: str, dataset: dict, one_time: list, step: list,
                 semantics: Optional[dict] = None, segment: Optional[str] = None):
        self.run_id, self.started, self.dataset = run_id, started, dataset
        self.one_time, self.step = one_time, step
        self.semantics: dict = semantics or {}
        self.segment = segment or uuid.uuid4().hex  # this session's
        self.journal: Optional[ReleaseJournal] = None
        self.sticky: dict = {k: False for k in STICKY_KEYS}
        self.budget_head: Optional[dict] = None
        self.base: dict = {"events": 0, "digest": ""}  # the ledger's chain when this session started
        self.key: Optional[LedgerKey] = None
        self.privacy_info: Optional[dict] = None
        self.dir_identity: Optional[dict] = None  # the journal file this session holds (`ReleaseJournal.identity`)
        self.trial: Any = None  # a trial of widedp tune (trainer/run/tune.py `Trial`): never resumed

    @property
    def tuning_id(self) -> Optional[str]:
        return None if self.trial is None else self.trial.tuning_id

    def plan(self, events: list, kind: str) -> None:
        target = self.one_time if kind == "one_time" else self.step
        for e in events:
            d = ev.event_to_dict(e)
            if d not in target:
                target.append(d)

    @property
    def lineage(self) -> list[str]:
        return self.journal.segments if self.journal is not None else [self.run_id]

    def voids(self) -> list[str]:
        """Why this run's ε does not bound what it released (the budget counts it as ∞)."""
        return run_semantics.void_reasons(self.semantics, self.sticky)


def save_checkpoint(run_dir: Path, engine: Engine, cfg: Config, run_state: Optional[RunState] = None) -> None:
    state: dict = {"engine": engine.state_dict(), "config": cfg.to_dict(), "format": CHECKPOINT_FORMAT}
    if engine.ledger is not None:
        state["ledger_chain"] = engine.ledger.chain()
    if run_state is not None:
        state.update(run_id=run_state.run_id, started=run_state.started, dataset=run_state.dataset,
                     planned_events={"one_time": run_state.one_time, "step": run_state.step},
                     semantics=run_state.semantics, lineage=run_state.lineage, sticky=dict(run_state.sticky),
                     journal_head=run_state.journal.head() if run_state.journal is not None else None,
                     budget_head=run_state.budget_head, privacy_info=run_state.privacy_info)
        sign_checkpoint_record(state, run_state.key)
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(run_dir / "checkpoint.pt", buf.getbuffer())  # no copy of the serialized checkpoint


def load_checkpoint(path: Path) -> dict:
    """checkpoint.pt as a dict; ValueError naming the file when it is not a readable widedp
    checkpoint (truncated, not a torch file, another program's)."""
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    try:
        state = torch.load(path, weights_only=False)
    except (EOFError, RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError,
            AttributeError, ImportError, IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a readable widedp checkpoint ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); it is truncated or damaged") from None
    missing = [k for k in ("engine", "config") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{path}: not a widedp checkpoint (no {' or '.join(missing)})")
    return state


# The classification of every config key is trainer/config/semantics.py's; as (section, key) pairs here.
def _pairs(keys) -> set:
    return {tuple(k.split(".", 1)) if "." in k else (k, None) for k in keys}


# Keys that do not change what a run's steps compute (placement, logging, recovery, debug outputs).
_COMPUTATION_FREE_KEYS = _pairs(run_semantics.COMPUTATION_FREE_KEYS)
# Keys a resume may change without changing what the replayed steps compute.
_RESUME_FREE_KEYS = _pairs(run_semantics.RESUME_FREE_KEYS)


def changed_computation_keys(saved: dict, now: dict, free: frozenset | set = frozenset(_COMPUTATION_FREE_KEYS)) -> list[str]:
    """The config keys ("section.key") whose value in `now` differs from `saved` (two
    `Config.to_dict()`s), ignoring the keys in `free`; a key `saved` lacks counts as changed."""
    changed = []
    for section, values in now.items():
        if (section, None) in free:
            continue
        if not isinstance(values, dict):
            if saved.get(section) != values:
                changed.append(section)
            continue
        for key, value in values.items():
            if (section, key) not in free and saved.get(section, {}).get(key, _MISSING) != value:
                changed.append(f"{section}.{key}")
    return changed


_MISSING = object()


def check_replay_is_identical(state: dict, cfg: Config, info, ckpt_file: Path) -> None:
    """A reproducible resume reuses the checkpoint's generator states, which is allowed only when
    the replay computes what was released (docs/DESIGN.md §1: never the same noise on different
    values): refuse a resume that changes anything the steps compute. train.steps may change only
    where no step depends on it: the resolved plan (an "auto" σ, the selection's and the
    recalibration's parameters are calibrated for train.steps) is the checkpoint's, and the
    learning-rate schedule is constant (linear and cosine are functions of train.steps)."""
    saved = state["config"]
    free = _RESUME_FREE_KEYS | {("train", "steps")}
    if lazy_dpsgd_noise(cfg):  # lazy DP-SGD noise: evaluations and checkpoints are where rows get their noise
        free = free - {("train", "eval_every"), ("train", "checkpoint_every")}
    changed = changed_computation_keys(saved, cfg.to_dict(), free)
    if changed:
        raise ValueError(f"{ckpt_file}: --resume in reproducible mode would replay the checkpoint's noise on different "
                         f"values: {', '.join(changed)} changed; resume with the run's values (privacy.reproducible "
                         f"is fixed for the run: a reproducible run resumes reproducibly)")
    was, now = saved.get("train", {}).get("steps"), cfg.train.steps
    if was == now:
        return
    recorded_plan = state.get("privacy_info")
    plan_now = info.to_dict() if info is not None else None
    why = []
    if cfg.train.lr_schedule != "constant":
        why.append(f"train.lr_schedule = {cfg.train.lr_schedule!r} is a function of train.steps")
    if recorded_plan is None:
        why.append("the checkpoint does not record its resolved privacy plan")
    elif plan_now != recorded_plan:
        diff = [f"{k} {recorded_plan.get(k)!r} -> {plan_now.get(k)!r}" for k in plan_now
                if recorded_plan.get(k) != plan_now.get(k)] if plan_now is not None else []
        why.append(f"the plan calibrated for it changes ({'; '.join(diff[:4])})")
    if why:
        raise ValueError(f"{ckpt_file}: --resume in reproducible mode with train.steps {was} -> {now} would replay the "
                         f"checkpoint's noise on different values: {', '.join(why)}; resume with train.steps = {was} "
                         f"(or set privacy.noise_multiplier and the selection's parameters explicitly and use a "
                         f"constant schedule)")


def _planned_one_time(engine: Engine) -> list:
    """The one-time selection event (DP-FEST) this plan charges before its first step, if any
    (as the engine charges it: `Engine.accounted`)."""
    if not engine.needs_one_time_selection():
        return []
    p = engine.private_plan
    event = get_selector(p.selection).one_time_event(p.selection_params)
    return [] if event is None else [engine.budget.accounted(event)]


def _charged_data_events(cfg: Config, engine: Engine, meta) -> list:
    """The data set's one-time events (dataset.json privacy_events) as this run charges them
    and as its plan calibrated for them (`planning.data_event_is_grouped`: for a group of k
    under privacy.user_sampling = "examples" unless the event bounds a whole user)."""
    return [engine.budget.accounted(e) if data_event_is_grouped(cfg, unit) else e
            for (_, e), unit in zip(meta.privacy_events, meta.privacy_event_units)]


def _planned_recalibration(info) -> list:
    """train.recalibrate's event (charged after the last step), if the plan has one (for a
    group of info.group_size under privacy.user_sampling = "examples", as the engine charges it)."""
    plan = info.recalibration
    return [] if plan is None else [ev.grouped(ev.GaussianDpEvent(plan["noise_multiplier"]), info.group_size or 1)]


_NO_WAY_PAST = "the only way on is a new run (a new --run-dir) with its own budget"


def _restore(engine: Engine, run_dir: Path, cfg: Config, data_events: list, info, now_semantics: dict,
             key: Optional[LedgerKey]) -> RunState:
    """Resume from checkpoint.pt and the records on disk (see the module docstring: the checks
    and what they refuse). The ledger resumed is ledger.json once verified: it may be longer than
    the checkpoint's (steps released after the checkpoint are replayed with fresh secret
    randomness, trainer/engine/randomness.py, and so are charged again, never forgotten)."""
    ckpt_file = run_dir / "checkpoint.pt"
    state = load_checkpoint(ckpt_file)
    identity = any_dataset_identity(cfg.data.path)
    recorded_identity = state.get("dataset")
    if recorded_identity is not None and recorded_identity != identity:
        diff = ", ".join(f"{k} {recorded_identity.get(k)!r} (now {identity[k]!r})" for k in identity
                         if recorded_identity.get(k) != identity[k])
        raise ValueError(f"{ckpt_file} was trained on other data than data.path {cfg.data.path} holds now: {diff}; "
                         f"resume on the data set the run started on, or start a new run")
    recorded = recorded_semantics(state)
    try:
        require_key(recorded.get(run_semantics.LEDGER_KEY_ID), key, str(ckpt_file))
    except LedgerKeyError as exc:
        raise ValueError(f"{exc}; a keyed run resumes with its key") from None
    changes = run_semantics.changed_semantics(recorded, now_semantics)
    if changes:
        raise ValueError(run_semantics.refusal(changes, str(ckpt_file)))
    if engine.randomness.reproducible:
        check_replay_is_identical(state, cfg, info, ckpt_file)
    records = verified_records(run_dir, state, key, _NO_WAY_PAST, ckpt_file)
    try:
        engine.load_state_dict(state["engine"])
    except (RuntimeError, KeyError, ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"{ckpt_file} does not match this run's config and data ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); resume with the config the "
                         f"run was trained with") from None
    dataset_budget.check_recorded_head(cfg.data.path, state.get("budget_head"), str(ckpt_file))
    dataset_budget.check_run(cfg.data.path, records.lineage, records.key_id, run_dir / "ledger.json", _NO_WAY_PAST)
    planned = state.get("planned_events") or {}
    run_state = RunState(state.get("run_id") or uuid.uuid4().hex, state.get("started") or dataset_budget.now(),
                         identity, list(planned.get("one_time", [])), list(planned.get("step", [])),
                         semantics={**recorded, **{k: v for k, v in now_semantics.items() if k not in recorded}})
    run_state.journal = records.journal
    run_state.sticky = {k: bool(records.sticky.get(k)) for k in STICKY_KEYS}
    if "semantics" not in state:  # an older widedp's run: its debug sessions are known from its config only
        debug = bool(state["config"].get("train", {}).get("debug_metrics"))
        run_state.sticky["debug_metrics"] = run_state.sticky["debug_metrics"] or debug
    if engine.ledger is not None:
        if records.ledger is None:
            raise ValueError(f"{ckpt_file} holds no privacy ledger (a nonprivate run's checkpoint): a private run "
                             f"cannot resume from it; {_NO_WAY_PAST}")
        run_state.plan(_planned_one_time(engine) + (_planned_recalibration(info) if info is not None else []),
                       "one_time")
        run_state.plan([engine.step_event] if engine.step_event is not None else [], "step")
        if "planned_events" not in state:  # format 1: what it charged is what its sessions planned
            in_ckpt = PrivacyLedger(state["engine"]["ledger"].get("accountant", "rdp"),
                                    state["engine"]["ledger"].get("delta", 1e-6))
            in_ckpt.load_state_dict(state["engine"]["ledger"])
            run_state.plan([e for e, _ in in_ckpt.history][len(data_events):], "step")
        _check_rebuilt(run_dir / "ledger.json", records.ledger, data_events, run_state)
        engine.ledger.load_state_dict(records.ledger.state_dict())
    return run_state


def _check_rebuilt(ledger_file: Path, ledger: PrivacyLedger, data_events: list, run_state: RunState) -> None:
    """The ledger's events against the ones rebuilt from the data set and the run's plans."""
    wanted_data = [ev.event_to_dict(e) for e in data_events]
    allowed = run_state.one_time + run_state.step
    position = 0
    for event, count in ledger.history:
        d = ev.event_to_dict(event)
        for i in range(position, position + count):
            if i < len(wanted_data):
                if d != wanted_data[i]:
                    raise ValueError(f"{ledger_file}: charged event {i + 1} is {d}, but the data set's one-time event "
                                     f"{i + 1} (dataset.json privacy_events) is {wanted_data[i]}; {_NO_WAY_PAST}")
                continue
            if d not in allowed:
                raise ValueError(f"{ledger_file}: charged event {i + 1} is {d}, which no session of this run planned "
                                 f"(planned per step: {run_state.step}); it was edited; {_NO_WAY_PAST}")
            break  # the rest of this entry is the same event
        position += count
    if position < len(wanted_data):
        raise ValueError(f"{ledger_file}: holds {position} charged events, fewer than the data set's "
                         f"{len(wanted_data)} one-time events; {_NO_WAY_PAST}")


def _start(engine: Engine, cfg: Config, run_dir: Path, train_set, data_events: list) -> None:
    """A new run: config.json, an empty metrics file, then the one-time events (data
    preparation, as `_charged_data_events` gives them; DP-FEST) charged before the first step."""
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    (run_dir / "metrics.jsonl").write_text("")
    if engine.ledger is not None:
        for event in data_events:  # as charged (`_charged_data_events`)
            engine.budget.charge(event, whole_unit=True)
    if engine.needs_one_time_selection():
        engine.prepare_fest(train_set.feature_rows)


class _TrainCallbacks:
    """What `widedp train` does after each step: metrics/eval lines (through the recorder, which
    enforces docs/THREAT_MODEL.md), checkpoints, the progress bar; stops the loop at a step
    boundary once Ctrl-C was pressed (`interrupt`)."""

    def __init__(self, run: Run, recorder: RunRecorder, run_dir: Path, progress: bool, run_state: RunState,
                 interrupt: "_Interrupt"):
        self.run, self.recorder, self.run_dir = run, recorder, run_dir
        self.run_state, self.interrupt = run_state, interrupt
        self.start = time.perf_counter()
        self.checkpoint_step: Optional[int] = None  # the step of the last checkpoint this session wrote
        self.bar = None
        if progress:
            from tqdm import tqdm

            cfg = run.config
            self.bar = tqdm(total=cfg.train.steps, initial=run.engine.step_count, desc=cfg.train.mode, unit="step")

    def checkpoint(self, engine: Engine) -> None:
        save_checkpoint(self.run_dir, engine, self.run.config, self.run_state)
        self.checkpoint_step = engine.step_count

    def on_step(self, engine: Engine, stats: StepStats, seconds: float) -> bool:
        t, recorder = self.run.config.train, self.recorder
        recorder.on_step(stats, seconds)
        if stats.step % t.log_every == 0 or stats.step == t.steps:
            recorder.log(recorder.metrics_line(stats))
        if t.eval_every and stats.step % t.eval_every == 0:
            recorder.log(eval_line(stats.step, self.run.evaluate()))
        if stats.step % t.checkpoint_every == 0:
            self.checkpoint(engine)
        if self.bar is not None:
            self.bar.set_postfix(**recorder.progress_postfix(stats, time.perf_counter() - self.start))
            self.bar.update(1)
        return self.interrupt.requested

    def close(self) -> None:
        self.recorder.close()
        if self.bar is not None:
            self.bar.close()


class _Interrupt:
    """Ctrl-C while training: the first one is deferred to the end of the step in progress (a
    step's release is then complete, so its checkpoint is consistent); a second one interrupts
    at once. Only in the main thread (where Python delivers signals); elsewhere nothing changes."""

    def __init__(self):
        self.requested = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator["_Interrupt"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _check_run_dir_is_free(run_dir: Path, ignore: tuple = ()) -> None:
    held = [name for name in RUN_FILES if name not in ignore and (run_dir / name).exists()]
    if held:
        raise ValueError(f"--run-dir {run_dir} holds a run ({', '.join(held)}): a run directory is never overwritten "
                         f"(its ledger would be lost); continue it with `widedp train --resume {run_dir}` or choose "
                         f"a new directory")


def _check_a_step_fits(engine: Engine, cfg: Config, run_dir: Path, one_time: list) -> None:
    """Refuse a session that cannot take one more step under privacy.target_epsilon (after
    `one_time`, events still to be charged before the first step) instead of ending with
    nothing trained."""
    if engine.ledger is None or engine.step_event is None or engine.step_count >= cfg.train.steps:
        return
    history = engine.ledger.history + [(e, 1) for e in one_time] + [(engine.step_event, 1)]
    if engine.ledger.accountant.epsilon(history, engine.ledger.delta) <= cfg.privacy.target_epsilon:
        return
    spent = engine.ledger.epsilon()
    what = ("the budget of this run is spent: a larger privacy.target_epsilon is a larger claim for this model"
            if engine.ledger.steps > 0 else
            "one step at this noise already costs more: raise privacy.noise_multiplier or privacy.target_epsilon")
    raise ValueError(f"{run_dir}: cannot take step {engine.step_count + 1} of train.steps = {cfg.train.steps}: it would "
                     f"spend past privacy.target_epsilon = {cfg.privacy.target_epsilon} (ε = {spent:.4g} spent over "
                     f"{engine.ledger.steps} charged events); nothing was trained; {what}")


def _budget_line(run_state: RunState, run_dir: Path, cfg: Config, engine: Engine, info, status: str) -> dict:
    ledger = engine.ledger
    return dataset_budget.run_record(
        run_id=run_state.run_id, run_dir=run_dir, mode=cfg.train.mode, target_epsilon=cfg.privacy.target_epsilon,
        delta=ledger.delta if ledger is not None else None, accountant=ledger.accountant.name if ledger is not None else None,
        epsilon=ledger.epsilon() if ledger is not None else math.inf, events_charged=ledger.steps if ledger is not None else 0,
        steps=engine.step_count, started=run_state.started, status=status,
        privacy_unit=run_state.semantics.get("privacy.unit", cfg.privacy.unit), lineage=run_state.lineage,
        base_events=run_state.base["events"], voids=run_state.voids(), dir_identity=run_state.dir_identity,
        ledger_key_id=run_state.key.key_id if run_state.key is not None else None, tuning_id=run_state.tuning_id)


def _append_budget(cfg: Config, run_state: RunState, line: dict) -> None:
    run_state.budget_head = dataset_budget.append(cfg.data.path, line)


def ledger_header(run_state: RunState) -> dict:
    """The header a new run's ledger starts with (bound into its chain): the run's id and what its
    ε means, without the noise seed and the data set's content hashes."""
    return {"run_id": run_state.run_id, "semantics": run_semantics.public_semantics(run_state.semantics)}


def train(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True, trial=None) -> dict:
    """Train per `cfg`, writing only what docs/THREAT_MODEL.md allows (trainer/run/outputs.py).
    A new run refuses a `run_dir` that holds a run; the directory is created only once the
    config is valid and the data loaded. A failed new run (any exception, Ctrl-C included)
    removes the directory it created, and the parents it created, unless it holds a record
    (a ledger, a checkpoint: `run_outputs.remove_unrecorded_run_dir`): no empty run dirs.

    `trial`: a trial of `widedp tune` (trainer/run/tune.py `Trial`): its training part of the
    data, its tuning's id in every budget line, its noised score in the summary. A trial is
    never resumed."""
    cfg.validate()
    if resume and (run_dir / TRIAL_FILE).exists():
        raise ValueError(f"--resume {run_dir}: a trial of widedp tune cannot be resumed (its tuning releases only "
                         f"the best trial it finished; {TRIAL_FILE} there names the tuning)")
    if not resume:
        _check_run_dir_is_free(run_dir)
    missing = []  # run_dir and the ancestors this call may create, deepest first
    p = run_dir.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    try:
        return _train(cfg, run_dir, resume, progress, trial)
    except BaseException:
        if missing:
            remove_unrecorded_run_dir(run_dir, tuple(missing[1:]))
        raise


def _train(cfg: Config, run_dir: Path, resume: bool, progress: bool, trial=None) -> dict:
    key = key_from_environment(run_dir)
    with build_run(cfg, None if trial is None else trial.train_part) as run, contextlib.ExitStack() as held:
        engine, info = run.engine, run.privacy
        data_events = list(run.meta.privacy_events)
        charged_data_events = _charged_data_events(cfg, engine, run.meta)
        now_semantics = run_semantics.semantics(cfg, info.delta if engine.ledger is not None else None,
                                                any_dataset_identity(cfg.data.path), key.key_id if key else None)
        journal_file = run_dir / JOURNAL_FILE
        if resume:
            # the session holds the journal before it reads the run's records: a session still
            # training here is refused, and nothing changes under the checks
            fd = hold_journal(journal_file, new=False)
            if fd is not None:
                held.callback(os.close, fd)
            run_state = _restore(engine, run_dir, cfg, charged_data_events, info, now_semantics, key)
            _check_a_step_fits(engine, cfg, run_dir, [])
        else:
            segment = uuid.uuid4().hex
            run_state = RunState(segment, dataset_budget.now(), now_semantics[run_semantics.DATA_IDENTITY], [], [],
                                 semantics=now_semantics, segment=segment)
            run_state.trial = trial
            run_state.journal = ReleaseJournal(journal_file, key)
            dataset_budget.head(cfg.data.path)  # a damaged or deleted budget is refused before anything is written
            one_time = charged_data_events + _planned_one_time(engine) if engine.ledger is not None else []
            _check_a_step_fits(engine, cfg, run_dir, one_time)
            if engine.ledger is not None:
                engine.ledger.set_header(ledger_header(run_state))
                run_state.plan(_planned_one_time(engine) + _planned_recalibration(info), "one_time")
                run_state.plan([engine.step_event] if engine.step_event is not None else [], "step")
            run_dir.mkdir(parents=True, exist_ok=True)
            # created exclusively, then the directory checked again: a run that started or finished
            # here while this one loaded its data is never overwritten
            fd = hold_journal(journal_file, new=True)
            assert fd is not None  # created here
            held.callback(os.close, fd)
            try:
                _check_run_dir_is_free(run_dir, ignore=(JOURNAL_FILE,))
            except ValueError:
                journal_file.unlink()  # ours, empty: the directory is left as the other run left it
                raise
        journal = run_state.journal
        assert journal is not None
        if fd is not None:
            journal.adopt(fd)
            held.pop_all()  # the journal closes it now
        if trial is not None:
            atomic_write_json(run_dir / TRIAL_FILE, trial.marker())
        held.callback(journal.close)
        run_state.key, run_state.privacy_info = key, info.to_dict()
        run_state.sticky["debug_metrics"] = run_state.sticky["debug_metrics"] or cfg.train.debug_metrics
        run_state.sticky["debug_tensorboard"] = (run_state.sticky["debug_tensorboard"]
                                                 or (cfg.train.debug_metrics and cfg.train.tensorboard))
        run_state.base = engine.ledger.chain() if engine.ledger is not None else {"events": 0, "digest": ""}
        journal.lock()  # a run of an older widedp has no journal yet: created and held now
        run_state.dir_identity = journal.identity()
        journal.begin_session(run_state.segment, dataset_budget.now(), resume, run_state.base,
                              {"debug_metrics": cfg.train.debug_metrics,
                               "debug_tensorboard": cfg.train.debug_metrics and cfg.train.tensorboard},
                              inherited=[run_state.run_id] if resume and journal.lines == 0 else None)
        if engine.ledger is not None:
            engine.budget.persist = LedgerStore(run_dir, journal, key, lambda: engine.step_count)
        return _train_session(run, cfg, run_dir, resume, progress, run_state, data_events, charged_data_events)


def _train_session(run: Run, cfg: Config, run_dir: Path, resume: bool, progress: bool, run_state: RunState,
                   data_events: list, charged_data_events: list) -> dict:
    engine, info = run.engine, run.privacy
    outlook = forecast_of(engine, info, cfg.train.steps, run.train_set)
    if outlook.get("unlikely_to_learn"):
        log.warning("%s", outlook["warning"])
    _append_budget(cfg, run_state, _budget_line(run_state, run_dir, cfg, engine, info, "running"))
    log.info("%s run %s in %s: %s, %d steps of expected batch %g, %s", "resuming" if resume else "starting",
             run_state.run_id, run_dir, cfg.train.mode if cfg.train.mode != "sparse" else f"sparse ({cfg.train.selection})",
             cfg.train.steps, engine.b, "non-private" if engine.ledger is None else
             f"noise multiplier {info.noise_multiplier:.4g}, target ε {cfg.privacy.target_epsilon} at δ "
             f"{engine.ledger.delta:.3g} ({engine.ledger.accountant.name})")
    recorder = RunRecorder(expected_batch_size=engine.b, metrics_path=run_dir / "metrics.jsonl",
                           debug_metrics=cfg.train.debug_metrics, randomness_note=engine.randomness.describe(),
                           reproducible=engine.randomness.reproducible, private=engine.plan is not None,
                           tensorboard_dir=run_dir / "tensorboard" if cfg.train.tensorboard else None,
                           debug_in_run=run_state.sticky["debug_metrics"],
                           debug_tensorboard_in_run=run_state.sticky["debug_tensorboard"])
    interrupt = _Interrupt()
    callbacks = _TrainCallbacks(run, recorder, run_dir, progress, run_state, interrupt)
    try:
        with interrupt.deferred():
            if not resume:
                _start(engine, cfg, run_dir, run.train_set, charged_data_events)
            result = run.run(cfg.train.steps, [callbacks])
            recalibrated = None
            if engine.step_count >= cfg.train.steps or result.stopped_by_budget:
                recalibrated = run.recalibrate()  # after the last step, before the final checkpoint
            callbacks.checkpoint(engine)
    except KeyboardInterrupt:
        # a second Ctrl-C (or one outside the main thread): mid-step, so no checkpoint of this state
        _append_budget(cfg, run_state, _budget_line(run_state, run_dir, cfg, engine, info, "interrupted"))
        last = callbacks.checkpoint_step
        where = (f"from its checkpoint at step {last}" if last is not None else
                 "from its last checkpoint" if (run_dir / "checkpoint.pt").exists() else
                 "no checkpoint was written yet, so it cannot be resumed")
        raise TrainingInterrupted(f"interrupted at step {engine.step_count} (during step {engine.step_count + 1}, "
                                  f"no checkpoint saved); resume with `widedp train --resume {run_dir}` ({where})")
    except BaseException:
        with contextlib.suppress(Exception):
            _append_budget(cfg, run_state, _budget_line(run_state, run_dir, cfg, engine, info, "failed"))
        raise
    finally:
        callbacks.close()
    if interrupt.requested and not (engine.step_count >= cfg.train.steps or result.stopped_by_budget):
        _append_budget(cfg, run_state, _budget_line(run_state, run_dir, cfg, engine, info, "interrupted"))
        raise TrainingInterrupted(f"interrupted at step {engine.step_count}; resume with "
                                  f"`widedp train --resume {run_dir}`")
    summary = _summary(run, cfg, resume, result, recalibrated, recorder, run_state, data_events)
    summary["forecast"] = outlook
    if run_state.trial is not None:
        summary["tuning"] = run_state.trial.score(run)  # the noised validation score (trainer/run/tune.py)
    atomic_write_json(run_dir / "summary.json", summary)
    _append_budget(cfg, run_state, _budget_line(run_state, run_dir, cfg, engine, info, "finished"))
    return summary


def _summary(run: Run, cfg: Config, resume: bool, result, recalibrated, recorder: RunRecorder, run_state: RunState,
             data_events: list) -> dict:
    """summary.json (docs/DESIGN.md §4): what the run's ε means is the run's (`run_state.semantics`,
    the sticky settings of every session), not this session's config."""
    engine, info = run.engine, run.privacy
    semantics = run_state.semantics
    unit = semantics.get("privacy.unit", cfg.privacy.unit)
    return {
        "mode": cfg.train.mode,
        "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
        # A non-private run: "epsilon": null (strict JSON has no Infinity) and "private": false.
        "private": engine.ledger is not None,
        # ε and δ of the ledger (the δ fixed when the run started: a resume cannot change it)
        "epsilon": engine.ledger.epsilon() if engine.ledger is not None else math.inf,
        "delta": engine.ledger.delta if engine.ledger is not None else info.delta,
        "accountant": engine.ledger.accountant.name if engine.ledger is not None else info.accountant,
        "steps": engine.step_count,
        "events_charged": engine.ledger.steps if engine.ledger is not None else 0,
        "num_shards": cfg.cluster.num_shards,
        "test_metrics": run.evaluate(),
        "bayes_auc": run.meta.bayes_auc,
        # which train/test split: the data set's test file ("file", "timestamp>=...") or random
        "test_split": run.train_set.manifest.split if getattr(run.train_set, "partitioned", False)
        else split_rule(run.meta, cfg.data.test_fraction, cfg.data.seed),
        **({"partitions": {"parts": run.train_set.manifest.num_parts,
                           "partition_by": run.train_set.manifest.partition_by,
                           "trainer_parts": [run.train_set.parts_of_trainer(i, engine.num_trainers)
                                             for i in range(engine.num_trainers)]}}
           if getattr(run.train_set, "partitioned", False) else {}),
        "target_epsilon": cfg.privacy.target_epsilon,
        # the [by_epsilon] row applied (config.pick_epsilon_row); None: no table or non-private
        "tuned_for_epsilon": cfg.tuned_for_epsilon,
        # train.recalibrate: what this session released (σ, Platt's a and b), or the plan with
        # "applied": false (it ran in an earlier session, or would have spent past the target)
        "recalibration": None if info.recalibration is None else
        {**info.recalibration, "applied": recalibrated is not None, **(recalibrated or {})},
        "noise_multiplier": info.noise_multiplier,
        "calibrated": info.calibrated,
        "selection_epsilon": info.selection_epsilon,
        "selection_sigma": info.selection_sigma,
        "selection_params": info.selection_params,
        "k": info.k,
        "threshold": info.threshold,
        "threshold_rule": info.threshold_rule,
        "table_policy": info.table_policy,
        **({"adaptive_clip": info.adaptive_clip} if info.adaptive_clip else {}),
        **({"modelmix": {"mix_width": info.mix_width, "mix_coordinates": info.mix_coordinates, "mixed": "every table and dense parameter, every step",
                         "threat_model": "ε holds only while each step's mixing weights stay secret "
                                         "(accounting/modelmix.py)"}} if info.mix_width else {}),
        "sample_rate": info.sample_rate,
        # user level: the number of users is public (like n); the number of training examples is not
        # (it changes by m_u when a user is removed). By example sampling, the kept examples are the
        # steps' n (sample_rate = b / kept examples): public there by that design, so stated.
        **({"user_level": {"users": info.num_units, "max_examples_per_user": info.max_examples_per_unit,
                           "user_sampling": info.user_sampling, "group_size": info.group_size,
                           **({"kept_examples": len(run.train_set)} if info.user_sampling == "examples" else {})}}
           if info.unit == "user" else {}),
        "stopped_by_budget": result.stopped_by_budget,
        "resumed": resume,
        "run_id": run_state.run_id,
        "lineage": run_state.lineage,
        "actor_restarts": getattr(run.engine.shards, "restarts", 0) + getattr(run.engine.trainers, "restarts", 0),
        "steps_redone": run.engine.step_restarts,
        "num_trainers": cfg.cluster.num_trainers,
        "trainer_actors": cfg.cluster.trainer_actors,
        "vocabulary_size": engine.layout.vocabulary_size,
        "backend": cfg.cluster.backend,
        **({"ledger_key_id": run_state.key.key_id} if run_state.key is not None else {}),
        **({"validation_metrics": run.evaluate(run.validation_set)} if run.validation_set is not None else {}),
        **({"one_time_epsilon": _one_time_epsilon(engine, data_events)} if data_events and engine.ledger is not None
           else {}),
        **recorder.summary_fields(result.elapsed_s, engine.shards, [d for d, _ in data_events],
                                  validation=run.validation_set is not None,
                                  unit_column=run.meta.unit_column, unit=unit,
                                  user_sampling=semantics.get("privacy.user_sampling", cfg.privacy.user_sampling)),
    }


def _one_time_epsilon(engine: Engine, data_events: list) -> list[dict]:
    """What each of the data set's one-time events (the private vocabulary, ...) would spend
    alone, as this run charged it, at the run's δ and accountant: how much of the target it
    took before the first step."""
    from widedp.accounting import make_accountant

    ledger = engine.ledger
    assert ledger is not None  # a private run's
    accountant = make_accountant(ledger.accountant.name)
    charged = [e for e, _ in ledger.history[:len(data_events)]]
    return [{"event": description, "epsilon_alone": accountant.epsilon([(event, 1)], ledger.delta)}
            for (description, _), event in zip(data_events, charged)]


def evaluate(run_dir: Path) -> dict:
    state = load_checkpoint(run_dir / "checkpoint.pt")
    cfg = saved_config(state["config"], f"{run_dir / 'checkpoint.pt'} (its config)")
    cfg.cluster.backend = "local"  # evaluation needs no cluster
    with build_run(cfg) as run:
        try:
            run.engine.load_state_dict(state["engine"])
        except (RuntimeError, KeyError, ValueError, IndexError, TypeError) as exc:
            raise ValueError(f"{run_dir / 'checkpoint.pt'} does not match its own config and data "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
        return {"run_dir": str(run_dir), "steps": run.engine.step_count, "test_metrics": run.evaluate(),
                "bayes_auc": run.meta.bayes_auc, "epsilon": run.engine.ledger.epsilon() if run.engine.ledger else None}

# The `train` and `evaluate` commands: trainer/cli/train.py (light, so config errors are fast).
