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

No optimizer state, generator state, sampler state or DP-FEST selection is written. The
directory is built under a temporary name next to OUT_DIR and renamed into place at the end,
so a failure leaves no OUT_DIR behind; an existing non-empty OUT_DIR is refused.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from widedp.trainer import strict_json

FORMAT_VERSION = 1
TEMPLATE_DIR = Path(__file__).resolve().parent / "export_template"
LOADER_FILE = "load_model.py"
REQUIRED_RUN_FILES = ("checkpoint.pt", "summary.json", "config.json")

# Config keys that are secret or describe the local machine, not the model: (section, key).
DROPPED_CONFIG_KEYS = (("privacy", "noise_seed"), ("cluster", "address"))

UNIT_OF_PRIVACY = "one training example; add/remove neighbouring datasets"
UNIT_OF_PRIVACY_USER = ("one user (the data set's unit column) with all of their examples; add/remove "
                        "neighbouring datasets over users")
COVERED = ("the released model and every intermediate update, for add/remove of one training example; "
           "data-preparation events such as a private vocabulary are in the history")
COVERED_USER = ("the released model and every intermediate update, for add/remove of one user with all of their "
                "training examples (users sampled, at most privacy.max_examples_per_user examples each per step, "
                "each user's gradient clipped as one); data-preparation events are in the history")
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

    summary = json.loads((run_dir / "summary.json").read_text())
    run_config = json.loads((run_dir / "config.json").read_text())
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    # The checkpoint's config is the one the saved state was trained under (a resume with --set
    # overrides does not rewrite config.json).
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
    report = privacy_report(run_dir, summary, config, engine_state, meta)
    spec = model_spec(config, meta, layout, engine_state.get("step"))
    ema_decay = config.get("train", {}).get("ema_decay", 0.0)
    spec["parameters"] = (f"exponential moving average of the iterates, decay {ema_decay} (train.ema_decay)"
                          if averaged else "the last iterate")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    try:
        spec["weights"] = {"file": _write_weights(tmp, weights), "keys": _weight_key_doc(spec)}
        _write_dense(tmp, dense_model, layout, meta.num_dense)
        shutil.copyfile(TEMPLATE_DIR / LOADER_FILE, tmp / LOADER_FILE)
        _write_json(tmp / "model.json", spec)
        _write_json(tmp / "config.json", public_config(config))
        vocab = Path(config["data"]["path"]) / "vocab.tsv"
        if vocab.is_file():
            shutil.copyfile(vocab, tmp / "vocab.tsv")
            report["vocabulary"] = _vocabulary_note(meta)
        _write_json(tmp / "privacy_report.json", report)
        (tmp / "PRIVACY.md").write_text(privacy_markdown(report), encoding="utf-8")
        (tmp / "README.md").write_text(readme(spec, report), encoding="utf-8")
        _self_check(tmp, tables, dense_model, layout, meta.num_dense)
        os.chmod(tmp, 0o755)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out_dir), "files": sorted(p.name for p in out_dir.iterdir()),
            "model": spec["model"], "dense_format": spec["dense"]["format"], "weights": spec["weights"]["file"],
            "mode": report["mode"], "private": report["private"], "epsilon": report["epsilon"], "delta": report["delta"],
            "accountant": report["accountant"], "steps": report["steps"]}


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
    from widedp.trainer.data.meta import read_meta

    path = Path(config["data"]["path"])
    if not (path / "dataset.json").is_file():
        raise ExportError(f"{path / 'dataset.json'}: missing (the export needs the run's data set "
                          f"description for the table sizes, features and pooling)")
    return read_meta(path)


def _layout(meta, config: dict):
    from widedp.trainer.layout import FeatureSpec, ShardLayout, TableSpec

    dim = int(config["model"]["embedding_dim"])
    tables = tuple(TableSpec(name, int(rows), dim) for name, rows in meta.table_sizes.items())
    features = tuple(FeatureSpec(f, meta.feature_tables[f], meta.pooling[f]) for f in meta.features)
    return ShardLayout(tables, features, int(config["cluster"]["num_shards"]))


def _dense_model(config: dict, meta, model_state: dict):
    from widedp.trainer.models import MODELS

    m = config["model"]
    with torch.random.fork_rng(devices=[]):  # construction draws initial weights; they are overwritten
        model = MODELS[m["name"]](features=list(meta.features), embedding_dim=int(m["embedding_dim"]),
                                  num_dense=meta.num_dense, bottom_mlp=list(m.get("bottom_mlp", [])),
                                  top_mlp=list(m.get("top_mlp", [])), interaction=m.get("interaction", "dot"))
    model.load_state_dict(model_state)
    return model.eval()


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


def _self_check(tmp: Path, tables: dict, dense_model, layout, num_dense: int) -> None:
    """Load the written artifact with its own loader and compare it with the in-memory model on a
    random batch (ids, bags and dense values drawn here: no data involved)."""
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


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    _check_out_dir(out_dir)
    try:
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked): replaced by the export
        os.rename(tmp, out_dir)
    except OSError as exc:
        raise ExportError(f"{out_dir}: cannot move the export into place ({exc})") from exc


# ---- model description ----------------------------------------------------------------------------
def model_spec(config: dict, meta, layout, step) -> dict:
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
    return spec


def _weight_key_doc(spec: dict) -> dict:
    return {"embeddings.<table>": "float32 [num_rows, dim], the whole table in row order",
            "dense.<name>": "the dense part's parameters (names as in dense.pt2's module)"}


