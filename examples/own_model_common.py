"""What the own-model examples share: click logs with users (`widedp synth logs`, converted by
their schema; the last day held out), the tuned settings of configs/logs.toml per mode, and a
sweep over modes, ε and seeds that prints one JSON object.

Replace `click_logs` with your own data: any KeyedJaggedTensor over your examples, with labels,
dense features and (for user-level privacy) a user per example, in a `widedp.KJTDataset`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import widedp

# configs/logs.toml and logs_dpsgd.toml: user level, tuned on the validation split of these logs
COMMON = ["privacy.unit=user", "privacy.max_examples_per_user=16", "privacy.clip_norm=3.0", "train.optimizer=sgd"]
BY_MODE = {
    "sparse": ["train.selection=fest-threshold", "train.lr=1.75", "train.dense_lr=0.175", "privacy.k=1000",
               "privacy.selection_fraction=0.1", "privacy.score_clip=0.05", "privacy.fest_max_rows_per_example=32"],
    "dpsgd": ["train.lr=0.52", "train.dense_lr=0.174"],
    # no clipping, so the clipped runs' step sizes diverge: widedp's defaults (Adam 0.01 / 0.001), not tuned
    "nonprivate": ["train.optimizer=adam", "train.lr=0.01", "train.dense_lr=0.001"],
}


def click_logs(root: Path, users: int, days: int, seed: int = 2):
    """(train, test) KJTDatasets of `widedp synth logs` click logs: features ad, history (the
    user's last items, sharing the item table), campaign, device; 4 dense features; the last
    day held out. Also the data set's table sizes."""
    from widedp.trainer.data import open_dataset
    from widedp.trainer.data.convert.table import convert_table
    from widedp.trainer.data.synthetic.synth_logs import synth_logs

    if not (root / "data" / "dataset.json").exists():
        truth = synth_logs(root / "logs", users=users, days=days, seed=seed)
        convert_table([str(root / "logs" / "day=*" / "*.parquet")], root / "data",
                      schema=root / "logs" / "schema.toml", test_after=truth["evaluation_day"]["date"])
    train, test = open_dataset(root / "data")
    return widedp.KJTDataset.from_split(train), widedp.KJTDataset.from_split(test), dict(train.meta.table_sizes)


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="expected users per step")
    parser.add_argument("--epsilons", default="1,8")
    parser.add_argument("--modes", default="sparse,dpsgd,nonprivate")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--data", default="", help="where the logs go (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 200 users, 2 days, 3 steps, ε = 8, 1 seed")
    args = parser.parse_args()
    if args.quick:
        args.users, args.days, args.steps, args.epsilons, args.seeds = 200, 2, 3, "8", "0"
    return args


def sweep(args, train_one: Callable[..., dict]) -> dict:
    """`train_one(train, test, tables, mode, epsilon, seed, settings)` -> metrics, for every mode,
    ε (once for non-private) and seed; prints and returns {mode: {ε: {metric: [median, min, max]}}}."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else Path(tmp)
        train, test, tables = click_logs(root, args.users, args.days)
        results: dict = {"examples": {"train": len(train), "test": len(test)}, "steps": args.steps, "runs": {}}
        for mode in args.modes.split(","):
            for eps in (["inf"] if mode == "nonprivate" else args.epsilons.split(",")):
                runs = []
                for seed in map(int, args.seeds.split(",")):
                    torch.manual_seed(seed)
                    settings = [*COMMON, *BY_MODE[mode], f"train.seed={seed}"]
                    start = time.perf_counter()
                    metrics = train_one(train, test, tables, mode, None if eps == "inf" else float(eps), args,
                                        settings)
                    metrics["seconds"] = time.perf_counter() - start
                    runs.append(metrics)
                results["runs"].setdefault(mode, {})[eps] = summarize(runs)
    print(json.dumps(results))
    return results


def summarize(runs: list) -> dict:
    """{metric: [median, min, max]} over the runs' metrics (one dict per seed)."""
    return {k: [statistics.median(r[k] for r in runs), min(r[k] for r in runs), max(r[k] for r in runs)]
            for k in runs[0]}
