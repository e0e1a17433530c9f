"""One training step of the DLRM-style CTR model: plain PyTorch (the floor), Opacus ghost
clipping (the peer) and widedp (sparse on in-process shards and on Ray, dpsgd, nonprivate).

The model is configs/ctr.toml's (trainer/models/dlrm.py: 13 dense features, 26 categorical
tables, embedding dim 16, bottom MLP [64], top MLP [64], interaction "cat"; expected batch
1024, Poisson sampling), on the project's planted-truth CTR data (`data.synth = "ctr"`, the
config's generator, 26 tables of `--rows` rows each). Every system reads the same train split:

  pytorch-nonprivate       the floor: one `nn.EmbeddingBag(mode="sum", sparse=True)` per table,
                           the same dense module (trainer.models.dlrm.DLRM), SGD with sparse
                           embedding gradients, no privacy; Poisson-sampled batches.
  opacus-ghost             the peer: what an Opacus user writes — one `nn.Embedding` per table
                           (each looked up once per forward, as ghost clipping requires), the same
                           dense module, `nn.BCEWithLogitsLoss` (a criterion with `reduction`),
                           `PrivacyEngine.make_private(..., poisson_sampling=True,
                           grad_sample_mode="ghost")`: per-example norms without per-example
                           gradients, then a dense gradient of every table noised and applied.
  widedp-sparse-inprocess  the config's selection (train.selection), in one process with one
                           shard: every table in one TBE, as a single-machine user runs it.
  widedp-sparse-sharded    the same in one process on the config's cluster.num_shards shards:
                           Ray's placement without Ray (what the Ray goal compares against).
  widedp-sparse-ray        the same on Ray shard actors (cluster.num_shards of the config).
  widedp-sparse-ray-compiled  the same over the compiled data plane (cluster.data_plane =
                           "compiled": one compiled Ray graph carries every round), its processes
                           waiting on the channels with sleeps (cluster.compiled_wait = "backoff").
  widedp-sparse-ray-compiled-spin
                           the same with Ray's own spinning channel reads (compiled_wait = "spin").
  widedp-sparse-ray-eager, widedp-sparse-ray-compiled-eager
                           the two Ray systems with the write-back in a round of its own
                           (cluster.fold_write_back = false; the default folds it into the
                           next step's lookup: one round fewer per step).
  widedp-sparse-ray-norms-round
                           Ray shards with the per-example norms computed on the shards in a
                           round of their own (cluster.norms_on_trainer = false; the default
                           computes them on the trainer from the ids: one round fewer per step).
  widedp-dpsgd             noise on every row, in one process, one shard, with lazy noise (the
                           default for SGD, train.dpsgd_noise = "auto"): a row's noise of the steps
                           it was not read in arrives in one draw at its next read or release.
  widedp-dpsgd-eager       the same with every row noised and written every step
                           (train.dpsgd_noise = "eager", the O(rows) step).
  widedp-nonprivate        in one process, one shard.

Same σ (--sigma), S1 (privacy.clip_norm), learning rates (train.lr for the embeddings,
train.dense_lr for the dense part; plain SGD) and expected batch for every private system.
Both PyTorch systems fetch a batch with one gather per tensor (the dataset's `__getitems__`),
so neither pays a per-example Python loop that widedp does not; Opacus's own DPDataLoader
(UniformWithReplacementSampler) draws its batches, the floor an equivalent Poisson sampler.

--repeats R runs every system R times, interleaved per size (A B C … A B C …: load that drifts
over the run falls on every system), and takes each (system, size)'s step time — and the goals —
as the median of its repeats' median steps (on this 2-core machine one repeat of the same system
moved 18 → 31 ms at b = 1,024, enough to flip a ratio goal; the ray_batch_* runs use 3).

Conventions of benchmarks/opacus_compare.py: every (system, size) in a fresh worker process,
warm-up then timed steps until --steps or --max-seconds, median ms/step, peak memory (the
worker's peak RSS and the peak summed RSS of its process tree — Ray's daemons and actors
included); a configuration whose estimated memory does not fit is skipped. The table gives,
per system and size, ms/step, "× floor" (system / plain PyTorch) and "Opacus / system"
(Opacus ghost / system: how many times faster than the peer), all measured in this run, and
the goals evaluated on these numbers (`evaluate_goals`, a pure function):

  - in-process widedp sparse ≤ 3× the floor at every size;
  - in-process widedp sparse ≥ 5× faster than Opacus ghost at 26 × 20,000 rows and ≥ 50× at
    26 × 262,144 (other sizes, e.g. --quick: 5× at the smallest, 50× at the largest);
  - widedp dpsgd not slower than Opacus ghost at every size;
  - widedp dpsgd with lazy noise ≤ 3× the floor at every size (the O(rows) part gone, the
    step's cost is the sparse step's: per-example clipping of the rows read);
  - the Ray sparse step ≤ 1.3× the in-process sparse step at every size;
  - over the compiled data plane ≤ 1.5× at expected batch ≤ 1k, ≤ 1.2× above (--batch 16384).

On a machine busy with other work, torch's OpenMP threads spin-wait for descheduled peers and
small steps slow down by up to 100× (measured: the floor's 26 × 500-row step 5 ms with one
thread, ~500 ms with two on a 2-core machine at load 4); time on an idle machine, or set
OMP_NUM_THREADS (every worker inherits it; the results file records torch's thread count).

    python benchmarks/dlrm_compare.py [--quick] [--rows 20000,262144] [--systems ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (DATA_DIR, announce_machine, ensure_config_dataset, fmt_bytes, format_table,  # noqa: E402
                     run_timed_system, time_engine, widedp_timing_spec, worker_entry, write_results)
from opacus_compare import _timed, torch_step  # noqa: E402  (the same training step and timing loop)

SYSTEMS = ("pytorch-nonprivate", "opacus-ghost", "widedp-sparse-inprocess", "widedp-sparse-sharded", "widedp-sparse-ray",
           "widedp-sparse-ray-compiled", "widedp-sparse-ray-compiled-spin", "widedp-sparse-ray-eager", "widedp-sparse-ray-compiled-eager",
           "widedp-sparse-ray-norms-round", "widedp-dpsgd", "widedp-dpsgd-eager",
           "widedp-nonprivate")
LABELS = {
    "pytorch-nonprivate": "plain PyTorch, EmbeddingBag(sparse=True) + SGD, non-private (the floor)",
    "opacus-ghost": "Opacus ghost clipping DP-SGD (the peer)",
    "widedp-sparse-inprocess": "widedp sparse, in-process, one shard",
    "widedp-sparse-sharded": "widedp sparse, in-process, Ray's shards",
    "widedp-sparse-ray": "widedp sparse, Ray shards",
    "widedp-sparse-ray-compiled": "widedp sparse, Ray shards, compiled data plane (waits with sleeps)",
    "widedp-sparse-ray-compiled-spin": "widedp sparse, Ray shards, compiled data plane, Ray's spinning waits",
    "widedp-sparse-ray-eager": "widedp sparse, Ray shards, write-back round of its own",
    "widedp-sparse-ray-compiled-eager": "widedp sparse, Ray shards, compiled data plane, write-back round of its own",
    "widedp-sparse-ray-norms-round": "widedp sparse, Ray shards, norms round on the shards",
    "widedp-dpsgd": "widedp dpsgd, in-process, lazy noise (the default)",
    "widedp-dpsgd-eager": "widedp dpsgd, in-process, eager noise (every row every step)",
    "widedp-nonprivate": "widedp nonprivate, in-process",
}
#: system -> (train.mode, cluster.backend, further overrides). In one process a row shard buys
#: nothing (no parallelism, one more call per phase), so the in-process systems hold one shard;
#: "sharded" keeps the config's shards, the placement the Ray system runs.
ONE_SHARD = ["cluster.num_shards=1"]
WIDEDP = {"widedp-sparse-inprocess": ("sparse", "local", ONE_SHARD), "widedp-sparse-sharded": ("sparse", "local", []),
          "widedp-sparse-ray": ("sparse", "ray", []),
          "widedp-sparse-ray-compiled": ("sparse", "ray", ["cluster.data_plane=compiled"]),
          "widedp-sparse-ray-compiled-spin": ("sparse", "ray", ["cluster.data_plane=compiled",
                                                                "cluster.compiled_wait=spin"]),
          "widedp-sparse-ray-eager": ("sparse", "ray", ["cluster.fold_write_back=false"]),
          "widedp-sparse-ray-compiled-eager": ("sparse", "ray", ["cluster.data_plane=compiled",
                                                                 "cluster.fold_write_back=false"]),
          "widedp-sparse-ray-norms-round": ("sparse", "ray", ["cluster.norms_on_trainer=false"]),
          "widedp-dpsgd": ("dpsgd", "local", ONE_SHARD),
          "widedp-dpsgd-eager": ("dpsgd", "local", [*ONE_SHARD, "train.dpsgd_noise=eager"]),
          "widedp-nonprivate": ("nonprivate", "local", ONE_SHARD)}
FLOOR, PEER = "pytorch-nonprivate", "opacus-ghost"
#: Goal: in-process sparse at least this many times faster than Opacus ghost, per rows per table.
SPEEDUP_GOALS = {20000: 5.0, 262144: 50.0}
FLOOR_GOAL = 3.0
RAY_GOAL = 1.3
#: Ray over the compiled data plane / in-process (same shards): ≤ 1.5× at b ≤ 1k, ≤ 1.2× at b ≥ 16k
#: (at large batches the shards' compute dominates the rounds' latency).
COMPILED_RAY_GOALS = {1024: 1.5, 16384: 1.2}


def compiled_ray_goal(batch: Optional[int]) -> float:
    """The compiled Ray goal at expected batch `batch` (the 1k goal up to 1k, else the 16k goal)."""
    return COMPILED_RAY_GOALS[1024] if batch is None or batch <= 1024 else COMPILED_RAY_GOALS[16384]


# ---- the PyTorch / Opacus user's DLRM ---------------------------------------------------------------

def _torch_model(table_rows: list[int], spec: dict, bag: bool):
    import torch
    from torch import nn

    from widedp.trainer.models.dlrm import DLRM

    dim = spec["dim"]

    class TorchDLRM(nn.Module):
        """One embedding per categorical feature (one id each) + the project's dense DLRM part."""

        def __init__(self):
            super().__init__()
            if bag:
                self.tables = nn.ModuleList(nn.EmbeddingBag(r, dim, mode="sum", sparse=True) for r in table_rows)
            else:
                self.tables = nn.ModuleList(nn.Embedding(r, dim) for r in table_rows)
            with torch.no_grad():
                for t in self.tables:
                    t.weight.normal_(0.0, spec["init_std"])
            self.dense = DLRM(features=[f"f{i}" for i in range(len(table_rows))], embedding_dim=dim,
                              num_dense=spec["num_dense"], bottom_mlp=spec["bottom_mlp"], top_mlp=spec["top_mlp"],
                              interaction=spec["interaction"])

        def forward(self, ids, dense):  # ids [B, F] (one id per feature), dense [B, 13]
            if bag:
                pooled = [t(ids[:, f:f + 1]) for f, t in enumerate(self.tables)]  # bags of one id
            else:
                pooled = [t(ids[:, f]) for f, t in enumerate(self.tables)]
            return self.dense(torch.stack(pooled, dim=1), dense)

    return TorchDLRM()


