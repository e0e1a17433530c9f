"""The built-in models' dense parts and their registry (config name -> class), with the metrics
they report (AUC, calibration).

May import: widedp.trainer.names, torch, numpy.
Not: any other part of the trainer (a model is what the engine trains, it knows no engine)."""

from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.cbow import CBOW
from widedp.trainer.models.dlrm import DLRM

MODELS: dict[str, type[DenseModel]] = {"cbow": CBOW, "dlrm": DLRM}

__all__ = ["MODELS", "DenseModel", "CBOW", "DLRM"]
