"""The one builder of a training engine from a config, a dense model, a layout and a training
set: `widedp train` (trainer/run/train.py `build_run`) and `make_private` (trainer/private/wrap.py)
both call `build_engine`, so a user's model and the built-in ones run the same step.

Privacy assumption: the engine's (docs/DESIGN.md §1). Here the privacy plan is resolved from the
config and the data set's public shape (n, the tables' sizes, which feature reads which table,
the data set's own one-time events), the sampler is keyed from the run's secret randomness, and
the ledger is made at the plan's δ; nothing here reads the training data's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from widedp.accounting import PrivacyLedger
from widedp.trainer.config import Config, lazy_dpsgd_noise
from widedp.trainer.config.planning import PrivacyInfo, plan_run
from widedp.trainer.engine import Engine, EngineOptions, EnginePrivacy
from widedp.trainer.engine.layout import ShardLayout
from widedp.trainer.engine.randomness import PrivacyRandomness


def shard_group(cfg: Config, layout: ShardLayout):
    """The shards of `layout`: in this process (cluster.backend = "local") or Ray actors."""
    from widedp.trainer.cluster.ray_shards import RayShardGroup
    from widedp.trainer.engine.shard_group import InProcessShardGroup

    kwargs: dict[str, Any] = dict(optimizer=cfg.train.optimizer, lr=cfg.train.lr, seed=cfg.train.seed,
                                  init_std=cfg.model.init_std, ema_decay=cfg.train.ema_decay,
                                  lazy_noise=lazy_dpsgd_noise(cfg))
    if cfg.cluster.backend == "local":
        return InProcessShardGroup(layout, **kwargs)
    return RayShardGroup(layout, cpus_per_shard=cfg.cluster.cpus_per_shard, gpus_per_shard=cfg.cluster.gpus_per_shard,
                         placement_strategy=cfg.cluster.placement_strategy,
                         max_restarts=cfg.cluster.max_actor_restarts, data_plane=cfg.cluster.data_plane,
                         compiled_wait=cfg.cluster.compiled_wait, fold_write_back=cfg.cluster.fold_write_back,
                         unawaited_write_back=cfg.cluster.unawaited_write_back, **kwargs)


def trainer_group(cfg: Config):
    """Where the trainers run: Ray actors (cluster.trainer_actors), else the engine's default
    (in this process)."""
    if not cfg.cluster.trainer_actors:
        return None
    from widedp.trainer.cluster.ray_trainers import ray_trainer_factory

    return ray_trainer_factory(cfg.cluster.cpus_per_trainer, cfg.cluster.dense_reduction, cfg.cluster.lead_fanout)


def dense_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    """train.optimizer's family over the dense parameters at train.dense_lr."""
    params = [p for p in model.parameters() if p.numel()] or list(model.parameters())
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[cfg.train.optimizer]
    return opt(params, lr=cfg.train.dense_lr)


def run_randomness(cfg: Config) -> PrivacyRandomness:
    """Fresh OS entropy, unless the config asks for a reproducible (public) noise seed."""
    if cfg.privacy.reproducible:
        return PrivacyRandomness.from_seed(cfg.privacy.noise_seed)
    return PrivacyRandomness.fresh(secure=cfg.privacy.secure_mode)


def connect_cluster(cfg: Config) -> None:
    """With cluster.backend = "ray": connect (or start) Ray before any data work, so connection
    problems surface first."""
    if cfg.cluster.backend != "ray":
        return
    from widedp.trainer.cluster.ray_runtime import ensure_ray

    trainer_cpus = cfg.cluster.cpus_per_trainer * cfg.cluster.num_trainers if cfg.cluster.trainer_actors else 0.0
    ensure_ray(cfg.cluster.address, needed_cpus=cfg.cluster.cpus_per_shard * cfg.cluster.num_shards + trainer_cpus,
               inline_bytes=cfg.cluster.inline_bytes)


@dataclasses.dataclass
class BuiltEngine:
    """What `build_engine` made: the engine, the resolved privacy info, and the training set
    the engine samples (each user's kept examples with privacy.user_sampling = "examples")."""

    engine: Engine
    info: PrivacyInfo
    train_set: Any


