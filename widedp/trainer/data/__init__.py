"""widedp data layer: the on-disk format (`format/`: validation, random-access splits, partitioned
data sets), Poisson sampling (`sampler`), a partitioned training set as trainers read it
(`partitioned_training`), converters (`convert/`: Criteo TSV, tables by a schema, plain text) and
synthetic generators with planted ground truth (`synthetic/`); `widedp convert` and `widedp synth`
are trainer/cli/data.py.

May import: the pure libraries (widedp.accounting, widedp.selection), pyarrow, numpy, torch,
torchrec. Not: anything of the trainer outside data/ (the data layer knows no engine, run or
cluster: tests/test_package_boundaries.py).

Public names are imported lazily (PEP 562) so that ``import trainer.cli.data`` — done
by every ``widedp convert`` / ``synth`` invocation — loads neither torch nor pyarrow. See ``trainer.data.format.meta``
for the on-disk format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from widedp.trainer.data.errors import DataError

_EXPORTS = {
    "DatasetMeta": "format.meta",
    "read_meta": "format.meta",
    "Batch": "format.dataset",
    "ParquetDataset": "format.dataset",
    "open_dataset": "format.dataset",
    "PoissonSampler": "sampler",
    "UnitPoissonSampler": "sampler",
    "unit_indices": "sampler",
    "convert_criteo": "convert.criteo",
    "convert_text": "convert.text",
    "synth_ctr": "synthetic.synth",
    "synth_text": "synthetic.synth",
    "ctr_planted_logits": "synthetic.synth",
    "ctr_planted_probabilities": "synthetic.synth",
    "ctr_planted_theta": "synthetic.synth",
    "ctr_rank_to_id": "synthetic.synth",
    "ctr_id_probabilities": "synthetic.synth",
    "text_planted_topics": "synthetic.synth",
    "text_unigram": "synthetic.synth",
    "expected_auc": "_util",
    "auc": "_util",
    "validate": "format.store",
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
    from widedp.trainer.data._util import auc, expected_auc
    from widedp.trainer.data.convert.criteo import convert_criteo
    from widedp.trainer.data.format.dataset import Batch, ParquetDataset, open_dataset
    from widedp.trainer.data.format.meta import DatasetMeta, read_meta
    from widedp.trainer.data.sampler import PoissonSampler, UnitPoissonSampler, unit_indices
    from widedp.trainer.data.format.store import validate
    from widedp.trainer.data.synthetic.synth import (ctr_id_probabilities, ctr_planted_logits, ctr_planted_probabilities,
                        ctr_planted_theta, ctr_rank_to_id, synth_ctr, synth_text,
                        text_planted_topics, text_unigram)
    from widedp.trainer.data.convert.text import convert_text
