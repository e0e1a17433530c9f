"""`widedp train` and `widedp evaluate`: build a run from a config and drive the engine.

Run dir: config.json, summary.json (docs/DESIGN.md §4 keys), metrics.jsonl (one line per logged
step), ledger.json (rewritten atomically after every recorded step, before the update is
released) and checkpoint.pt (atomic; private; `--resume DIR` continues it).

What a run writes or prints follows docs/THREAT_MODEL.md (enforced in `trainer/run_outputs.py`):
by default nothing un-noised about the training data; `train.debug_metrics = true` adds raw
training statistics and says in the summary that the privacy report does not cover them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from accounting import PrivacyLedger
from accounting.atomic import atomic_write_bytes
from trainer.config import Config, load_config, load_saved_config, saved_config
from trainer.engine import Engine, StepStats
from trainer.layout import FeatureSpec, ShardLayout, TableSpec
from trainer.models import MODELS
from trainer.planning import PrivacyInfo, default_delta, plan_privacy, plan_run  # noqa: F401  (public here too)
from trainer.randomness import PrivacyRandomness
from trainer.run import Run
from trainer.run_outputs import RunRecorder, eval_line

# docs/DESIGN.md §4 keys of every summary.json (debug-only statistics are in run_outputs.DEBUG_SUMMARY_KEYS).
SUMMARY_KEYS = ("mode", "selection", "epsilon", "delta", "accountant", "steps", "examples_per_sec",
                "step_time_ms_median", "rows_selected_mean", "num_shards", "test_metrics", "bayes_auc")


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, default=_json_default) + "\n").encode())


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
    absent (trainer/data/generators.py), and a cached one must match the config."""
    from trainer import data as data_mod
    from trainer.data.generators import SYNTHETIC_DATASETS

    path = Path(cfg.data.path)
    synthetic = SYNTHETIC_DATASETS.get(cfg.data.synth) if cfg.data.synth else None
    if cfg.data.synth and synthetic is None:
        raise ValueError(f"data.synth must be empty or one of {sorted(SYNTHETIC_DATASETS)}, got {cfg.data.synth!r}")
    if not (path / "dataset.json").exists():
        if synthetic is None:
            raise ValueError(f"data.path {path} has no dataset.json (set data.synth to generate one)")
        synthetic.generate(path, cfg.data)
    elif synthetic is not None:
        _check_synthetic_matches(path, synthetic.wanted(cfg.data), synthetic.recorded(json.loads((path / "dataset.json").read_text())))
    return data_mod.open_dataset(path, test_fraction=cfg.data.test_fraction, seed=cfg.data.seed)


def _check_synthetic_matches(path: Path, want: dict, have: dict) -> None:
    """A cached synthetic data set must be the one the config asks for (else a changed
    synth_* key would silently train on the old data)."""
    diff = [f"{k}={have.get(k)} (config: {want[k]})" for k in want if have.get(k) != want[k]]
    if diff:
        raise ValueError(f"data.path {path} holds a different synthetic data set: {', '.join(diff)}; "
                         f"delete that directory or point data.path elsewhere")


def _layout(meta, cfg: Config) -> ShardLayout:
    tables = tuple(TableSpec(name, int(rows), cfg.model.embedding_dim) for name, rows in meta.table_sizes.items())
    features = tuple(FeatureSpec(f, meta.feature_tables[f], meta.pooling[f]) for f in meta.features)
    return ShardLayout(tables, features, cfg.cluster.num_shards)


def _shard_group(cfg: Config, layout: ShardLayout):
    from trainer.shard_group import InProcessShardGroup, RayShardGroup

    kwargs = dict(optimizer=cfg.train.optimizer, lr=cfg.train.lr, seed=cfg.train.seed, init_std=cfg.model.init_std,
                  ema_decay=cfg.train.ema_decay)
    if cfg.cluster.backend == "local":
        return InProcessShardGroup(layout, **kwargs)
    return RayShardGroup(layout, cpus_per_shard=cfg.cluster.cpus_per_shard, gpus_per_shard=cfg.cluster.gpus_per_shard,
                         placement_strategy=cfg.cluster.placement_strategy,
                         max_restarts=cfg.cluster.max_actor_restarts, **kwargs)


def _dense_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.numel()] or list(model.parameters())
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[cfg.train.optimizer]
    return opt(params, lr=cfg.train.dense_lr)


