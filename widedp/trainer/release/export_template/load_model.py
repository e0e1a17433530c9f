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

Raw rows (exports of runs on a ``widedp convert table`` data set; ``model.json``'s ``raw_rows``
says whether this export has it, and why not): ``features.json`` carries the conversion's feature
pipeline — per dense column its fill and transforms (log1p, clip, standardize with the public or
DP-released mean/std), per categorical feature its column, hashing or vocabulary
(``vocabularies/*.txt``, copied from the conversion), list handling and ``max_length`` — and
this file re-implements it in plain Python/numpy, bit for bit::

    model.score_rows(rows)          # rows: list of dicts column -> value (lists for list
                                    # columns, or for a CSV schema the text its separator
                                    # splits), a pyarrow Table / RecordBatch or a pandas DataFrame
    model.featurize(rows)           # -> (features, dense): what the converter would have stored
    model.score_parquet(PATH)       # needs pyarrow
    model.score_csv(PATH)           # the schema's delimiter/header/columns; .gz read as gzip

or ``python load_model.py [EXPORT_DIR] --score-parquet FILE`` / ``--score-csv FILE`` (``--out
FILE``; default stdout): one CSV line per input row, in order (dlrm: ``logit,probability``).
Scores equal ``widedp evaluate``'s on the converted rows (same ids, same float32 dense values).
The label, unit and timestamp columns are not model inputs and are not read.

Ids (``features.json`` ``hash``): an integer value v (an integer, or text that is a canonical
decimal integer: ``-?(0|[1-9][0-9]{0,17})``) has key ``splitmix64(v mod 2**64)``; other text
has key ``hash_bytes(utf-8 of the text)`` (below: an unkeyed 64-bit hash whose only constant,
``seed``, is public); id = ``1 + key % (hash_size - 1)``; null or empty text -> 0. A
vocabulary maps value text (an integer by its decimal text) on line i to id i + 1, anything
else (or null) to 0. List values: null/empty items dropped, then the FIRST ``max_length``
kept, each mapped as above (unknown vocabulary items stay in the bag as id 0).
Dense values: null or empty text -> ``fill``; text parsed as a float (ASCII, no spaces); then
the transforms in float64, in order; then float32; a non-finite result is an error.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FORMAT_VERSION = 1
FEATURES_FORMAT_VERSION = 1


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

    # ---- raw rows (features.json) -------------------------------------------------------------
    pipeline: Optional["FeaturePipeline"] = None

    def _require_pipeline(self) -> "FeaturePipeline":
        if self.pipeline is None:
            raw = self.spec.get("raw_rows") or {}
            raise ValueError("this export cannot score raw rows: "
                             + str(raw.get("reason", "model.json has no raw_rows section (an older export)")))
        return self.pipeline

    def featurize(self, rows) -> tuple[dict, torch.Tensor]:
        """(features, dense) of raw rows, as the data set's converter would have stored them:
        features name -> (ids int64, offsets int64 [B + 1]), dense float32 [B, num_dense]."""
        return self._require_pipeline().featurize(rows)

    def score_rows(self, rows, batch_size: int = 65536) -> torch.Tensor:
        """The model's outputs on raw rows (see the module docstring), in order."""
        pipeline = self._require_pipeline()
        rows = as_rows(rows)
        outs = []
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                outs.append(self(*pipeline.featurize(rows[start:start + batch_size])))
            if not outs:
                outs.append(self(*pipeline.featurize([])))
        return torch.cat(outs)

    def score_parquet(self, path, batch_size: int = 65536) -> torch.Tensor:
        """Outputs on every row of a Parquet file (needs pyarrow), in file order."""
        pipeline = self._require_pipeline()
        with torch.no_grad():
            outs = [self(*pipeline.featurize(rows)) for rows in pipeline.read_parquet(path, batch_size)]
        return torch.cat(outs) if outs else self.score_rows([])

    def score_csv(self, path, batch_size: int = 65536) -> torch.Tensor:
        """Outputs on every row of a CSV file read with the schema's delimiter, header and
        columns (plain or .gz), in file order."""
        pipeline = self._require_pipeline()
        with torch.no_grad():
            outs = [self(*pipeline.featurize(rows)) for rows in pipeline.read_csv(path, batch_size)]
        return torch.cat(outs) if outs else self.score_rows([])


# ---- the feature pipeline of `widedp convert table` (features.json) ----------------------------
_MASK64 = (1 << 64) - 1
SPLITMIX64_ADD = 0x9E3779B97F4A7C15
SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
STRING_SEED = 0x6A09E667F3BCC909  # public constant (fractional bits of sqrt(2)): the hash is unkeyed
HASH_NAME = "widedp-stable-hash-v1"
CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]{0,17})")  # "007", "+7", " 7" are text, not 7


def splitmix64(x: int) -> int:
    """SplitMix64 finalizer of a uint64 (Python int in [0, 2**64))."""
    z = (x + SPLITMIX64_ADD) & _MASK64
    z = ((z ^ (z >> 30)) * SPLITMIX64_MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX64_MUL2) & _MASK64
    return z ^ (z >> 31)


def hash_bytes(data: bytes) -> int:
    """widedp's stable 64-bit hash of a byte string: h = splitmix64(len ^ seed), then for each
    8-byte little-endian word w (the last zero-padded) h = splitmix64(h ^ w)."""
    h = splitmix64(len(data) ^ STRING_SEED)
    for k in range(0, len(data), 8):
        h = splitmix64(h ^ int.from_bytes(data[k:k + 8].ljust(8, b"\0"), "little"))
    return h


def _integer(value) -> Optional[int]:
    """int of an integer value (Python or numpy), None for anything else (bools included)."""
    if isinstance(value, (bool, np.bool_, float, np.floating)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def value_key(value) -> Optional[int]:
    """The 64-bit key a hashed feature takes from one value; None when missing."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "":
            return None
        if CANONICAL_INT.fullmatch(value):
            return splitmix64(int(value) & _MASK64)
        return hash_bytes(value.encode("utf-8"))
    v = _integer(value)
    if v is None:
        raise TypeError(f"{value!r}: a categorical value must be an integer or text (or None)")
    if not -(1 << 63) <= v < (1 << 63):
        raise ValueError(f"{v}: outside int64")
    return splitmix64(v & _MASK64)


def read_vocabulary(path: Path) -> list:
    """A vocabulary file's values, parsed as the converter parses it (UTF-8, one per line,
    a final empty line and one trailing carriage return per line dropped)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def as_rows(rows) -> list:
    """A list of row dicts from a list of dicts, a pyarrow Table/RecordBatch or a pandas
    DataFrame (missing values -> None; list cells as lists)."""
    if hasattr(rows, "to_pylist"):  # pyarrow
        return rows.to_pylist()
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # pandas
        frame = rows.astype(object)
        return frame.where(frame.notna(), None).to_dict("records")
    if isinstance(rows, dict):
        raise TypeError("rows: a list of dicts (one per row), not a dict")
    return list(rows)


class FeaturePipeline:
    """features.json: raw rows -> (features, dense) exactly as `widedp convert table` made them."""

    def __init__(self, spec: dict, directory: Path, model_spec: dict):
        if spec.get("format_version") != FEATURES_FORMAT_VERSION:
            raise ValueError(f"features.json: unsupported format_version {spec.get('format_version')!r}")
        h = spec["hash"]
        mine = {"name": HASH_NAME, "splitmix64": [hex(SPLITMIX64_ADD), hex(SPLITMIX64_MUL1), hex(SPLITMIX64_MUL2)],
                "seed": hex(STRING_SEED)}
        theirs = {"name": h.get("name"), "splitmix64": [c.lower() for c in h.get("splitmix64", {}).get("constants", [])],
                  "seed": str(h.get("string", {}).get("seed", "")).lower()}
        if mine != theirs:
            raise ValueError(f"features.json: hash {theirs} is not the one this loader implements ({mine})")
        self.spec = spec
        self.input = spec["input"]
        self.dense = spec["dense"]
        self.categorical = spec["categorical"]
        tables = {t["name"]: int(t["num_rows"]) for t in model_spec["tables"]}
        features = [(f["name"], f["table"]) for f in model_spec["features"]]
        if [(c["name"], c["table"]) for c in self.categorical] != features:
            raise ValueError("features.json: its categorical features are not model.json's features")
        if len(self.dense) != int(model_spec["num_dense"]):
            raise ValueError("features.json: its dense columns are not model.json's num_dense")
        self.vocab: dict = {}
        for c in self.categorical:
            ids = c["ids"]
            if ids["kind"] == "hash":
                if int(ids["hash_size"]) != tables[c["table"]]:
                    raise ValueError(f"features.json: feature {c['name']!r}: hash_size is not its table's size")
            elif ids["kind"] == "vocabulary":
                if ids["file"] not in self.vocab:
                    values = read_vocabulary(directory / ids["file"])
                    if len(values) != int(ids["values"]) or len(values) + 1 != tables[c["table"]]:
                        raise ValueError(f"{ids['file']}: {len(values)} values, features.json says {ids['values']}")
                    self.vocab[ids["file"]] = {v: i + 1 for i, v in enumerate(values)}
            else:
                raise ValueError(f"features.json: feature {c['name']!r}: unknown id kind {ids['kind']!r}")
        self.columns = list(dict.fromkeys([d["column"] for d in self.dense] + [c["column"] for c in self.categorical]))

    # ---- one feature ----
    def _ids(self, values: list, c: dict) -> list:
        ids = c["ids"]
        if ids["kind"] == "hash":
            m = int(ids["hash_size"]) - 1
            keys = [value_key(v) for v in values]
            return [0 if k is None else 1 + k % m for k in keys]
        index = self.vocab[ids["file"]]
        out = []
        for v in values:
            if v is None or isinstance(v, str):
                out.append(0 if v is None else index.get(v, 0))
                continue
            i = _integer(v)
            if i is None:
                raise TypeError(f"{v!r}: a categorical value must be an integer or text (or None)")
            out.append(index.get(str(i), 0))
        return out

    def _bag(self, value, c: dict) -> list:
        if value is None:
            items: list = []
        elif isinstance(value, str):
            if self.input["format"] != "csv":
                raise TypeError(f"feature {c['name']!r}: a list column needs a list, got text {value!r}")
            items = value.split(c["separator"])
        elif isinstance(value, (bytes, dict)):
            raise TypeError(f"feature {c['name']!r}: a list column needs a list, got {type(value).__name__}")
        else:
            items = list(value)
        items = [v for v in items if v is not None and not (isinstance(v, str) and v == "")]
        if c["max_length"] is not None:
            items = items[:int(c["max_length"])]  # the first max_length values, as the converter keeps
        return items

    @staticmethod
    def _number(value, fill: float) -> float:
        if value is None:
            return fill
        if isinstance(value, str):
            if value == "":
                return fill
            try:
                if not value.isascii() or value != value.strip() or "_" in value:
                    raise ValueError
                x = float(value)
            except ValueError:
                raise ValueError(f"dense value {value!r} is not a number") from None
        else:
            x = float(value)
        if not math.isfinite(x):
            raise ValueError(f"dense value {value!r} is not finite")
        return x

    def _dense_column(self, rows: list, d: dict) -> np.ndarray:
        col = d["column"]
        try:
            x = np.array([self._number(r[col], float(d["fill"])) for r in rows], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"column {col!r} (dense feature {d['name']!r}): {exc}") from None
        for t in d["transforms"]:
            op = t["op"]
            if op == "log1p":
                x = np.log1p(np.maximum(x, 0.0))
            elif op == "clip":
                x = np.clip(x, float(t["lo"]), float(t["hi"]))
            elif op == "standardize":
                x = (x - float(t["mean"])) / float(t["std"])
            else:
                raise ValueError(f"features.json: unknown transform {op!r}")
        out = x.astype(np.float32)
        bad = ~np.isfinite(out)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"row {i}: column {col!r}: dense value becomes {out[i]} after {d['transforms']}")
        return out

    def featurize(self, rows) -> tuple[dict, torch.Tensor]:
        rows = as_rows(rows)
        for i, r in enumerate(rows):
            missing = [c for c in self.columns if c not in r]
            if missing:
                raise ValueError(f"row {i}: column {missing[0]!r} missing (the model reads {self.columns})")
        features = {}
        for c in self.categorical:
            col = c["column"]
            try:
                if c["list"]:
                    bags = [self._bag(r[col], c) for r in rows]
                    lengths = [len(b) for b in bags]
                    values = self._ids([v for b in bags for v in b], c)
                else:
                    lengths = [1] * len(rows)
                    values = self._ids([r[col] for r in rows], c)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"column {col!r} (feature {c['name']!r}): {exc}") from None
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            features[c["name"]] = (torch.tensor(values, dtype=torch.int64), torch.from_numpy(offsets))
        dense = np.zeros((len(rows), len(self.dense)), dtype=np.float32)
        for j, d in enumerate(self.dense):
            dense[:, j] = self._dense_column(rows, d)
        return features, torch.from_numpy(dense)

    # ---- files ----
    def read_parquet(self, path, batch_rows: int = 65536) -> Iterator[list]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(str(path))
        for batch in pf.iter_batches(batch_size=batch_rows, columns=self.columns, use_threads=False):
            yield batch.to_pylist()

    def read_csv(self, path, batch_rows: int = 65536) -> Iterator[list]:
        import csv
        import gzip
        import io

        if self.input["format"] != "csv":
            raise ValueError(f"the model was trained on {self.input['format']} input; its schema has no CSV "
                             "delimiter or header (score a Parquet file or rows)")
        opened = gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")
        with opened as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as fh:
            reader: Iterable[list] = csv.reader(fh, delimiter=self.input["delimiter"])
            lines = iter(reader)
            names = next(lines, None) if self.input["header"] else self.input["columns"]
            if names is None:
                return
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise ValueError(f"{path}: column {missing[0]!r} missing (the header has {names})")
            batch: list = []
            for n, fields in enumerate(lines):
                if len(fields) != len(names):
                    raise ValueError(f"{path}: data row {n}: {len(fields)} fields, expected {len(names)}")
                batch.append(dict(zip(names, fields)))
                if len(batch) == batch_rows:
                    yield batch
                    batch = []
            if batch:
                yield batch


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
    raw = spec.get("raw_rows") or {}
    if raw.get("available"):
        features = json.loads((out_dir / raw["file"]).read_text(encoding="utf-8"))
        model.pipeline = FeaturePipeline(features, out_dir, spec)
    return model.eval()


def _write_scores(out: torch.Tensor, kind: str, fh) -> None:
    if out.dim() == 1:
        header = ["logit", "probability"] if kind == "logit" else ["score"]
        cols = [out, torch.sigmoid(out)] if kind == "logit" else [out]
    else:
        header = [f"score_{j}" for j in range(out.shape[1])]
        cols = [out[:, j] for j in range(out.shape[1])]
    fh.write(",".join(header) + "\n")
    for row in zip(*(c.tolist() for c in cols)):
        fh.write(",".join(repr(float(v)) for v in row) + "\n")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="Load a widedp export; print its architecture or score raw rows.")
    parser.add_argument("export_dir", nargs="?", default=str(Path(__file__).resolve().parent))
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--score-parquet", metavar="FILE", help="score every row of a Parquet file (needs pyarrow)")
    source.add_argument("--score-csv", metavar="FILE", help="score every row of a CSV file (the schema's format)")
    parser.add_argument("--out", metavar="FILE", help="write the scores there (CSV) instead of stdout")
    parser.add_argument("--batch-rows", type=int, default=65536)
    args = parser.parse_args(argv)
    m = load(args.export_dir)
    if args.score_parquet is None and args.score_csv is None:
        print(json.dumps({"model": m.spec["model"], "output": m.spec["output"],
                          "tables": m.spec["tables"], "features": m.spec["features"],
                          "num_dense": m.num_dense, "raw_rows": m.spec.get("raw_rows")}, indent=1))
        return 0
    if args.score_parquet is not None:
        out = m.score_parquet(args.score_parquet, args.batch_rows)
    else:
        out = m.score_csv(args.score_csv, args.batch_rows)
    kind = m.spec["output"]["kind"]
    if args.out is None:
        _write_scores(out, kind, sys.stdout)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            _write_scores(out, kind, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
