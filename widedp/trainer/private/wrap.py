"""`make_private`: a user's TorchRec embedding tables, dense module and per-example loss, trained
by widedp's engine — sparse (private row selection, noise on the selected rows only), DP-SGD
or non-private — over a data set widedp Poisson-samples.

Privacy assumption: the engine's (docs/DESIGN.md §1): neighbouring data sets differ by adding
or removing one example (`privacy.unit = "user"`: one unit with all of its examples, `units` of
the `KJTDataset`); each step Poisson-samples the data set at rate q = batch_size / n and
normalizes by the expected batch size; each example's gradient over the tables and the dense
module is clipped to S1 (sensitivity S1 of the clipped sum). Two things are the user's to hold,
and `make_private` checks what it can of them:
- the loss of an example depends on that example only (`check_examples_independent` probes the
  first batch and refuses a coupled loss, trainer/private/dense.py);
- the initial weights (the user's EBC and dense module as handed over) do not depend on the
  training data (they are public, like `train.seed`'s initialization).
The ε is the ledger's: every step's event is budgeted before the step runs and recorded before
anything of it is released; `step()` returns None instead of spending past the target ε.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from widedp.public import public
from widedp.trainer.config import Config, load_config
from widedp.trainer.config.forecast import forecast_of
from widedp.trainer.config.lr_schedule import lr_multiplier
from widedp.trainer.config.planning import data_event_is_grouped
from widedp.trainer.config.semantics import void_reasons
from widedp.trainer.engine.checkpoint import engine_state, load_engine_state
from widedp.trainer.engine.recalibration import undo_recalibration
from widedp.trainer.private.build import build_engine, connect_cluster
from widedp.trainer.private.data import KJTDataset
from widedp.trainer.private.dense import (LossFn, MetricsFn, UserDenseModel, check_examples_independent,
                                         check_logit_layer)
from widedp.trainer.private.features import (EmbeddingInputs, ExpandedDataset, check_ids, embedding_inputs,
                                            initial_weights)
from widedp.trainer.private.loader import HandedBatches, HandOverSampler, LoaderData, batch_of
import widedp.trainer.run.budget as dataset_budget

def _settings(config: Union[None, Config, str, Path, Sequence[str]], fixed: Mapping[str, Any]) -> Config:
    """The config: a `Config`, a TOML path or `section.key=value` strings, with `fixed` on top."""
    if isinstance(config, Config):
        cfg = load_config(None, [])
        for section in ("train", "privacy", "cluster"):
            setattr(cfg, section, getattr(config, section))
    elif isinstance(config, (str, Path)):
        cfg = load_config(str(config), [])
    else:
        cfg = load_config(None, list(config or ()))
    for key, value in fixed.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate()


@public
class PrivateTrainer:
    """One private training run of a user's model, in this process; its shards in this process
    or on Ray (`backend = "ray"`). Made by `make_private`; close it (or use `with`).

    Attributes:
        config: the resolved `Config` (train, privacy and cluster sections apply).
        privacy: the resolved privacy plan (`PrivacyInfo`: σ, sample rate, δ, selection).
        engine: the engine that runs the step (trainer/engine/engine.py).
        model: the user's dense module wrapped as a `DenseModel` (`model.module` is theirs).
        ledger: the privacy ledger, None in non-private mode.
    """

    def __init__(self, cfg: Config, model: UserDenseModel, inputs: EmbeddingInputs, data: KJTDataset,
                 initial_tables: Optional[Mapping[str, torch.Tensor]], ledger_path: Optional[Path]):
        if isinstance(data, LoaderData):
            if cfg.cluster.trainer_actors:
                raise ValueError("trainer actors (cluster.trainer_placement) read the training set themselves: with "
                                 "your own loader the trainers run in this process (the shards may be Ray actors)")
            if cfg.privacy.unit == "user" and cfg.privacy.user_sampling == "examples":
                raise ValueError('privacy.user_sampling = "examples" trims each user\'s examples inside widedp: with '
                                 'your own loader use privacy.user_sampling = "users"')
        connect_cluster(cfg)
        layout, self.inputs = inputs.layout, inputs
        units = None
        if cfg.privacy.unit == "user":
            from widedp.trainer.data.sampler import unit_indices

            raw = data.units()
            if raw is None:
                raise ValueError('privacy.unit = "user" needs the KJTDataset\'s units (one per example)')
            per_example = [d for (d, _), u in zip(data.privacy_events, data.privacy_event_units) if u != "user"]
            if per_example and cfg.privacy.user_sampling == "users":
                raise ValueError(f"the data set's preparation released statistics with example-level DP "
                                 f"({'; '.join(per_example)}); privacy.unit = \"user\" needs user-level ones")
            units = unit_indices(raw)[0]
        table_sizes = {t.name: t.num_rows for t in layout.tables}
        feature_tables = {f.name: f.table for f in layout.features}
        events = [e for _, e in data.privacy_events]
        self._handed: Optional[HandedBatches] = None
        if isinstance(data, LoaderData):
            self._handed = HandedBatches(data.with_features(self.inputs.order))
        engine_data = self._handed if self._handed is not None else data
        built = build_engine(cfg, model, layout, self._engine_data(engine_data), table_sizes=table_sizes,
                             feature_tables=feature_tables, example_units=units, data_events=events,
                             data_event_units=data.privacy_event_units)
        self.config, self.engine, self.privacy, self.layout = cfg, built.engine, built.info, layout
        self.train_set, self.model = built.train_set, model
        self._num_dense = data.num_dense
        if self._handed is not None:
            if self.engine.needs_one_time_selection():
                raise ValueError(f"train.selection = {cfg.train.selection!r} selects once over the whole data set "
                                 "(DP-FEST): with your own loader choose a per-step selector (e.g. threshold)")
            self.engine.sampler = HandOverSampler(self.engine.sampler)
        if initial_tables is not None:
            self._load_tables(initial_tables)
        if ledger_path is not None and self.engine.ledger is not None:
            self.engine.budget.persist = lambda ledger: ledger.save(ledger_path)
        if self.engine.ledger is not None:  # what preparing the data spent, before the first step
            for event, unit in zip(events, data.privacy_event_units):
                grouped = data_event_is_grouped(cfg, unit)
                self.engine.budget.charge(self.engine.budget.accounted(event) if grouped else event, whole_unit=True)
        #: the forecast before training (trainer/config/forecast.py): can the rows outgrow their noise?
        self.forecast = forecast_of(self.engine, self.privacy, cfg.train.steps, self.train_set)
        if self.forecast.get("unlikely_to_learn"):
            import logging

            logging.getLogger("widedp").warning("%s", self.forecast["warning"])
        self._checked = False
        self._dataset_path = getattr(data, "dataset_path", None)
        self._run_dir = Path(ledger_path).parent if ledger_path is not None else Path.cwd()
        self._run_id, self._started, self._closed = uuid.uuid4().hex, dataset_budget.now(), False
        if self._dataset_path is not None:  # counted in the data set's budget before the first step
            self._append_budget("running")

    def _engine_data(self, data):
        """`data` keyed by the engine's features (sequence positions, the lengths as dense columns)."""
        data = data.with_features(self.inputs.order) if not isinstance(data, HandedBatches) else data
        return data if self.inputs.uniform else ExpandedDataset(data, self.inputs)

    # ---- training ----------------------------------------------------------------------------------------
    def sample(self) -> Optional[np.ndarray]:
        """This step's Poisson sample, for your own loader (`make_private(data=LoaderData(n))`):
        the sorted indices 0..n-1 of the examples to load and hand to `step(batch)`, or None —
        nothing drawn, nothing spent — when the planned steps are done or the next step would
        pass the target ε. Drawn from the run's secret-keyed sampler at rate q = batch_size / n
        (per unit at user level); asking again before `step` returns the same draw. The indices
        are secret: the loader reading them is inside the run's trust boundary
        (trainer/private/loader.py)."""
        if self._handed is None:
            raise ValueError("sample() feeds your own loader: make_private(data=widedp.LoaderData(n)); with a "
                             "KJTDataset widedp samples it itself — call step()")
        engine, t = self.engine, self.config.train
        if engine.sampler.drawn is not None:
            return engine.sampler.drawn.copy()
        if engine.step_count >= t.steps:
            return None
        engine.budget.plan_steps(t.steps)
        if engine.budget.would_exceed(engine.step_count):
            return None
        return engine.sampler.draw().copy()

    def step(self, batch=None):
        """One private step (docs/DESIGN.md §2): `StepStats`, or None — nothing spent — when it
        would pass `privacy.target_epsilon` or the planned `train.steps` are done. The raw
        training statistics of a step (its batch loss, realized batch size, touched rows) are
        un-noised: they are NaN / -1 unless `train.debug_metrics = true` (docs/THREAT_MODEL.md).

        Args:
            batch: with your own loader only — the examples at the indices `sample()` returned,
                in that order: a `KJTDataset`, or (KeyedJaggedTensor, labels[, dense]).
        """
        engine, t = self.engine, self.config.train
        if self._handed is not None:
            return self._handed_step(batch)
        if batch is not None:
            raise ValueError("step(batch) is for your own loader (make_private(data=widedp.LoaderData(n))); "
                             "widedp samples this KJTDataset itself: call step()")
        if engine.step_count >= t.steps:
            return None
        undo_recalibration(engine)  # go on from the training iterate, not a recalibrated release
        if not self._checked:
            self._check_first_batch()
        if engine.needs_one_time_selection() and engine.fixed_rows is None:
            engine.prepare_fest(self.train_set.feature_rows)
        engine.budget.plan_steps(t.steps)
        engine.lr_scale = lr_multiplier(t.lr_schedule, engine.step_count, t.steps)
        return self._released(engine.step())

    def _released(self, stats):
        """A step's stats without its raw training statistics (batch loss, realized batch size,
        touched rows) unless train.debug_metrics."""
        if stats is None or self.config.train.debug_metrics:
            return stats
        return dataclasses.replace(stats, loss=float("nan"), batch_size=-1, rows_touched=-1, trainer_cpu_s=())

    def _handed_step(self, batch):
        idx = self.engine.sampler.drawn
        if idx is None:
            raise ValueError("step(batch) needs this step's sample first: idx = trainer.sample(), then load those "
                             "examples and call trainer.step(batch)")
        data = batch_of(batch, self.inputs.order, int(idx.size), self._num_dense)
        check_ids(self.inputs, data, lambda j: f"dataset example {int(idx[j])}")
        self._handed.hand_over(idx, data)
        try:
            if not self._checked and len(data) >= 4:
                self._check_first_batch(self._engine_data(data))
            t = self.config.train
            self.engine.budget.plan_steps(t.steps)
            self.engine.lr_scale = lr_multiplier(t.lr_schedule, self.engine.step_count, t.steps)
            stats = self.engine.step()
        finally:
            self._handed.clear()
        return self._released(stats)

    def train(self, steps: Optional[int] = None) -> int:
        """Step until `steps` more were taken (default: until `train.steps` or the target ε);
        returns how many were taken."""
        if self._handed is not None:
            raise ValueError("train() lets widedp read the data; with your own loader loop: idx = trainer.sample(); "
                             "trainer.step(load(idx)) until sample() returns None")
        taken = 0
        while steps is None or taken < steps:
            if self.step() is None:
                break
            taken += 1
        if self.engine.step_count >= self.config.train.steps:
            self.recalibrate()
        return taken

    def recalibrate(self) -> Optional[dict]:
        """train.recalibrate's release for a model with a `logit_layer` (make_private): a noisy
        histogram of the training set's logits by label, charged to the ledger first, and
        Platt's z ↦ a·clip(z, ±8) + b made the released model's function: (a, b) folded into
        the logit layer, whose output a forward hook then clamps to [b − 8a, b + 8a] (on your
        module's own layer; `state_dict()` keeps it; trainer/engine/recalibration.py). Returns {a, b, σ, ...}, or None when the plan has none,
        it already ran after this step, or it would pass the target ε (a warning says so).
        `train()` runs it after the planned steps; a loop of `step()` calls it at the end.
        Training on afterwards starts from the training iterate, not the recalibrated one."""
        from widedp.accounting.events import GaussianDpEvent
        from widedp.trainer.engine.recalibration import BINS, recalibrate_engine

        plan, engine = self.privacy.recalibration, self.engine
        if plan is None or engine.ledger is None or engine.step_count == 0 or engine.recalibrated_at == engine.step_count:
            return None
        if engine.ledger.would_exceed(engine.budget.accounted(GaussianDpEvent(plan["noise_multiplier"])),
                                      self.config.privacy.target_epsilon):
            import logging

            logging.getLogger("widedp").warning("train.recalibrate skipped: it would spend past the target ε")
            return None
        return recalibrate_engine(engine, self.train_set, plan["noise_multiplier"], self.config.train.eval_batch_size,
                                  bins=plan.get("bins", BINS))

    def _check_first_batch(self, source=None) -> None:
        """The coupling probe and the logit layer's check on a few examples
        (trainer/private/dense.py) of the training set (or of `source`, the first batch your
        loader handed over); public-shape work only, nothing of it is released."""
        from widedp.trainer.engine.evaluation import lookup

        source = self.train_set if source is None else source
        batch = source.take(np.arange(min(16, len(source)), dtype=np.int64))
        pooled = torch.from_numpy(lookup(self.engine, batch, batch.size))
        check_logit_layer(self.model, pooled, batch.dense)
        check_examples_independent(self.model, pooled, batch.dense, batch.labels)
        self._checked = True

    # ---- what it spent ------------------------------------------------------------------------------------
    @property
    def ledger(self):
        """The privacy ledger (accounting/ledger.py); None in non-private mode."""
        return self.engine.ledger

    def epsilon(self, delta: Optional[float] = None) -> float:
        """ε spent so far at `delta` (default: the plan's δ); 0 in non-private mode."""
        return 0.0 if self.engine.ledger is None else float(self.engine.ledger.epsilon(delta))

    @property
    def steps_taken(self) -> int:
        return int(self.engine.step_count)

    # ---- the model ----------------------------------------------------------------------------------------
    def evaluate(self, data: KJTDataset, batch_size: Optional[int] = None) -> dict:
        """Held-out metrics of the released model on `data` (the module's `metrics_fn`)."""
        return self.engine.evaluate(self._engine_data(data), batch_size or self.config.train.eval_batch_size)

    def predict(self, data: KJTDataset, batch_size: Optional[int] = None) -> torch.Tensor:
        """The released model's outputs on `data`, in its order."""
        out = self.engine.outputs(self._engine_data(data), batch_size or self.config.train.eval_batch_size)
        return torch.zeros(0) if out is None else out[0]

    def embedding_state_dict(self, averaged: Optional[bool] = None) -> dict[str, torch.Tensor]:
        """The released tables under their TorchRec modules' state-dict keys
        (`embedding_bags.<table>.weight` for an EmbeddingBagCollection's, `embeddings.<table>.weight`
        for an EmbeddingCollection's), each at its own width: `ebc.load_state_dict(...)` takes
        them (with several modules, the keys of each). `averaged` (default: with
        train.ema_decay > 0) gives the averaged tables."""
        averaged = self.config.train.ema_decay > 0 if averaged is None else averaged
        self.engine.store_pending_noise()
        states = self.engine.shards.broadcast("state_dict")
        key = "averaged_weights" if averaged else "weights"
        out = {}
        for t, table in enumerate(self.layout.tables):
            blocks = [torch.as_tensor(s[key][t], dtype=torch.float32) for s in states]
            width = self.inputs.tables[table.name]
            out[self.inputs.state_key(table.name)] = torch.cat(blocks)[:table.num_rows, :width].clone()
        return out

    def _load_tables(self, tables: Mapping[str, torch.Tensor]) -> None:
        self.engine.store_pending_noise()
        states = self.engine.shards.broadcast("state_dict")
        for t, table in enumerate(self.layout.tables):
            if table.name not in tables:
                continue
            w = tables[table.name]
            if tuple(w.shape) != (table.num_rows, table.dim):
                raise ValueError(f"table {table.name!r}: initial weights of shape {tuple(w.shape)}, expected "
                                 f"({table.num_rows}, {self.inputs.tables[table.name]})")
            for s, state in enumerate(states):
                start, end = self.layout.row_range(table, s)
                for key in ("weights", "averaged_weights"):
                    if key in state:
                        state[key][t] = w[start:end].detach().to(torch.float32).numpy().copy()
        self.engine.shards.call("load_state_dict", [(s,) for s in states])

    def state_dict(self) -> dict:
        """Everything a resumed trainer needs (the engine's checkpoint: trainer/engine/checkpoint.py);
        generator states only in reproducible mode."""
        return engine_state(self.engine)

    def load_state_dict(self, state: dict) -> None:
        load_engine_state(self.engine, state)

    def _append_budget(self, status: str) -> None:
        """One line of this run in the data set's privacy_budget.jsonl (trainer/run/budget.py):
        "running" with its target before the first step, its spent ε when it closes."""
        cfg, ledger = self.config, self.engine.ledger
        voids = void_reasons({"train.mode": cfg.train.mode, "privacy.reproducible": cfg.privacy.reproducible},
                             {"debug_metrics": cfg.train.debug_metrics})
        line = dataset_budget.run_record(
            run_id=self._run_id, run_dir=self._run_dir, mode=cfg.train.mode,
            target_epsilon=math.inf if cfg.privacy.target_epsilon is None else cfg.privacy.target_epsilon,
            delta=None if ledger is None else ledger.delta, accountant=None if ledger is None else ledger.accountant.name,
            epsilon=math.inf if ledger is None else ledger.epsilon(), events_charged=0 if ledger is None else ledger.steps,
            steps=self.engine.step_count, started=self._started, status=status, privacy_unit=cfg.privacy.unit,
            lineage=[self._run_id], base_events=0, voids=voids)
        dataset_budget.append(self._dataset_path, line)

    def close(self, status: Optional[str] = None) -> None:
        """Release the shards; the data set's budget (when the data has one) records the run's
        spent ε: "finished" once its planned steps ran or its target is spent, else
        "interrupted" (`status` overrides)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._dataset_path is not None:
                done = self.engine.step_count >= self.config.train.steps or (
                    self.engine.ledger is not None and self.engine.budget.would_exceed(self.engine.step_count))
                self._append_budget(status or ("finished" if done else "interrupted"))
        finally:
            self.engine.shutdown()

    def __enter__(self) -> "PrivateTrainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close("failed" if exc_type is not None else None)


@public
def make_private(embeddings, dense_module: nn.Module, loss_fn: LossFn, data: KJTDataset, *,
                 mode: str = "sparse", target_epsilon: Optional[float] = None, delta: Optional[float] = None,
                 batch_size: Optional[int] = None, steps: Optional[int] = None, epochs: Optional[float] = None,
                 config: Union[None, Config, str, Path, Sequence[str]] = None,
                 metrics_fn: Optional[MetricsFn] = None, pooled_as: str = "dict",
                 backend: str = "local", num_shards: int = 1,
                 ledger_path: Optional[Union[str, Path]] = None,
                 max_sequence_length: Union[None, int, Mapping[str, int]] = None,
                 sequence_keep: str = "first", logit_layer: Optional[nn.Linear] = None) -> PrivateTrainer:
    """Wrap a user's TorchRec embedding tables, dense module and loss for private training.

    Neighbouring relation: add/remove one example of `data` (one unit with all its examples
    when the config sets `privacy.unit = "user"`). Sensitivity: each example's (unit's)
    gradient over the tables and `dense_module` together is clipped to S1
    (`privacy.clip_norm`); the noise and the selection are those of `train.mode` and
    `train.selection`, calibrated to `target_epsilon` over the planned steps.

    Args:
        embeddings: an `EmbeddingBagCollection` (pooled bags), an `EmbeddingCollection`
            (sequences: each id list read position by position), a list of their configs, or a
            list of several of these. A module's weights are its tables' starting values; a
            config's table starts at N(0, model.init_std²). Any widths; table names distinct.
        dense_module: called as `dense_module(embeddings, dense)` — with sequence features
            `dense_module(embeddings, dense, lengths)`: `embeddings` {feature: [B, D_t]} for a
            pooled feature, {feature: [B, L, D_t]} for a sequence (zeros past its length),
            `lengths` {sequence feature: [B] int64}; with `pooled_as = "tensor"` (pooled
            features of one width) `embeddings` is [B, F, D]; `dense` [B, num_dense]. Trained
            in place.
        loss_fn: `(outputs, labels) -> [B]` per-example losses (reduction="none"); a loss that
            couples the examples of a batch is refused at the first step.
        data: the training set (`KJTDataset`); widedp Poisson-samples it.
        mode: "sparse" (private row selection), "dpsgd" or "nonprivate".
        target_epsilon, delta: the guarantee (δ default: the config's rule from n).
        batch_size: the expected batch size (Poisson rate batch_size / n).
        steps, epochs: the planned steps (or epochs · n / batch_size of them).
        config: further settings — a `Config`, a TOML file or `section.key=value` strings
            (train.selection, train.optimizer, train.lr, privacy.clip_norm, cluster.backend, ...).
        metrics_fn: `(outputs, labels) -> {name: value}` for `evaluate`; None: binary metrics of
            logits (AUC, logloss, ECE).
        pooled_as: see `dense_module`.
        backend, num_shards: where the tables live — "local" (this process) or "ray" (one Ray
            actor per row-shard; the `cluster.*` settings of `config` apply); these two take
            precedence over `config`'s.
        ledger_path: where the ledger is written after every charge, before the release.
        max_sequence_length: L per sequence feature (an int for all, or {feature: L}); an
            example keeps L of its ids (a public setting). Required with sequence features.
        sequence_keep: which L of a longer sequence: its "first" L ids (TorchRec's
            `to_padded_dense`; lists stored most recent first) or its "last" L (time order).
        logit_layer: the `nn.Linear` of `dense_module` whose one output is the logit it returns;
            given, `train.recalibrate` (default on) runs after the planned steps in the private
            modes — a private Platt scaling of the released model, budgeted in the target ε.
            Without it recalibration is off.

    Returns:
        A `PrivateTrainer`: `step()`, `train()`, `epsilon()`, `ledger`, `evaluate(data)`,
        `embedding_state_dict()`, `state_dict()`.

    Raises:
        ValueError / TypeError naming the table, feature, example or setting that is wrong.
    """
    if not isinstance(data, (KJTDataset, LoaderData)):
        raise TypeError(f"data must be a widedp KJTDataset (widedp samples it) or a widedp.LoaderData (your loader "
                        f"reads the examples widedp samples), got {type(data).__name__}")
    fixed: dict[str, Any] = {"train.mode": mode, "data.path": "(in memory)",
                             "cluster.backend": backend, "cluster.num_shards": int(num_shards)}
    if logit_layer is None:
        fixed["train.recalibrate"] = False
    if target_epsilon is not None:
        fixed["privacy.target_epsilon"] = float(target_epsilon)
    if delta is not None:
        fixed["privacy.delta"] = float(delta)
    if batch_size is not None:
        fixed["train.batch_size"] = int(batch_size)
    if steps is not None and epochs is not None:
        raise ValueError("give steps or epochs, not both")
    if epochs is not None:  # T = ⌈E·n/B⌉ over the examples, as `widedp.sampling` counts them
        if batch_size is None:
            raise ValueError("epochs needs batch_size")
        fixed["train.steps"] = max(1, math.ceil(float(epochs) * len(data) / batch_size))
    elif steps is not None:
        fixed["train.steps"] = int(steps)
    inputs = embedding_inputs(embeddings, int(num_shards), max_sequence_length, sequence_keep)
    fixed["model.embedding_dim"] = inputs.width
    cfg = _settings(config, fixed)
    if cfg.train.optimizer == "adagrad" and len(set(inputs.tables.values())) > 1:
        raise ValueError(f"tables of different widths {dict(inputs.tables)} with train.optimizer = \"adagrad\": "
                         "row-wise Adagrad would average over the widest width; use sgd or adam (exact per column)")
    data = data.with_features(inputs.order)
    if inputs.weighted and isinstance(data, KJTDataset) and not data.weighted:
        names = [f.name for f in inputs.layout.features if f.weighted]
        raise ValueError(f"features {names} are a weighted EmbeddingBagCollection's: the KJTDataset's "
                         "KeyedJaggedTensor needs per-id weights")
    check_ids(inputs, data)
    if logit_layer is not None and isinstance(data, LoaderData) and cfg.train.recalibrate:
        raise ValueError("train.recalibrate reads every training example once more: with your own loader set "
                         "train.recalibrate=false (or give no logit_layer)")
    model = UserDenseModel(dense_module, loss_fn, inputs, metrics_fn, pooled_as, logit_layer=logit_layer)
    initial = initial_weights(embeddings, inputs)
    return PrivateTrainer(cfg, model, inputs, data, initial, None if ledger_path is None else Path(ledger_path))
