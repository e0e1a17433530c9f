"""Training configuration: a TOML file, overridable with `--set section.key=value`.

The config package (trainer/config/): the config's sections and loading (here), the plan a
config resolves to (`planning`), per-table policies (`table_policy`), learning-rate schedules
(`lr_schedule`) and the classification of every key for resumes (`semantics`).
May import: widedp.trainer.engine (the plan's types and rules: `PrivacyPlan`, DP-STAT, the
step's noise event, the recalibration's σ rule), widedp.trainer.models (the registry of model
names), widedp.trainer.names, the pure libraries.
Not: data, cluster, run, release or cli (loading and checking a config trains nothing).

One load-and-validate path (`config_from_dict`) serves a TOML file, `--set` overrides and a
run's saved `config.json` / checkpoint: unknown sections/keys and wrong types are errors
naming the source and the key (a typo must not silently train with a default). Each section
validates itself (`validate()`), reading the registries for names (selectors, accountants,
models, optimizers, synthetic data sets) instead of lists of its own.

Values the trainer derives are spelled explicitly: `"auto"` (e.g. `privacy.delta = "auto"`)
or, for an optional feature that is off, `"none"` in TOML / `--set` (None in Python, null in
config.json). A literal 0 never means "automatic" and is refused with a message saying so.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import importlib
import importlib.util
import json
import tomllib
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from widedp.trainer.config.table_policy import DEFAULTS as TABLE_DEFAULTS
from widedp.trainer.names import is_import_path
from widedp.trainer.config.table_policy import POLICIES as TABLE_POLICIES

MODES = ("nonprivate", "dpsgd", "sparse")
#: train.dpsgd_noise (`lazy_dpsgd_noise`).
DPSGD_NOISE = ("auto", "lazy", "eager")
# train.selection: any registered selector (selection.registry); DP-SGD is train.mode = "dpsgd".
AUTO = "auto"
ADAPTIVE = "adaptive"
PLACEMENT_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
BACKENDS = ("ray", "local")

Auto = Union[float, str]  # a positive number, or AUTO
AutoInt = Union[int, str]


def auto_or(kind: type, help: str) -> Any:
    """A field that is a positive `kind` or "auto" (the default: the trainer derives it)."""
    return dataclasses.field(default=AUTO, metadata={"kind": kind, "auto": True, "help": help})


def none_or(kind: type, help: str) -> Any:
    """A field that is a positive `kind` or None (off; "none" in TOML / --set)."""
    return dataclasses.field(default=None, metadata={"kind": kind, "none": True, "help": help})


def keyword_or(kind: type, keyword: str, default: Any, help: str) -> Any:
    """A field that is a positive `kind` or the string `keyword` (e.g. clip_norm = "adaptive")."""
    return dataclasses.field(default=default, metadata={"kind": kind, "keyword": keyword, "help": help})


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


class ConfigError(ValueError):
    """A config value or structure is wrong; the message names the source and the key."""


_LIGHT_NAMES: contextvars.ContextVar[bool] = contextvars.ContextVar("light_names", default=False)


@contextlib.contextmanager
def light_names():
    """Within: `validate()` checks names against trainer/names.py (lists read without importing
    torch, FBGEMM or dp_accounting) instead of the registries, so the whole config is checked in
    well under a second (trainer/cli/train.py runs this pass first; `train()` the full one)."""
    token = _LIGHT_NAMES.set(True)
    try:
        yield
    finally:
        _LIGHT_NAMES.reset(token)


# kind -> (module, attribute): a collection of names, or a function returning one.
_REGISTRIES = {
    "synthetic": ("widedp.trainer.data.synthetic.generators", "SYNTHETIC_DATASETS"),
    "models": ("widedp.trainer.models", "MODELS"),
    "interactions": ("widedp.trainer.models.dlrm", "INTERACTIONS"),
    "selectors": ("widedp.selection.registry", "selector_names"),
    "lr_schedules": ("widedp.trainer.config.lr_schedule", "LR_SCHEDULES"),
    "optimizers": ("widedp.trainer.engine.shard", "OPTIMIZERS"),
    "accountants": ("widedp.accounting.base", "accountant_names"),
}
# The light pass's lists (trainer/names.py) for the registries that import torch/FBGEMM/dp_accounting;
# the others import nothing heavy and are read as they are.
_LIGHT = {"models": "MODELS", "interactions": "INTERACTIONS", "selectors": "selectors", "optimizers": "OPTIMIZERS",
          "accountants": "ACCOUNTANTS"}


def registry(kind: str) -> Any:
    """The names a config key is checked against: the registry itself, or in the light pass
    (`light_names`) its list in trainer/names.py."""
    module, attribute = _REGISTRIES[kind]
    if _LIGHT_NAMES.get() and kind in _LIGHT:
        module, attribute = "widedp.trainer.names", _LIGHT[kind]
    names = getattr(importlib.import_module(module), attribute)
    return names() if callable(names) else names


def _require(checks: Sequence[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


@dataclasses.dataclass
class DataConfig:
    path: str = ""  # dataset directory (dataset.json + data.parquet)
    synth: str = ""  # a synthetic generator (trainer.data.synthetic.generators): generate the dataset at `path` if it does not exist
    synth_examples: int = 20_000
    synth_table_size: int = 10_000  # ctr: rows of every table; criteo: the hash size (tables of min(cardinality, it) rows)
    synth_vocab: int = 1_000
    test_fraction: float = 0.1
    # Fraction of the training split held out as a validation split (never trained on; its
    # metrics are `validation_metrics`, for tuning): benchmarks/tune.py sets it.
    validation_fraction: float = 0.0
    seed: int = 0
    # a partitioned data set at a URI (data.path = "s3://bucket/prefix"): the local directory on
    # each node where trainers stage their own parts and the coordinator the test split;
    # empty: $WIDEDP_STAGE_DIR, else ~/.cache/widedp/staged (trainer/data/format/remote.py)
    stage_dir: str = ""

    def validate(self) -> None:
        SYNTHETIC_DATASETS = registry("synthetic")
        _require([
            (bool(self.path), "data.path is required"),
            (not self.synth or self.synth in SYNTHETIC_DATASETS,
             f"data.synth must be empty or one of {sorted(SYNTHETIC_DATASETS)}, got {self.synth!r}"),
            (0 <= self.test_fraction < 1, f"data.test_fraction must be in [0, 1), got {self.test_fraction}"),
            (0 <= self.validation_fraction < 1,
             f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}"),
            (self.synth_examples >= 1, "data.synth_examples must be >= 1"),
            (self.seed >= 0, "data.seed must be >= 0"),
        ])


@dataclasses.dataclass
class ModelConfig:
    # a registered model (trainer.models.MODELS): "dlrm" | "cbow"; or your DenseModel subclass by
    # import path, "package.module:Class" (built as Class(features=, embedding_dim=, num_dense=, **model.kwargs))
    name: str = "dlrm"
    embedding_dim: int = 16
    bottom_mlp: list = dataclasses.field(default_factory=lambda: [64])
    top_mlp: list = dataclasses.field(default_factory=lambda: [64])
    init_std: float = 0.05
    interaction: str = "dot"  # dlrm: "dot" (pairwise dots) | "cat" (embeddings concatenated into the top MLP)
    # a model by import path: its keyword arguments (a TOML table [model.kwargs]); built-ins take none
    kwargs: dict = dataclasses.field(default_factory=dict, metadata={"values": "plain"})

    def validate(self) -> None:
        MODELS, INTERACTIONS = registry("models"), registry("interactions")
        _require([
            (self.name in MODELS or is_import_path(self.name),
             f"model.name must be one of {sorted(MODELS)} or an import path 'package.module:Class', got {self.name!r}"),
            (not self.kwargs or self.name not in MODELS,
             f"model.kwargs is for a model named by import path; {self.name!r} takes model.* keys"),
            (self.interaction in INTERACTIONS, f"model.interaction must be one of {INTERACTIONS}, got {self.interaction!r}"),
            (self.embedding_dim >= 1, "model.embedding_dim must be >= 1"),
            (all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in [*self.bottom_mlp, *self.top_mlp]),
             "model.bottom_mlp and model.top_mlp must be lists of positive integers"),
            (self.init_std > 0, "model.init_std must be > 0"),
        ])
        if self.name not in MODELS and not _LIGHT_NAMES.get():  # the import itself, outside the fast check
            from widedp.trainer.models import model_class

            try:
                model_class(self.name)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc


@dataclasses.dataclass
class TrainConfig:
    mode: str = "sparse"
    selection: str = "em"
    batch_size: int = 256  # expected batch size b (Poisson rate q = b / n)
    steps: int = 200
    optimizer: str = "adam"  # embeddings: sgd | adagrad | adam ; dense: the same family
    lr: float = 0.01
    dense_lr: float = 0.001
    # Multiplier of lr and dense_lr per step (trainer/config/lr_schedule.py): constant | linear | cosine.
    # A function of the step and train.steps only: public, no privacy cost.
    lr_schedule: str = "constant"
    # > 0: evaluate, checkpoint and export the exponential moving average of the iterates
    # (ema_t = β·ema_{t-1} + (1-β)·w_t over tables and dense parameters): post-processing, free
    # in privacy. 0: the last iterate.
    ema_decay: float = 0.0
    # Private runs of binary models (dlrm): after the last step, one noisy histogram of the
    # training logits by label (privacy.recalibration_noise_multiplier; charged like DP-FEST's
    # count, and planned inside the target ε) and Platt scaling fitted to it, folded into the
    # output layer (trainer/engine/recalibration.py). Fixes the intercept that per-example clipping
    # biases and the logit spread the noise adds; the ranking (AUC) is unchanged.
    recalibrate: bool = True
    # ModelMix (seed B Alg 1, trainer/engine/modelmix.py): each step starts from a secret random mix of
    # the two latest states (gap enforced to privacy.mix_width update sensitivities). dpsgd mode,
    # sgd, rdp accountant; the amplification is claimed only because every coordinate is mixed.
    modelmix: bool = False
    seed: int = 0  # initialization only (public); sampling and noise are secret (privacy.reproducible)
    log_every: int = 10
    eval_every: int = 0  # > 0: log test-split metrics every N steps (held-out data, no privacy cost)
    # true: metrics.jsonl / summary.json / progress also carry raw training statistics (batch loss,
    # realized batch sizes, touched rows, bytes). Outside the guarantee: the privacy report says so.
    debug_metrics: bool = False
    # true: every metrics.jsonl record is also written to RUN_DIR/tensorboard/ (TensorBoard event
    # files: the same tags, steps and values, nothing more; raw statistics only with debug_metrics).
    # Needs the tensorboard package: pip install 'widedp[tensorboard]'.
    tensorboard: bool = False
    eval_batch_size: int = 4096
    checkpoint_every: int = 100
    # DP-SGD's noise of the rows a step does not read (train.mode = "dpsgd"): "lazy" defers it to
    # the row's next read or release and draws it there at once — the same distribution of
    # everything the run reads and releases, exact for SGD without ema_decay or ModelMix
    # (trainer/engine/shard_update.py); "eager" draws every row every step; "auto" (default):
    # lazy where exact, else eager (`lazy_dpsgd_noise`).
    dpsgd_noise: str = "auto"

    def validate(self) -> None:
        selectors, LR_SCHEDULES, OPTIMIZERS = registry("selectors"), registry("lr_schedules"), registry("optimizers")
        _require([
            (self.mode in MODES, f"train.mode must be one of {MODES}, got {self.mode!r}"),
            (self.selection in selectors, f"train.selection must be one of {tuple(selectors)}, got {self.selection!r}"),
            (self.batch_size >= 1, "train.batch_size must be >= 1"),
            (self.steps >= 1, "train.steps must be >= 1"),
            (self.optimizer in OPTIMIZERS, f"train.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"),
            (self.lr > 0 and self.dense_lr > 0, "train.lr and train.dense_lr must be > 0"),
            (0 <= self.ema_decay < 1, f"train.ema_decay must be in [0, 1), got {self.ema_decay}"),
            (self.lr_schedule in LR_SCHEDULES,
             f"train.lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {self.lr_schedule!r}"),
            (self.log_every >= 1, "train.log_every must be >= 1"),
            (self.eval_every >= 0, "train.eval_every must be >= 0"),
            (self.eval_batch_size >= 1, "train.eval_batch_size must be >= 1"),
            (self.checkpoint_every >= 1, "train.checkpoint_every must be >= 1"),
            (self.dpsgd_noise in DPSGD_NOISE, f"train.dpsgd_noise must be one of {DPSGD_NOISE}, got {self.dpsgd_noise!r}"),
            (not self.tensorboard or importlib.util.find_spec("tensorboard") is not None, TENSORBOARD_MISSING),
        ])


PRIVACY_UNITS = ("example", "user")
USER_SAMPLINGS = ("users", "examples")


@dataclasses.dataclass
class PrivacyConfig:
    # What the guarantee protects (docs/DESIGN.md §1): "example" (add/remove one example) or
    # "user" (add/remove one unit of the data set's unit_column with all of its examples:
    # units are sampled, each contributes at most max_examples_per_user examples per step and
    # is clipped as one gradient; n, q and δ are over units — trainer/engine/engine.py).
    unit: str = "example"
    max_examples_per_user: int = 16  # public; a sampled user with more contributes a random subset
    # privacy.unit = "user", how (Charles et al. 2024): "users" — Poisson-sample users, each
    # contributing ≤ max_examples_per_user random examples per step, one clip per user; or
    # "examples" — each user keeps ≤ max_examples_per_user random examples once, then example-level
    # DP-SGD accounted for a group of that many (Ganesh 2024 mixture-of-Gaussians PLD; pld/auto only).
    user_sampling: str = "users"
    target_epsilon: float = 3.0
    delta: Auto = auto_or(float, "auto: min(1/(10n), n^-1.1), clearly below 1/n (docs/THREAT_MODEL.md)")
    noise_multiplier: Auto = auto_or(
        float, "auto: calibrated to target_epsilon; a number: that σ (ε reported, training stops at target_epsilon)")
    # "auto" (accounting/auto.py): PLD where every event reduces to Gaussians (DP-SGD, threshold
    # selectors, DP-FEST, recalibration: 3x tighter than RDP at ε = 1 here), RDP where one does not
    # (exponential mechanism, SVT, ModelMix). "rdp", "pld", "prv": that accountant only.
    accountant: str = "auto"
    clip_norm: Union[float, str] = keyword_or(
        float, ADAPTIVE, 1.0, "S1; \"adaptive\": chosen privately each step by DP-STAT on the batch's per-example "
                              "gradient norms (trainer/engine/adaptive_clip.py; its counts are charged with the step)")
    # clip_norm = "adaptive" (seed C's DP-STAT, trainer/engine/adaptive_clip.py): candidates
    # adaptive_clip_min·2^j, j = 0..adaptive_clip_doublings; each count of examples above a
    # candidate gets N(0, adaptive_clip_noise²); the first candidate whose noisy count is below
    # the union-bound width τ = noise·√(2·log(2(J+1)/β)) is S1 (about τ examples may exceed it).
    adaptive_clip_min: float = 0.01
    adaptive_clip_doublings: int = 12
    adaptive_clip_noise: Auto = auto_or(float, "std of each DP-STAT count's noise; auto: 0.05 · expected batch size")
    adaptive_clip_beta: float = 0.05
    adaptive_clip_lr_reference: Optional[float] = none_or(
        float, "with clip_norm = \"adaptive\": each step's learning rates times this / S1 (the update keeps the scale "
               "of a step at S1 = this); none: the configured rates")
    # train.modelmix: the enforced gap τ in units of the update's ℓ2 sensitivity lr·S1/b (the
    # seed's τ = r·η with averaged gradients is mix_width = r·b/S1); ModelMixDpEvent's w.
    mix_width: float = 0.0
    # train.modelmix: Alg 2's refined clipping — after the ℓ2 clip each coordinate of each
    # example's gradient is clamped to ±S1/√k (k = mix_coordinates); accounted by Cor 4.1. 1: off.
    mix_coordinates: int = 1
    second_clip_norm: Optional[float] = none_or(float, "S2; none: no second clip")
    selection_fraction: float = 0.2
    k: AutoInt = auto_or(int, "rows selected per step (em, noisy-max, random, fest); auto: floor(gamma * vocabulary)")
    gamma: float = 0.01  # k = floor(gamma * vocabulary) when k = "auto"
    score_clip: float = 0.1  # S0: EM/SVT/noisy-max utility is min(‖G_r‖, S0)
    selection_epsilon: Auto = auto_or(float, "per-draw ε (em, noisy-max) / Alg 1 ε (svt); auto: calibrated")
    selection_sigma: Auto = auto_or(float, "σ of threshold counts; auto: calibrated")
    threshold: Auto = auto_or(float, "τ (threshold counts), α (svt scores); auto: about k noise-only rows pass, "
                                     "or (threshold selectors) false_positive_ratio·b·(sparse features) when set")
    contribution_clip: float = 1.0  # C1 for threshold counts
    false_positive_ratio: Optional[float] = none_or(
        float, "threshold = auto (threshold selectors): τ lets about this fraction of b·(sparse-table features) "
               "pure-noise rows pass per step; none: about k rows")
    fest_noise_multiplier: Auto = auto_or(
        float, "DP-FEST's one-time σ on the training set's row counts; auto: from n, L, k and the target ε "
               "(selection.fest.auto_fest_noise_multiplier)")
    fest_max_rows_per_example: int = 32
    recalibration_noise_multiplier: Auto = auto_or(
        float, "σ of train.recalibrate's histogram counts (sensitivity √2); auto: from n and the target ε "
               "(trainer/recalibration.auto_noise_multiplier)")
    # Per-table policy of sparse mode (trainer/config/table_policy.py): "dense" tables are noised and
    # updated every step like DP-SGD, "sparse" ones go through the selection. "auto": dense when
    # the table has at most dense_max_rows rows ("auto": b × the most ids one example puts into it,
    # from the data set's public bounds). [privacy.tables] name = "dense" | "sparse" overrides.
    table_default: str = "auto"
    dense_max_rows: AutoInt = auto_or(int, "tables with at most this many rows are dense (table_default = auto); "
                                           "auto: the expected batch size × the most ids one example "
                                           "puts into the table (public bounds of the data set)")
    tables: dict = dataclasses.field(default_factory=dict)
    secure_mode: bool = False  # 4-draw Gaussian (floating-point attack resistant); needs secret randomness
    # Sampling, selection and noise come from fresh OS entropy unless reproducible = true, which
    # derives them from noise_seed: for tests/debugging only, ε then holds only while the seed is secret.
    reproducible: bool = False
    noise_seed: int = 0

    def validate(self) -> None:
        names = registry("accountants")
        _require([
            (self.unit in PRIVACY_UNITS, f"privacy.unit must be one of {PRIVACY_UNITS}, got {self.unit!r}"),
            (not isinstance(self.max_examples_per_user, bool) and isinstance(self.max_examples_per_user, int)
             and self.max_examples_per_user >= 1, "privacy.max_examples_per_user must be an integer >= 1"),
            (self.user_sampling in USER_SAMPLINGS,
             f"privacy.user_sampling must be one of {USER_SAMPLINGS}, got {self.user_sampling!r}"),
            (self.unit != "user" or self.user_sampling != "examples" or self.accountant in ("auto", "pld"),
             "privacy.user_sampling = \"examples\" is accounted by the pld accountant only (privacy.accountant = "
             "\"auto\" or \"pld\")"),
            (self.unit != "user" or self.mix_coordinates == 1,
             "privacy.mix_coordinates > 1 (refined clipping) clamps each example's coordinates: not with "
             "privacy.unit = \"user\""),
            (self.target_epsilon > 0, "privacy.target_epsilon must be > 0"),
            (is_auto(self.delta) or 0 < float(self.delta) < 1, "privacy.delta must be \"auto\" or in (0, 1)"),
            (self.noise_seed >= 0, "privacy.noise_seed must be >= 0"),
            (not (self.secure_mode and self.reproducible),
             "privacy.secure_mode and privacy.reproducible exclude each other (secure mode needs secret randomness)"),
            (self.clip_norm == ADAPTIVE or (isinstance(self.clip_norm, (int, float)) and self.clip_norm > 0),
             'privacy.clip_norm must be > 0 or "adaptive"'),
            (self.adaptive_clip_min > 0, "privacy.adaptive_clip_min must be > 0"),
            (self.mix_width >= 0, "privacy.mix_width must be >= 0"),
            (self.mix_coordinates >= 1, "privacy.mix_coordinates must be >= 1"),
            (0 <= self.adaptive_clip_doublings <= 60, "privacy.adaptive_clip_doublings must be in [0, 60]"),
            (0 < self.adaptive_clip_beta < 1, "privacy.adaptive_clip_beta must be in (0, 1)"),
            (0 < self.selection_fraction < 1, "privacy.selection_fraction must be in (0, 1)"),
            (0 < self.gamma <= 1, "privacy.gamma must be in (0, 1]"),
            (self.score_clip > 0, "privacy.score_clip must be > 0"),
            (self.contribution_clip > 0, "privacy.contribution_clip must be > 0"),
            (self.fest_max_rows_per_example >= 1, "privacy.fest_max_rows_per_example must be >= 1"),
            (self.accountant in names, f"privacy.accountant must be one of {names}, got {self.accountant!r}"),
            (self.table_default in TABLE_DEFAULTS,
             f"privacy.table_default must be one of {TABLE_DEFAULTS}, got {self.table_default!r}"),
        ])
        for name, kind in self.tables.items():
            _require([(kind in TABLE_POLICIES, f"privacy.tables.{name} must be one of {TABLE_POLICIES}, got {kind!r}")])

    def resolved(self, name: str) -> Optional[Any]:
        """The field's value with "auto" as None (the caller derives it)."""
        value = getattr(self, name)
        return None if is_auto(value) else value