# ---- privacy report ---------------------------------------------------------------------------------
def _ledger(run_dir: Path, engine_state: dict):
    """ledger.json (persisted before each release; its events hash to the chain it stores) — and
    it must extend the ledger the checkpoint embeds: a ledger.json that is missing, rolled back,
    replaced or edited is refused, never replaced by the checkpoint's shorter copy (which would
    forget the steps released after the checkpoint)."""
    from widedp.accounting import PrivacyLedger

    ledger_file = run_dir / "ledger.json"
    if not ledger_file.is_file():
        return None
    try:
        ledger = PrivacyLedger.load(ledger_file)
    except (ValueError, KeyError, OSError) as exc:
        raise ExportError(f"{exc}: its privacy cannot be reported") from None
    saved = engine_state.get("ledger")
    if saved is not None:
        from_checkpoint = PrivacyLedger(saved.get("accountant", "rdp"), saved.get("delta", 1e-6))
        from_checkpoint.load_state_dict(saved)
        if not ledger.extends(from_checkpoint.chain()):
            raise ExportError(f"{ledger_file}: does not extend the {from_checkpoint.steps} events {run_dir / 'checkpoint.pt'} "
                              f"records (it holds {ledger.steps}): it was rolled back, replaced or edited, so its "
                              "privacy cannot be reported")
    return ledger


def privacy_report(run_dir: Path, summary: dict, config: dict, engine_state: dict, meta) -> dict:
    train, priv = config["train"], config["privacy"]
    mode = summary.get("mode", train["mode"])
    private = mode != "nonprivate"
    ledger = _ledger(run_dir, engine_state) if private else None
    if private and ledger is None:
        raise ExportError(f"{run_dir}: a {mode} run without ledger.json: its privacy cannot be reported "
                          f"(a ledger is never rebuilt from the checkpoint, which misses the steps released after it)")
    reproducible = bool(summary.get("reproducible", False) or priv.get("reproducible", False)
                        or engine_state.get("reproducible", False))
    debug = bool(summary.get("debug_metrics", False) or train.get("debug_metrics", False))
    data_events = [redact(d) for d, _ in meta.privacy_events]
    user_level = priv.get("unit", "example") == "user"

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
        "secure_mode": priv.get("secure_mode"),
        "randomness": summary.get("randomness"),
        "reproducible": reproducible,
        "debug_metrics": debug,
        "history": state["history"] if state is not None else [],
        "data_preparation_events": data_events,
        "covered": [COVERED_USER if user_level else COVERED] if private else [],
        "not_covered": not_covered,
        "caveats": run_caveats,
    }
    if ledger is not None and report["target_epsilon"] is not None and epsilon > float(report["target_epsilon"]) * (1 + 1e-9):
        report["not_covered"].insert(0, f"ε = {epsilon:.6g} exceeds the run's target ε = {report['target_epsilon']} "
                                        f"(the ledger counts {ledger.steps} events for {report['steps']} steps; "
                                        f"events charged by a crashed attempt are counted, never forgotten)")
    return report


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
    rows = [("mode", r["mode"]), ("selection", r["selection"]), ("target ε", r["target_epsilon"]),
            ("steps", r["steps"]), ("events charged", r["events_charged"]), ("sample rate q", r["sample_rate"]),
            ("expected batch size", r["expected_batch_size"]), ("noise multiplier σ", r["noise_multiplier"]),
            ("selection ε", r["selection_epsilon"]), ("k", r["k"]), ("clip norm S1", r["clip_norm"]),
            ("second clip norm S2", r["second_clip_norm"]), ("secure mode", r["secure_mode"]),
            ("randomness", r["randomness"])]
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
        + (", vocab.tsv (row id = line number, 0-based)" if "vocabulary" in report else "") + ".",
        "",
    ])


# ---- CLI --------------------------------------------------------------------------------------------
def add_commands(sub) -> dict:
    e = sub.add_parser("export", help="write a run's releasable model (weights, loader) and privacy report")
    e.add_argument("run_dir_pos", nargs="?", metavar="RUN_DIR", help="the run (or --run-dir, as `widedp evaluate`)")
    e.add_argument("out_dir_pos", nargs="?", metavar="OUT_DIR", help="new (or empty) directory (or --out-dir)")
    e.add_argument("--run-dir", dest="run_dir_opt", metavar="RUN_DIR")
    e.add_argument("--out-dir", dest="out_dir_opt", metavar="OUT_DIR")
    return {"export": cmd_export}


def _one_of(positional, option, what: str, flag: str):
    if positional is not None and option is not None:
        raise ValueError(f"give {what} once: as {flag} or positionally, not both")
    if positional is None and option is None:
        raise ValueError(f"{flag} (or {what} positionally) is required")
    return positional if positional is not None else option


def cmd_export(args) -> dict:
    if args.run_dir_opt is not None and args.run_dir_pos is not None and args.out_dir_pos is None:
        args.run_dir_pos, args.out_dir_pos = None, args.run_dir_pos  # `export --run-dir R OUT`
    run_dir = _one_of(args.run_dir_pos, args.run_dir_opt, "RUN_DIR", "--run-dir")
    out_dir = _one_of(args.out_dir_pos, args.out_dir_opt, "OUT_DIR", "--out-dir")
    return export_run(run_dir, out_dir)
