"""The built-in models' dense parts and their registry (config name -> class), with the metrics
they report (AUC, calibration).

May import: widedp.trainer.names, torch, numpy.
Not: any other part of the trainer (a model is what the engine trains, it knows no engine)."""

import importlib
from typing import Any, Mapping, Optional, Sequence

from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.cbow import CBOW
from widedp.trainer.models.dlrm import DLRM
from widedp.trainer.names import is_import_path

MODELS: dict[str, type[DenseModel]] = {"cbow": CBOW, "dlrm": DLRM}


def model_class(name: str) -> type[DenseModel]:
    """The class `model.name` names: a registered built-in ("dlrm", "cbow") or a user's
    `DenseModel` subclass by import path ("package.module:Class", imported here).

    Raises ValueError naming `model.name` when the module cannot be imported, has no such
    attribute, or it is not a DenseModel subclass."""
    if name in MODELS:
        return MODELS[name]
    if not is_import_path(name):
        raise ValueError(f"model.name must be one of {sorted(MODELS)} or an import path 'package.module:Class', "
                         f"got {name!r}")
    module_name, _, attribute = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model.name = {name!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") \
            from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model.name = {name!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, DenseModel)):
        raise ValueError(f"model.name = {name!r} is {obj!r}, not a subclass of widedp.trainer.models.DenseModel "
                         "(forward(pooled [B, F, D], dense [B, num_dense]), loss(outputs, labels) -> [B], metrics)")
    return obj


def build_model(name: str, *, features: Sequence[str], embedding_dim: int, num_dense: int,
                bottom_mlp: Sequence[int] = (), top_mlp: Sequence[int] = (), interaction: str = "dot",
                kwargs: Optional[Mapping[str, Any]] = None) -> DenseModel:
    """The dense model of a config's `[model]` section. A built-in takes the section's keys; a
    model by import path is called as `Class(features=..., embedding_dim=..., num_dense=...,
    **model.kwargs)`."""
    cls = model_class(name)
    if name in MODELS:
        return cls(features=list(features), embedding_dim=embedding_dim, num_dense=num_dense,
                   bottom_mlp=list(bottom_mlp), top_mlp=list(top_mlp), interaction=interaction)
    try:
        return cls(features=list(features), embedding_dim=embedding_dim, num_dense=num_dense, **dict(kwargs or {}))
    except TypeError as exc:
        raise ValueError(f"model.name = {name!r}: {cls.__name__}(features=..., embedding_dim=..., num_dense=..., "
                         f"**model.kwargs = {dict(kwargs or {})}) failed: {exc}") from exc


__all__ = ["MODELS", "DenseModel", "CBOW", "DLRM", "build_model", "model_class"]