class _BatchedTensors:
    """Map-style dataset over aligned tensors; `__getitems__` gathers a whole batch at once
    (torch's DataLoader calls it instead of one `__getitem__` per example)."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i):
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices):
        import torch

        idx = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[idx] for t in self.tensors)


def _as_batch(batch):
    return batch  # already collated by `__getitems__`


class _PoissonBatches:
    """Poisson sampling for the floor: each example in a batch independently with rate q
    (what Opacus's UniformWithReplacementSampler does)."""

    def __init__(self, n: int, q: float, seed: int):
        import torch

        self.n, self.q = n, q
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return max(1, round(1 / self.q))

    def __iter__(self):
        import torch

        for _ in range(len(self)):
            yield torch.nonzero(torch.rand(self.n, generator=self.gen) < self.q).reshape(-1).tolist()


def _ctr_tensors(data_path: str, test_fraction: float, seed: int):
    """The train split as [N, F] ids, [N, 13] dense features, [N] labels, and the table sizes."""
    import numpy as np

    from widedp.trainer.data import open_dataset

    train, _ = open_dataset(data_path, test_fraction=test_fraction, seed=seed)
    batch = train.take(np.arange(len(train)))
    meta, n = train.meta, len(train)
    kjt = batch.sparse
    if not bool((kjt.lengths() == 1).all()):
        raise ValueError(f"{data_path}: the DLRM comparison needs one id per categorical feature")
    ids = kjt.values().reshape(len(meta.features), n).T.contiguous()  # key-major -> [N, F]
    rows = [int(meta.table_sizes[meta.feature_tables[f]]) for f in meta.features]
    return ids, batch.dense, batch.labels, rows


def torch_worker(spec: dict) -> dict:
    """Time the plain PyTorch floor or Opacus ghost clipping on the same train split."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    system = spec["system"]
    ids, dense, labels, rows = _ctr_tensors(spec["data"], spec["test_fraction"], spec["seed"])
    spec = dict(spec, num_dense=int(dense.shape[1]))
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    device = torch.device(spec.get("device", "cpu"))
    model = _torch_model(rows, spec, bag=(system == FLOOR)).to(device)
    groups = [{"params": list(model.tables.parameters()), "lr": spec["lr"]},
              {"params": list(model.dense.parameters()), "lr": spec["dense_lr"]}]
    optimizer = torch.optim.SGD(groups, lr=spec["lr"])
    criterion = nn.BCEWithLogitsLoss(reduction="mean")
    n = len(labels)
    dataset: Any = _BatchedTensors(ids, dense, labels)
    loader: Any
    if system == FLOOR:
        loader = DataLoader(dataset, batch_sampler=_PoissonBatches(n, spec["batch"] / n, spec["seed"]),
                            collate_fn=_as_batch)
    elif system == PEER:
        from opacus import PrivacyEngine

        engine = PrivacyEngine(accountant="rdp")
        loader = DataLoader(dataset, batch_size=spec["batch"], collate_fn=_as_batch)
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=loader,
            noise_multiplier=spec["sigma"], max_grad_norm=spec["clip"], poisson_sampling=True,
            grad_sample_mode="ghost")
    else:
        raise ValueError(f"unknown system {system!r}")
    build_s = time.perf_counter() - t0

    expected_batch = spec["batch"] if system == FLOOR else n / len(loader)
    return _timed(torch_step(model, optimizer, criterion, loader, device if device.type != "cpu" else None), spec,
                  build_s, extra={"train_examples": n, "table_rows": rows, "expected_batch": expected_batch,
                                  "device": str(device)})


def worker(spec: dict) -> dict:
    if spec["system"].startswith("widedp"):
        return time_engine(spec)
    return torch_worker(spec)


# ---- goals and ratios (pure: from step times only) --------------------------------------------------

def speedup_goal(rows: int, sizes: list[int]) -> Optional[float]:
    """The issue's speed-up goal over Opacus at `rows` per table: 5× at 20,000, 50× at 262,144;
    at other sizes (--quick, --rows), 5× at the smallest measured size and 50× at the largest."""
    if rows in SPEEDUP_GOALS:
        return SPEEDUP_GOALS[rows]
    if rows == max(sizes) and len(sizes) > 1:
        return SPEEDUP_GOALS[262144]
    if rows == min(sizes):
        return SPEEDUP_GOALS[20000]
    return None


def evaluate_goals(step_ms: dict, sizes: list[int], batch: Optional[int] = None) -> list[dict]:
    """The goals on measured median step times `step_ms[(system, rows)]` (ms).

    Each goal: {"goal", "per_size": {rows: {"value", "target", "met"}}, "met"} where `met` is
    True when every size met it, False when a measured size missed it, None when some size
    lacks a measurement (and none missed)."""
    def ms(system, rows):
        v = step_ms.get((system, rows))
        return v if v is not None and v > 0 else None

    specs = [
        ("in-process widedp sparse ≤ 3× the floor (plain PyTorch) at every size", "≤",
         lambda r: (ms("widedp-sparse-inprocess", r), ms(FLOOR, r)), lambda r: FLOOR_GOAL, "× floor"),
        ("in-process widedp sparse ≥ 5× faster than Opacus ghost at 26 × 20,000 and ≥ 50× at 26 × 262,144", "≥",
         lambda r: (ms(PEER, r), ms("widedp-sparse-inprocess", r)), lambda r: speedup_goal(r, sizes), "Opacus / sparse"),
        ("widedp dpsgd not slower than Opacus ghost at every size", "≥",
         lambda r: (ms(PEER, r), ms("widedp-dpsgd", r)), lambda r: 1.0, "Opacus / dpsgd"),
        ("Ray sparse step ≤ 1.3× the in-process sparse step (same shards) at every size", "≤",
         lambda r: (ms("widedp-sparse-ray", r), ms("widedp-sparse-sharded", r)), lambda r: RAY_GOAL,
         "Ray / in-process"),
        (f"Ray sparse step over the compiled data plane ≤ {compiled_ray_goal(batch):g}× the in-process sparse step "
         f"(same shards) at every size (expected batch {batch})", "≤",
         lambda r: (ms("widedp-sparse-ray-compiled", r), ms("widedp-sparse-sharded", r)),
         lambda r: compiled_ray_goal(batch), "compiled Ray / in-process"),
        (f"widedp dpsgd with lazy noise ≤ {FLOOR_GOAL:g}× the floor (plain PyTorch) at every size", "≤",
         lambda r: (ms("widedp-dpsgd", r), ms(FLOOR, r)), lambda r: FLOOR_GOAL, "× floor"),
    ]
    goals = []
    for text, op, pair, target, unit in specs:
        per, missing = {}, False
        for rows in sizes:
            t = target(rows)
            if t is None:
                continue
            a, b = pair(rows)
            if a is None or b is None:
                missing = True
                per[rows] = {"value": None, "target": t, "met": None}
                continue
            v = a / b
            per[rows] = {"value": v, "target": t, "met": v <= t if op == "≤" else v >= t}
        flags = [p["met"] for p in per.values() if p["met"] is not None]
        met = False if (False in flags) else (None if missing or not flags else True)
        goals.append({"goal": text, "op": op, "unit": unit, "per_size": per, "met": met})
    return goals


def goal_line(g: dict) -> str:
    status = {True: "met", False: "missed", None: "not measured at every size"}[g["met"]]
    parts = [f"26 × {int(rows):,}: " + ("not measured" if p["value"] is None else f"{p['value']:,.2f}×")
             + f" (goal {g['op']} {p['target']:g}×)" for rows, p in g["per_size"].items()]
    return f"{g['goal']}: {status} — {g['unit']} " + "; ".join(parts)


def repeat_step_ms(results: list) -> dict:
    """(system, rows) -> each repeat's median step ms, in repeat order (rows without "repeat": one)."""
    out: dict = {}
    for r in sorted(results, key=lambda r: r.get("repeat", 0)):
        if r.get("step_ms_median"):
            out.setdefault((r["system"], r["rows"]), []).append(r["step_ms_median"])
    return out


def summarize(results: list, sizes: list[int], batch: Optional[int] = None) -> dict:
    """Ratios and goals on each (system, size)'s step time: the median over repeats of each
    repeat's median step (--repeats runs every system once per repeat, interleaved)."""
    per_repeat = repeat_step_ms(results)
    step_ms = {key: float(np.median(v)) for key, v in per_repeat.items()}
    ratios = {}
    for rows in sizes:
        floor, peer = step_ms.get((FLOOR, rows)), step_ms.get((PEER, rows))
        entry = {}
        for s in SYSTEMS:
            t = step_ms.get((s, rows))
            if t is None:
                continue
            entry[s] = {"step_ms": t, "x_floor": t / floor if floor else None, "opacus_over": peer / t if peer else None,
                        "repeats_ms": per_repeat[(s, rows)]}
        ratios[str(rows)] = entry
    goals = evaluate_goals(step_ms, sizes, batch)
    return {"ratios": ratios, "goals": goals, "lines": [goal_line(g) for g in goals]}


# ---- driver -------------------------------------------------------------------------------------------

def memory_estimate(system: str, rows: int, tables: int, dim: int) -> float:
    table = tables * rows * dim * 4
    if system == PEER:
        return table * 5.0 + 1.0e9  # weights, dense grads, summed grads, noise, temporaries
    if system == FLOOR:
        return table * 1.5 + 1.0e9  # weights + sparse grads
    return table * 1.3 + 3e9  # widedp: the tables (+ Ray)


def _dataset(config: str, rows: int, examples: int, seed: int, extra: list[str]) -> tuple[str, list[str]]:
    """The config's planted-truth CTR set with `rows` per table (generated once, cached)."""
    path = DATA_DIR / f"dlrm_ctr_t{rows}_n{examples}_s{seed}"
    over = [f"data.path={path}", "data.synth=ctr", f"data.synth_table_size={rows}", f"data.synth_examples={examples}",
            *extra]
    return ensure_config_dataset(config, over), over


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="26 x 500 and 26 x 2000 rows, batch 64, few steps")
    parser.add_argument("--config", default="configs/ctr.toml")
    parser.add_argument("--rows", default=None, help="rows per table, comma list (default 20000,262144; quick 500,2000)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--batch", type=int, default=None, help="expected batch (default: the config's; quick 64)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--examples", type=int, default=None, help="default: the config's synth_examples (quick 5000)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (quick 1)")
    parser.add_argument("--max-seconds", type=float, default=None, help="per configuration (default 120, quick 20)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every system this many times, interleaved (A B C A B C ...: load drifting over the "
                             "run falls on all); each (system, size) is the median of its repeats' median steps")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--device", default="cpu",
                        help="where plain PyTorch and Opacus run (cuda: the GPU; widedp's shards take the GPU "
                             "whenever torch sees one, its dense part stays on the CPU)")
    parser.add_argument("--out")
    parser.add_argument("--recompute", metavar="FILE", help="re-derive ratios and goals of an existing results file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.recompute:
        return recompute(Path(args.recompute))
    started = time.time()
    quick = args.quick
    sizes = [int(float(v)) for v in (args.rows or ("500,2000" if quick else "20000,262144")).split(",")]
    steps = args.steps or (3 if quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    max_seconds = args.max_seconds or (20.0 if quick else 120.0)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    machine = announce_machine()
    from widedp.trainer.config import load_config

    cfg = load_config(args.config, args.set)
    batch = args.batch or (64 if quick else cfg.train.batch_size)
    examples = args.examples or (5000 if quick else cfg.data.synth_examples)
    m = cfg.model
    common = {"dim": m.embedding_dim, "bottom_mlp": list(m.bottom_mlp), "top_mlp": list(m.top_mlp),
              "interaction": m.interaction, "init_std": m.init_std, "batch": batch, "sigma": args.sigma,
              "clip": cfg.privacy.clip_norm, "lr": cfg.train.lr, "dense_lr": cfg.train.dense_lr,
              "test_fraction": cfg.data.test_fraction, "seed": cfg.data.seed}
    print(f"DLRM ({args.config}): 26 tables × {', '.join(f'{r:,}' for r in sizes)} rows, dim {m.embedding_dim}, "
          f"bottom {list(m.bottom_mlp)}, top {list(m.top_mlp)}, interaction {m.interaction}; expected batch {batch} "
          f"(Poisson), σ {args.sigma}, S1 {common['clip']}, SGD lr {common['lr']} (dense {common['dense_lr']}), "
          f"widedp sparse/{cfg.train.selection} k {cfg.privacy.k}, {cfg.cluster.num_shards} shards; {examples:,} examples\n")
    results = []
    for rows in sizes:
        data, data_over = _dataset(args.config, rows, examples, cfg.data.seed, args.set)
        for repeat, system in ((rep, s) for rep in range(args.repeats) for s in systems):
            row: dict = {"system": system, "rows": rows, "tables": 26, "repeat": repeat}
            spec = dict(common, system=system, data=str(data), steps=steps, warmup=warmup, max_seconds=max_seconds,
                        device=args.device)
            if system in WIDEDP:
                mode, backend, placement = WIDEDP[system]
                extra = [*data_over, f"train.batch_size={batch}", "train.optimizer=sgd", *placement]
                spec.update(widedp_timing_spec(args.config, mode, cfg.train.selection, backend, extra, args.sigma))
            results.append(run_timed_system(__file__, row, spec, memory_estimate(system, rows, 26, m.embedding_dim),
                                            f"26×{rows:,}" + (f" (repeat {repeat + 1}/{args.repeats})"
                                                              if args.repeats > 1 else "")))
    summary = summarize(results, sizes, batch)
    print_tables(results, summary, sizes)
    payload = {"config": args.config, "rows": sizes, "tables": 26, **common, "examples": examples, "steps": steps,
               "warmup": warmup, "max_seconds": max_seconds, "repeats": args.repeats,
               "selection": cfg.train.selection, "k": cfg.privacy.k,
               "num_shards": cfg.cluster.num_shards, "fold_write_back": cfg.cluster.fold_write_back,
               "norms_on_trainer": cfg.cluster.norms_on_trainer,
               "systems": systems, "labels": LABELS, "results": results,
               "summary": summary}
    write_results("dlrm_compare", payload, quick=quick, machine=machine, out=args.out, started=started)
    return payload


def _note(r) -> str:
    if r.get("skipped"):
        return "skipped: " + r["skipped"][:70]
    if r.get("error"):
        return "FAILED: " + r["error"][:70]
    if r.get("steps_timed") == 1:
        return "1 timed step"
    return ""


def print_tables(results: list, summary: dict, sizes: list[int]) -> None:
    ratios = summary["ratios"]

    def x(v):
        return None if v is None else f"{v:,.2f}×"

    print("\n" + format_table(
        ["rows", "system", "step ms", "× floor", "Opacus / system", "examples/s", "peak RSS", "peak tree RSS", "note"],
        [[f"26 × {r['rows']:,}", r["system"], r.get("step_ms_median"),
          x(ratios.get(str(r["rows"]), {}).get(r["system"], {}).get("x_floor")),
          x(ratios.get(str(r["rows"]), {}).get(r["system"], {}).get("opacus_over")), r.get("examples_per_sec"),
          fmt_bytes(r.get("ru_maxrss_bytes")), fmt_bytes(r.get("peak_tree_rss_bytes")), _note(r)] for r in results]))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in results)]
    headers = ["system"] + [h for rows in sizes for h in (f"26×{rows:,} ms", "× floor", "Opacus/sys")]
    body = []
    for s in systems:
        line: list = [s]
        for rows in sizes:
            e = ratios.get(str(rows), {}).get(s, {})
            line += [e.get("step_ms"), x(e.get("x_floor")), x(e.get("opacus_over"))]
        body.append(line)
    print("\n" + format_table(headers, body))
    print("\ngoals (measured in this run):")
    for text in summary["lines"]:
        print("  " + text)


def recompute(path: Path) -> dict:
    """Ratios and goals again from the measured rows of a results file (no timing)."""
    import json

    doc = json.loads(path.read_text())
    doc["summary"] = summarize(doc["results"], doc["rows"], doc.get("batch"))
    doc["recomputed"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_tables(doc["results"], doc["summary"], doc["rows"])
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"rewrote {path}")
    return doc


if __name__ == "__main__":
    worker_entry(worker)
    main()
