"""Load a model exported by `widedp export` with plain PyTorch (widedp is not needed).

Usage::

    import sys; sys.path.insert(0, "EXPORT_DIR")
    from load_model import load
    model = load("EXPORT_DIR")             # an nn.Module, in eval mode, on the CPU
    with torch.no_grad():
        out = model(features, dense)

or, from a shell, ``python EXPORT_DIR/load_model.py EXPORT_DIR`` prints the architecture.

Files it reads (all in EXPORT_DIR): ``model.json`` (architecture), ``weights.safetensors`` or
``weights.pt`` (a plain ``dict[str, Tensor]``: ``embeddings.<table>`` is a whole table
[num_rows, dim] in row order, ``dense.<name>`` a dense-part parameter) and ``dense.pt2`` (the
dense part as a ``torch.export`` program; its parameters are overwritten from the weights file).

Inputs of ``model(features, dense)``:

* ``features``: ``dict`` feature name -> ``(values, offsets)``, one entry for **every** feature
  listed in ``model.json`` (``model.features``). ``values``: 1-D integer tensor of row ids into
  that feature's table (``0 <= id < num_rows``), the bags of all B examples concatenated.
  ``offsets``: 1-D integer tensor, the start of each example's bag in ``values`` — exactly
  ``torch.nn.EmbeddingBag``'s convention (B entries, first 0); B + 1 entries with the total
  ``len(values)`` last are accepted too. A bag may be empty (its pooled vector is zero). Each
  bag is pooled with the feature's pooling (``sum`` or ``mean``); features may share a table.
* ``dense``: float tensor [B, num_dense] (CTR models: the 13 dense features, preprocessed as
  in the training data set); [B, 0] or ``None`` for models with ``num_dense == 0`` (CBOW; with
  ``None`` the offsets must have B entries).

Output (``model.json``'s ``output`` says which):

* ``dlrm``: click logits [B] (probability = ``torch.sigmoid(logits)``).
* ``cbow``: scores [B, 1 + K]: column 0 is ``h · o_target``, column i >= 1 is
  ``h · o_neg_{i-1}``, with ``h`` the mean of the context words' rows of table ``input`` and
  ``o`` rows of table ``output``; the training loss per example is
  ``-logsigmoid(s[:, 0]) - logsigmoid(-s[:, 1:]).sum(1)``. Word vectors: ``model.table("input").weight``.

``model.pooled(features, batch_size)`` gives the pooled embeddings [B, F, D] the dense part
consumes (features in ``model.json`` order).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

FORMAT_VERSION = 1


class ExportedModel(nn.Module):
    """Embedding tables (one ``nn.EmbeddingBag`` per table) + the exported dense part."""

    def __init__(self, spec: dict, dense_module: nn.Module):
        super().__init__()
        self.spec = spec
        self.table_names = [t["name"] for t in spec["tables"]]
        index = {name: i for i, name in enumerate(self.table_names)}
        self.features = [(f["name"], index[f["table"]], f["pooling"]) for f in spec["features"]]
        self.num_dense = int(spec["num_dense"])
        bags = []
        for i, t in enumerate(spec["tables"]):
            modes = {pool for _, ti, pool in self.features if ti == i}
            mode = modes.pop() if len(modes) == 1 else "sum"  # per-feature pooling is applied in pooled()
            bags.append(nn.EmbeddingBag(int(t["num_rows"]), int(t["dim"]), mode=mode))
        self.embeddings = nn.ModuleList(bags)
        self.dense = dense_module

    def table(self, name: str) -> nn.EmbeddingBag:
        return cast(nn.EmbeddingBag, self.embeddings[self.table_names.index(name)])

    def train(self, mode: bool = True):
        # A torch.export module refuses train()/eval(); the model has no train-time behaviour
        # (no dropout or batch norm), so only the embedding modules' flags are set.
        self.training = mode
        for bag in self.embeddings:
            bag.train(mode)
        return self

    def pooled(self, features: dict, batch_size: int) -> torch.Tensor:
        missing = [name for name, _, _ in self.features if name not in features]
        if missing:
            raise ValueError(f"features missing: {missing} (the model needs {[n for n, _, _ in self.features]})")
        unknown = sorted(set(features) - {name for name, _, _ in self.features})
        if unknown:
            raise ValueError(f"unknown features: {unknown}")
        out = []
        for name, ti, pooling in self.features:
            values, offsets = features[name]
            values = torch.as_tensor(values).reshape(-1).long()
            offsets = torch.as_tensor(offsets).reshape(-1).long()
            bag = cast(nn.EmbeddingBag, self.embeddings[ti])
            if offsets.numel() == batch_size + 1:
                last = True
                if int(offsets[-1]) != values.numel():
                    raise ValueError(f"feature {name!r}: the last of B + 1 offsets must be len(values)")
            elif offsets.numel() == batch_size:
                last = False
            else:
                raise ValueError(f"feature {name!r}: {offsets.numel()} offsets for a batch of {batch_size}")
            if values.numel():
                lo, hi = int(values.min()), int(values.max())
                if lo < 0 or hi >= bag.num_embeddings:
                    bad = lo if lo < 0 else hi
                    raise ValueError(f"feature {name!r}: id {bad} outside table {self.table_names[ti]!r} "
                                     f"of {bag.num_embeddings} rows")
            if batch_size == 0:
                out.append(bag.weight.new_zeros((0, bag.embedding_dim)))
                continue
            out.append(F.embedding_bag(values, bag.weight, offsets, mode=pooling, include_last_offset=last))
        return torch.stack(out, dim=1)

    def forward(self, features: dict, dense=None) -> torch.Tensor:
        if dense is None:
            if self.num_dense:
                raise ValueError(f"dense features [B, {self.num_dense}] are required")
            first = self.features[0][0]
            batch_size = torch.as_tensor(features[first][1]).numel() if first in features else 0
            dense = torch.zeros((batch_size, 0))
        dense = torch.as_tensor(dense, dtype=torch.float32)
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be [B, {self.num_dense}], got {tuple(dense.shape)}")
        return self.dense(self.pooled(features, dense.shape[0]), dense)


def _read_weights(out_dir: Path, spec: dict) -> dict:
    name = spec["weights"]["file"]
    path = out_dir / name
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_dense(out_dir: Path, spec: dict, weights: dict) -> nn.Module:
    dense_spec = spec["dense"]
    if dense_spec["format"] != "torch.export":
        raise ValueError(f"unknown dense format {dense_spec['format']!r}")
    module = torch.export.load(str(out_dir / dense_spec["file"])).module()
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    for key, value in weights.items():
        if not key.startswith("dense."):
            continue
        name = key[len("dense."):]
        if name not in tensors:
            raise ValueError(f"{spec['weights']['file']}: {key} is not a parameter of the dense part")
        if tuple(tensors[name].shape) != tuple(value.shape):
            raise ValueError(f"{key}: shape {tuple(value.shape)}, the dense part has {tuple(tensors[name].shape)}")
        with torch.no_grad():
            tensors[name].copy_(value)
    return module


def load(out_dir) -> ExportedModel:
    """The exported model (CPU, eval mode). See the module docstring for inputs and outputs."""
    out_dir = Path(out_dir)
    spec = json.loads((out_dir / "model.json").read_text())
    if spec.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{out_dir / 'model.json'}: unsupported format_version {spec.get('format_version')!r}")
    weights = _read_weights(out_dir, spec)
    model = ExportedModel(spec, _load_dense(out_dir, spec, weights))
    with torch.no_grad():
        for i, t in enumerate(spec["tables"]):
            w = weights[f"embeddings.{t['name']}"]
            if tuple(w.shape) != (int(t["num_rows"]), int(t["dim"])):
                raise ValueError(f"embeddings.{t['name']}: shape {tuple(w.shape)}, model.json says "
                                 f"[{t['num_rows']}, {t['dim']}]")
            cast(nn.EmbeddingBag, model.embeddings[i]).weight.copy_(w)
    return model.eval()


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent
    m = load(target)
    print(json.dumps({"model": m.spec["model"], "output": m.spec["output"],
                      "tables": m.spec["tables"], "features": m.spec["features"],
                      "num_dense": m.num_dense}, indent=1))
