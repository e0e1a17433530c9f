"""What a run's ε means is fixed when the run first starts (docs/DESIGN.md §1).

Every config key is in one class (`KEY_CLASSES`; tests/test_run_semantics.py enumerates the
config's keys so that a new key cannot escape the classification):

- FREE: changes neither what the steps compute nor what ε means (logging, placement, transports,
  records of the config). A resume may change it.
- INITIAL: used only when a run first starts (initialization of the parameters); a resume loads
  the checkpoint's, so changing it there changes nothing.
- STICKY: computation-free, but once any session had it on, what the outputs mean is weaker for
  the whole run (train.debug_metrics: the raw statistics are written; the report is void for
  them forever). A resume may change it; the weaker meaning is reported for every later output
  (summary.json, the export, the data set's budget), read from the run's journal
  (trainer/run/journal.py), not from the last session's config.
- CHARGED: changes what later steps compute, and with it the events charged; every session's
  events are in the ledger and the ε reported is the ledger's, so a secret resume may change it
  (its steps draw fresh noise). A reproducible resume reuses the checkpoint's generator states
  and may change none of these (trainer/run/train.py, `check_replay_is_identical`).
- FIXED: changes what the ε *means* (whom it protects, against whom it holds, at which δ, for
  which data) or what the checkpoint is (the model's structure). Recorded when the run starts
  (`semantics`) in the checkpoint and in the ledger's header (bound into its hash chain); a
  resume that changes one is refused, naming the key and both values (`changed_semantics`).

Values are recorded resolved, not as configured: privacy.delta (the δ the ledger was started
at: "auto" depends on n), data.path (compared by the data set's identity, not its path: a data
set may move), the ledger key's id (trainer/run/ledger_key.py; none when unkeyed), and the user-level
keys privacy.user_sampling and privacy.max_examples_per_user as none at example level (they
bound nothing there; privacy.unit itself is fixed).
"""

from __future__ import annotations

from typing import Any, Optional

FREE, INITIAL, STICKY, CHARGED, FIXED = "free", "initial", "sticky", "charged", "fixed"
CLASSES = (FREE, INITIAL, STICKY, CHARGED, FIXED)

#: Why each FIXED key cannot change at resume (the refusal quotes it).
FIXED_REASONS = {
    "data.path": "the data set the run trains on (compared by its identity)",
    "data.synth": "names the data set the run trains on",
    "data.synth_examples": "names the data set the run trains on",
    "data.synth_table_size": "names the data set the run trains on",
    "data.synth_vocab": "names the data set the run trains on",
    "data.test_fraction": "which examples are training data (the test split is assumed not to be)",
    "data.validation_fraction": "which examples are training data (the validation split is held out)",
    "data.seed": "which examples are training data (the split's seed)",
    "model.name": "the model the checkpoint holds",
    "model.embedding_dim": "the model the checkpoint holds",
    "model.bottom_mlp": "the model the checkpoint holds",
    "model.top_mlp": "the model the checkpoint holds",
    "model.interaction": "the model the checkpoint holds",
    "model.kwargs": "the model the checkpoint holds",
    "train.mode": "whether and how the run is private",
    "train.optimizer": "the optimizer state the checkpoint holds",
    "train.ema_decay": "which parameters are released (the average the checkpoint holds)",
    "train.modelmix": "the threat model of the ε (ModelMix's holds only while the mixing weights stay secret)",
    "privacy.unit": "whom the ε protects (one example, or one user with all of their examples)",
    "privacy.user_sampling": "how a user's examples are bounded, and so what the ε of a user means",
    "privacy.max_examples_per_user": "the bound on a user's contribution the user-level ε is stated for",
    "privacy.delta": "the δ of every (ε, δ) the run reports (its ledger's)",
    "privacy.accountant": "how the run's events are composed (its ledger's accountant)",
    "privacy.secure_mode": "against whom the noise holds (floating-point attacks)",
    "privacy.reproducible": "whether the ε holds only while a seed in config.json stays secret",
    "privacy.noise_seed": "the seed a reproducible run's ε depends on",
    "cluster.num_shards": "the checkpoint holds one state per shard",
}

_FREE = ("train.log_every", "train.eval_every", "train.eval_batch_size", "train.checkpoint_every",
         "train.tensorboard", "cluster.backend", "cluster.cpus_per_shard", "cluster.gpus_per_shard",
         "cluster.address", "cluster.placement_strategy", "cluster.max_actor_restarts", "cluster.trainer_placement",
         "cluster.cpus_per_trainer", "cluster.data_plane", "cluster.compiled_wait", "cluster.fold_write_back",
         "cluster.unawaited_write_back", "cluster.inline_bytes", "run_dir", "by_epsilon", "tuned_for_epsilon",
         "data.stage_dir", "cluster.lead_fanout")
_INITIAL = ("train.seed", "model.init_std")
_STICKY = ("train.debug_metrics",)
_CHARGED = (
    "train.selection", "train.batch_size", "train.steps", "train.lr", "train.dense_lr", "train.lr_schedule",
    "train.recalibrate", "privacy.target_epsilon", "privacy.noise_multiplier", "privacy.clip_norm",
    "privacy.adaptive_clip_min", "privacy.adaptive_clip_doublings", "privacy.adaptive_clip_noise",
    "privacy.adaptive_clip_beta", "privacy.adaptive_clip_lr_reference", "privacy.mix_width",
    "privacy.mix_coordinates", "privacy.second_clip_norm", "privacy.selection_fraction", "privacy.k",
    "privacy.gamma", "privacy.score_clip", "privacy.selection_epsilon", "privacy.selection_sigma",
    "privacy.threshold", "privacy.contribution_clip", "privacy.false_positive_ratio",
    "privacy.fest_noise_multiplier", "privacy.fest_max_rows_per_example", "privacy.recalibration_noise_multiplier",
    "privacy.table_default", "privacy.dense_max_rows", "privacy.tables",
    # the same distribution of the step, other draws (a secret resume draws fresh ones anyway)
    "cluster.num_trainers", "cluster.selection_on_shards", "cluster.fuse_selection", "cluster.norms_on_trainer",
    "cluster.dense_reduction",  # the same dense sum up to float64 rounding
    "train.dpsgd_noise",  # lazy or eager DP-SGD noise: a checkpoint holds every row's noise either way
)