def build_engine(cfg: Config, model, layout: ShardLayout, train_set, *, table_sizes: Mapping[str, int],
                 feature_tables: Mapping[str, str], example_units: Optional[np.ndarray] = None,
                 data_events: Sequence = (), data_event_units: Optional[Sequence[str]] = None,
                 feature_max_ids: Optional[Mapping[str, Optional[int]]] = None,
                 randomness: Optional[PrivacyRandomness] = None) -> BuiltEngine:
    """The engine over `model`, `layout`'s shards and `train_set`, with its privacy plan.

    Args:
        cfg: the run's config (train, privacy and cluster sections are read).
        model: the dense model (a `DenseModel`).
        layout: the tables and features, sharded cluster.num_shards ways.
        train_set: the engine's data interface (`len`, `take`, `iter_batches`, `feature_rows`).
        table_sizes, feature_tables: public shape of the data set ({table: rows}, {feature: table}).
        example_units: user level: the dense unit index 0..U-1 of each example; None: example level.
        data_events, data_event_units: the data set's own one-time events and whom each bounds.
        feature_max_ids: per feature, the most ids one example holds (the "auto" dense-table rule).
        randomness: the run's secret randomness; None: `run_randomness(cfg)`.

    Returns:
        `BuiltEngine`. Raises what the planner raises for an unreachable target ε.
    """
    from widedp.trainer.data import PoissonSampler, UnitPoissonSampler

    n = len(train_set)
    if n == 0:
        raise ValueError("the training set is empty")
    randomness = run_randomness(cfg) if randomness is None else randomness
    num_units = None
    partitioned = bool(getattr(train_set, "partitioned", False))
    if partitioned:  # the trainers read and sample their own parts (trainer/data/format/partitioned.py)
        _check_partitioned(cfg, train_set, example_units)
        if train_set.unit_level:
            n = int(train_set.num_units)
    if example_units is not None and cfg.privacy.user_sampling == "examples":
        # user level by example sampling: each user keeps ≤ k examples (a secret random subset),
        # the steps are example-level and every event is accounted for a group of k
        from widedp.trainer.data.format.dataset import SplitSubset
        from widedp.trainer.data.sampler import trimmed_positions

        num_units = int(example_units.max()) + 1
        train_set = SplitSubset(train_set, trimmed_positions(example_units, cfg.privacy.max_examples_per_user,
                                                             randomness.user_trim_rng()))
        example_units, n = None, len(train_set)
    elif example_units is not None:  # user level: n, q, b and δ are over units (trainer/engine/engine.py)
        n = int(example_units.max()) + 1
    plan, info, policy = plan_run(cfg, n, table_sizes, list(data_events), feature_tables, num_units=num_units,
                                  data_event_units=data_event_units, feature_max_ids=feature_max_ids)
    ledger = PrivacyLedger(cfg.privacy.accountant, info.delta) if plan is not None else None
    shards = shard_group(cfg, layout)
    sampler: "PoissonSampler | UnitPoissonSampler | None"
    if partitioned:
        sampler = None  # each trainer samples its parts (`PartitionSampler`), the engine gathers them
    elif example_units is None:
        sampler = PoissonSampler(n, info.sample_rate, seed=randomness.sampler_rng())
    else:
        sampler = UnitPoissonSampler(example_units, info.sample_rate, cfg.privacy.max_examples_per_user,
                                     seed=randomness.sampler_rng())
    privacy = None if plan is None or ledger is None else EnginePrivacy(
        plan, ledger, cfg.privacy.target_epsilon, secure_mode=cfg.privacy.secure_mode, group_size=info.group_size or 1)
    options = EngineOptions(num_trainers=cfg.cluster.num_trainers, selection_on_shards=cfg.cluster.selection_on_shards,
                            fuse_selection=cfg.cluster.fuse_selection, norms_on_trainer=cfg.cluster.norms_on_trainer,
                            trainer_group=trainer_group(cfg))
    engine = Engine(model, layout, shards, train_set, sampler, mode=cfg.train.mode,
                    expected_batch_size=info.sample_rate * n, sample_rate=info.sample_rate,
                    dense_optimizer=dense_optimizer(cfg, model), privacy=privacy, randomness=randomness,
                    options=options, dense_tables=policy.dense_indices([t.name for t in layout.tables]) if policy else (),
                    ema_decay=cfg.train.ema_decay, example_units=example_units)
    return BuiltEngine(engine, info, train_set)


def _check_partitioned(cfg: Config, train_set, example_units) -> None:
    """What a run on a partitioned data set needs: the trainers sample their parts, so no
    per-example array reaches the coordinator, and every unit-level setting agrees."""
    user = cfg.privacy.unit == "user"
    if example_units is not None:
        raise ValueError("a partitioned training set holds its units in its parts: pass example_units=None")
    if user and cfg.privacy.user_sampling == "examples":
        raise ValueError(f"{train_set.directory}: privacy.user_sampling = \"examples\" trims each user's examples "
                         "over the whole training set at the coordinator: not with a partitioned data set "
                         "(privacy.user_sampling = \"users\" samples users in each part)")
    if user != train_set.unit_level or (user and train_set.max_examples_per_unit != cfg.privacy.max_examples_per_user):
        raise ValueError(f"{train_set.directory}: the partitioned training set was opened for "
                         f"{'user' if train_set.unit_level else 'example'} level "
                         f"(max_examples_per_unit={train_set.max_examples_per_unit}), the config has privacy.unit = "
                         f"{cfg.privacy.unit!r} (max_examples_per_user = {cfg.privacy.max_examples_per_user})")
