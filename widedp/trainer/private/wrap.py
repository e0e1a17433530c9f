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
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from widedp.public import public
from widedp.trainer.config import Config, load_config
from widedp.trainer.config.lr_schedule import lr_multiplier
from widedp.trainer.config.planning import data_event_is_grouped
from widedp.trainer.engine.checkpoint import engine_state, load_engine_state
from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec
from widedp.trainer.private.build import build_engine, connect_cluster
from widedp.trainer.private.data import KJTDataset
from widedp.trainer.private.dense import LossFn, MetricsFn, UserDenseModel, check_examples_independent

_POOLINGS = {"SUM": "sum", "MEAN": "mean"}


def layout_of(embeddings, num_shards: int) -> ShardLayout:
    """widedp's table layout from a TorchRec `EmbeddingBagCollection` or its `EmbeddingBagConfig`s.

    Every feature name of every config becomes one pooled feature of its table (several names:
    a shared table), in the EBC's output order. Raises ValueError naming the table for what the
    engine cannot hold yet: per-table embedding dimensions, pooling other than SUM / MEAN,
    weighted bags, a feature read by two tables."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if isinstance(embeddings, EmbeddingBagCollection):
        if embeddings.is_weighted():
            raise ValueError("a weighted EmbeddingBagCollection (per-id weights) is not supported yet")
        configs = list(embeddings.embedding_bag_configs())
    else:
        configs = list(embeddings)
        bad = [type(c).__name__ for c in configs if not isinstance(c, EmbeddingBagConfig)]
        if bad or not configs:
            raise TypeError("embeddings must be a torchrec EmbeddingBagCollection or a non-empty list of "
                            f"EmbeddingBagConfig, got {bad or 'an empty list'}")
    tables: list[TableSpec] = []
    features: list[FeatureSpec] = []
    seen: dict[str, str] = {}
    for c in configs:
        pooling = _POOLINGS.get(getattr(c.pooling, "name", str(c.pooling)))
        if pooling is None:
            raise ValueError(f"table {c.name!r}: pooling {c.pooling} is not supported (SUM or MEAN)")
        if not c.feature_names:
            raise ValueError(f"table {c.name!r} has no feature_names: nothing would read it")
        tables.append(TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim)))
        for f in c.feature_names:
            if f in seen:
                raise ValueError(f"feature {f!r} is read by tables {seen[f]!r} and {c.name!r}")
            seen[f] = c.name
            features.append(FeatureSpec(f, c.name, pooling))
    dims = {t.name: t.dim for t in tables}
    if len(set(dims.values())) != 1:
        raise ValueError(f"per-table embedding dimensions {dims} are not supported yet: every table must have one "
                         "embedding_dim (project inside the dense module instead)")
    return ShardLayout(tuple(tables), tuple(features), num_shards)


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

    def __init__(self, cfg: Config, model: UserDenseModel, layout: ShardLayout, data: KJTDataset,
                 initial_tables: Optional[Mapping[str, torch.Tensor]], ledger_path: Optional[Path]):
        connect_cluster(cfg)
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
        built = build_engine(cfg, model, layout, data, table_sizes=table_sizes, feature_tables=feature_tables,
                             example_units=units, data_events=events, data_event_units=data.privacy_event_units)
        self.config, self.engine, self.privacy, self.layout = cfg, built.engine, built.info, layout
        self.train_set, self.model = built.train_set, model
        if initial_tables is not None:
            self._load_tables(initial_tables)
        if ledger_path is not None and self.engine.ledger is not None:
            self.engine.budget.persist = lambda ledger: ledger.save(ledger_path)
        if self.engine.ledger is not None:  # what preparing the data spent, before the first step
            for event, unit in zip(events, data.privacy_event_units):
                grouped = data_event_is_grouped(cfg, unit)
                self.engine.budget.charge(self.engine.budget.accounted(event) if grouped else event, whole_unit=True)
        self._checked = False

    # ---- training ----------------------------------------------------------------------------------------
    def step(self):
        """One private step (docs/DESIGN.md §2): `StepStats`, or None — nothing spent — when it
        would pass `privacy.target_epsilon` or the planned `train.steps` are done. The raw
        training statistics of a step (its batch loss, realized batch size, touched rows) are
        un-noised: they are NaN / -1 unless `train.debug_metrics = true` (docs/THREAT_MODEL.md)."""
        engine, t = self.engine, self.config.train
        if engine.step_count >= t.steps:
            return None
        if not self._checked:
            self._check_first_batch()
        if engine.needs_one_time_selection() and engine.fixed_rows is None:
            engine.prepare_fest(self.train_set.feature_rows)
        engine.budget.plan_steps(t.steps)
        engine.lr_scale = lr_multiplier(t.lr_schedule, engine.step_count, t.steps)
        stats = engine.step()
        if stats is None or t.debug_metrics:
            return stats
        return dataclasses.replace(stats, loss=float("nan"), batch_size=-1, rows_touched=-1, trainer_cpu_s=())

    def train(self, steps: Optional[int] = None) -> int:
        """Step until `steps` more were taken (default: until `train.steps` or the target ε);
        returns how many were taken."""
        taken = 0
        while steps is None or taken < steps:
            if self.step() is None:
                break
            taken += 1
        return taken

    def _check_first_batch(self) -> None:
        """The coupling probe on a few examples (trainer/private/dense.py); public-shape work
        only, nothing of it is released."""
        from widedp.trainer.engine.evaluation import lookup

        batch = self.train_set.take(np.arange(min(16, len(self.train_set)), dtype=np.int64))
        pooled = torch.from_numpy(lookup(self.engine, batch, batch.size))
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
        return self.engine.evaluate(data.with_features(self.model.features),
                                    batch_size or self.config.train.eval_batch_size)

    def predict(self, data: KJTDataset, batch_size: Optional[int] = None) -> torch.Tensor:
        """The released model's outputs on `data`, in its order."""
        out = self.engine.outputs(data.with_features(self.model.features),
                                  batch_size or self.config.train.eval_batch_size)
        return torch.zeros(0) if out is None else out[0]

    def embedding_state_dict(self, averaged: Optional[bool] = None) -> dict[str, torch.Tensor]:
        """The released tables under an EmbeddingBagCollection's state-dict keys
        (`embedding_bags.<table>.weight`): `ebc.load_state_dict(...)` takes them. `averaged`
        (default: with train.ema_decay > 0) gives the averaged tables."""
        averaged = self.config.train.ema_decay > 0 if averaged is None else averaged
        states = self.engine.shards.broadcast("state_dict")
        key = "averaged_weights" if averaged else "weights"
        out = {}
        for t, table in enumerate(self.layout.tables):
            blocks = [torch.as_tensor(s[key][t], dtype=torch.float32) for s in states]
            out[f"embedding_bags.{table.name}.weight"] = torch.cat(blocks)[:table.num_rows].clone()
        return out

    def _load_tables(self, tables: Mapping[str, torch.Tensor]) -> None:
        states = self.engine.shards.broadcast("state_dict")
        for t, table in enumerate(self.layout.tables):
            w = tables[table.name]
            if tuple(w.shape) != (table.num_rows, table.dim):
                raise ValueError(f"table {table.name!r}: initial weights of shape {tuple(w.shape)}, expected "
                                 f"({table.num_rows}, {table.dim})")
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

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "PrivateTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@public
def make_private(embeddings, dense_module: nn.Module, loss_fn: LossFn, data: KJTDataset, *,
                 mode: str = "sparse", target_epsilon: Optional[float] = None, delta: Optional[float] = None,
                 batch_size: Optional[int] = None, steps: Optional[int] = None, epochs: Optional[float] = None,
                 config: Union[None, Config, str, Path, Sequence[str]] = None,
                 metrics_fn: Optional[MetricsFn] = None, pooled_as: str = "dict",
                 backend: str = "local", num_shards: int = 1,
                 ledger_path: Optional[Union[str, Path]] = None) -> PrivateTrainer:
    """Wrap a user's TorchRec embedding tables, dense module and loss for private training.

    Neighbouring relation: add/remove one example of `data` (one unit with all its examples
    when the config sets `privacy.unit = "user"`). Sensitivity: each example's (unit's)
    gradient over the tables and `dense_module` together is clipped to S1
    (`privacy.clip_norm`); the noise and the selection are those of `train.mode` and
    `train.selection`, calibrated to `target_epsilon` over the planned steps.

    Args:
        embeddings: an `EmbeddingBagCollection` (its weights are the starting tables) or a list
            of `EmbeddingBagConfig` (tables start at N(0, model.init_std²)). One embedding_dim.
        dense_module: called as `dense_module(pooled, dense)`; `pooled` is {feature: [B, D]}
            (`pooled_as = "dict"`) or [B, F, D] (`"tensor"`), `dense` [B, num_dense]. Trained in
            place.
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

    Returns:
        A `PrivateTrainer`: `step()`, `train()`, `epsilon()`, `ledger`, `evaluate(data)`,
        `embedding_state_dict()`, `state_dict()`.

    Raises:
        ValueError / TypeError naming the table, feature, example or setting that is wrong.
    """
    if not isinstance(data, KJTDataset):
        raise TypeError(f"data must be a widedp KJTDataset, got {type(data).__name__}")
    fixed: dict[str, Any] = {"train.mode": mode, "data.path": "(in memory)", "train.recalibrate": False,
                             "cluster.backend": backend, "cluster.num_shards": int(num_shards)}
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
    layout = layout_of(embeddings, int(num_shards))
    fixed["model.embedding_dim"] = layout.dim
    cfg = _settings(config, fixed)
    features = [f.name for f in layout.features]
    data = data.with_features(features)
    for f in layout.features:
        rows = next(t.num_rows for t in layout.tables if t.name == f.table)
        top, example = data.max_ids(f.name)
        if top >= rows:
            raise ValueError(f"feature {f.name!r}, example {example}: id {top} is outside table {f.table!r} "
                             f"of {rows} rows")
    model = UserDenseModel(dense_module, loss_fn, features, metrics_fn, pooled_as)
    initial = None
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if isinstance(embeddings, EmbeddingBagCollection):
        weights = {name: bag.weight for name, bag in embeddings.embedding_bags.items()}
        if all(w.device.type != "meta" for w in weights.values()):
            initial = {name: w.detach().cpu() for name, w in weights.items()}
    return PrivateTrainer(cfg, model, layout, data, initial, None if ledger_path is None else Path(ledger_path))