def run_randomness(cfg: Config) -> PrivacyRandomness:
    """Fresh OS entropy, unless the config asks for a reproducible (public) noise seed."""
    if cfg.privacy.reproducible:
        return PrivacyRandomness.from_seed(cfg.privacy.noise_seed)
    return PrivacyRandomness.fresh()


def build_run(cfg: Config, train_transform=None) -> Run:
    """Everything a run needs (trainer/run.py `Run`): engine, splits, metadata, privacy plan.
    `train_transform(train_split) -> split`: applied to the training split before anything is
    planned from it (the one-run audit adds its canaries there, trainer/audit.py)."""
    from trainer.data import PoissonSampler

    if cfg.cluster.backend == "ray":  # connection problems surface before any data work
        from trainer.ray_runtime import ensure_ray

        trainer_cpus = cfg.cluster.cpus_per_trainer * cfg.cluster.num_trainers if cfg.cluster.trainer_actors else 0.0
        ensure_ray(cfg.cluster.address, needed_cpus=cfg.cluster.cpus_per_shard * cfg.cluster.num_shards + trainer_cpus)
    train_set, test_set = _ensure_dataset(cfg)
    validation_set = None
    if cfg.data.validation_fraction > 0:
        from trainer.data.dataset import hold_out

        train_set, validation_set = hold_out(train_set, cfg.data.validation_fraction, cfg.data.seed)
    if train_transform is not None:
        train_set = train_transform(train_set)
    meta = train_set.meta
    layout = _layout(meta, cfg)
    torch.manual_seed(cfg.train.seed)
    model = MODELS[cfg.model.name](features=list(meta.features), embedding_dim=cfg.model.embedding_dim,
                                   num_dense=meta.num_dense, bottom_mlp=list(cfg.model.bottom_mlp),
                                   top_mlp=list(cfg.model.top_mlp), interaction=cfg.model.interaction)
    n = len(train_set)
    if n == 0:
        raise ValueError(f"{cfg.data.path}: the training split is empty")
    plan, info, policy = plan_run(cfg, n, meta.table_sizes, [e for _, e in meta.privacy_events], meta.feature_tables)
    ledger = PrivacyLedger(cfg.privacy.accountant, info.delta) if plan is not None else None
    shards = _shard_group(cfg, layout)
    randomness = run_randomness(cfg)
    sampler = PoissonSampler(n, info.sample_rate, seed=randomness.sampler_seed())
    engine = Engine(model, layout, shards, train_set, sampler, mode=cfg.train.mode,
                    expected_batch_size=info.sample_rate * n, sample_rate=info.sample_rate, plan=plan,
                    ledger=ledger, target_epsilon=cfg.privacy.target_epsilon,
                    dense_optimizer=_dense_optimizer(cfg, model), randomness=randomness,
                    secure_mode=cfg.privacy.secure_mode,
                    dense_tables=policy.dense_indices([t.name for t in layout.tables]) if policy else (),
                    ema_decay=cfg.train.ema_decay, num_trainers=cfg.cluster.num_trainers,
                    selection_on_shards=cfg.cluster.selection_on_shards,
                    fuse_selection=cfg.cluster.fuse_selection, trainer_actors=cfg.cluster.trainer_actors,
                    cpus_per_trainer=cfg.cluster.cpus_per_trainer)
    return Run(cfg, engine, train_set, test_set, meta, info, validation_set)


def save_checkpoint(run_dir: Path, engine: Engine, cfg: Config) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"engine": engine.state_dict(), "config": cfg.to_dict()}, buf)
    atomic_write_bytes(run_dir / "checkpoint.pt", buf.getvalue())


# Keys that do not change what a run's steps compute (placement, logging, recovery).
_COMPUTATION_FREE_KEYS = {("train", "log_every"), ("train", "eval_every"), ("train", "checkpoint_every"),
                          ("train", "eval_batch_size"), ("train", "debug_metrics"), ("cluster", "address"),
                          ("cluster", "backend"), ("cluster", "cpus_per_shard"), ("cluster", "gpus_per_shard"),
                          ("cluster", "placement_strategy"), ("cluster", "max_actor_restarts"), ("cluster", "trainer_placement"),
                          ("cluster", "cpus_per_trainer"), ("run_dir", None)}