TRAINER_PLACEMENTS = ("auto", "actors", "coordinator")
#: cluster.compiled_wait (trainer/cluster/compiled_wait.py implements each).
COMPILED_WAITS = ("backoff", "spin")
#: train.tensorboard = true without the package (trainer/run/outputs.py raises it too).
TENSORBOARD_MISSING = "train.tensorboard = true needs the tensorboard package: pip install 'widedp[tensorboard]'"
DATA_PLANES = ("calls", "compiled")  # trainer/cluster/ray_shards.py's (config checks before Ray loads)


DEFAULT_INLINE_BYTES = 8 * 1024 * 1024  # cluster.inline_bytes (trainer/cluster/ray_runtime.py reads it from here)
MAX_INLINE_BYTES = 1 << 30  # 1 GiB: Ray sends an inlined object in one gRPC message


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "ray"  # "ray" | "local" (in-process shards)
    num_shards: int = 2
    cpus_per_shard: float = 1.0
    gpus_per_shard: float = 0.0
    address: str = ""  # Ray address; empty: RAY_ADDRESS (set under `ray job submit`) or embedded local Ray
    placement_strategy: str = "SPREAD"  # Ray placement group strategy for the shard actors
    # A shard actor that dies is replaced and brought back to its state by replaying what was
    # released since the last checkpoint (trainer/engine/shard_group.py), up to this many attempts
    # per failure; 0: a death stops the run.
    max_actor_restarts: int = 1
    # Data-parallel trainers (docs/DESIGN.md §2.2): trainer i owns the i-th of N contiguous
    # example partitions; each does the lookup, dense part and clip factors of its examples and
    # its clipped row sums are reduced at the shards.
    num_trainers: int = 1
    # Where the trainers run: "actors" (Ray actors calling the shard actors directly, in
    # parallel; backend "ray" only), "coordinator" (in the coordinator's process, one after
    # another), "auto": actors when backend = "ray" and num_trainers > 1.
    trainer_placement: str = "auto"
    cpus_per_trainer: float = 1.0
    # Trainer actors (N > 1): where their dense clipped sums are added — "coordinator" (each
    # trainer returns its sum and gets the dense parameters each step: N calls and N of each
    # through the coordinator) or "trainers" (trainer 0 leads each round and the sums are reduced
    # to it over gloo, trainer/cluster/dense_collective.py: one call and one of each). The same
    # sum up to float64 rounding.
    dense_reduction: str = "coordinator"
    # dense_reduction = "trainers": each round runs down a tree of the trainers rooted at trainer 0,
    # each calling at most this many others (trainer/cluster/ray_trainers.py `lead_tree`): depth
    # ceil(log_f N), and no trainer's fan-out grows with N
    lead_fanout: int = 8
    # Selection on the shards (docs/DESIGN.md §2.2) for selectors that support it (threshold,
    # fest-threshold): each shard thresholds its own rows with its own stream; the same output
    # distribution as selecting over the whole vocabulary on the coordinator (false).
    selection_on_shards: bool = True
    # With one trainer, each shard selects in the call that makes its row sums and returns only
    # the rows the step uses (one round fewer); false: a call of its own (the same output, bit
    # for bit; for comparisons).
    fuse_selection: bool = True
    # Each trainer computes its examples' embedding-gradient norms itself, from the batch's ids and
    # the pooled-output gradients (trainer/engine/example_norms.py), and the pooled gradients travel to
    # the shards with the clip factors: one round fewer per step (user level keeps the shards'
    # per-unit norms). false: the shards compute the norms in a round of their own (the same
    # norms; for comparisons).
    norms_on_trainer: bool = True
    # How the coordinator reaches the shard actors each round (backend "ray"; trainer/engine/shard_group.py):
    # "calls" (one Ray actor call per shard per round) or "compiled" (a compiled Ray graph with
    # shared-memory channels, built once, rebuilt after a lost actor; trainer actors that call the
    # shards themselves use calls).
    data_plane: str = "calls"
    # data_plane "compiled": how the coordinator and the shard actors wait on the graph's channels
    # (trainer/cluster/compiled_wait.py). "backoff": look, then sleep 20 µs doubling to 200 µs between looks
    # (to 2 ms once a wait has lasted 50 ms); "spin": Ray's own read, which keeps a core busy per waiting process (1.0 core for an idle
    # actor here) and so takes the cores the step's compute needs where cores are few.
    compiled_wait: str = "backoff"
    # Backend "ray": each step's write-back of the noisy selected rows (and DP-SGD's dense-table
    # update) travels to each shard with the next call instead of a round of its own — one round
    # fewer per step, the same model bit for bit (docs/DESIGN.md §2, "Folded write-back"); false:
    # a round of its own (for comparisons). Trainer actors that call the shards themselves get
    # their own write-back round unless unawaited_write_back is set.
    fold_write_back: bool = True
    # Trainer actors with fold_write_back: the coordinator sends the write-back without waiting and
    # the trainers' next lookups wait for it at each shard (ObjectRef arguments). Off by default:
    # in interleaved A/B runs on 2 cores it saved 1-14 ms per step at b = 1,024 (N = 1) but was
    # slower at b = 16,384 in 5 of 6 pairs (median +47 ms), N = 2 mixed (docs/DESIGN.md §2.2).
    unawaited_write_back: bool = False
    # Embedded local Ray only (no cluster.address): Ray objects up to this many bytes travel
    # inside the actor call instead of through the object store (Ray's max_direct_call_object_size,
    # default 100 kB; a cluster of your own takes it at `ray start --system-config`). A step's
    # shard calls carry 0.1-30 MB on the CTR model (docs/DESIGN.md §2.1 has the measurements).
    inline_bytes: int = DEFAULT_INLINE_BYTES

    @property
    def trainer_actors(self) -> bool:
        """Whether the trainers run as Ray actors (`trainer_placement`, "auto" resolved)."""
        if self.trainer_placement == "auto":
            return self.backend == "ray" and self.num_trainers > 1
        return self.trainer_placement == "actors"

    def validate(self) -> None:
        _require([
            (self.backend in BACKENDS, f"cluster.backend must be one of {BACKENDS}, got {self.backend!r}"),
            (self.num_shards >= 1, "cluster.num_shards must be >= 1"),
            (self.cpus_per_shard > 0, "cluster.cpus_per_shard must be > 0"),
            (self.gpus_per_shard >= 0, "cluster.gpus_per_shard must be >= 0"),
            (self.max_actor_restarts >= 0, "cluster.max_actor_restarts must be >= 0"),
            (self.num_trainers >= 1, "cluster.num_trainers must be >= 1"),
            (self.trainer_placement in TRAINER_PLACEMENTS,
             f"cluster.trainer_placement must be one of {TRAINER_PLACEMENTS}, got {self.trainer_placement!r}"),
            (self.trainer_placement != "actors" or self.backend == "ray",
             'cluster.trainer_placement = "actors" needs cluster.backend = "ray"'),
            (self.cpus_per_trainer > 0, "cluster.cpus_per_trainer must be > 0"),
            (self.lead_fanout >= 1, f"cluster.lead_fanout must be >= 1, got {self.lead_fanout}"),
            (self.dense_reduction in ("coordinator", "trainers"),
             f"cluster.dense_reduction must be \"coordinator\" or \"trainers\", got {self.dense_reduction!r}"),
            (self.dense_reduction != "trainers" or (self.trainer_actors and self.num_trainers > 1),
             "cluster.dense_reduction = \"trainers\" reduces among trainer actors: it needs cluster.num_trainers > 1 "
             "with the trainers on Ray (cluster.backend = \"ray\", cluster.trainer_placement \"actors\" or \"auto\")"),
            (self.data_plane in DATA_PLANES, f"cluster.data_plane must be one of {DATA_PLANES}, got {self.data_plane!r}"),
            (self.compiled_wait in COMPILED_WAITS,
             f"cluster.compiled_wait must be one of {COMPILED_WAITS}, got {self.compiled_wait!r}"),
            (0 < self.inline_bytes <= MAX_INLINE_BYTES,
             f"cluster.inline_bytes must be in (0, {MAX_INLINE_BYTES}], got {self.inline_bytes}"),
            (self.placement_strategy in PLACEMENT_STRATEGIES,
             f"cluster.placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}"),
        ])


