"""`widedp export RUN_DIR OUT_DIR`: the releasable artifact of a training run.

What a run directory holds is mostly private (docs/THREAT_MODEL.md): `checkpoint.pt` carries
optimizer state and, in reproducible mode, generator states; `metrics.jsonl`/`summary.json` may
carry debug statistics. The export writes only what the privacy report covers:

    OUT_DIR/weights.safetensors   (or weights.pt when safetensors is not installed: a plain
                                   dict[str, Tensor], torch.load(weights_only=True)):
                                   embeddings.<table> [num_rows, dim] — each table whole, in
                                   global row order, gathered from the shards by the layout's
                                   row ranges; dense.<name> — the dense part's parameters
    OUT_DIR/dense.pt2             the trained dense part as a torch.export program (dynamic
                                   batch): forward(pooled [B, F, D], dense [B, num_dense])
    OUT_DIR/load_model.py         standalone loader (plain PyTorch, imports nothing of widedp)
    OUT_DIR/model.json            architecture, input format and what the output is
    OUT_DIR/config.json           the run's config without privacy.noise_seed,
                                   cluster.address and run_dir
    OUT_DIR/privacy_report.json   ε (re-accounted from the ledger), δ, the full event history,
    OUT_DIR/PRIVACY.md            what is and is not covered
    OUT_DIR/README.md             how to load it
    OUT_DIR/vocab.tsv             if the data set has one
    OUT_DIR/features.json         data sets made by `widedp convert table` only: the feature
                                   pipeline that turns a raw Parquet/CSV row into the model's
                                   inputs (below); model.json's raw_rows says whether it is there
    OUT_DIR/vocabularies/*.txt    the schema's vocabulary files (one per table that uses one)

No optimizer state, generator state, sampler state or DP-FEST selection is written. The
directory is built under a temporary name next to OUT_DIR and renamed into place at the end,
so a failure leaves no OUT_DIR behind; an existing non-empty OUT_DIR is refused.

Raw rows. When the run's data set came from `widedp convert table` (dataset.json has `schema`),
the export carries the conversion's feature pipeline in features.json, and load_model.py
re-implements it in plain Python/numpy, so `model.score_rows(rows)` (dicts column -> value, a
pyarrow Table or a pandas DataFrame), `model.score_parquet(PATH)`, `model.score_csv(PATH)` and
`python load_model.py --score-parquet FILE` / `--score-csv FILE` score a raw row exactly as
`widedp evaluate` scores its converted example. features.json holds, from the schema as
converted: the input format (CSV delimiter, header, column names); the label, unit and timestamp
column names (not model inputs: never read for scoring); per dense column (in dense order) its
source column, `fill` and transforms in order (log1p; clip with its bounds; standardize with the
schema's PUBLIC mean/std or the DP-released ones of dataset.json `dense_statistics`, whose
release is a data-preparation event in the privacy report); per categorical feature (in model
order) its source column, table, list or not, CSV separator, `max_length` (the first values are
kept, after null/empty items are dropped), pooling, and either `hash_size` with the hash named
precisely (SplitMix64 for integers and canonical integer text, widedp's unkeyed hash_strings
with its public constant for other text; key examples computed by the converter's own code) or
a vocabulary (copied into vocabularies/: a PUBLIC file by the schema's contract; dataset.json's
`vocabulary_files` digest must still match the file, else raw rows are left out with the
reason). Before the export is moved into place, the shipped loader is run on synthetic raw rows
(drawn here: no data) in the schema's format and must produce the converter's ids and float32
dense values bit for bit. Data sets of other origins (`convert criteo`, `convert text`, the
synthetic generators) get `raw_rows.available = false` in model.json with the reason: their
exports take ids and dense values as before.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from widedp.trainer import strict_json

FORMAT_VERSION = 1
TEMPLATE_DIR = Path(__file__).resolve().parent / "export_template"
LOADER_FILE = "load_model.py"
REQUIRED_RUN_FILES = ("checkpoint.pt", "summary.json", "config.json")
FEATURES_FILE = "features.json"
FEATURES_FORMAT_VERSION = 1
VOCABULARY_DIR = "vocabularies"
HASH_NAME = "widedp-stable-hash-v1"  # load_model.py implements this one (and refuses any other)

# Config keys that are secret or describe the local machine, not the model: (section, key).
DROPPED_CONFIG_KEYS = (("privacy", "noise_seed"), ("cluster", "address"))

UNIT_OF_PRIVACY = "one training example; add/remove neighbouring datasets"
UNIT_OF_PRIVACY_USER = ("one user (the data set's unit column) with all of their examples; add/remove "
                        "neighbouring datasets over users")
COVERED = ("the released model and every intermediate update, for add/remove of one training example; "
           "data-preparation events such as a private vocabulary are in the history")
COVERED_USER = ("the released model and every intermediate update, for add/remove of one user with all of their "
                "training examples (how users were sampled and bounded, privacy.user_sampling, is in the caveats); "
                "data-preparation events are in the history")
NOT_COVERED_ALWAYS = (
    "Hyperparameters, the model architecture and the data pipeline are taken as public: choosing them by "
    "trying several runs on the private data is not accounted for.",
    "The run directory's other files are not part of this export: checkpoint.pt (optimizer and generator "
    "state) is private; metrics.jsonl and summary.json follow the run's own caveats below.",
)
CAVEAT_SEED = ("privacy.reproducible = true: sampling, selection and noise were derived from privacy.noise_seed; "
               "the ε holds only while the noise seed stays secret (it is not included in this export)")
CAVEAT_DEBUG = ("train.debug_metrics = true: the run's metrics files (metrics.jsonl, summary.json) carry raw "
                "training statistics outside the guarantee; this report is VOID for them (they are not part of "
                "this export; do not publish them)")
NO_GUARANTEE = "mode = nonprivate: no privacy guarantee (ε = inf)"
# A seed value written into a free-text note (e.g. a reproducible vocabulary's description)
# would void the ε that the note says depends on it: redacted in everything the export copies.
_SEED_VALUE = re.compile(r"(\w*noise_seed)(\s*[=:]\s*)\d+")


def redact(text: str) -> str:
    return _SEED_VALUE.sub(r"\1\2<redacted>", str(text))


class ExportError(ValueError):
    """A bad RUN_DIR or OUT_DIR (a ValueError: `widedp` prints one line, exit code 2)."""


# ---- public API -----------------------------------------------------------------------------------
def export_run(run_dir, out_dir) -> dict:
    """Write the releasable artifact of the run in `run_dir` to the new directory `out_dir`."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    missing = [name for name in REQUIRED_RUN_FILES if not (run_dir / name).is_file()]
    if missing:
        raise ExportError(f"{run_dir}: no {', '.join(missing)} there (not a finished `widedp train` run dir?)")
    _check_out_dir(out_dir)

    from widedp.trainer.run.train import load_checkpoint

    summary = json.loads((run_dir / "summary.json").read_text())
    run_config = json.loads((run_dir / "config.json").read_text())
    try:
        state = load_checkpoint(run_dir / "checkpoint.pt")
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    # The checkpoint's config is the one the saved state was trained under (a resume with --set
    # overrides does not rewrite config.json); what the ε *means* is not read from it but from the
    # run's records (the ledger's header, the journal: `privacy_report`).
    config = state.get("config") or run_config
    engine_state = state["engine"]
    meta = _read_dataset_meta(config)
    layout = _layout(meta, config)

    # With train.ema_decay > 0 the released model is the moving average of the iterates (what
    # the run evaluated; post-processing of the released iterates), else the last iterate.
    averaged = "averaged_model" in engine_state
    tables = gather_tables(layout, engine_state["shards"], key="averaged_weights" if averaged else "weights")
    dense_model = _dense_model(config, meta, engine_state["averaged_model" if averaged else "model"])
    weights = {f"embeddings.{name}": w for name, w in tables.items()}
    weights.update({f"dense.{k}": v.detach().cpu().contiguous().clone()
                    for k, v in dense_model.state_dict().items() if v.numel()})
    report = privacy_report(run_dir, summary, config, engine_state, meta, state)
    logit_range = _clamp_logit(dense_model, engine_state.get("logit_range"))
    spec = model_spec(config, meta, layout, engine_state.get("step"), output_is_logit=dense_model.logit_layer() is not None,
                      logit_range=logit_range)
    ema_decay = config.get("train", {}).get("ema_decay", 0.0)
    spec["parameters"] = (f"exponential moving average of the iterates, decay {ema_decay} (train.ema_decay)"
                          if averaged else "the last iterate")
    pipeline = feature_pipeline(meta)
    if pipeline.spec is not None:
        spec["raw_rows"] = {"available": True, "file": FEATURES_FILE,
                            "columns": pipeline.spec["model_input_columns"],
                            "vocabularies": sorted(pipeline.files)}
        report["feature_pipeline"] = _pipeline_note(pipeline.spec)
    else:
        spec["raw_rows"] = {"available": False, "reason": pipeline.reason}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    try:
        spec["weights"] = {"file": _write_weights(tmp, weights), "keys": _weight_key_doc(spec)}
        _write_dense(tmp, dense_model, layout, meta.num_dense)
        shutil.copyfile(TEMPLATE_DIR / LOADER_FILE, tmp / LOADER_FILE)
        if pipeline.spec is not None:
            _write_pipeline(tmp, pipeline)
        _write_json(tmp / "model.json", spec)
        exported_config = public_config(config)
        # what the run's outputs mean is the run's: debug statistics written by any session count
        exported_config.setdefault("train", {})["debug_metrics"] = bool(report["debug_metrics"])
        _write_json(tmp / "config.json", exported_config)
        vocab = Path(config["data"]["path"]) / "vocab.tsv"
        if vocab.is_file():
            shutil.copyfile(vocab, tmp / "vocab.tsv")
            report["vocabulary"] = _vocabulary_note(meta)
        _write_json(tmp / "privacy_report.json", report)
        (tmp / "PRIVACY.md").write_text(privacy_markdown(report), encoding="utf-8")
        (tmp / "README.md").write_text(readme(spec, report), encoding="utf-8")
        _self_check(tmp, tables, dense_model, layout, meta.num_dense, pipeline.schema)
        os.chmod(tmp, 0o755)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out_dir), "files": sorted(p.name for p in out_dir.iterdir()),
            "model": spec["model"], "dense_format": spec["dense"]["format"], "weights": spec["weights"]["file"],
            "mode": report["mode"], "private": report["private"], "epsilon": report["epsilon"], "delta": report["delta"],
            "accountant": report["accountant"], "steps": report["steps"],
            "raw_rows": bool(spec["raw_rows"]["available"])}


