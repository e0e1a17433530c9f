"""`widedp train` and `widedp evaluate`: build a run from a config and drive the engine.

Run dir: config.json, summary.json (docs/DESIGN.md §4 keys), metrics.jsonl (one line per logged
step), ledger.json (rewritten atomically after every recorded step, before the update is
released) and checkpoint.pt (atomic; private; `--resume DIR` continues it).

What a run writes or prints follows docs/THREAT_MODEL.md (enforced in `trainer/run_outputs.py`):
by default nothing un-noised about the training data; `train.debug_metrics = true` adds raw
training statistics and says in the summary that the privacy report does not cover them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from accounting import PrivacyLedger, calibrate
from accounting.atomic import atomic_write_bytes
from accounting import events as ev
from selection import k_from_fraction
from selection.registry import NO_SELECTION, get_selector
from trainer.config import Config, load_config
from trainer.engine import Engine, PrivacyPlan
from trainer.layout import FeatureSpec, ShardLayout, TableSpec
from trainer.models import MODELS
from trainer.randomness import PrivacyRandomness
from trainer.run_outputs import RunRecorder, eval_line

# docs/DESIGN.md §4 keys of every summary.json (debug-only statistics are in run_outputs.DEBUG_SUMMARY_KEYS).
SUMMARY_KEYS = ("mode", "selection", "epsilon", "delta", "accountant", "steps", "examples_per_sec",
                "step_time_ms_median", "rows_selected_mean", "num_shards", "test_metrics", "bayes_auc")


def default_delta(n: int) -> float:
    """δ when privacy.delta is 0: min(1/(10n), n^-1.1), clearly below 1/n at every n.

    δ = 1/n admits mechanisms that publish one random example outright ((0, 1/n)-DP), so δ
    must be well below 1/n. 1/(10n) keeps a 10× margin at practical sizes; n^-1.1 makes δ
    o(1/n) as n grows (it takes over beyond n = 10^10). The ε cost is logarithmic in 1/δ.
    """
    return min(0.1 / n, float(n) ** -1.1)


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
    from trainer import data as data_mod

    path = Path(cfg.data.path)
    if not (path / "dataset.json").exists():
        if not cfg.data.synth:
            raise ValueError(f"data.path {path} has no dataset.json (set data.synth to generate one)")
        if cfg.data.synth == "ctr":
            data_mod.synth_ctr(path, num_examples=cfg.data.synth_examples, table_sizes=cfg.data.synth_table_size,
                               seed=cfg.data.seed)
        elif cfg.data.synth == "text":
            data_mod.synth_text(path, num_examples=cfg.data.synth_examples, vocab=cfg.data.synth_vocab,
                                seed=cfg.data.seed)
        else:
            raise ValueError(f"data.synth must be 'ctr' or 'text', got {cfg.data.synth!r}")
    elif cfg.data.synth:
        _check_synthetic_matches(path, cfg)
    return data_mod.open_dataset(path, test_fraction=cfg.data.test_fraction, seed=cfg.data.seed)


def _check_synthetic_matches(path: Path, cfg: Config) -> None:
    """A cached synthetic data set must be the one the config asks for (else a changed
    synth_* key would silently train on the old data)."""
    raw = json.loads((path / "dataset.json").read_text())
    d = cfg.data
    want = {"synth_examples": d.synth_examples, "seed": d.seed}
    have = {"synth_examples": raw.get("num_examples"), "seed": raw.get("seed")}
    if d.synth == "ctr":
        want["synth_table_size"] = d.synth_table_size
        sizes = set((raw.get("table_sizes") or {}).values())
        have["synth_table_size"] = sizes.pop() if len(sizes) == 1 else sorted(sizes)
    else:
        want["synth_vocab"] = d.synth_vocab
        have["synth_vocab"] = (raw.get("table_sizes") or {}).get("input")
    diff = [f"{k}={have[k]} (config: {want[k]})" for k in want if have[k] != want[k]]
    if diff:
        raise ValueError(f"data.path {path} holds a different synthetic data set: {', '.join(diff)}; "
                         f"delete that directory or point data.path elsewhere")


def _layout(meta, cfg: Config) -> ShardLayout:
    tables = tuple(TableSpec(name, int(rows), cfg.model.embedding_dim) for name, rows in meta.table_sizes.items())
    features = tuple(FeatureSpec(f, meta.feature_tables[f], meta.pooling[f]) for f in meta.features)
    return ShardLayout(tables, features, cfg.cluster.num_shards)


def plan_privacy(cfg: Config, n: int, vocabulary: int, data_events: Sequence[ev.DpEvent] = ()
                 ) -> tuple[Optional[PrivacyPlan], dict]:
    """Privacy plan and what it implies (calibrated or explicit σ, ε, δ).

    `data_events`: one-time events of data preparation (e.g. a private vocabulary), charged
    before the first step; calibration leaves room for them inside the target ε."""
    t, p = cfg.train, cfg.privacy
    q = min(1.0, t.batch_size / n)
    delta = p.delta or default_delta(n)
    info = {"sample_rate": q, "delta": delta, "accountant": p.accountant}
    if t.mode == "nonprivate":
        return None, info
    k = p.k or k_from_fraction(p.gamma, vocabulary)
    selector = get_selector(t.selection) if t.mode == "sparse" else None
    selection = selector.name if selector is not None else NO_SELECTION
    # What the selectors' Params read (their `config=` keys): privacy.*, k resolved from gamma, δ.
    source = {**dataclasses.asdict(p), "k": k, "delta": delta}
    extra = [(event, 1) for event in data_events]
    params = None
    if selector is not None:
        params = selector.params_from(source, "config")
        one_time = selector.one_time_event(params)
        if one_time is not None:
            extra.append((one_time, 1))
    sigma = p.noise_multiplier
    if p.noise_multiplier <= 0:
        out = calibrate(p.target_epsilon, delta, q, t.steps, selection=selection, fraction=p.selection_fraction,
                        accountant=p.accountant, k=k, max_answers=k, selection_delta=delta,
                        svt_release_values=False, extra_history=extra)
        sigma = out.noise_multiplier
        if selector is not None and out.selection_params:  # the calibrated fields replace the config's
            params = dataclasses.replace(params, **dict(out.selection_params))
        info["calibrated"] = True
    else:
        if selector is not None:
            missing = [selector.config_fields()[f] for f in selector.budget_fields() if getattr(params, f) <= 0]
            if missing:
                raise ValueError(f"privacy.noise_multiplier is set: selection {selection!r} also needs "
                                 + " and ".join(f"privacy.{m}" for m in missing))
        info["calibrated"] = False
    if selector is not None and getattr(params, "threshold", 1.0) <= 0:
        auto = selector.auto_threshold(params, k=k, num_rows=vocabulary, clip_norm=p.clip_norm,
                                       batch_size=min(t.batch_size, n))
        if auto is not None:
            params = dataclasses.replace(params, threshold=auto[0])
            info["threshold_rule"] = auto[1]
    plan = PrivacyPlan(noise_multiplier=sigma, clip_norm=p.clip_norm, second_clip_norm=p.second_clip_norm or None,
                       selection=selection, selection_params=params)
    # The run summary's keys (unchanged): the config's names of the selector's parameters.
    named = {key: getattr(params, f) for f, key in (selector.config_fields() if selector else {}).items()}
    unset = info["calibrated"]  # a calibrated run has no config value for parameters its selector lacks
    info.update(noise_multiplier=sigma, selection_epsilon=named.get("selection_epsilon", 0.0 if unset else p.selection_epsilon),
                selection_sigma=named.get("selection_sigma", 0.0 if unset else p.selection_sigma), k=k,
                threshold=named.get("threshold", p.threshold))
    return plan, info


def auto_selection_threshold(plan: PrivacyPlan, k: int, vocabulary: int, batch_size: int) -> tuple[float, str]:
    """The threshold used when a config leaves privacy.threshold at 0 (threshold and svt): the
    selector's own data-independent rule (`Selector.auto_threshold`): about k of the p rows
    pass on noise alone (a literal 0 would let about half of all p rows through)."""
    selector = plan.selector
    auto = selector.auto_threshold(plan.selection_params, k=k, num_rows=vocabulary, clip_norm=plan.clip_norm,
                                   batch_size=batch_size) if selector is not None else None
    if auto is None:
        raise ValueError(f"selection {plan.selection!r} has no threshold")
    return auto


def _shard_group(cfg: Config, layout: ShardLayout):
    from trainer.shard_group import InProcessShardGroup, RayShardGroup

    kwargs = dict(optimizer=cfg.train.optimizer, lr=cfg.train.lr, seed=cfg.train.seed, init_std=cfg.model.init_std)
    if cfg.cluster.backend == "local":
        return InProcessShardGroup(layout, **kwargs)
    return RayShardGroup(layout, cpus_per_shard=cfg.cluster.cpus_per_shard, gpus_per_shard=cfg.cluster.gpus_per_shard,
                         placement_strategy=cfg.cluster.placement_strategy, **kwargs)


def _dense_optimizer(cfg: Config, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.numel()] or list(model.parameters())
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[cfg.train.optimizer]
    return opt(params, lr=cfg.train.dense_lr)


def run_randomness(cfg: Config) -> PrivacyRandomness:
    """Fresh OS entropy, unless the config asks for a reproducible (public) noise seed."""
    if cfg.privacy.reproducible:
        return PrivacyRandomness.from_seed(cfg.privacy.noise_seed)
    return PrivacyRandomness.fresh()


def build_run(cfg: Config):
    """Everything a run needs: (engine, train split, test split, meta, privacy info)."""
    from trainer.data import PoissonSampler

    if cfg.cluster.backend == "ray":  # connection problems surface before any data work
        from trainer.ray_runtime import ensure_ray

        ensure_ray(cfg.cluster.address, needed_cpus=cfg.cluster.cpus_per_shard * cfg.cluster.num_shards)
    train_set, test_set = _ensure_dataset(cfg)
    meta = train_set.meta
    layout = _layout(meta, cfg)
    torch.manual_seed(cfg.train.seed)
    model = MODELS[cfg.model.name](features=list(meta.features), embedding_dim=cfg.model.embedding_dim,
                                   num_dense=meta.num_dense, bottom_mlp=list(cfg.model.bottom_mlp),
                                   top_mlp=list(cfg.model.top_mlp), interaction=cfg.model.interaction)
    n = len(train_set)
    if n == 0:
        raise ValueError(f"{cfg.data.path}: the training split is empty")
    plan, info = plan_privacy(cfg, n, layout.vocabulary_size, [e for _, e in meta.privacy_events])
    ledger = PrivacyLedger(cfg.privacy.accountant, info["delta"]) if plan is not None else None
    shards = _shard_group(cfg, layout)
    randomness = run_randomness(cfg)
    sampler = PoissonSampler(n, info["sample_rate"], seed=randomness.sampler_seed())
    engine = Engine(model, layout, shards, train_set, sampler, mode=cfg.train.mode,
                    expected_batch_size=info["sample_rate"] * n, sample_rate=info["sample_rate"], plan=plan,
                    ledger=ledger, target_epsilon=cfg.privacy.target_epsilon,
                    dense_optimizer=_dense_optimizer(cfg, model), randomness=randomness,
                    secure_mode=cfg.privacy.secure_mode)
    return engine, train_set, test_set, meta, info


def save_checkpoint(run_dir: Path, engine: Engine, cfg: Config) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"engine": engine.state_dict(), "config": cfg.to_dict()}, buf)
    atomic_write_bytes(run_dir / "checkpoint.pt", buf.getvalue())


# Keys a resume may change without changing what the replayed steps compute.
_RESUME_FREE_KEYS = {("train", "steps"), ("train", "log_every"), ("train", "eval_every"), ("train", "checkpoint_every"),
                     ("train", "eval_batch_size"), ("train", "debug_metrics"), ("cluster", "address"),
                     ("cluster", "backend"), ("cluster", "cpus_per_shard"), ("cluster", "gpus_per_shard"),
                     ("cluster", "placement_strategy"), ("run_dir", None)}


def _check_replay_is_identical(saved: dict, cfg: Config) -> None:
    """A reproducible resume reuses the checkpoint's generator states, which is allowed only when
    the replay computes what was released (docs/DESIGN.md §1: never the same noise on different
    values): refuse a resume that changes anything the steps compute."""
    now = cfg.to_dict()
    changed = []
    for section, values in now.items():
        if not isinstance(values, dict):
            if (section, None) not in _RESUME_FREE_KEYS and saved.get(section) != values:
                changed.append(section)
            continue
        for key, value in values.items():
            if (section, key) not in _RESUME_FREE_KEYS and saved.get(section, {}).get(key) != value:
                changed.append(f"{section}.{key}")
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


def train(cfg: Config, run_dir: Path, resume: bool = False, progress: bool = True) -> dict:
    """Train per `cfg`, writing only what docs/THREAT_MODEL.md allows (trainer/run_outputs.py)."""
    cfg.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    engine, train_set, test_set, meta, info = build_run(cfg)
    try:
        data_events = list(meta.privacy_events)
        engine.ledger_path = run_dir / "ledger.json" if engine.ledger is not None else None
        if resume:
            _restore(engine, run_dir, cfg)
        else:
            _start(engine, cfg, run_dir, train_set, data_events)
        recorder = RunRecorder(expected_batch_size=engine.b, metrics_path=run_dir / "metrics.jsonl",
                               debug_metrics=cfg.train.debug_metrics, randomness_note=engine.randomness.describe(),
                               reproducible=engine.randomness.reproducible, private=engine.plan is not None)
        stopped_by_budget = False
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.train.steps, initial=engine.step_count, desc=f"{cfg.train.mode}", unit="step")
        start = time.perf_counter()
        while engine.step_count < cfg.train.steps:
            t0 = time.perf_counter()
            stats = engine.step()
            if stats is None:
                stopped_by_budget = True
                break
            recorder.on_step(stats, time.perf_counter() - t0)
            if stats.step % cfg.train.log_every == 0 or stats.step == cfg.train.steps:
                recorder.log(recorder.metrics_line(stats))
            if cfg.train.eval_every and stats.step % cfg.train.eval_every == 0:
                recorder.log(eval_line(stats.step, engine.evaluate(test_set, cfg.train.eval_batch_size)))
            if stats.step % cfg.train.checkpoint_every == 0:
                save_checkpoint(run_dir, engine, cfg)
            if bar is not None:
                bar.set_postfix(**recorder.progress_postfix(stats, time.perf_counter() - start))
                bar.update(1)
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        save_checkpoint(run_dir, engine, cfg)
        summary = {
            "mode": cfg.train.mode,
            "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
            "epsilon": engine.ledger.epsilon() if engine.ledger is not None else math.inf,
            "delta": info["delta"],
            "accountant": info["accountant"],
            "steps": engine.step_count,
            "events_charged": engine.ledger.steps if engine.ledger is not None else 0,
            "num_shards": cfg.cluster.num_shards,
            "test_metrics": engine.evaluate(test_set, cfg.train.eval_batch_size),
            "bayes_auc": meta.bayes_auc,
            "target_epsilon": cfg.privacy.target_epsilon,
            "noise_multiplier": info.get("noise_multiplier"),
            "selection_epsilon": info.get("selection_epsilon"),
            "selection_sigma": info.get("selection_sigma"),
            "k": info.get("k"),
            "threshold": info.get("threshold"),
            "threshold_rule": info.get("threshold_rule"),
            "sample_rate": info["sample_rate"],
            "stopped_by_budget": stopped_by_budget,
            "resumed": resume,
            "vocabulary_size": engine.layout.vocabulary_size,
            "backend": cfg.cluster.backend,
            **recorder.summary_fields(elapsed, engine.shards, [d for d, _ in data_events]),
        }
        atomic_write_json(run_dir / "summary.json", summary)
        return summary
    finally:
        engine.shards.shutdown()


def evaluate(run_dir: Path) -> dict:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    cfg = _config_from_dict(state["config"], [])
    cfg.cluster.backend = "local"  # evaluation needs no cluster
    engine, _, test_set, meta, _ = build_run(cfg)
    try:
        engine.load_state_dict(state["engine"])
        return {"run_dir": str(run_dir), "steps": engine.step_count, "test_metrics": engine.evaluate(test_set, cfg.train.eval_batch_size),
                "bayes_auc": meta.bayes_auc, "epsilon": engine.ledger.epsilon() if engine.ledger else None}
    finally:
        engine.shards.shutdown()


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


def _config_from_dict(data: dict, overrides: list[str]) -> Config:
    """A Config from its saved dict (config.json / checkpoint), then `--set` overrides applied."""
    cfg = Config()
    for section in ("data", "model", "train", "privacy", "cluster"):
        for key, value in data.get(section, {}).items():
            setattr(getattr(cfg, section), key, value)
    cfg.run_dir = data.get("run_dir", "")
    if overrides:
        patched = load_config(None, overrides)
        defaults = Config()
        for section in ("data", "model", "train", "privacy", "cluster"):
            for key in vars(getattr(defaults, section)):
                if any(o.startswith(f"{section}.{key}=") for o in overrides):
                    setattr(getattr(cfg, section), key, getattr(getattr(patched, section), key))
    return cfg


def cmd_train(args) -> dict:
    if args.resume and not args.config:
        config_path = Path(args.resume) / "config.json"
        if not config_path.exists():
            raise ValueError(f"--resume {args.resume}: no config.json there (pass --config)")
        cfg = _config_from_dict(json.loads(config_path.read_text()), args.set)
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
