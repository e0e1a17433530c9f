"""Model registry: config name -> dense-part class."""

from widedp.trainer.models.base import DenseModel
from widedp.trainer.models.cbow import CBOW
from widedp.trainer.models.dlrm import DLRM

MODELS: dict[str, type[DenseModel]] = {"cbow": CBOW, "dlrm": DLRM}

__all__ = ["MODELS", "DenseModel", "CBOW", "DLRM"]