def gather_tables(layout, shard_states: list, key: str = "weights") -> dict:
    """{table name: full [num_rows, dim] float32 tensor}: each shard's block of every table
    (shard s holds rows `layout.row_range(table, s)`, its state's `key`: "weights" or
    "averaged_weights") put back in global row order."""
    if len(shard_states) != layout.num_shards:
        raise ExportError(f"checkpoint has {len(shard_states)} shards, the layout {layout.num_shards}")
    out = {}
    for t, table in enumerate(layout.tables):
        full = torch.empty((table.num_rows, table.dim), dtype=torch.float32)
        covered = 0
        for s, shard in enumerate(shard_states):
            start, end = layout.row_range(table, s)
            block = torch.as_tensor(shard[key][t], dtype=torch.float32)
            if tuple(block.shape) != (end - start, table.dim):
                raise ExportError(f"checkpoint shard {s}, table {table.name!r}: shape {tuple(block.shape)}, "
                                  f"the layout expects rows [{start}, {end}) of dim {table.dim}")
            full[start:end] = block
            covered += end - start
        if covered != table.num_rows:
            raise ExportError(f"table {table.name!r}: the shards cover {covered} of {table.num_rows} rows")
        out[table.name] = full
    return out


def public_config(config: dict) -> dict:
    """The run's config without secrets or local details (noise seed, Ray address, run dir)."""
    out = copy.deepcopy(config)
    out.pop("run_dir", None)
    for section, key in DROPPED_CONFIG_KEYS:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


# ---- reading the run ------------------------------------------------------------------------------
def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ExportError(f"{out_dir}: exists and is not a directory")
        if any(out_dir.iterdir()):
            raise ExportError(f"{out_dir}: exists and is not empty (refusing to overwrite; remove it or "
                              f"choose another OUT_DIR)")


def _read_dataset_meta(config: dict):
    from widedp.trainer.data.format.meta import read_meta

    path = Path(config["data"]["path"])
    if not (path / "dataset.json").is_file():
        raise ExportError(f"{path / 'dataset.json'}: missing (the export needs the run's data set "
                          f"description for the table sizes, features and pooling)")
    return read_meta(path)


def _layout(meta, config: dict):
    from widedp.trainer.engine.layout import FeatureSpec, ShardLayout, TableSpec

    dim = int(config["model"]["embedding_dim"])
    tables = tuple(TableSpec(name, int(rows), dim) for name, rows in meta.table_sizes.items())
    features = tuple(FeatureSpec(f, meta.feature_tables[f], meta.pooling[f]) for f in meta.features)
    return ShardLayout(tables, features, int(config["cluster"]["num_shards"]))


