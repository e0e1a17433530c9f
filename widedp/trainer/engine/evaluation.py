"""What a trained engine's model scores: metrics and outputs on a split with the released
parameters — the averaged tables and dense parameters with train.ema_decay > 0, else the last
iterate (the coordinator's own lookups; the training lookups are the trainers')."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from widedp.trainer.engine.trainer_role import pooled_lookup


def lookup(engine, batch, B: int, example_ids=None, averaged: bool = False) -> np.ndarray:
    """Pooled embeddings [B, F, D] of `batch` from the engine's shards."""
    return pooled_lookup(engine.layout, engine.shards, batch, B, example_ids, averaged)[0]


@torch.no_grad()
def evaluate(engine, dataset, batch_size: int, averaged: Optional[bool] = None) -> dict:
    """The model's metrics on `dataset`: with `averaged` (default: when ema_decay > 0) the
    averaged tables and dense parameters, else the last iterate."""
    out = outputs(engine, dataset, batch_size, averaged)
    return {} if out is None else engine.model.metrics(*out)


@torch.no_grad()
def outputs(engine, dataset, batch_size: int, averaged: Optional[bool] = None
            ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(model outputs, labels) over `dataset` with the released parameters (see `evaluate`);
    None for an empty dataset."""
    averaged = engine.dense.ema is not None if averaged is None else averaged
    engine.store_pending_noise()  # lazy DP-SGD noise: the rows read as released, consistently with later reads
    dense_params = engine.dense.released_params(averaged)
    outs, labels = [], []
    for batch in dataset.iter_batches(batch_size):
        pooled = torch.from_numpy(lookup(engine, batch, batch.size, averaged=averaged))
        outs.append(torch.func.functional_call(engine.model, dense_params, (pooled, batch.dense)))
        labels.append(batch.labels)
    if not outs:
        return None
    return torch.cat(outs), torch.cat(labels)
