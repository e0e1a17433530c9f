"""widedp versus Opacus DP-SGD on CBOW: throughput and peak memory at vocabularies 10^5..10^7.

The Opacus side is CBOW written the way an Opacus user would: two `nn.Embedding` tables
(input, output), the context mean-pooled from a padded id matrix with a mask, target and
negatives looked up together (each embedding is used once per forward, which ghost clipping
requires), a criterion object with a `reduction` attribute, `PrivacyEngine.make_private`
with Poisson sampling and `grad_sample_mode="ghost"` (ghost clipping: per-example norms
without materializing per-example gradients — the mode that helps for embeddings); "hooks"
(per-example gradients, B x V x D) only up to --hooks-max-vocab. Also plain non-private
PyTorch (same model, dense gradients). The widedp side is configs/cbow.toml on the same data
(same train split, expected batch, σ, clip S1, learning rate, embedding dim), SGD for every
system: `sparse` (config's selection and k) on Ray and in-process, `dpsgd` (lazy noise, the
default for SGD) on Ray and in-process, `nonprivate`.

Every (system, vocabulary) runs in a fresh process: warm-up, then timed steps until --steps
or --max-seconds (a step that alone outlasts the budget is measured once and marked so).
A configuration whose estimated memory does not fit is not run; its time is extrapolated
from the same system's two largest measured vocabularies (power law in V) and marked
"extrapolated". Peak memory = the worker's peak RSS (getrusage) and, for Ray, the peak summed
RSS of its process tree (Ray's daemons and actors included).

    python benchmarks/opacus_compare.py [--quick] [--vocabs 100000,1000000,10000000] [--dim 64]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, fmt_bytes, format_table, run_timed_system, text_dataset, time_engine,  # noqa: E402
                     widedp_timing_spec, worker_entry, write_results)

SYSTEMS = ("opacus-ghost", "opacus-hooks", "pytorch-nonprivate", "widedp-sparse", "widedp-sparse-inprocess",
           "widedp-dpsgd", "widedp-dpsgd-inprocess", "widedp-nonprivate")
#: Goal: widedp DP-SGD (lazy noise, the default for SGD) at least this many times Opacus ghost's
#: throughput at the largest vocabulary (LazyDP's 119× over its DP-SGD baseline is the anchor).
DPSGD_GOAL = 500.0


# ---- the Opacus user's CBOW ---------------------------------------------------------------------

def _torch_model(vocab: int, dim: int, init_std: float):
    import torch
    from torch import nn

    class TorchCBOW(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Embedding(vocab, dim)
            self.out = nn.Embedding(vocab, dim)
            with torch.no_grad():
                self.inp.weight.normal_(0.0, init_std)
                self.out.weight.normal_(0.0, init_std)

        def forward(self, ctx, mask, out_ids):
            e = self.inp(ctx) * mask.unsqueeze(-1)  # [B, L, D], padding masked out
            h = e.sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)  # mean over the real context
            o = self.out(out_ids)  # [B, 1 + negatives, D]: target first
            return torch.einsum("bd,bkd->bk", h, o)

    return TorchCBOW()


def _criterion():
    import torch.nn.functional as F
    from torch import nn

    class CBOWLoss(nn.Module):
        """-log σ(h·o_target) - Σ log σ(-h·o_neg); `reduction` as Opacus' ghost clipping wants."""

        def __init__(self):
            super().__init__()
            self.reduction = "mean"

        def forward(self, logits, labels=None):
            per = -F.logsigmoid(logits[:, 0]) - F.logsigmoid(-logits[:, 1:]).sum(dim=1)
            return per if self.reduction == "none" else (per.sum() if self.reduction == "sum" else per.mean())

    return CBOWLoss()