def _dense_model(config: dict, meta, model_state: dict):
    from widedp.trainer.models import build_model

    m = config["model"]
    with torch.random.fork_rng(devices=[]):  # construction draws initial weights; they are overwritten
        try:
            model = build_model(m["name"], features=list(meta.features), embedding_dim=int(m["embedding_dim"]),
                                num_dense=meta.num_dense, bottom_mlp=m.get("bottom_mlp", []),
                                top_mlp=m.get("top_mlp", []), interaction=m.get("interaction", "dot"),
                                kwargs=m.get("kwargs", {}))
        except ValueError as exc:
            raise ExportError(f"the run's model: {exc}") from exc
    model.load_state_dict(model_state)
    return model.eval()


def _clamp_logit(dense_model, bounds):
    """A recalibrated run's released model computes a·clip(z) + b: its logit layer's output is
    clamped to the checkpoint's `logit_range` (trainer/engine/recalibration.py), recorded in the
    exported program as one clamp. Returns the bounds, or None when the run has none."""
    if bounds is None:
        return None
    from widedp.trainer.engine.recalibration import LogitRange

    layer = dense_model.logit_layer()
    if layer is None:
        raise ExportError(f"the checkpoint clamps a logit but the {type(dense_model).__name__} model has no logit layer")
    hook = LogitRange(*bounds)
    layer.register_forward_hook(hook)
    return [hook.low, hook.high]