# Keys a resume may change without changing what the replayed steps compute.
_RESUME_FREE_KEYS = _COMPUTATION_FREE_KEYS | {("train", "steps")}


def changed_computation_keys(saved: dict, now: dict, free: frozenset | set = frozenset(_COMPUTATION_FREE_KEYS)) -> list[str]:
    """The config keys ("section.key") whose value in `now` differs from `saved` (two
    `Config.to_dict()`s), ignoring the keys in `free`; a key `saved` lacks counts as changed."""
    changed = []
    for section, values in now.items():
        if not isinstance(values, dict):
            if (section, None) not in free and saved.get(section) != values:
                changed.append(section)
            continue
        for key, value in values.items():
            if (section, key) not in free and saved.get(section, {}).get(key, _MISSING) != value:
                changed.append(f"{section}.{key}")
    return changed


_MISSING = object()


def _check_replay_is_identical(saved: dict, cfg: Config) -> None:
    """A reproducible resume reuses the checkpoint's generator states, which is allowed only when
    the replay computes what was released (docs/DESIGN.md §1: never the same noise on different
    values): refuse a resume that changes anything the steps compute."""
    changed = changed_computation_keys(saved, cfg.to_dict(), _RESUME_FREE_KEYS)
    if changed:
        raise ValueError(f"--resume in reproducible mode would replay the checkpoint's noise on different values: "
                         f"{', '.join(changed)} changed; resume without those changes, or unset privacy.reproducible "
                         f"(a secret run resumes with fresh noise)")


def _restore(engine: Engine, run_dir: Path, cfg: Config) -> None:
    """Resume from checkpoint.pt. The ledger is the larger of the checkpoint's and ledger.json
    (persisted before every release): steps released after the checkpoint are replayed with
    fresh secret randomness (trainer/randomness.py) and so are charged again, never forgotten."""
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    if engine.randomness.reproducible:
        _check_replay_is_identical(state["config"], cfg)
    engine.load_state_dict(state["engine"])
    ledger_file = run_dir / "ledger.json"
    if engine.ledger is not None and ledger_file.exists():
        on_disk = PrivacyLedger.load(ledger_file)
        if on_disk.steps > engine.ledger.steps:
            engine.ledger.load_state_dict(on_disk.state_dict())


def _start(engine: Engine, cfg: Config, run_dir: Path, train_set, data_events) -> None:
    """A new run: config.json, an empty metrics file, then the one-time events (data
    preparation, DP-FEST) charged before the first step."""
    atomic_write_json(run_dir / "config.json", cfg.to_dict())
    (run_dir / "metrics.jsonl").write_text("")
    if engine.ledger is not None:
        for _, event in data_events:
            engine.charge(event)
    if engine.needs_one_time_selection():
        engine.prepare_fest(train_set.feature_rows)