def _padded_tensors(data_path: str, test_fraction: float, seed: int):
    import numpy as np
    import torch

    from widedp.trainer.data import open_dataset

    train, _ = open_dataset(data_path, test_fraction=test_fraction, seed=seed)
    batch = train.take(np.arange(len(train)))
    kjt = batch.sparse
    ctx_jt = kjt["context"]
    lengths = ctx_jt.lengths().numpy().astype(np.int64)
    values = ctx_jt.values().numpy()
    n, width = len(train), max(int(lengths.max()), 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ctx = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.float32)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(values.size) - np.repeat(offsets[:-1], lengths)
    ctx[rows, cols], mask[rows, cols] = values, 1.0
    outs = [kjt[f].values() for f in train.meta.features[1:]]  # target, neg_0, ... (one id each)
    out_ids = torch.stack(outs, dim=1)
    return (torch.from_numpy(ctx), torch.from_numpy(mask), out_ids, torch.zeros(n),
            int(train.meta.table_sizes["input"]))


def torch_worker(spec: dict) -> dict:
    """Time the Opacus (ghost / hooks) or plain PyTorch CBOW."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    system = spec["system"]
    ctx, mask, out_ids, labels, vocab = _padded_tensors(spec["data"], spec["test_fraction"], spec["seed"])
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = _torch_model(vocab, spec["dim"], spec["init_std"])
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    criterion = _criterion()
    n = len(labels)
    dataset = TensorDataset(ctx, mask, out_ids, labels)
    if system == "pytorch-nonprivate":
        loader = DataLoader(dataset, batch_size=spec["batch"], shuffle=True)
    else:
        from opacus import PrivacyEngine

        engine = PrivacyEngine(accountant="rdp")
        loader = DataLoader(dataset, batch_size=spec["batch"])
        kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=spec["sigma"],
                      max_grad_norm=spec["clip"], poisson_sampling=True)
        if system == "opacus-ghost":
            model, optimizer, criterion, loader = engine.make_private(criterion=criterion, grad_sample_mode="ghost",
                                                                      **kwargs)
        else:
            model, optimizer, loader = engine.make_private(grad_sample_mode="hooks", **kwargs)
    build_s = time.perf_counter() - t0

    return _timed(torch_step(model, optimizer, criterion, loader), spec, build_s,
                  extra={"vocab": vocab, "train_examples": n})


def torch_step(model, optimizer, criterion, loader, device=None):
    """One plain PyTorch / Opacus training step per call over `loader` (cycled); batches are
    (*model inputs, labels). Returns the step function; it returns the batch's size. `device`
    (a CUDA device): the batch is copied there each step and the step waits for the GPU to
    finish, so a timed step is the whole step."""
    def batches():
        while True:
            yield from loader

    it = batches()

    def step():
        *inputs, labels = next(it)
        if device is not None:
            inputs, labels = [x.to(device, non_blocking=True) for x in inputs], labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        criterion(model(*inputs), labels).backward()
        optimizer.step()
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        return int(inputs[0].shape[0])

    return step


def _timed(step, spec, build_s, extra) -> dict:
    warm = []
    for _ in range(spec["warmup"]):
        t = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t)
    max_seconds = spec["max_seconds"]
    min_steps = 1 if warm and warm[-1] > max_seconds / 2 else 2
    times, sizes, start = [], [], time.perf_counter()
    while len(times) < spec["steps"] and (len(times) < min_steps or time.perf_counter() - start < max_seconds):
        t = time.perf_counter()
        sizes.append(step())
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"build_s": build_s, "warmup_ms": [1e3 * w for w in warm], "steps_timed": len(times),
            "step_ms": [1e3 * t for t in times], "step_ms_median": 1e3 * med,
            "batch_mean": sum(sizes) / len(sizes), "examples_per_sec": (sum(sizes) / len(sizes)) / med,
            "single_step_only": len(times) == 1, **extra}


def worker(spec: dict) -> dict:
    if spec["system"].startswith("widedp"):
        return time_engine(spec)
    return torch_worker(spec)


# ---- driver ---------------------------------------------------------------------------------------

def memory_estimate(system: str, vocab: int, dim: int, batch: int) -> float:
    table = vocab * dim * 4
    if system == "opacus-hooks":
        return 2 * 2 * batch * table + 2e9  # per-example gradients of both tables
    if system == "opacus-ghost":
        return 2 * table * 5.0 + 1.0e9  # measured ~4.7x the tables at V = 10^6 (grads, summed grads, noise, temporaries)
    if system == "pytorch-nonprivate":
        return 2 * table * 2.6 + 1.0e9  # weights + dense grads + temporaries
    return 2 * table * 1.3 + 3e9  # widedp: the tables (+ Ray)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vocabularies 10^4, 10^5; few steps")
    parser.add_argument("--config", default="configs/cbow.toml")
    parser.add_argument("--vocabs", default=None, help="comma list (default 100000,1000000,10000000)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=None, help="expected batch (default: the config's)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--hooks-max-vocab", type=int, default=None, help="default 10^5 (quick 10^4)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (quick 1)")
    parser.add_argument("--max-seconds", type=float, default=None, help="per configuration (default 120, quick 20)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    parser.add_argument("--recompute", metavar="FILE",
                        help="re-derive extrapolations and ratios of an existing results file from its measurements")
    args = parser.parse_args(argv)
    if args.recompute:
        return recompute(Path(args.recompute))
    started = time.time()
    quick = args.quick
    vocabs = [int(float(v)) for v in (args.vocabs or ("10000,100000" if quick else "100000,1000000,10000000")).split(",")]
    steps = args.steps or (3 if quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    max_seconds = args.max_seconds or (20.0 if quick else 120.0)
    hooks_max = args.hooks_max_vocab or (10**4 if quick else 10**5)
    systems = [s for s in args.systems.split(",") if s]
    machine = announce_machine()
    from widedp.trainer.config import load_config

    cfg = load_config(args.config, args.set)
    batch = args.batch or cfg.train.batch_size
    common = {"dim": args.dim, "batch": batch, "sigma": args.sigma, "clip": cfg.privacy.clip_norm, "lr": cfg.train.lr,
              "init_std": cfg.model.init_std, "test_fraction": cfg.data.test_fraction, "seed": cfg.data.seed}
    print(f"CBOW ({args.config}): dim {args.dim}, expected batch {batch}, σ {args.sigma}, S1 {common['clip']}, "
          f"SGD lr {common['lr']}, k {cfg.privacy.k} (widedp sparse/{cfg.train.selection}), {args.examples} examples\n")
    results = []
    for vocab in vocabs:
        data = text_dataset(vocab, args.examples)
        for system in systems:
            row = {"system": system, "vocab": vocab}
            if system == "opacus-hooks" and vocab > hooks_max:
                row["skipped"] = f"hooks mode materializes B x V x D per-example gradients; run only up to V = {hooks_max:.0e}"
                results.append(row)
                continue
            spec = dict(common, system=system, data=str(data), steps=steps, warmup=warmup, max_seconds=max_seconds)
            if system.startswith("widedp"):
                mode = {"widedp-sparse": "sparse", "widedp-sparse-inprocess": "sparse", "widedp-dpsgd": "dpsgd",
                        "widedp-dpsgd-inprocess": "dpsgd", "widedp-nonprivate": "nonprivate"}[system]
                backend = "local" if system.endswith("inprocess") else None
                extra = [f"data.path={data}", "data.synth=", f"model.embedding_dim={args.dim}", f"train.batch_size={batch}",
                         "train.optimizer=sgd", *args.set]
                spec.update(widedp_timing_spec(args.config, mode, cfg.train.selection, backend, extra, args.sigma))
            results.append(run_timed_system(__file__, row, spec, memory_estimate(system, vocab, args.dim, batch),
                                            f"V={vocab:.0e}"))
    extrapolate(results)
    summary = summarize(results, vocabs)
    print("\n" + format_table(
        ["vocab", "system", "step ms", "examples/s", "peak RSS", "peak tree RSS", "note"],
        [[f"{r['vocab']:.0e}", r["system"], r.get("step_ms_median"), r.get("examples_per_sec"),
          fmt_bytes(r.get("ru_maxrss_bytes")), fmt_bytes(r.get("peak_tree_rss_bytes")),
          _note(r)] for r in results]))
    print("\nratios (measured in this run; 'extrapolated' where marked):")
    for line in summary["lines"]:
        print("  " + line)
    payload = {"config": args.config, "vocabs": vocabs, **common, "examples": args.examples, "steps": steps,
               "warmup": warmup, "max_seconds": max_seconds, "selection": cfg.train.selection, "k": cfg.privacy.k,
               "results": results, "summary": summary}
    write_results("opacus_compare", payload, quick=quick, machine=machine, out=args.out, started=started)
    return payload


def recompute(path: Path) -> dict:
    """Extrapolations and ratios again from the measured rows of a results file (no timing)."""
    import json

    doc = json.loads(path.read_text())
    extrapolate(doc["results"])
    doc["summary"] = summarize(doc["results"], doc["vocabs"])
    doc["recomputed"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for line in doc["summary"]["lines"]:
        print("  " + line)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"rewrote {path}")
    return doc


def _note(r) -> str:
    if r.get("extrapolated"):
        return "extrapolated, " + r.get("extrapolation", "")
    if r.get("skipped"):
        return "skipped: " + r["skipped"][:70]
    if r.get("error"):
        return "FAILED: " + r["error"][:70]
    if r.get("steps_timed") == 1:
        return "1 timed step"
    return ""


def extrapolate(results) -> None:
    """Fill skipped/failed rows from the same system's two largest measured vocabularies, with
    an affine model t(V) = a + b·V: a fixed per-step cost (per-example work on the batch) plus a
    cost per table row (the dense V×D gradient, noise and update an Opacus step makes) — the
    step's actual cost structure; b >= 0. The power-law fit through two noisy points is kept
    as `power_law_ms` for comparison."""
    for r in results:
        if r.get("extrapolated"):
            for key in ("step_ms_median", "examples_per_sec", "extrapolated", "extrapolation", "power_law_ms"):
                r.pop(key, None)
    for r in results:
        if "step_ms_median" in r or r["system"] == "opacus-hooks":
            continue
        measured = sorted((x["vocab"], x["step_ms_median"], x["batch_mean"]) for x in results
                          if x["system"] == r["system"] and "step_ms_median" in x and not x.get("extrapolated"))
        measured = [m for m in measured if m[0] < r["vocab"]]
        if len(measured) < 2:
            continue
        (v1, t1, _), (v2, t2, b2) = measured[-2], measured[-1]
        per_row = max(0.0, (t2 - t1) / (v2 - v1))
        t = t2 + per_row * (r["vocab"] - v2)
        slope = max(0.0, math.log(t2 / t1) / math.log(v2 / v1))
        r.update(step_ms_median=t, examples_per_sec=b2 / (t / 1e3), extrapolated=True,
                 extrapolation=f"affine in V through V={v1:.0e} ({t1:.0f} ms) and V={v2:.0e} ({t2:.0f} ms): "
                               f"{t2 - per_row * v2:.0f} ms + {per_row * 1e3:.3g} µs/row",
                 power_law_ms=t2 * (r["vocab"] / v2) ** slope)


def summarize(results, vocabs) -> dict:
    by = {(r["system"], r["vocab"]): r for r in results if "examples_per_sec" in r}
    out = {"ratios": {}, "lines": []}
    for v in vocabs:
        ours, theirs = by.get(("widedp-sparse", v)), by.get(("opacus-ghost", v))
        entry = {}
        if ours and theirs:
            entry["sparse_over_opacus_ghost"] = ours["examples_per_sec"] / theirs["examples_per_sec"]
            entry["extrapolated"] = bool(ours.get("extrapolated") or theirs.get("extrapolated"))
            tag = " (extrapolated)" if entry["extrapolated"] else ""
            out["lines"].append(f"V={v:.0e}: widedp sparse / Opacus ghost throughput = "
                                f"{entry['sparse_over_opacus_ghost']:,.1f}x{tag}")
        inproc = by.get(("widedp-sparse-inprocess", v))
        if inproc and theirs:
            entry["sparse_inprocess_over_opacus_ghost"] = inproc["examples_per_sec"] / theirs["examples_per_sec"]
        dp = by.get(("widedp-dpsgd", v))
        if dp and theirs:
            entry["dpsgd_over_opacus_ghost"] = dp["examples_per_sec"] / theirs["examples_per_sec"]
            out["lines"].append(f"V={v:.0e}: widedp dpsgd / Opacus ghost throughput = {entry['dpsgd_over_opacus_ghost']:.2f}x"
                                f"{' (extrapolated)' if dp.get('extrapolated') or theirs.get('extrapolated') else ''}")
        dp_in = by.get(("widedp-dpsgd-inprocess", v))
        if dp_in and theirs:
            entry["dpsgd_inprocess_over_opacus_ghost"] = dp_in["examples_per_sec"] / theirs["examples_per_sec"]
            out["lines"].append(f"V={v:.0e}: widedp dpsgd in-process / Opacus ghost throughput = "
                                f"{entry['dpsgd_inprocess_over_opacus_ghost']:.2f}x"
                                f"{' (extrapolated)' if dp_in.get('extrapolated') or theirs.get('extrapolated') else ''}")
        nonp, torch_np = by.get(("widedp-nonprivate", v)), by.get(("pytorch-nonprivate", v))
        if ours and nonp:
            entry["sparse_over_widedp_nonprivate"] = ours["examples_per_sec"] / nonp["examples_per_sec"]
        if ours and torch_np:
            entry["sparse_over_pytorch_nonprivate"] = ours["examples_per_sec"] / torch_np["examples_per_sec"]
        mem = {s: by[(s, v)].get("peak_tree_rss_bytes") or by[(s, v)].get("ru_maxrss_bytes")
               for s in SYSTEMS if (s, v) in by and not by[(s, v)].get("extrapolated")}
        entry["peak_memory_bytes"] = mem
        out["ratios"][str(v)] = entry
    top = str(max(vocabs))
    if "sparse_over_opacus_ghost" in out["ratios"].get(top, {}):
        r = out["ratios"][top]["sparse_over_opacus_ghost"]
        out["goal"] = {"vocab": int(top), "ratio": r, "goal": 100.0, "met": r >= 100.0,
                       "extrapolated": out["ratios"][top]["extrapolated"]}
        out["lines"].append(f"goal: widedp sparse >= 100x Opacus at V={int(top):.0e}: {'met' if r >= 100 else 'missed'} "
                            f"({r:,.1f}x)")
    for key, label in (("dpsgd_over_opacus_ghost", "dpsgd (Ray)"), ("dpsgd_inprocess_over_opacus_ghost",
                                                                     "dpsgd in-process")):
        if key in out["ratios"].get(top, {}):
            r = out["ratios"][top][key]
            system = "widedp-dpsgd" if key == "dpsgd_over_opacus_ghost" else "widedp-dpsgd-inprocess"
            guessed = bool(by[(system, int(top))].get("extrapolated") or by[("opacus-ghost", int(top))].get("extrapolated"))
            out.setdefault("dpsgd_goals", {})[key] = {"vocab": int(top), "ratio": r, "goal": DPSGD_GOAL,
                                                     "met": r >= DPSGD_GOAL, "extrapolated": guessed}
            out["lines"].append(f"goal: widedp {label} >= {DPSGD_GOAL:g}x Opacus at V={int(top):.0e}: "
                                f"{'met' if r >= DPSGD_GOAL else 'missed'} ({r:,.1f}x)")
    return out


if __name__ == "__main__":
    worker_entry(worker)
    main()