# ---- writing ----------------------------------------------------------------------------------------
def _write_json(path: Path, obj) -> None:
    path.write_text(strict_json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_weights(tmp: Path, weights: dict) -> str:
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        save_file(weights, str(tmp / "weights.safetensors"))
        return "weights.safetensors"
    buf = io.BytesIO()
    torch.save(weights, buf)
    (tmp / "weights.pt").write_bytes(buf.getvalue())
    return "weights.pt"


def _write_dense(tmp: Path, model, layout, num_dense: int) -> None:
    """The dense part as a torch.export program with a dynamic batch dimension (example inputs:
    zeros, so the archive's sample inputs carry no data)."""
    batch = torch.export.Dim("batch")
    example = (torch.zeros(4, len(layout.features), layout.dim), torch.zeros(4, num_dense))
    try:
        program = torch.export.export(model, example, dynamic_shapes=({0: batch}, {0: batch}))
    except Exception as exc:  # noqa: BLE001 - report which model could not be exported
        raise ExportError(f"torch.export of the {type(model).__name__} dense part failed: {exc}") from exc
    torch.export.save(program, str(tmp / "dense.pt2"))


def _self_check(tmp: Path, tables: dict, dense_model, layout, num_dense: int, schema=None) -> None:
    """Load the written artifact with its own loader and compare it with the in-memory model on a
    random batch (ids, bags and dense values drawn here: no data involved); with a `convert
    table` schema, also the loader's raw-row pipeline with the converter (`_check_pipeline`)."""
    # exec'd from source: importing it would leave a __pycache__ in the export
    path = tmp / LOADER_FILE
    namespace: dict[str, Any] = {"__name__": "_widedp_export_check", "__file__": str(path)}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
    loaded = namespace["load"](tmp)
    gen = torch.Generator().manual_seed(0)
    B = 5
    features, pooled = {}, []
    for f in layout.features:
        table = tables[f.table]
        lengths = torch.randint(0, 4, (B,), generator=gen)
        values = torch.randint(0, table.shape[0], (int(lengths.sum()),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        features[f.name] = (values, offsets[:-1])
        rows = [table[values[offsets[j]:offsets[j + 1]]] for j in range(B)]
        pooled.append(torch.stack([(r.mean(0) if f.pooling == "mean" else r.sum(0)) if len(r) else
                                   torch.zeros(layout.dim) for r in rows]))
    dense = torch.randn(B, num_dense, generator=gen)
    with torch.no_grad():
        want = dense_model(torch.stack(pooled, dim=1), dense)
        got = loaded(features, dense)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise ExportError(f"self-check failed: the exported model's outputs differ from the trained model's "
                          f"(max abs diff {float((got - want).abs().max()):.3g})")
    if schema is not None:
        _check_pipeline(loaded, schema)


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    _check_out_dir(out_dir)
    try:
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked): replaced by the export
        os.rename(tmp, out_dir)
    except OSError as exc:
        raise ExportError(f"{out_dir}: cannot move the export into place ({exc})") from exc


# ---- the raw-row feature pipeline (features.json) ---------------------------------------------------
class Pipeline(NamedTuple):
    """`feature_pipeline`'s answer: features.json's content (None when raw rows are not
    available, then `reason` says why), the vocabulary files to ship {export name: source} and
    the converter's schema (with the DP statistics filled in) for the self-check."""

    spec: Optional[dict]
    files: dict
    reason: Optional[str]
    schema: Any = None


def _unavailable(reason: str) -> Pipeline:
    return Pipeline(None, {}, reason)


def _vocabulary_name(table: str, index: int, taken: dict) -> str:
    """vocabularies/<table>.txt, or vocabularies/table_<i>.txt when the table's name is not a
    plain file name or would collide (case-insensitively) with another table's file."""
    safe = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}", table) is not None
    stems = ([table] if safe else []) + [f"table_{index}"] + [f"table_{index}_{k}" for k in range(1, len(taken) + 2)]
    for stem in stems:
        name = f"{VOCABULARY_DIR}/{stem}.txt"
        if taken.setdefault(name.lower(), table) == table:
            return name
    raise AssertionError("unreachable: more names than tables")


def feature_pipeline(meta) -> Pipeline:
    """The feature pipeline of a `widedp convert table` data set (module docstring), from
    dataset.json's `schema` (re-parsed with the converter's own parser, so every default is the
    converter's), `dense_statistics` and `vocabulary_files`."""
    from widedp.trainer.data.errors import DataError
    from widedp.trainer.data.convert.table import _read_vocabulary, parse_schema, vocabulary_digest

    raw = meta.extra.get("schema")
    if meta.kind != "ctr" or not isinstance(raw, dict):
        source = str(meta.extra.get("source", meta.kind)).split(" ")[0]
        return _unavailable(f"the run's data set was not made by `widedp convert table` (source: {source}; "
                            "dataset.json has no schema): map raw values to ids and dense values as its own "
                            "converter did and call the model with them (model.json's input)")
    raw = copy.deepcopy(raw)
    records = meta.extra.get("vocabulary_files") or {}
    digests: dict = {}
    for name, cat in (raw.get("categorical") or {}).items():
        if not isinstance(cat, dict) or "vocabulary" not in cat:
            continue
        record = records.get(name)
        if not isinstance(record, dict) or not {"path", "values", "sha256"} <= set(record):
            return _unavailable(f"feature {name!r}: dataset.json does not record which vocabulary it was converted "
                                "with (a data set converted before `vocabulary_files` was recorded): re-convert it "
                                "to export its feature pipeline")
        path = Path(record["path"])
        try:
            values = _read_vocabulary(path, f"feature {name!r}").to_pylist()
        except DataError as exc:
            return _unavailable(f"feature {name!r}: its vocabulary file cannot be read: {exc}")
        if len(values) != record["values"] or vocabulary_digest(values) != record["sha256"]:
            return _unavailable(f"feature {name!r}: vocabulary file {path} changed since the data set was converted "
                                f"({len(values)} values now, {record['values']} then, or other values)")
        cat["vocabulary"] = str(path)
        digests[str(path)] = record["sha256"]
    try:
        schema = parse_schema(raw, Path(str(meta.extra.get("schema_file", "schema.toml"))))
    except DataError as exc:
        return _unavailable(f"dataset.json's schema does not parse: {exc}")
    statistics = meta.extra.get("dense_statistics") or {}
    dense = []
    for d in schema.dense:
        if d.dp_statistics:
            s = statistics.get(d.name)
            if not isinstance(s, dict) or "mean" not in s or "std" not in s:
                return _unavailable(f"dense feature {d.name!r}: DP standardization statistics missing from "
                                    "dataset.json dense_statistics")
            d = dataclasses.replace(d, mean=float(s["mean"]), std=float(s["std"]))
        dense.append(d)
    schema = dataclasses.replace(schema, dense=dense)
    if ([c.name for c in schema.categorical] != list(meta.features) or len(dense) != meta.num_dense
            or any(meta.table_sizes.get(c.table) != c.table_size or meta.feature_tables.get(c.name) != c.table
                   or meta.pooling.get(c.name) != c.pooling for c in schema.categorical)):
        return _unavailable("dataset.json's schema does not describe its own features, tables or dense columns")

    table_index = {t: i for i, t in enumerate(meta.tables)}
    files: dict = {}
    taken: dict = {}
    categorical = []
    for c in schema.categorical:
        if c.hash_size is not None:
            ids: dict = {"kind": "hash", "hash_size": c.hash_size,
                         "rule": "1 + key % (hash_size - 1); missing (null or empty text) -> 0"}
        else:
            name = _vocabulary_name(c.table, table_index[c.table], taken)
            files[name] = Path(str(c.vocabulary))
            ids = {"kind": "vocabulary", "file": name, "values": c.table_size - 1,
                   "sha256": digests[str(c.vocabulary)],
                   "rule": "value text (an integer by its decimal text) on line i (0-based) -> id i + 1; a value not "
                           "in the file, or missing -> 0"}
        categorical.append({
            "name": c.name, "column": c.column, "table": c.table, "table_rows": c.table_size, "list": c.is_list,
            "separator": c.separator if c.is_list and schema.format == "csv" else None,
            "max_length": c.max_length, "pooling": c.pooling, "ids": ids})
    dense_spec = []
    for d in schema.dense:
        transforms: list = []
        for t in d.transforms:
            if t == "clip":
                assert d.clip is not None
                transforms.append({"op": "clip", "lo": d.clip[0], "hi": d.clip[1]})
            elif t == "standardize":
                transforms.append({"op": "standardize", "mean": d.mean, "std": d.std,
                                   "statistics": "dp" if d.dp_statistics else "public"})
            else:
                transforms.append({"op": t})
        dense_spec.append({"name": d.name, "column": d.column, "fill": d.fill, "transforms": transforms})
    fmt: dict = {"format": schema.format}
    if schema.format == "csv":
        fmt.update(delimiter=schema.delimiter, header=schema.header, columns=schema.columns, encoding="utf-8",
                   quoting="double quotes (RFC 4180); a field is never null (empty text is missing)")
    model_inputs = list(dict.fromkeys([d.column for d in schema.dense] + [c.column for c in schema.categorical]))
    spec = {
        "format_version": FEATURES_FORMAT_VERSION,
        "made_by": "widedp convert table (trainer/data/convert/table.py); load_model.py implements it",
        "input": fmt,
        "label": schema.label,
        "unit": schema.unit,
        "timestamp": schema.timestamp,
        "model_input_columns": model_inputs,
        "not_model_inputs": ("the label, unit and timestamp columns are not read for scoring (unless a dense or "
                             "categorical feature reads the same column)"),
        "dense": dense_spec,
        "dense_rule": ("value: a number (text parsed as a float: ASCII, no spaces); null or empty text -> fill; then "
                       "the transforms in order in float64: log1p(x) = log(1 + max(x, 0)), clip = min(max(x, lo), "
                       "hi), standardize = (x - mean) / std; then float32; a non-finite value is an error. "
                       "statistics 'dp': released by a DP mechanism (a data-preparation event in "
                       "privacy_report.json), 'public': given in the schema"),
        "categorical": categorical,
        "list_rule": ("a list value (Parquet list, or CSV text split by separator): null and empty items dropped, "
                      "then the FIRST max_length items kept (all when null), in order, repeats kept, each mapped "
                      "to an id (an unknown vocabulary item stays in the bag as id 0); a null list is an empty bag; "
                      "a bag is pooled with the feature's pooling (sum, or mean; an empty bag pools to zeros)"),
        "hash": _hash_spec(),
    }
    return Pipeline(spec, files, None, schema)


def _hash_spec() -> dict:
    """The hash, named precisely, with examples computed by the converter's own code."""
    import pyarrow as pa

    from widedp.trainer.data import _util
    from widedp.trainer.data.convert.table import _CANONICAL_INT, _int_or_text_keys

    text = ["i42", "42", "-7", "007", "héllo, wörld: longer than 8 bytes"]
    keys, _ = _int_or_text_keys(pa.array(text, pa.string()))
    int_keys, _ = _int_or_text_keys(pa.array([42, -7], pa.int64()))
    examples: list[dict[str, Any]] = [{"value": v, "key": hex(int(k))} for v, k in zip(text, keys)]
    examples += [{"value": v, "key": hex(int(k))} for v, k in zip([42, -7], int_keys)]
    return {
        "name": HASH_NAME,
        "key": ("an integer v (an integer column, or text matching canonical_integer_text) -> splitmix64(v mod "
                "2**64); other text -> string hash of its UTF-8 bytes; null or empty text -> missing"),
        "canonical_integer_text": _CANONICAL_INT,
        "splitmix64": {"constants": [hex(int(c)) for c in (_util._GOLDEN, _util._M1, _util._M2)],
                       "definition": ("z = (x + c0) mod 2**64; z = ((z ^ (z >> 30)) * c1) mod 2**64; "
                                      "z = ((z ^ (z >> 27)) * c2) mod 2**64; return z ^ (z >> 31)")},
        "string": {"seed": hex(int(_util._STRING_SEED)),
                   "definition": ("h = splitmix64(len(b) ^ seed); for each 8-byte word w of b (little-endian, the "
                                  "last zero-padded): h = splitmix64(h ^ w)"),
                   "keyed": False},
        "examples": examples,
    }


def _write_pipeline(tmp: Path, pipeline: Pipeline) -> None:
    """features.json and the vocabulary copies (each checked against its conversion digest)."""
    from widedp.trainer.data.convert.table import _read_vocabulary, vocabulary_digest

    assert pipeline.spec is not None
    want = {c["ids"]["file"]: c["ids"]["sha256"] for c in pipeline.spec["categorical"] if c["ids"]["kind"] == "vocabulary"}
    for name, source in pipeline.files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, tmp / name)
        if vocabulary_digest(_read_vocabulary(tmp / name, name).to_pylist()) != want[name]:
            raise ExportError(f"{source}: changed while it was copied into the export")
    _write_json(tmp / FEATURES_FILE, pipeline.spec)