class _TrainCallbacks:
    """What `widedp train` does after each step: metrics/eval lines (through the recorder, which
    enforces docs/THREAT_MODEL.md), checkpoints, the progress bar."""

    def __init__(self, run: Run, recorder: RunRecorder, run_dir: Path, progress: bool):
        self.run, self.recorder, self.run_dir = run, recorder, run_dir
        self.start = time.perf_counter()
        self.bar = None
        if progress:
            from tqdm import tqdm

            cfg = run.config
            self.bar = tqdm(total=cfg.train.steps, initial=run.engine.step_count, desc=cfg.train.mode, unit="step")

    def on_step(self, engine: Engine, stats: StepStats, seconds: float) -> None:
        t, recorder = self.run.config.train, self.recorder
        recorder.on_step(stats, seconds)
        if stats.step % t.log_every == 0 or stats.step == t.steps:
            recorder.log(recorder.metrics_line(stats))
        if t.eval_every and stats.step % t.eval_every == 0:
            recorder.log(eval_line(stats.step, self.run.evaluate()))
        if stats.step % t.checkpoint_every == 0:
            save_checkpoint(self.run_dir, engine, self.run.config)
        if self.bar is not None:
            self.bar.set_postfix(**recorder.progress_postfix(stats, time.perf_counter() - self.start))
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True) -> dict:
    """Train per `cfg`, writing only what docs/THREAT_MODEL.md allows (trainer/run_outputs.py)."""
    cfg.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    with build_run(cfg) as run:
        engine, info = run.engine, run.privacy
        data_events = list(run.meta.privacy_events)
        engine.ledger_path = run_dir / "ledger.json" if engine.ledger is not None else None
        if resume:
            _restore(engine, run_dir, cfg)
        else:
            _start(engine, cfg, run_dir, run.train_set, data_events)
        recorder = RunRecorder(expected_batch_size=engine.b, metrics_path=run_dir / "metrics.jsonl",
                               debug_metrics=cfg.train.debug_metrics, randomness_note=engine.randomness.describe(),
                               reproducible=engine.randomness.reproducible, private=engine.plan is not None)
        callbacks = _TrainCallbacks(run, recorder, run_dir, progress)
        try:
            result = run.run(cfg.train.steps, [callbacks])
        finally:
            callbacks.close()
        save_checkpoint(run_dir, engine, cfg)
        summary = {
            "mode": cfg.train.mode,
            "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
            "epsilon": engine.ledger.epsilon() if engine.ledger is not None else math.inf,
            "delta": info.delta,
            "accountant": info.accountant,
            "steps": engine.step_count,
            "events_charged": engine.ledger.steps if engine.ledger is not None else 0,
            "num_shards": cfg.cluster.num_shards,
            "test_metrics": run.evaluate(),
            "bayes_auc": run.meta.bayes_auc,
            "target_epsilon": cfg.privacy.target_epsilon,
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
            "stopped_by_budget": result.stopped_by_budget,
            "resumed": resume,
            "actor_restarts": getattr(run.engine.shards, "restarts", 0) + getattr(run.engine.trainers, "restarts", 0),
            "steps_redone": run.engine.step_restarts,
            "num_trainers": cfg.cluster.num_trainers,
            "trainer_actors": cfg.cluster.trainer_actors,
            "vocabulary_size": engine.layout.vocabulary_size,
            "backend": cfg.cluster.backend,
            **({"validation_metrics": run.evaluate(run.validation_set)} if run.validation_set is not None else {}),
            **recorder.summary_fields(result.elapsed_s, engine.shards, [d for d, _ in data_events],
                                      validation=run.validation_set is not None),
        }
        atomic_write_json(run_dir / "summary.json", summary)
        return summary


def evaluate(run_dir: Path) -> dict:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    cfg = saved_config(state["config"], f"{run_dir / 'checkpoint.pt'} (its config)")
    cfg.cluster.backend = "local"  # evaluation needs no cluster
    with build_run(cfg) as run:
        run.engine.load_state_dict(state["engine"])
        return {"run_dir": str(run_dir), "steps": run.engine.step_count, "test_metrics": run.evaluate(),
                "bayes_auc": run.meta.bayes_auc, "epsilon": run.engine.ledger.epsilon() if run.engine.ledger else None}


# ---- CLI ----------------------------------------------------------------------------------------
def add_commands(sub) -> dict:
    t = sub.add_parser("train", help="train a model (embedded local Ray unless --address is given)")
    t.add_argument("--config", help="TOML config (with --resume: defaults to RUN_DIR/config.json)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    t.add_argument("--run-dir")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    t.add_argument("--address", help="Ray cluster address (default: embedded local Ray)")
    t.add_argument("--no-progress", action="store_true")
    e = sub.add_parser("evaluate", help="evaluate a run's checkpoint on its test split")
    e.add_argument("--run-dir", required=True)
    return {"train": cmd_train, "evaluate": cmd_evaluate}


def cmd_train(args) -> dict:
    if args.resume and not args.config:
        config_path = Path(args.resume) / "config.json"
        if not config_path.exists():
            raise ValueError(f"--resume {args.resume}: no config.json there (pass --config)")
        cfg = load_saved_config(config_path, args.set)
    elif not args.config:
        raise ValueError("--config is required (or --resume RUN_DIR)")
    else:
        cfg = load_config(args.config, args.set)
    if args.address:
        cfg.cluster.address = args.address
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "checkpoint.pt").exists():
            raise ValueError(f"--resume {run_dir}: no checkpoint.pt there")
    else:
        run_dir = Path(args.run_dir or cfg.run_dir or "runs/latest")
    summary = train(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    return {"run_dir": str(run_dir), **summary}


def cmd_evaluate(args) -> dict:
    run_dir = Path(args.run_dir)
    if not (run_dir / "checkpoint.pt").exists():
        raise ValueError(f"--run-dir {run_dir}: no checkpoint.pt there")
    return evaluate(run_dir)