SECTIONS = ("data", "model", "train", "privacy", "cluster")
#: The sections a [by_epsilon] row may set: what a tuning at one target ε chooses (learning
#: rates, schedules, the selection and its budget split, the model's size). Not the data, the
#: cluster, nor privacy.target_epsilon / delta / accountant (the row is picked by them).
BY_EPSILON_SECTIONS = ("model", "train", "privacy")
BY_EPSILON_FIXED = ("privacy.target_epsilon", "privacy.delta", "privacy.accountant", "train.mode")


@dataclasses.dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    run_dir: str = ""
    # [by_epsilon."ε"] rows: values tuned at that target ε ({"1": {"train": {"lr": 3.0}}, ...}).
    # The row picked for privacy.target_epsilon (`by_epsilon_row`) is already applied to the
    # sections above; kept so config.json says what was tuned where.
    by_epsilon: dict = dataclasses.field(default_factory=dict)
    # The key of the row applied (None: no table, or a non-private run).
    tuned_for_epsilon: Optional[float] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        for section in SECTIONS:
            _check_auto_fields(section, getattr(self, section))
            getattr(self, section).validate()
        t, p = self.train, self.privacy
        if t.modelmix:
            _require([
                (t.mode == "dpsgd", f'train.modelmix needs train.mode = "dpsgd" (got {t.mode!r}): the amplification '
                                    "holds only if every noised coordinate is mixed, and sparse mode's selected rows "
                                    "are not (docs/DESIGN.md §6)"),
                (t.optimizer == "sgd", f'train.modelmix needs train.optimizer = "sgd" (got {t.optimizer!r}): its '
                                       "analysis covers θ_t = mix − lr·(clipped sum + noise), not a rescaled step"),
                (p.accountant in ("rdp", "auto"), f'train.modelmix needs privacy.accountant = "rdp" or "auto" (got '
                                                  f'{p.accountant!r}): only RDP accounts ModelMix steps'),
                (p.mix_width > 0, "train.modelmix needs privacy.mix_width > 0 (the enforced gap; 0 is no mixing)"),
                (t.ema_decay == 0, "train.modelmix with train.ema_decay > 0 is not supported"),
            ])
            _require([(p.mix_coordinates == 1 or p.second_clip_norm is None,
                       "privacy.mix_coordinates > 1 needs privacy.second_clip_norm = \"none\" (the second clip "
                       "breaks the per-coordinate bound)")])
        elif p.mix_width or p.mix_coordinates != 1:
            raise ConfigError("privacy.mix_width and privacy.mix_coordinates apply only with train.modelmix = true")
        if t.dpsgd_noise == "lazy":
            refusal = lazy_noise_refusal(self)
            if refusal is not None:
                raise ConfigError(f'train.dpsgd_noise = "lazy" {refusal}; use "auto" or "eager"')
        return self