def _pipeline_note(spec: dict) -> dict:
    dp = [d["name"] for d in spec["dense"] if any(t.get("statistics") == "dp" for t in d["transforms"])]
    vocabularies = sorted({c["ids"]["file"] for c in spec["categorical"] if c["ids"]["kind"] == "vocabulary"})
    note: dict[str, Any] = {
        "file": FEATURES_FILE,
        "note": ("the conversion's feature pipeline: column names, hash sizes, the hash (unkeyed and "
                 "data-independent), list lengths, dense fills, clip bounds and PUBLIC standardization "
                 "statistics are the schema's public choices")}
    if dp:
        note["dp_statistics"] = dp
        note["dp_statistics_note"] = ("mean/std of these dense features were estimated from the training data with "
                                      "differential privacy; that release is in the data-preparation events above "
                                      "(charged before training), so they are releasable with the model")
    if vocabularies:
        note["vocabularies"] = vocabularies
        note["vocabularies_note"] = ("copied from the schema's vocabulary files, which the schema's contract says "
                                     "are PUBLIC (not built from the private data): not covered by ε; do not "
                                     "export them if one was built from private data without DP")
    return note


# Synthetic raw values for the pipeline self-check (no data): text, integers, numbers.
_TEXT = ["a", "B", "42", "-7", "0", "007", "+7", " 7", "9223372036854775807", "123456789012345678",
         "héllo, wörld: longer than 8 bytes", "|", "x;y", ""]
_INTS = [0, 1, -1, 42, -7, 9223372036854775807, -9223372036854775808, 123456789]
_NUMBERS = [0.0, -1.5, 3.25, 1e6, 123.456, -0.0, 7.0, 2.5e-3]
_NUMBER_TEXT = ["0", "-1.5", "3.25", "1e6", "123.456", "+2", ".5", "7", "2.5E-3", ""]


def _synthetic_columns(schema, ints: bool, n: int = 64) -> dict:
    """Raw input columns of `n` synthetic rows in the schema's format (every value drawn here)."""
    import numpy as np
    import pyarrow as pa

    from widedp.trainer.data.convert.table import _CANONICAL_INT

    rng = np.random.default_rng(7 + int(ints))
    csv = schema.format == "csv"
    vocab: dict = {}
    for c in schema.categorical:
        if c.vocabulary_values is not None:
            values = c.vocabulary_values.to_pylist()
            vocab.setdefault(c.column, []).extend(values[:4] + values[-2:] + ["not-in-the-vocabulary"])

    def pick(pool: list, k: int) -> list:
        return [pool[i] for i in rng.integers(0, len(pool), k)]

    def text_pool(column: str) -> list:
        return _TEXT + vocab.get(column, []) + [None]

    def int_pool(column: str) -> list:
        return _INTS + [int(v) for v in vocab.get(column, []) if re.fullmatch(_CANONICAL_INT, v)] + [None]

    lists = {c.column: c for c in schema.categorical if c.is_list}
    cats = {c.column for c in schema.categorical if not c.is_list}
    dense = {d.column for d in schema.dense}
    out: dict = {}
    for column in schema.input_columns():
        if column == schema.label:
            labels = [int(v) for v in rng.integers(0, 2, n)]
            out[column] = pa.array([str(v) for v in labels] if csv else labels, pa.string() if csv else pa.int64())
        elif column == schema.timestamp:
            seconds = [int(v) for v in 1_700_000_000 + rng.integers(0, 10**6, n)]
            out[column] = pa.array([str(v) for v in seconds] if csv else seconds, pa.string() if csv else pa.int64())
        elif column == schema.unit:
            out[column] = pa.array([str(int(v)) for v in rng.integers(1, 50, n)], pa.string())
        elif column in lists:
            c = lists[column]
            longest = (c.max_length or 4) + 3
            if csv:
                pool = [v for v in text_pool(column) if v is not None]
                out[column] = pa.array([c.separator.join(pick(pool, int(rng.integers(0, longest)))) for _ in range(n)],
                                       pa.string())
            else:
                pool = int_pool(column) if ints else text_pool(column)
                rows = [None if rng.random() < 0.1 else pick(pool, int(rng.integers(0, longest))) for _ in range(n)]
                out[column] = pa.array(rows, pa.list_(pa.int64() if ints else pa.string()))
        elif column in cats and (csv or column in dense or not ints):
            pool = text_pool(column) if column not in dense else _NUMBER_TEXT + [None]
            values = pick([v for v in pool if not (csv and v is None)], n)
            out[column] = pa.array(values, pa.string())
        elif column in cats:
            out[column] = pa.array(pick(int_pool(column), n), pa.int64())
        else:  # dense only
            out[column] = pa.array(pick(_NUMBER_TEXT, n) if csv else pick(_NUMBERS + [None], n),
                                   pa.string() if csv else pa.float64())
    return out


