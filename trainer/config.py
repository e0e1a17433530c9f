"""Training configuration: a TOML file, overridable with `--set section.key=value`.

Unknown sections/keys and wrong types are errors naming the key (a typo must not silently
train with a default).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, Optional

from selection.registry import is_selector, selector_names

MODES = ("nonprivate", "dpsgd", "sparse")
# train.selection: any registered selector (selection.registry); DP-SGD is train.mode = "dpsgd".


@dataclasses.dataclass
class DataConfig:
    path: str = ""  # dataset directory (dataset.json + data.parquet)
    synth: str = ""  # "ctr" | "text": generate the dataset at `path` if it does not exist
    synth_examples: int = 20_000
    synth_table_size: int = 10_000
    synth_vocab: int = 1_000
    test_fraction: float = 0.1
    seed: int = 0


@dataclasses.dataclass
class ModelConfig:
    name: str = "dlrm"  # "dlrm" | "cbow"
    embedding_dim: int = 16
    bottom_mlp: list = dataclasses.field(default_factory=lambda: [64])
    top_mlp: list = dataclasses.field(default_factory=lambda: [64])
    init_std: float = 0.05
    interaction: str = "dot"  # dlrm: "dot" (pairwise dots) | "cat" (embeddings concatenated into the top MLP)


@dataclasses.dataclass
class TrainConfig:
    mode: str = "sparse"
    selection: str = "em"
    batch_size: int = 256  # expected batch size b (Poisson rate q = b / n)
    steps: int = 200
    optimizer: str = "adam"  # embeddings: sgd | adagrad | adam ; dense: the same family
    lr: float = 0.01
    dense_lr: float = 0.001
    seed: int = 0  # initialization only (public); sampling and noise are secret (privacy.reproducible)
    log_every: int = 10
    eval_every: int = 0  # > 0: log test-split metrics every N steps (held-out data, no privacy cost)
    # true: metrics.jsonl / summary.json / progress also carry raw training statistics (batch loss,
    # realized batch sizes, touched rows, bytes). Outside the guarantee: the privacy report says so.
    debug_metrics: bool = False
    eval_batch_size: int = 4096
    checkpoint_every: int = 100


@dataclasses.dataclass
class PrivacyConfig:
    target_epsilon: float = 3.0
    delta: float = 0.0  # 0 = min(1/(10n), n^-1.1): clearly below 1/n (docs/THREAT_MODEL.md)
    noise_multiplier: float = 0.0  # > 0: use this σ (ε reported, training stops at target_epsilon)
    accountant: str = "rdp"
    clip_norm: float = 1.0  # S1
    second_clip_norm: float = 0.0  # S2 (0 = no second clip)
    selection_fraction: float = 0.2
    k: int = 0  # rows selected per step (em, noisy-max, random, fest); 0 = from gamma
    gamma: float = 0.01  # k = floor(gamma * vocabulary) when k = 0
    score_clip: float = 0.1  # S0: EM/SVT/noisy-max utility is min(‖G_r‖, S0)
    selection_epsilon: float = 0.0  # explicit per-draw ε (em, noisy-max) / Alg 1 ε (svt)
    selection_sigma: float = 0.0  # explicit σ of threshold counts
    threshold: float = 0.0  # τ for threshold selection (counts), α for svt (scores); 0 = auto (about k noise-only rows pass)
    contribution_clip: float = 1.0  # C1 for threshold counts
    fest_noise_multiplier: float = 5.0
    fest_max_rows_per_example: int = 32
    secure_mode: bool = False  # 4-draw Gaussian (floating-point attack resistant); needs secret randomness
    # Sampling, selection and noise come from fresh OS entropy unless reproducible = true, which
    # derives them from noise_seed: for tests/debugging only, ε then holds only while the seed is secret.
    reproducible: bool = False
    noise_seed: int = 0


@dataclasses.dataclass
class ClusterConfig:
    backend: str = "ray"  # "ray" | "local" (in-process shards)
    num_shards: int = 2
    cpus_per_shard: float = 1.0
    gpus_per_shard: float = 0.0
    address: str = ""  # Ray address; empty: RAY_ADDRESS (set under `ray job submit`) or embedded local Ray
    placement_strategy: str = "SPREAD"  # Ray placement group strategy for the shard actors


@dataclasses.dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    run_dir: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        t, p, c = self.train, self.privacy, self.cluster
        checks = [
            (t.mode in MODES, f"train.mode must be one of {MODES}, got {t.mode!r}"),
            (is_selector(t.selection), f"train.selection must be one of {selector_names()}, got {t.selection!r}"),
            (t.batch_size >= 1, "train.batch_size must be >= 1"),
            (t.steps >= 1, "train.steps must be >= 1"),
            (t.optimizer in ("sgd", "adagrad", "adam"), f"train.optimizer must be sgd, adagrad or adam, got {t.optimizer!r}"),
            (t.lr > 0 and t.dense_lr > 0, "train.lr and train.dense_lr must be > 0"),
            (p.target_epsilon > 0, "privacy.target_epsilon must be > 0"),
            (0 <= p.delta < 1, "privacy.delta must be in [0, 1) (0 means min(1/(10n), n^-1.1))"),
            (p.noise_seed >= 0, "privacy.noise_seed must be >= 0"),
            (not (p.secure_mode and p.reproducible),
             "privacy.secure_mode and privacy.reproducible exclude each other (secure mode needs secret randomness)"),
            (t.eval_every >= 0, "train.eval_every must be >= 0"),
            (p.noise_multiplier >= 0, "privacy.noise_multiplier must be >= 0"),
            (p.clip_norm > 0, "privacy.clip_norm must be > 0"),
            (p.second_clip_norm >= 0, "privacy.second_clip_norm must be >= 0"),
            (0 < p.selection_fraction < 1, "privacy.selection_fraction must be in (0, 1)"),
            (p.accountant in ("rdp", "pld", "prv", "paper"), f"privacy.accountant unknown: {p.accountant!r}"),
            (c.backend in ("ray", "local"), f"cluster.backend must be 'ray' or 'local', got {c.backend!r}"),
            (c.num_shards >= 1, "cluster.num_shards must be >= 1"),
            (c.placement_strategy in ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"),
             f"cluster.placement_strategy must be SPREAD, STRICT_SPREAD, PACK or STRICT_PACK, got {c.placement_strategy!r}"),
            (self.model.name in ("dlrm", "cbow"), f"model.name must be dlrm or cbow, got {self.model.name!r}"),
            (self.model.interaction in ("dot", "cat"), f"model.interaction must be dot or cat, got {self.model.interaction!r}"),
            (bool(self.data.path), "data.path is required"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


def _coerce(section: str, key: str, current: Any, value: Any) -> Any:
    where = f"{section}.{key}"
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if isinstance(current, int) and not isinstance(current, bool):
        try:
            return int(value) if not isinstance(value, float) or value.is_integer() else _raise()
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be an integer, got {value!r}")
    if isinstance(current, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be a number, got {value!r}")
    if isinstance(current, list):
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return value
    return str(value)


def _raise():
    raise ValueError


def _read_toml(path: Path, seen: tuple = ()) -> dict:
    """Read a config file; `base = "other.toml"` (relative to the file) is merged underneath."""
    if path.resolve() in seen:
        raise ValueError(f"{path}: circular base = chain")
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist")
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML ({exc})")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_toml(path.parent / base, seen + (path.resolve(),))
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    cfg = Config()
    raw: dict = _read_toml(Path(path)) if path else {}
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    for section, values in raw.items():
        if section == "run_dir":
            cfg.run_dir = str(values)
            continue
        if not hasattr(cfg, section) or not isinstance(values, dict):
            raise ValueError(f"{path or '--set'}: unknown config section [{section}]")
        target = getattr(cfg, section)
        for key, value in values.items():
            if not hasattr(target, key):
                raise ValueError(f"{path or '--set'}: unknown key {section}.{key}")
            setattr(target, key, _coerce(section, key, getattr(target, key), value))
    return cfg