def lazy_noise_refusal(cfg: "Config") -> Optional[str]:
    """Why lazy DP-SGD noise would not be exact for `cfg` (None: it is). Exact: SGD on the
    tables, without an average of the iterates or ModelMix (trainer/engine/shard_update.py)."""
    t = cfg.train
    if t.mode != "dpsgd":
        return f'applies to train.mode = "dpsgd" only (got {t.mode!r}; sparse mode\'s dense tables are noised eagerly)'
    if t.optimizer != "sgd":
        return (f"is exact for train.optimizer = \"sgd\" only (got {t.optimizer!r}): Adagrad's and Adam's state "
                "depend on every step's noisy gradient of every row")
    if t.ema_decay > 0:
        return "is not exact with train.ema_decay > 0: the average reads every row's every intermediate value"
    if t.modelmix:
        return "is not exact with train.modelmix: every step mixes every row's two latest states"
    return None


def lazy_dpsgd_noise(cfg: "Config") -> bool:
    """Whether the run defers DP-SGD's noise (train.dpsgd_noise: "auto" = where exact)."""
    return cfg.train.dpsgd_noise != "eager" and lazy_noise_refusal(cfg) is None


def _check_auto_fields(section: str, values: Any) -> None:
    """"auto"/None fields hold their keyword or a positive number, also when set from Python."""
    for field in dataclasses.fields(values):
        meta, value = field.metadata, getattr(values, field.name)
        if (meta.get("auto") and is_auto(value)) or (meta.get("none") and value is None) \
                or (meta.get("keyword") and value == meta["keyword"]):
            continue
        if meta.get("auto") or meta.get("none") or meta.get("keyword"):
            _check_positive_or_keyword(f"{section}.{field.name}", meta, value)