def _check_pipeline(loaded, schema) -> None:
    """The shipped loader's `featurize` on synthetic raw rows must give the converter's ids,
    bags and float32 dense values exactly (`_decode`, the function `convert table` writes)."""
    import numpy as np
    import pyarrow as pa

    from widedp.trainer.data.convert.table import _Chunk, _decode

    for ints in ((False,) if schema.format == "csv" else (False, True)):
        columns = _synthetic_columns(schema, ints)
        chunk = _Chunk(Path("<export self-check>"), 0, columns, 2 if schema.format == "csv" else None)
        table, _ = _decode(chunk, schema)
        features, dense = loaded.featurize(pa.table(columns).to_pylist())
        for c in schema.categorical:
            col = table.column(c.name).combine_chunks()
            if c.is_list:
                want_values = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
                want_offsets = np.asarray(col.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
                want_offsets = want_offsets - want_offsets[0]
            else:
                want_values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)
                want_offsets = np.arange(len(col) + 1, dtype=np.int64)
            values, offsets = features[c.name]
            if not (np.array_equal(values.numpy(), want_values) and np.array_equal(offsets.numpy(), want_offsets)):
                raise ExportError(f"self-check failed: load_model.py maps raw values of feature {c.name!r} to other "
                                  "ids than `widedp convert table` did")
        if schema.dense:
            want = np.asarray(table.column("dense").combine_chunks().flatten().to_numpy(zero_copy_only=False),
                              dtype=np.float32).reshape(-1, len(schema.dense))
            if not np.array_equal(dense.numpy(), want):
                raise ExportError("self-check failed: load_model.py's dense values differ from `widedp convert table`'s")


# ---- model description ----------------------------------------------------------------------------
def model_spec(config: dict, meta, layout, step, output_is_logit: bool = False, logit_range=None) -> dict:
    """model.json's description of the exported model; `logit_range` (a recalibrated run's
    [low, high]) is stated in the output's entry."""
    m = config["model"]
    name = m["name"]
    spec = {
        "format_version": FORMAT_VERSION,
        "model": name,
        "embedding_dim": layout.dim,
        "tables": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim} for t in layout.tables],
        "features": [{"name": f.name, "table": f.table, "pooling": f.pooling} for f in layout.features],
        "num_dense": meta.num_dense,
        "steps_trained": step,
        "input": ("features: {feature name: (values int64 [nnz], offsets int64 [B] or [B+1])} as "
                  "torch.nn.EmbeddingBag takes them, one entry per feature above; dense: float32 "
                  f"[B, {meta.num_dense}]"),
        "dense": {
            "format": "torch.export",
            "file": "dense.pt2",
            "torch_version": torch.__version__,
            "forward": (f"(pooled float32 [B, {len(layout.features)}, {layout.dim}] — the features' pooled "
                        f"embeddings in the order above —, dense float32 [B, {meta.num_dense}])"),
            "parameters": "overwritten at load time from the weights file's dense.* entries",
        },
    }
    if name == "dlrm":
        spec.update(bottom_mlp=list(m["bottom_mlp"]), top_mlp=list(m["top_mlp"]), interaction=m["interaction"])
        spec["output"] = {
            "kind": "logit",
            "shape": "[B]",
            "description": ("click logit (log-odds); probability = sigmoid(logit); trained with binary "
                            "cross-entropy on labels in {0, 1}"),
        }
        spec["architecture"] = (
            f"x = bottom MLP {[meta.num_dense, *m['bottom_mlp'], layout.dim]} (ReLU after every layer) on dense; "
            + ("top MLP input = [x, dot products v_i·v_j for i<j over v = (x, pooled_1..F)]"
               if m["interaction"] == "dot" else "top MLP input = [x, pooled_1, ..., pooled_F]")
            + f"; top MLP {[*m['top_mlp'], 1]} (ReLU between layers) -> logit")
    elif name == "cbow":
        k = len(layout.features) - 2
        spec.update(negatives=k, interaction=None)
        spec["output"] = {
            "kind": "scores",
            "shape": f"[B, {1 + k}]",
            "description": ("column 0 = h·o_target, column i >= 1 = h·o_neg_{i-1}; h = mean of the context "
                            "words' rows of table 'input' (feature 'context'), o = rows of table 'output' "
                            "(features 'target', 'neg_*'); per-example loss = -logsigmoid(s[:,0]) - "
                            "sum(logsigmoid(-s[:,1:]), 1); word vectors: table 'input'"),
        }
        spec["architecture"] = "word2vec CBOW with negative sampling; the dense part has no parameters"
    else:  # a model by import path: the class is not needed to load (dense.pt2 holds its program)
        spec.update(model_class=name, model_kwargs=dict(m.get("kwargs", {})))
        spec["output"] = {
            "kind": "logit" if output_is_logit else "outputs",
            "shape": "the model's own",
            "description": (f"what {name}'s forward returns" + (" — its logit_layer's one output, a logit; "
                            "probability = sigmoid(logit)" if output_is_logit else "")),
        }
        spec["architecture"] = f"{name}, built with model.kwargs = {dict(m.get('kwargs', {}))}"
    if logit_range is not None:
        low, high = logit_range
        spec["output"]["range"] = [low, high]
        spec["output"]["description"] += (f"; recalibrated (train.recalibrate): the logit is a·clip(z, ±8) + b of the "
                                          f"trained logit z, so it lies in [{low:.6g}, {high:.6g}] (the program clamps it)")
    return spec


def _weight_key_doc(spec: dict) -> dict:
    return {"embeddings.<table>": "float32 [num_rows, dim], the whole table in row order",
            "dense.<name>": "the dense part's parameters (names as in dense.pt2's module)"}


# ---- privacy report ---------------------------------------------------------------------------------
def _records(run_dir: Path, state: dict):
    """The run's privacy records, verified as `--resume` verifies them (trainer/run/records.py):
    ledger.json must extend the checkpoint's chain and the journal's last charge (a ledger that
    is missing, rolled back, replaced or edited is refused, never replaced by the checkpoint's
    shorter copy, which would forget the steps released after the checkpoint); a keyed run
    needs its key (WIDEDP_LEDGER_KEY_FILE) and every signature must verify; and the data set's
    budget, when the data set is at the run's data.path, must not record more events for the
    run's last session than the ledger holds, nor a key its records lack."""
    from widedp.trainer.run.ledger_key import LedgerKeyError, key_from_environment
    from widedp.trainer.run.records import RecordError, verified_records

    remedy = "its privacy cannot be reported"
    try:
        records = verified_records(run_dir, state, key_from_environment(run_dir), remedy, signer=True)
        records.check_against_budget((state.get("config") or {}).get("data", {}).get("path"), run_dir, remedy)
    except (RecordError, LedgerKeyError, ValueError) as exc:
        raise ExportError(str(exc)) from None
    return records


