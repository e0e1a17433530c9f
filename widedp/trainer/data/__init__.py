"""widedp data layer: on-disk format, validation, random-access splits, Poisson sampling,
converters (Criteo TSV, plain text) and synthetic generators with planted ground truth.

Public names are imported lazily (PEP 562) so that ``import trainer.data.commands`` — done
by every ``widedp`` invocation — loads neither torch nor pyarrow. See ``trainer.data.meta``
for the on-disk format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import DataError

_EXPORTS = {
    "DatasetMeta": "meta",
    "read_meta": "meta",
    "Batch": "dataset",
    "ParquetDataset": "dataset",
    "open_dataset": "dataset",
    "PoissonSampler": "sampler",
    "UnitPoissonSampler": "sampler",
    "unit_indices": "sampler",
    "convert_criteo": "criteo",
    "convert_text": "text",
    "synth_ctr": "synth",
    "synth_text": "synth",
    "ctr_planted_logits": "synth",
    "ctr_planted_probabilities": "synth",
    "ctr_planted_theta": "synth",
    "ctr_rank_to_id": "synth",
    "ctr_id_probabilities": "synth",
    "text_planted_topics": "synth",
    "text_unigram": "synth",
    "expected_auc": "_util",
    "auc": "_util",
    "validate": "store",
}

__all__ = ["DataError", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from ._util import auc, expected_auc
    from .criteo import convert_criteo
    from .dataset import Batch, ParquetDataset, open_dataset
    from .meta import DatasetMeta, read_meta
    from .sampler import PoissonSampler, UnitPoissonSampler, unit_indices
    from .store import validate
    from .synth import (ctr_id_probabilities, ctr_planted_logits, ctr_planted_probabilities,
                        ctr_planted_theta, ctr_rank_to_id, synth_ctr, synth_text,
                        text_planted_topics, text_unigram)
    from .text import convert_text