def _check_positive_or_keyword(where: str, meta: Mapping[str, Any], value: Any) -> None:
    """The one rule (and message) of "auto"/"none" fields: a number there must be > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        keyword = f'"{meta["keyword"]}"' if meta.get("keyword") else '"auto"' if meta.get("auto") else '"none"'
        zero = " (0 does not mean automatic or off)" if value == 0 and not isinstance(value, bool) else ""
        raise ConfigError(f"{where} must be > 0 or {keyword}{zero}, got {value!r}")


def _plain(value: Any) -> bool:
    """A value config.json can hold as it is: a string, number, boolean, or a list of them."""
    if isinstance(value, list):
        return all(_plain(v) and not isinstance(v, list) for v in value)
    return isinstance(value, (str, int, float, bool))


def _coerce(where: str, field: dataclasses.Field, current: Any, value: Any) -> Any:
    meta = field.metadata
    kind = meta.get("kind") or type(current)
    if meta.get("auto") and isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if meta.get("none") and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
        return None
    if meta.get("keyword") and isinstance(value, str) and value.strip().lower() == meta["keyword"]:
        return meta["keyword"]
    if value is None:
        raise ConfigError(f"{where} must not be null")
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if kind in (int, float):
        out = _number(where, kind, value)
        if meta.get("auto") or meta.get("none") or meta.get("keyword"):
            _check_positive_or_keyword(where, meta, out)
        return out
    if kind is dict and meta.get("values") == "plain":
        if isinstance(value, str):  # --set model.kwargs='{"hidden": 32}'
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{where} must be a table (TOML) or a JSON object like {{\"hidden\": 32}}, "
                                  f"got {value!r}")
        if not isinstance(value, dict) or not all(isinstance(k, str) and _plain(v) for k, v in value.items()):
            raise ConfigError(f"{where} must be a table of names to strings, numbers, booleans or lists of them, "
                              f"got {value!r}")
        return copy.deepcopy(dict(value))
    if kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"{where} must be a table of names to strings, got {value!r}")
        return dict(value)
    if kind is list:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{where} must be a list like [64, 32], got {value!r}")
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return list(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _number(where: str, kind: type, value: Any) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}")


def _read_toml(path: Path, seen: tuple = ()) -> dict:
    """Read a config file; `base = "other.toml"` (relative to the file) is merged underneath."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: circular base = chain")
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_toml(path.parent / base, seen + (path.resolve(),))
    for key, value in raw.items():
        # A file's [by_epsilon] table replaces its base's whole: rows tuned on another data set
        # must not leak into this one's missing ε.
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "by_epsilon":
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        if section == "by_epsilon":
            raise ConfigError(f"--set {item}: [by_epsilon] rows are not set from the command line; set the key "
                              f"itself (e.g. --set train.lr=3), which wins over the row")
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"--set {item}: [{section}] is not a config section")
        target[key] = value
    return raw