def privacy_report(run_dir: Path, summary: dict, config: dict, engine_state: dict, meta,
                   state: Optional[dict] = None) -> dict:
    """The privacy report of a run. What the ε means — unit of privacy, reproducible mode,
    debug outputs in any session, δ — is the run's, fixed when it started (the checkpoint's
    semantics, the ledger's header, the journal's sessions: trainer/config/semantics.py), never the
    last session's config."""
    train, priv = config["train"], config["privacy"]
    state = state if state is not None else {"engine": engine_state, "config": config}
    records = _records(run_dir, state)
    semantics, ledger = records.semantics, records.ledger
    mode = semantics.get("train.mode") or summary.get("mode", train["mode"])
    private = mode != "nonprivate"
    if private and ledger is None:
        raise ExportError(f"{run_dir}: a {mode} run whose checkpoint holds no ledger: its privacy cannot be reported")
    reproducible = bool(semantics.get("privacy.reproducible") or summary.get("reproducible", False)
                        or engine_state.get("reproducible", False))
    debug = bool(records.sticky.get("debug_metrics") or summary.get("debug_metrics", False)
                 or train.get("debug_metrics", False))
    data_events = [redact(d) for d, _ in meta.privacy_events]
    user_level = (semantics.get("privacy.unit") or priv.get("unit", "example")) == "user"

    not_covered = [] if private else [NO_GUARANTEE]
    if reproducible:
        not_covered.append(CAVEAT_SEED)
    if debug:
        not_covered.append(CAVEAT_DEBUG)
    not_covered += NOT_COVERED_ALWAYS
    run_caveats = [redact(c) for c in summary.get("privacy_caveats") or []]
    for caveat in run_caveats:
        if caveat not in not_covered:
            not_covered.append(caveat)

    # From here `ledger is not None` exactly when `private` (a private run without one raised above).
    epsilon = ledger.epsilon() if ledger is not None else math.inf
    state = ledger.state_dict() if ledger is not None else None
    report = {
        "format_version": FORMAT_VERSION,
        "guarantee": "(ε, δ)-differential privacy" if private else "no privacy guarantee",
        "unit_of_privacy": UNIT_OF_PRIVACY_USER if user_level else UNIT_OF_PRIVACY,
        "privacy_unit": "user" if user_level else "example",
        "private": private,  # false: "epsilon" is null in the JSON (no finite bound; strict JSON has no Infinity)
        "epsilon": epsilon,
        "delta": state["delta"] if state is not None else summary.get("delta"),
        "accountant": state["accountant"] if state is not None else summary.get("accountant", priv.get("accountant")),
        "epsilon_in_summary": summary.get("epsilon"),
        "target_epsilon": summary.get("target_epsilon", priv.get("target_epsilon")),
        "mode": mode,
        "selection": summary.get("selection", train.get("selection") if mode == "sparse" else None),
        "steps": engine_state.get("step", summary.get("steps")),
        "events_charged": ledger.steps if ledger is not None else 0,
        "stopped_by_budget": summary.get("stopped_by_budget"),
        "sample_rate": summary.get("sample_rate"),
        "expected_batch_size": summary.get("expected_batch_size"),
        "noise_multiplier": summary.get("noise_multiplier"),
        "selection_epsilon": summary.get("selection_epsilon"),
        "k": summary.get("k"),
        "threshold": summary.get("threshold"),
        "selection_params": summary.get("selection_params"),
        "table_policy": summary.get("table_policy"),
        "clip_norm": priv.get("clip_norm"),
        "second_clip_norm": priv.get("second_clip_norm"),
        "secure_mode": semantics.get("privacy.secure_mode", priv.get("secure_mode")),
        "lineage": records.lineage,
        "ledger_key_id": records.key_id,
        "randomness": summary.get("randomness"),
        "reproducible": reproducible,
        "debug_metrics": debug,
        "history": state["history"] if state is not None else [],
        "data_preparation_events": data_events,
        "covered": [COVERED_USER if user_level else COVERED] if private else [],
        "not_covered": not_covered,
        "caveats": run_caveats,
    }
    _apply_tuning(run_dir, report)
    if ledger is not None and report["target_epsilon"] is not None and epsilon > float(report["target_epsilon"]) * (1 + 1e-9):
        report["not_covered"].insert(0, f"ε = {epsilon:.6g} exceeds the run's target ε = {report['target_epsilon']} "
                                        f"(the ledger counts {ledger.steps} events for {report['steps']} steps; "
                                        f"events charged by a crashed attempt are counted, never forgotten)")
    return report


def _apply_tuning(run_dir: Path, report: dict) -> None:
    """A trial of `widedp tune` (trainer/run/tune.py) is releasable only if its tuning chose it,
    and then with the tuning's ε (its ledger, beside the trial): the run's own ε is one trial's."""
    from widedp.accounting import PrivacyLedger
    from widedp.trainer.run.train import TRIAL_FILE
    from widedp.trainer.run.tune import TUNING_FILE

    if not (run_dir / TRIAL_FILE).exists():
        return
    chosen = run_dir / TUNING_FILE
    tuning_ledger = run_dir.parent / "ledger.json"
    if not chosen.is_file() or not tuning_ledger.is_file():
        raise ExportError(f"{run_dir}: a trial of widedp tune that its tuning did not choose (or of a tuning that did "
                          f"not finish): only the tuning's chosen trial is released, with the tuning's ε")
    tuning = json.loads(chosen.read_text())
    ledger = PrivacyLedger.load(tuning_ledger)
    if (ledger.header or {}).get("tuning_id") != tuning.get("tuning_id"):
        raise ExportError(f"{tuning_ledger}: not the ledger of tuning {tuning.get('tuning_id')} ({chosen})")
    report["trial_epsilon"], report["epsilon"] = report["epsilon"], ledger.epsilon()
    report["delta"], report["accountant"] = ledger.delta, ledger.accountant.name
    report["target_epsilon"] = tuning.get("target_epsilon")
    report["tuning"] = {"tuning_id": tuning["tuning_id"], "candidate": tuning["chosen"]["candidate"],
                        "noised_validation_score": tuning["chosen"]["noised_validation_score"],
                        "score": tuning["score"], "trials": tuning["trials"], "note": tuning["privacy_note"]}
    report["history"] = ledger.state_dict()["history"]


def _vocabulary_note(meta) -> dict:
    events = [redact(d) for d, _ in meta.privacy_events]
    if events:
        return {"file": "vocab.tsv", "status": "private",
                "note": ("chosen by a differentially private mechanism on the training data upstream (its event "
                         "is in the history, charged before training): releasable as part of this artifact"),
                "events": events}
    return {"file": "vocab.tsv", "status": "public",
            "note": ("the data set records no private vocabulary selection: the vocabulary is taken as public "
                     "(not covered by ε; do not export it if it was built from private data without DP)")}


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.6g}"
    return str(x)


