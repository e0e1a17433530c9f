"""Registry of the synthetic data sets `data.synth` can name (generated at `data.path` when it
holds no dataset.json).

Each entry says how to generate the set from the config's `[data]` section and which config
values a cached copy must match (else a changed `synth_*` key would silently train on the old
data). `register_synthetic` refuses a name that is taken. Generators import lazily: naming a
set loads neither numpy-heavy code nor pyarrow until a set is generated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

# (config) -> {key: value} of what the data set depends on; (dataset.json dict) -> the same keys.
Fingerprint = Callable[[Any], dict]
Recorded = Callable[[dict], dict]


@dataclasses.dataclass(frozen=True)
class SyntheticDataset:
    name: str
    generate: Callable[[Path, Any], Any]  # (path, DataConfig) -> DatasetMeta
    wanted: Fingerprint  # DataConfig -> values the set depends on
    recorded: Recorded  # dataset.json -> the same keys as recorded there


SYNTHETIC_DATASETS: dict[str, SyntheticDataset] = {}


def register_synthetic(entry: SyntheticDataset) -> SyntheticDataset:
    if entry.name in SYNTHETIC_DATASETS and SYNTHETIC_DATASETS[entry.name] is not entry:
        raise ValueError(f"synthetic data set {entry.name!r} is already registered; refusing to overwrite it")
    SYNTHETIC_DATASETS[entry.name] = entry
    return entry


def _ctr(path: Path, d) -> Any:
    from widedp.trainer.data.synthetic.synth import synth_ctr

    return synth_ctr(path, num_examples=d.synth_examples, table_sizes=d.synth_table_size, seed=d.seed)


def _text(path: Path, d) -> Any:
    from widedp.trainer.data.synthetic.synth import synth_text

    return synth_text(path, num_examples=d.synth_examples, vocab=d.synth_vocab, seed=d.seed)


def _one_table_size(raw: dict):
    sizes = set((raw.get("table_sizes") or {}).values())
    return sizes.pop() if len(sizes) == 1 else sorted(sizes)


register_synthetic(SyntheticDataset(
    "ctr", _ctr,
    wanted=lambda d: {"synth_examples": d.synth_examples, "seed": d.seed, "synth_table_size": d.synth_table_size},
    recorded=lambda raw: {"synth_examples": raw.get("num_examples"), "seed": raw.get("seed"),
                          "synth_table_size": _one_table_size(raw)}))
register_synthetic(SyntheticDataset(
    "text", _text,
    wanted=lambda d: {"synth_examples": d.synth_examples, "seed": d.seed, "synth_vocab": d.synth_vocab},
    recorded=lambda raw: {"synth_examples": raw.get("num_examples"), "seed": raw.get("seed"),
                          "synth_vocab": (raw.get("table_sizes") or {}).get("input")}))


def _criteo_like(path: Path, d) -> Any:
    from widedp.trainer.data.synthetic.realistic import synth_criteo_like

    return synth_criteo_like(path, num_examples=d.synth_examples, hash_size=d.synth_table_size, seed=d.seed)


def _heavytail(path: Path, d) -> Any:
    from widedp.trainer.data.synthetic.realistic import HEAVYTAIL_PARAMS, synth_criteo_like

    return synth_criteo_like(path, num_examples=d.synth_examples, hash_size=d.synth_table_size, seed=d.seed,
                             **HEAVYTAIL_PARAMS)


# Criteo Kaggle's 26 published cardinalities, per-feature Zipf popularity, hashed into tables of
# min(cardinality, data.synth_table_size) rows (trainer/data/synthetic/realistic.py).
register_synthetic(SyntheticDataset(
    "criteo", _criteo_like,
    wanted=lambda d: {"synth_examples": d.synth_examples, "seed": d.seed, "synth_table_size": d.synth_table_size},
    recorded=lambda raw: {"synth_examples": raw.get("num_examples"), "seed": raw.get("seed"),
                          "synth_table_size": raw.get("hash_size")}))
# The same pipeline with another shape (realistic.HEAVYTAIL_PARAMS): other cardinalities, flatter
# tails, a 17% positive rate; the second CTR set of the privacy-utility grid.
register_synthetic(SyntheticDataset(
    "heavytail", _heavytail,
    wanted=lambda d: {"synth_examples": d.synth_examples, "seed": d.seed, "synth_table_size": d.synth_table_size},
    recorded=lambda raw: {"synth_examples": raw.get("num_examples"), "seed": raw.get("seed"),
                          "synth_table_size": raw.get("hash_size")}))