def config_from_dict(raw: Mapping[str, Any], source: str, overrides: Sequence[str] = (),
                     apply_by_epsilon: bool = True) -> Config:
    """The one path from plain data to a Config: `raw` (a TOML file's tables, a config.json)
    with `--set` overrides applied on top, every key and type checked against the dataclasses.
    Errors name `source` (or `--set`) and the key. Does not run `validate()` (callers may still
    change fields, e.g. benchmarks); `train()` validates.

    A `by_epsilon` table (rows keyed by target ε, each `{section: {key: value}}`) is checked
    like the sections; with `apply_by_epsilon` the row for the resolved privacy.target_epsilon
    (`pick_epsilon_row`) is applied on top, except the keys given with `--set`, which win. A
    saved config (config.json) already holds the applied values and is read without it."""
    data = _apply_overrides(copy.deepcopy(dict(raw)), overrides)
    overridden = {o.split("=", 1)[0] for o in overrides}
    table = data.pop("by_epsilon", None)
    tuned_for = data.pop("tuned_for_epsilon", None)
    cfg = _sections_from_dict(data, source, overridden)
    if table is None:
        return cfg
    cfg.by_epsilon = _checked_by_epsilon(table, source)
    if not apply_by_epsilon:
        cfg.tuned_for_epsilon = None if tuned_for is None else _number(f"{source}: tuned_for_epsilon", float, tuned_for)
        return cfg
    if cfg.train.mode == "nonprivate" or not cfg.by_epsilon:
        return cfg
    key = pick_epsilon_row(cfg.by_epsilon, cfg.privacy.target_epsilon)
    row = {section: {k: v for k, v in values.items() if f"{section}.{k}" not in overridden}
           for section, values in cfg.by_epsilon[key].items()}
    _sections_into(cfg, row, f"{source}: by_epsilon.{key}", set())
    cfg.tuned_for_epsilon = float(key)
    return cfg