def privacy_markdown(r: dict) -> str:
    lines = ["# Privacy report", ""]
    if r["mode"] == "nonprivate":
        lines += ["**No privacy guarantee**: this model was trained without differential privacy (ε = inf).", ""]
    else:
        lines += [f"This model satisfies **(ε = {_fmt(r['epsilon'])}, δ = {_fmt(r['delta'])})-differential "
                  f"privacy** ({r['accountant']} accountant), unit of privacy: {r['unit_of_privacy']}.", ""]
    if r.get("tuning"):
        t = r["tuning"]
        lines += [f"Chosen by `widedp tune` (candidate {' '.join(t['candidate']) or 'the config'}, noised validation "
                  f"{t['score']['name']} {_fmt(t['noised_validation_score'])}): the best of a secret random number of "
                  f"private trials ({t['trials']['distribution']}); ε is the whole tuning's, which bounds every trial "
                  f"together — one trial alone spent {_fmt(r['trial_epsilon'])}.", ""]
    rows = [("mode", r["mode"]), ("selection", r["selection"]), ("target ε", r["target_epsilon"]),
            ("steps", r["steps"]), ("events charged", r["events_charged"]), ("sample rate q", r["sample_rate"]),
            ("expected batch size", r["expected_batch_size"]), ("noise multiplier σ", r["noise_multiplier"]),
            ("selection ε", r["selection_epsilon"]), ("k", r["k"]), ("clip norm S1", r["clip_norm"]),
            ("second clip norm S2", r["second_clip_norm"]), ("secure mode", r["secure_mode"]),
            ("randomness", r["randomness"]),
            ("records signed (ledger key id, verified at export)", r.get("ledger_key_id") or "no (unkeyed run)")]
    lines += ["| parameter | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]
    if r["covered"]:
        lines += ["## Covered", ""] + [f"- {c}" for c in r["covered"]] + [""]
    lines += ["## Not covered", ""] + [f"- {c}" for c in r["not_covered"]] + [""]
    if r["history"]:
        lines += ["## Event history (composed in order)", ""]
        lines += [f"- {h['count']} × `{json.dumps(h['event'])}`" for h in r["history"]] + [""]
    if r["data_preparation_events"]:
        lines += ["## Data preparation events", ""] + [f"- {d}" for d in r["data_preparation_events"]] + [""]
    if "vocabulary" in r:
        lines += ["## Vocabulary", "", f"`{r['vocabulary']['file']}`: {r['vocabulary']['note']}", ""]
    if "feature_pipeline" in r:
        fp = r["feature_pipeline"]
        lines += ["## Feature pipeline (raw-row scoring)", "", f"`{fp['file']}`: {fp['note']}.", ""]
        if fp.get("dp_statistics"):
            lines += [f"- DP standardization statistics ({', '.join(fp['dp_statistics'])}): "
                      f"{fp['dp_statistics_note']}.", ""]
        if fp.get("vocabularies"):
            lines += [f"- Vocabularies ({', '.join(f'`{v}`' for v in fp['vocabularies'])}): "
                      f"{fp['vocabularies_note']}.", ""]
    return "\n".join(lines)


def readme(spec: dict, report: dict) -> str:
    eps = "no privacy guarantee (nonprivate)" if report["mode"] == "nonprivate" else \
        f"(ε = {_fmt(report['epsilon'])}, δ = {_fmt(report['delta'])})-DP"
    return "\n".join([
        f"# widedp export: {spec['model']}",
        "",
        f"Privacy: {eps} — see PRIVACY.md and privacy_report.json.",
        "",
        "Load with plain PyTorch (widedp not needed):",
        "",
        "```python",
        "import sys; sys.path.insert(0, EXPORT_DIR)",
        "from load_model import load",
        "model = load(EXPORT_DIR)",
        "out = model(features, dense)",
        "```",
        "",
        "Inputs: `features` is a dict with one entry per feature of model.json, "
        "`name -> (values, offsets)`: `values` a 1-D LongTensor of row ids into the feature's table (all B "
        "bags concatenated), `offsets` a 1-D LongTensor of bag starts as `torch.nn.EmbeddingBag` takes them "
        "(B entries starting at 0; B + 1 with len(values) last also accepted). Each bag is pooled "
        "(sum or mean, per model.json). "
        f"`dense` is a float tensor [B, {spec['num_dense']}]"
        + (" (or None)." if spec["num_dense"] == 0 else "."),
        "",
        f"Output: {spec['output']['kind']} {spec['output']['shape']} — {spec['output']['description']}.",
        "",
        "Files: model.json (architecture), "
        f"{spec['weights']['file']} (`embeddings.<table>` [rows, dim] and `dense.<name>` tensors), "
        "dense.pt2 (the dense part, `torch.export`; needs a compatible PyTorch, "
        f"exported with {spec['dense']['torch_version']}), load_model.py, config.json (training config "
        "without secrets), privacy_report.json, PRIVACY.md"
        + (", vocab.tsv (row id = line number, 0-based)" if "vocabulary" in report else "")
        + (", features.json (the feature pipeline)" if spec.get("raw_rows", {}).get("available") else "")
        + (", vocabularies/ (the schema's public vocabulary files)"
           if spec.get("raw_rows", {}).get("vocabularies") else "") + ".",
        "",
        *_readme_raw_rows(spec),
    ])


def _readme_raw_rows(spec: dict) -> list:
    raw = spec.get("raw_rows") or {}
    if not raw.get("available"):
        return ["Raw rows: not available for this export — " + str(raw.get("reason", "")).rstrip(".") + ".", ""]
    return [
        "## Scoring raw rows",
        "",
        "The data set came from `widedp convert table`: features.json carries its feature pipeline (dense fills "
        "and transforms with their bounds and mean/std, hashing with its function and constants, vocabularies, "
        "list separators, max_length, pooling) and load_model.py applies it in plain Python/numpy, giving the "
        "ids and float32 dense values the converter gave, so the scores equal `widedp evaluate`'s on the same "
        "rows:",
        "",
        "```python",
        "model = load(EXPORT_DIR)",
        "out = model.score_rows([{column: value, ...}, ...])   # or a pyarrow Table / pandas DataFrame",
        "out = model.score_parquet(PATH)                        # needs pyarrow; model.score_csv(PATH)",
        "features, dense = model.featurize(rows)                # the model's inputs, as converted",
        "```",
        "",
        "From a shell: `python load_model.py EXPORT_DIR --score-parquet FILE` (or `--score-csv FILE`; "
        "`--out SCORES.csv`), one CSV line per input row, in order. Columns read: "
        + ", ".join(f"`{c}`" for c in raw.get("columns", [])) + " (list columns as lists; in CSV as text split "
        "by the feature's separator). Label, unit and timestamp columns are not model inputs.",
        "",
    ]