KEY_CLASSES: dict[str, str] = {
    **{k: FREE for k in _FREE}, **{k: INITIAL for k in _INITIAL}, **{k: STICKY for k in _STICKY},
    **{k: CHARGED for k in _CHARGED}, **{k: FIXED for k in FIXED_REASONS},
}

#: The keys a new run's computation does not depend on (a benchmark may reuse a run saved with
#: other values: trainer/run/train.py `changed_computation_keys`).
COMPUTATION_FREE_KEYS = frozenset(k for k, c in KEY_CLASSES.items() if c in (FREE, STICKY))
#: The keys a resume may change whatever the run's randomness (FREE, INITIAL, STICKY).
RESUME_FREE_KEYS = frozenset(k for k, c in KEY_CLASSES.items() if c in (FREE, INITIAL, STICKY))

#: What `semantics` records besides the FIXED config keys.
LEDGER_KEY_ID = "ledger.key_id"
DATA_IDENTITY = "data.identity"
SEMANTICS_VERSION = 1


def config_keys(cfg_dict: dict) -> list[str]:
    """Every key of a `Config.to_dict()`: "section.key", or the top-level name."""
    out = []
    for section, values in cfg_dict.items():
        if isinstance(values, dict) and section != "by_epsilon":
            out += [f"{section}.{key}" for key in values]
        else:
            out.append(section)
    return out


def key_value(cfg_dict: dict, key: str, default: Any = None) -> Any:
    section, _, name = key.partition(".")
    if not name:
        return cfg_dict.get(section, default)
    return cfg_dict.get(section, {}).get(name, default)


def semantics(cfg, delta: Optional[float], identity: dict, key_id: Optional[str]) -> dict:
    """What the run's ε means, as the run records it when it first starts: every FIXED key's
    value (privacy.delta resolved to the ledger's δ, None for a non-private run), the data set's
    identity and the ledger key's id."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    out: dict[str, Any] = {"version": SEMANTICS_VERSION}
    for key in FIXED_REASONS:
        if key == "data.path":
            continue  # compared by identity (below)
        out[key] = key_value(d, key)
    if out.get("privacy.unit") != "user":  # they bound nothing at example level
        out["privacy.user_sampling"] = out["privacy.max_examples_per_user"] = None
    out["privacy.delta"] = None if delta is None else float(delta)
    out[DATA_IDENTITY] = dict(identity)
    out[LEDGER_KEY_ID] = key_id
    return out


def public_semantics(recorded: dict) -> dict:
    """The part a ledger header (and a privacy report) may carry: without the noise seed and the
    data set's content hashes (a hash of private data is still a function of it)."""
    return {k: v for k, v in recorded.items() if k not in ("privacy.noise_seed", DATA_IDENTITY)}


def changed_semantics(recorded: dict, now: dict) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value now) for every meaning-changing value that differs; a key
    the record lacks (an older widedp's) is not compared."""
    out = []
    for key, value in now.items():
        if key == "version" or key not in recorded:
            continue
        was = recorded[key]
        if key == DATA_IDENTITY:
            if was != value:
                out.append((key, "(the data set the run started on)", "(another data set's contents)"))
            continue
        if _differs(was, value):
            out.append((key, was, value))
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) != float(b)
    return a != b


def refusal(changes: list[tuple[str, Any, Any]], where: str) -> str:
    """The one-line message of a resume refused for `changes`."""
    parts = []
    for key, was, now in changes:
        reason = FIXED_REASONS.get(key) or {LEDGER_KEY_ID: "the key the run's records are signed with",
                                            DATA_IDENTITY: FIXED_REASONS["data.path"]}.get(key, "")
        parts.append(f"{key} was {was!r} when the run started, now {now!r} ({reason})")
    return (f"{where}: --resume would change what the run's ε means: {'; '.join(parts)}. What a run's ε means is "
            f"fixed when it first starts: resume with the run's own values (they are in its config.json), or "
            f"start a new run (a new --run-dir) with its own budget")


def void_reasons(recorded: dict, sticky: dict, mode: Optional[str] = None) -> list[str]:
    """Why the run's ε does not bound what it released (the data set's budget then counts it as
    infinite): non-private, reproducible (the seed is in config.json), raw debug statistics."""
    out = []
    mode = mode if mode is not None else recorded.get("train.mode")
    if mode == "nonprivate":
        out.append("train.mode = nonprivate: no privacy guarantee")
    if recorded.get("privacy.reproducible"):
        out.append("privacy.reproducible = true: sampling and noise came from privacy.noise_seed, which config.json "
                   "holds; the ε holds only while that seed stays secret")
    if sticky.get("debug_metrics"):
        out.append("train.debug_metrics = true in a session of this run: raw, un-noised training statistics were "
                   "written (metrics.jsonl, summary.json)")
    return out