def pick_epsilon_row(table: Mapping[str, Any], target_epsilon: float) -> str:
    """The key of the row for `target_epsilon`: the largest ε ≤ the target (values tuned for at
    least as much noise as the run will have), else the smallest (the target is below every row).
    Public: a function of the config only."""
    keys = sorted(table, key=float)
    at_or_below = [k for k in keys if float(k) <= target_epsilon * (1 + 1e-12)]
    return at_or_below[-1] if at_or_below else keys[0]


def _checked_by_epsilon(table: Any, source: str) -> dict:
    """[by_epsilon] as {"ε": {section: {key: value}}}, each row's keys and types checked (on a
    throw-away Config) and refused where a row may not set them (`BY_EPSILON_FIXED`)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: by_epsilon must be a table of rows keyed by target ε, e.g. [by_epsilon.1]")
    out: dict = {}
    for key, row in table.items():
        where = f"{source}: by_epsilon.{key}"
        try:
            eps = float(key)
        except (TypeError, ValueError):
            eps = float("nan")
        if not (eps > 0 and eps < float("inf")):
            raise ConfigError(f"{where}: a row's key is a target ε > 0 (e.g. [by_epsilon.1] or [by_epsilon.\"0.5\"]), "
                              f"got {key!r}")
        if not isinstance(row, dict):
            raise ConfigError(f"{where} must be a table of section.key = value")
        for section, values in row.items():
            if section not in BY_EPSILON_SECTIONS or not isinstance(values, dict):
                raise ConfigError(f"{where}: a row may set keys of {BY_EPSILON_SECTIONS} (e.g. train.lr = 3), "
                                  f"got {section!r}")
            for name in values:
                if f"{section}.{name}" in BY_EPSILON_FIXED:
                    raise ConfigError(f"{where}: {section}.{name} cannot be set per ε (it picks the row or is the "
                                      "run's kind)")
        _sections_into(Config(), copy.deepcopy(row), where, set())  # keys and types, as in the sections
        out[str(key)] = copy.deepcopy(row)
    return out


def _sections_from_dict(data: Mapping[str, Any], source: str, overridden: set) -> Config:
    cfg = Config()
    _sections_into(cfg, data, source, overridden)
    return cfg


def _sections_into(cfg: Config, data: Mapping[str, Any], source: str, overridden: set) -> None:
    for section, values in data.items():
        if section == "run_dir":
            cfg.run_dir = "" if values is None else str(values)
            continue
        if section not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"{source}: unknown config section [{section}]")
        target = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            origin = "--set" if f"{section}.{key}" in overridden else source
            head, _, item = key.partition(".")
            if item and head in fields and isinstance(getattr(target, head), dict):  # --set privacy.tables.C1=dense
                current = dict(getattr(target, head))
                current[item] = value
                setattr(target, head, _coerce(f"{origin}: {section}.{head}", fields[head], current, current))
                continue
            if key not in fields:
                raise ConfigError(f"{origin}: unknown key {section}.{key}")
            setattr(target, key, _coerce(f"{origin}: {section}.{key}", fields[key], getattr(target, key), value))


def load_config(path: Optional[str] = None, overrides: Optional[Sequence[str]] = None) -> Config:
    """A TOML file (or only defaults) with `--set` overrides (`config_from_dict`)."""
    raw: dict = _read_toml(Path(path)) if path else {}
    return config_from_dict(raw, path or "--set", overrides or ())


def saved_config(raw: Any, source: str, overrides: Sequence[str] = ()) -> Config:
    """A config a run saved (config.json, a checkpoint's "config") through `config_from_dict`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object of config sections")
    return config_from_dict(raw, source, overrides, apply_by_epsilon=False)


def load_saved_config(path: Path, overrides: Sequence[str] = ()) -> Config:
    """A run's config.json (written by `train`) with `--set` overrides (`saved_config`)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})")
    return saved_config(raw, str(path), overrides)
