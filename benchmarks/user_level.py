"""User-level against example-level differential privacy on click logs with users.

Data: `widedp synth logs` (trainer/data/synthetic/synth_logs.py: raw click logs with a user id per row,
heavy-tailed examples per user, planted per-user effects, the evaluation day's Bayes AUC in
truth.json), converted by its own schema with the last day as the test split (truth.json's
`convert_command`); made once under the work directory and reused, or given as --data.
Configs: configs/logs.toml (sparse, fest-threshold) and configs/logs_dpsgd.toml (dpsgd), both
`privacy.unit = "user"`; each run overrides the data path, mode, unit, target ε, steps, batch
size, learning rates and `cluster.backend`, and fixes `train.seed`; the privacy randomness
(sampling, selection, noise) is the configs' own: secret, fresh per run.

The grid: mode ∈ {sparse, dpsgd} × privacy unit ∈ {example, user} × target ε ∈ {1, 3, 8}, plus
one nonprivate run (example sampling): 13 runs, one after another in this process.

Matched examples per step (a benchmark choice, stated in the output). At example level
`train.batch_size` is the expected number of EXAMPLES per step (q = B / n); at user level it
is the expected number of USERS per step (q = b / U), each sampled user contributing
min(n_u, k) examples (k = privacy.max_examples_per_user). The user-level batch is
b = round(B / c̄) with c̄ = mean over the training users of min(n_u, k): the expected examples
per step then match. c̄ is computed from the data (it depends on public k, but also on the data;
the benchmark uses it to size b, a run of its own would fix b without looking at the data).
The engine divides the summed clipped gradients by the expected batch size in the unit of the
run (b users or B examples), so with the same learning rate a user-level step would be B/b ≈ c̄
times longer per example (measured: the nonprivate user-level run diverges at the example
level's rate). The configs' learning rates are user level; the example-level runs multiply them
by B/b, so that lr/batch_size — the step per expected example — is the same at both units
(`--same-lr` turns this off).

Reported per run (summary.json): ε spent and the unit it protects (summary.json
`privacy_unit`, checked against the requested unit), δ, σ, q, test AUC / log loss / ECE
(`test_metrics`), against the test split's base-rate log loss and truth.json's Bayes AUC and log
loss; and for the example-level runs what they imply for a user with m examples by group
privacy, (m·ε, m·e^((m−1)ε)·δ), at m = the median and the largest number of training examples
of a user. Cost: the median step time (`step_time_ms_median`) and the median of the `norms`
phase (`phase_ms_median`: per-example norms at example level, norms of each user's summed
gradient at user level) of the user-level run over the example-level run at the same mode and
ε, beside the nonprivate run's (the floor, same model). Timings are system measurements on a
possibly shared machine (the JSON records the load average); nothing asserts on them.

Sweeping k: `--user-k` (a comma list; default the config's privacy.max_examples_per_user) gives
the k of the users-sampled runs, each at its own user batch b(k) = round(B / c̄(k)) and the
config's lr; `--example-sampling-k` (a comma list; default 4) the k of the `user-examples` runs,
all at B examples per step and the example level's lr (the config's × B/b at the config's k).
Every record carries its k, and run names hold it (`sparse-user-k16-eps8`). `--repeats R` trains
each private point R times (run dirs `…-r1`, `…-r2` beside the first; fresh secret noise each,
the same train.seed); the tables then give the mean test AUC / log loss over the R runs and
their min–max. When both user-level methods ran, a table compares them at each (mode, ε, k).
An invocation with several k or R > 1 writes benchmarks/results/user_level_k.json.

Runs are kept under WORK/runs/<data>/ and reused when their config is unchanged up to keys of
placement, logging and recovery (--fresh retrains). The script exits 1 when a run failed, lacks
finite test metrics, or its summary does not name the requested privacy unit.

    python benchmarks/user_level.py [--users 20000] [--days 4] [--seed 0] [--data DIR] [--eps 1,3,8]
        [--modes sparse,dpsgd] [--units example,user] [--no-nonprivate] [--steps 300]
        [--user-k 16] [--example-sampling-k 4] [--repeats 1]
        [--examples-per-step 368] [--backend local|ray] [--threads 1] [--same-lr] [--set SECTION.KEY=VALUE ...]
        [--work-dir DIR] [--fresh] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, train_point, write_results  # noqa: E402

CONFIGS = {"sparse": "configs/logs.toml", "dpsgd": "configs/logs_dpsgd.toml", "nonprivate": "configs/logs.toml"}
TRAIN_SEED = 0
#: The --units values and the privacy.unit each runs at: "user-examples" is user level by example
#: sampling (privacy.user_sampling = "examples": each user keeps ≤ --example-sampling-k examples,
#: example-level steps accounted for groups of that many).
USER_BY_EXAMPLES = "user-examples"
PRIVACY_UNIT_OF = {"example": "example", "user": "user", USER_BY_EXAMPLES: "user"}
#: --quick: a tiny grid (seconds per run): few users, two days, three steps, one ε
QUICK: dict[str, Any] = {"users": 300, "days": 2, "items": 2000, "steps": 3, "eps": "8", "examples_per_step": 64}


# ---- data -----------------------------------------------------------------------------------------

def logs_dataset(root: Path, users: int, days: int, seed: int, items: Optional[int]) -> tuple[Path, Path]:
    """(converted data set, truth.json) of `widedp synth logs` at these parameters, made under
    `root` if absent: raw logs in root/TAG/raw, the data set (last day = test split) in root/TAG/data."""
    from widedp.trainer.data.synthetic.synth_logs import synth_logs
    from widedp.trainer.data.convert.table import convert_table

    tag = f"logs_u{users}_d{days}_s{seed}" + (f"_i{items}" if items else "")
    raw, data = root / tag / "raw", root / tag / "data"
    if not (raw / "truth.json").exists():
        print(f"generating {raw}")
        extra: dict[str, Any] = {"items": items} if items else {}
        synth_logs(raw, users=users, days=days, seed=seed, **extra)
    truth = json.loads((raw / "truth.json").read_text())
    if not (data / "dataset.json").exists():
        print(f"converting {raw} -> {data} (test split: {truth['evaluation_day']['date']})")
        convert_table([str(raw / "day=*" / "*.parquet")], data, schema=raw / "schema.toml",
                      test_after=truth["evaluation_day"]["date"])
    return data, raw / "truth.json"


def find_truth(data: Path) -> Optional[Path]:
    """truth.json beside the schema a converted synth-logs data set was made with, if any."""
    try:
        meta = json.loads((data / "dataset.json").read_text())
    except (OSError, ValueError):
        return None
    schema = meta.get("schema_file")
    p = Path(schema).parent / "truth.json" if schema else None
    return p if p is not None and p.exists() else None


def user_counts(data: Path):
    """(examples per user of the training split, training examples, test examples)."""
    import numpy as np

    from widedp.trainer.data import open_dataset
    from widedp.trainer.data.sampler import unit_indices

    train_set, test_set = open_dataset(data)
    units = train_set.units()
    if units is None:
        raise ValueError(f"{data}: no unit column (user level needs one: `widedp convert table` with a schema unit)")
    idx, num_units = unit_indices(units)
    return np.bincount(idx, minlength=num_units), int(len(train_set)), int(len(test_set))


def k_statistics(counts, k: int) -> dict:
    """What a cap of k examples per user keeps: c̄ = mean min(n_u, k), the share of users above
    k, the share of the training examples beyond k (dropped) and the examples kept."""
    import numpy as np

    return {"k": int(k), "mean_contribution": float(np.minimum(counts, k).mean()),
            "users_above_k": float((counts > k).mean()),
            "examples_beyond_k": float(np.maximum(counts - k, 0).sum() / counts.sum()),
            "examples_kept": int(np.minimum(counts, k).sum())}


def unit_statistics(data: Path, k: int, counts=None) -> dict:
    """Per-user counts of the training split: users U, examples n, examples per user (median,
    mean, p90, p99, max), c̄ = mean min(n_u, k) and the share of users above k."""
    import numpy as np

    if counts is None:
        counts, n_train, n_test = user_counts(data)
    else:
        counts, n_train, n_test = counts
    ks = k_statistics(counts, k)
    return {"train_examples": n_train, "test_examples": n_test, "users": int(len(counts)),
            "k": int(k), "examples_per_user": {
                "median": float(np.median(counts)), "mean": float(counts.mean()),
                "p90": float(np.percentile(counts, 90)), "p99": float(np.percentile(counts, 99)),
                "max": int(counts.max())},
            "mean_contribution": ks["mean_contribution"], "users_above_k": ks["users_above_k"],
            "examples_beyond_k": ks["examples_beyond_k"]}


def truth_reference(truth_path: Optional[Path]) -> dict:
    if truth_path is None:
        return {}
    t = json.loads(truth_path.read_text())
    ev = t.get("evaluation_day", {})
    return {"truth": str(truth_path.relative_to(REPO) if truth_path.is_relative_to(REPO) else truth_path),
            "bayes_auc": ev.get("bayes_auc"), "bayes_logloss": ev.get("bayes_logloss"),
            "auc_without_user_offset": ev.get("auc_without_user_offset"), "test_day": ev.get("date"),
            "test_base_rate": ev.get("base_rate"), "generator_params": t.get("params"),
            "convert_command": t.get("convert_command")}


# ---- runs -----------------------------------------------------------------------------------------

def run_one(spec: dict, root: Path, fresh: bool) -> dict:
    """Train one grid point (or reuse its run); the record of summary.json's numbers."""
    from widedp.trainer.config import load_config
    mode, unit, eps, k, rep = spec["mode"], spec["unit"], spec["target_epsilon"], spec.get("k"), spec.get("repeat", 0)
    name = run_name(mode, unit, eps, k, rep)
    run_dir = root / name
    config = CONFIGS[mode]
    try:
        cfg = load_config(str(REPO / config), spec["overrides"])
        cfg.validate()
    except Exception as exc:  # a bad point (say its accountant) must not lose the grid
        print(f"  {name}: FAILED: {type(exc).__name__}: {exc}"[:500])
        return {"name": name, "mode": mode, "unit": unit, "target_epsilon": eps, "k": k, "repeat": rep,
                "config": config, "overrides": spec["overrides"], "error": f"{type(exc).__name__}: {exc}"[:500]}
    record = {"name": name, "mode": mode, "unit": unit, "target_epsilon": eps, "k": k, "repeat": rep,
              "config": config,
              "selection": cfg.train.selection if mode == "sparse" else None, "overrides": spec["overrides"],
              "batch_size": cfg.train.batch_size, "batch_unit": "users" if unit == "user" else "examples",
              "privacy_unit_requested": PRIVACY_UNIT_OF[unit],
              "expected_examples_per_step": spec["expected_examples_per_step"], "lr": cfg.train.lr,
              "dense_lr": cfg.train.dense_lr, "lr_scale": spec["lr_scale"],
              "run_dir": str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir)}
    if not train_point(cfg, run_dir, fresh, record, name, (
            "privacy_unit", "epsilon", "delta", "noise_multiplier", "sample_rate", "expected_batch_size", "steps",
            "stopped_by_budget", "test_metrics", "step_time_ms_median", "phase_ms_median", "rows_selected_mean",
            "vocabulary_size", "accountant", "selection_params", "table_policy", "recalibration")):
        return record
    record["norms_ms_median"] = (record.get("phase_ms_median") or {}).get("norms")
    record["recalibration_applied"] = (record.pop("recalibration") or {}).get("applied")
    m = record.get("test_metrics") or {}
    eps_txt = f", ε {record['epsilon']:.3g} ({record['privacy_unit']})" if mode != "nonprivate" and record.get("epsilon") else ""
    print(f"  {name}: AUC {_g(m.get('auc'))}, logloss {_g(m.get('logloss'))}, ECE {_g(m.get('ece'))}{eps_txt}, "
          f"step {_g(record['step_time_ms_median'], 1)} ms (norms {_g(record['norms_ms_median'], 2)})"
          + (" (reused)" if record.get("reused") else f" ({record['wall_s']:.0f} s)"))
    return record


def run_name(mode: str, unit: str, eps: Optional[float], k: Optional[int] = None, repeat: int = 0) -> str:
    """The run's directory name: mode, unit, k (user level), ε, and `-rN` for repeats after the first."""
    if mode == "nonprivate":
        return "nonprivate"
    return f"{mode}-{unit}" + (f"-k{k}" if k is not None else "") + f"-eps{eps:g}" + (f"-r{repeat}" if repeat else "")


def _g(v, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def grid(args, stats: dict, base_over: list, k_stats: Optional[dict] = None) -> tuple[list, dict]:
    """The run specs and the batch/learning-rate matching they use. `k_stats`: k_statistics at
    each k of args.user_k (the users-sampled runs' batch b(k) = round(B / c̄(k)))."""
    from widedp.trainer.config import load_config

    B = int(args.examples_per_step)
    c_bar = stats["mean_contribution"]
    b_user = max(1, round(B / c_bar))
    scale = 1.0 if args.same_lr else B / b_user
    matching = {"examples_per_step": B, "mean_contribution": c_bar, "user_batch": b_user,
                "user_expected_examples_per_step": b_user * c_bar, "example_lr_scale": scale,
                "rule": "user batch b = round(B / c̄), c̄ = mean over training users of min(n_u, k); example-level "
                        "runs use the config's lr and dense_lr × B/b (same lr per expected example)"
                        if not args.same_lr else "user batch b = round(B / c̄); the same lr at both units (--same-lr)"}
    user_ks = list(getattr(args, "user_k", None) or [stats["k"]])
    example_ks = list(getattr(args, "example_sampling_k", None) or [4])
    repeats = max(1, int(getattr(args, "repeats", 1) or 1))
    c_of = {k: (k_stats or {}).get(k, {}).get("mean_contribution", c_bar if k == stats["k"] else None) for k in user_ks}
    if any(v is None for v in c_of.values()):
        raise ValueError("grid: k_stats must hold every --user-k")
    b_of = {k: max(1, round(B / c_of[k])) for k in user_ks}
    if user_ks != [stats["k"]] or repeats > 1 or example_ks != [4]:
        matching["user_batch_by_k"] = {str(k): {"user_batch": b_of[k], "mean_contribution": c_of[k],
                                                "user_expected_examples_per_step": b_of[k] * c_of[k]} for k in user_ks}
        matching["k_rule"] = ("users-sampled runs at k: b(k) = round(B / c̄(k)) users per step, the config's lr; "
                              f"{USER_BY_EXAMPLES} runs at every k: B examples per step, the example level's lr "
                              "(config's × B/b at the config's k)")
    specs = []

    def spec(mode: str, unit: str, eps: Optional[float], k: Optional[int] = None, repeat: int = 0) -> dict:
        cfg = load_config(str(REPO / CONFIGS[mode]), base_over)
        over = [*base_over, f"train.mode={mode}", f"privacy.unit={unit}", f"train.seed={TRAIN_SEED}"]
        over[over.index(f"privacy.unit={unit}")] = f"privacy.unit={PRIVACY_UNIT_OF[unit]}"
        if unit == USER_BY_EXAMPLES:  # each user keeps ≤ k_e examples once; example-level steps, groups of k_e
            over += ["privacy.user_sampling=examples", f"privacy.max_examples_per_user={k}"]
        if unit in ("example", USER_BY_EXAMPLES):  # batches of examples (the user-level config's lr × B/b)
            over += [f"train.batch_size={B}", f"train.lr={cfg.train.lr * scale:.6g}",
                     f"train.dense_lr={cfg.train.dense_lr * scale:.6g}"]
        else:  # users sampled: b(k) users per step, each ≤ k examples
            if k != stats["k"]:
                over.append(f"privacy.max_examples_per_user={k}")
            over.append(f"train.batch_size={b_of[k]}")
        if eps is not None:
            over.append(f"privacy.target_epsilon={eps:g}")
        over += args.set  # --set wins
        return {"mode": mode, "unit": unit, "target_epsilon": eps, "k": k, "repeat": repeat, "overrides": over,
                "lr_scale": scale if unit != "user" else 1.0,
                "expected_examples_per_step": float(B) if unit != "user" else b_of[k] * c_of[k]}

    ks_of = {"example": [None], "user": user_ks, USER_BY_EXAMPLES: example_ks}
    all_ks = sorted({k for u in args.units for k in ks_of[u] if k is not None})
    if not args.no_nonprivate:
        specs.append(spec("nonprivate", "example", None))
    for mode in args.modes:
        for eps in args.eps:
            for repeat in range(repeats):
                # the units of one (mode, ε, k) back to back: alike machine load
                specs += [spec(mode, "example", eps, None, repeat) for u in args.units if u == "example"]
                for k in all_ks:
                    specs += [spec(mode, u, eps, k, repeat) for u in args.units if u != "example" and k in ks_of[u]]
    return specs, matching


# ---- analysis ---------------------------------------------------------------------------------------

def group_privacy(records: list, stats: dict) -> list:
    """What each example-level run's (ε, δ) gives a user with m examples by group privacy:
    (m·ε, m·e^((m−1)ε)·δ), at m = median and max training examples per user."""
    out = []
    per_user = stats["examples_per_user"]
    for r in records:
        if r["unit"] != "example" or r["mode"] == "nonprivate" or "error" in r or not r.get("epsilon"):
            continue
        eps, delta = r["epsilon"], r["delta"]
        row = {"mode": r["mode"], "target_epsilon": r["target_epsilon"], "epsilon": eps, "delta": delta, "groups": []}
        for label, m in (("median", per_user["median"]), ("max", per_user["max"])):
            m = max(1, int(round(m)))
            log10_delta = math.log10(m) + (m - 1) * eps / math.log(10) + math.log10(delta) if delta else None
            row["groups"].append({"m": m, "of": label, "epsilon": m * eps,
                                  "delta": None if log10_delta is None else (10 ** log10_delta if log10_delta < 0 else None),
                                  "log10_delta": log10_delta, "vacuous_delta": log10_delta is not None and log10_delta >= 0})
        out.append(row)
    return out


def costs(records: list) -> dict:
    """User-level over example-level median step and norms-phase times at each (mode, ε), and
    both over the nonprivate floor."""
    ok = [r for r in records if "error" not in r]
    floor = next((r for r in ok if r["mode"] == "nonprivate"), None)
    f_step = floor["step_time_ms_median"] if floor else None
    f_norms = floor["norms_ms_median"] if floor else None
    rows = []
    for r in ok:
        if r["unit"] != "user" or r["mode"] == "nonprivate":
            continue
        e = next((x for x in ok if x["mode"] == r["mode"] and x["unit"] == "example"
                  and x["target_epsilon"] == r["target_epsilon"] and x.get("repeat", 0) == r.get("repeat", 0)), None)
        if e is None:
            continue
        rows.append({"mode": r["mode"], "target_epsilon": r["target_epsilon"],
                     **({"k": r["k"], "repeat": r.get("repeat", 0)} if r.get("k") is not None else {}),
                     "example_step_ms": e["step_time_ms_median"], "user_step_ms": r["step_time_ms_median"],
                     "step_ratio": _ratio(r["step_time_ms_median"], e["step_time_ms_median"]),
                     "example_norms_ms": e["norms_ms_median"], "user_norms_ms": r["norms_ms_median"],
                     "norms_ratio": _ratio(r["norms_ms_median"], e["norms_ms_median"]),
                     "example_over_floor": _ratio(e["step_time_ms_median"], f_step),
                     "user_over_floor": _ratio(r["step_time_ms_median"], f_step),
                     "reused": bool(r.get("reused") or e.get("reused"))})
    by_mode = {}
    for mode in sorted({x["mode"] for x in rows}):
        mine = [x for x in rows if x["mode"] == mode]
        by_mode[mode] = {k: statistics.median([x[k] for x in mine if x[k] is not None])
                         for k in ("step_ratio", "norms_ratio", "user_over_floor", "example_over_floor")
                         if any(x[k] is not None for x in mine)}
    return {"floor_step_ms": f_step, "floor_norms_ms": f_norms, "rows": rows, "median_over_epsilon": by_mode}


def _ratio(a, b):
    return a / b if a is not None and b else None


def _key(r: dict) -> tuple:
    return r["mode"], r["unit"], r.get("k"), r["target_epsilon"]


def points(records: list) -> list:
    """The grid points (mode, unit, k, target ε) in the records' order, each with its finished
    runs (`runs`, one per repeat), failures, and the mean / min / max / std over the runs of the
    test AUC, log loss and ECE."""
    out: dict = {}
    for r in records:
        pt = out.setdefault(_key(r), {"mode": r["mode"], "unit": r["unit"], "k": r.get("k"),
                                      "target_epsilon": r["target_epsilon"], "runs": [], "failed": 0})
        if "error" in r:
            pt["failed"] += 1
        else:
            pt["runs"].append(r)
    for pt in out.values():
        for key in ("auc", "logloss", "ece"):
            vals = [v for v in ((x.get("test_metrics") or {}).get(key) for x in pt["runs"])
                    if isinstance(v, (int, float)) and math.isfinite(v)]
            pt[key] = {"mean": statistics.fmean(vals) if vals else None, "min": min(vals, default=None),
                       "max": max(vals, default=None), "std": statistics.stdev(vals) if len(vals) > 1 else None,
                       "n": len(vals)}
    return list(out.values())


def _point_summary(pt: dict) -> dict:
    """A point's numbers for the JSON (without its records)."""
    return {k: v for k, v in pt.items() if k != "runs"} | {"runs": [r["name"] for r in pt["runs"]]}


def checks(records: list, reference: dict) -> dict:
    """Hard checks (the script exits 1 on any): every run finished, its summary names the
    requested privacy unit, its test metrics are finite, ε spent ≤ target. Flags (reported, not
    failed): a private log loss at or above the base rate; a user-level run whose AUC beats the
    example-level run of its (mode, ε) by more than 0.01."""
    failures, flags = [], []
    for r in records:
        if "error" in r:
            failures.append(f"{r['name']}: {r['error']}")
            continue
        if r.get("privacy_unit") != PRIVACY_UNIT_OF[r["unit"]]:
            failures.append(f"{r['name']}: summary.json privacy_unit {r.get('privacy_unit')!r}, asked "
                            f"{PRIVACY_UNIT_OF[r['unit']]!r}")
        m = r.get("test_metrics") or {}
        for key in ("auc", "logloss", "ece", "base_rate_logloss"):
            v = m.get(key)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                failures.append(f"{r['name']}: test {key} = {v!r}, not a finite number")
        if r["mode"] != "nonprivate" and not (isinstance(r.get("epsilon"), (int, float))
                                              and r["epsilon"] <= r["target_epsilon"] * (1 + 1e-6)):
            failures.append(f"{r['name']}: ε spent {r.get('epsilon')!r} above the target {r['target_epsilon']}")
        ll, base = m.get("logloss"), m.get("base_rate_logloss")
        if r["mode"] != "nonprivate" and isinstance(ll, float) and isinstance(base, float) and ll >= base:
            flags.append(f"{r['name']}: test logloss {ll:.4f} at or above the base rate's {base:.4f}")
    for r in records:
        if r["unit"] != "user" or "error" in r or r["mode"] == "nonprivate":
            continue
        e = next((x for x in records if "error" not in x and x["mode"] == r["mode"] and x["unit"] == "example"
                  and x["target_epsilon"] == r["target_epsilon"]), None)
        ua, ea = (r.get("test_metrics") or {}).get("auc"), ((e or {}).get("test_metrics") or {}).get("auc")
        if isinstance(ua, float) and isinstance(ea, float) and ua > ea + 0.01:
            flags.append(f"{r['name']}: user-level AUC {ua:.4f} above example level's {ea:.4f} by more than 0.01")
    return {"ok": not failures, "failures": failures, "flags": flags}


# ---- tables -------------------------------------------------------------------------------------------

def md_table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(c) -> str:
    if c is None:
        return "–"
    if isinstance(c, float):
        if not math.isfinite(c):
            return str(c)
        return f"{c:.4f}" if abs(c) < 10 else f"{c:,.1f}"
    if isinstance(c, int):
        return f"{c:,}"
    return str(c)


def _several_k(records: list) -> bool:
    return len({r.get("k") for r in records if r.get("k") is not None}) > 1


def _repeated(records: list) -> bool:
    return any(r.get("repeat", 0) for r in records)


def utility_table(records: list) -> str:
    """One row per run; with several k a k column; with repeats one row per point: the mean test
    AUC / log loss / ECE over its runs and the AUC and log loss min–max."""
    if _repeated(records):
        return _utility_table_repeated(records)
    nonp = next((r for r in records if r["mode"] == "nonprivate" and "error" not in r), None)
    nonp_auc = ((nonp or {}).get("test_metrics") or {}).get("auc")
    with_k = _several_k(records)
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["mode"], r["unit"], r["target_epsilon"], "FAILED"] + [None] * 9)
            continue
        m = r.get("test_metrics") or {}
        private = r["mode"] != "nonprivate"
        rows.append([r["mode"] + (f"/{r['selection']}" if r.get("selection") else ""),
                     (r.get("privacy_unit") or "?") if private else "–",
                     *([_unit_label(r), r.get("k")] if with_k else []),
                     r["target_epsilon"], r.get("epsilon") if private else None,
                     f"{r['delta']:.2g}" if private and r.get("delta") else None,
                     r.get("noise_multiplier") if private else None,
                     f"{r['batch_size']} {r['batch_unit']}", r["expected_examples_per_step"],
                     m.get("auc"), m.get("logloss"), m.get("ece"),
                     (m["auc"] - nonp_auc) if private and m.get("auc") is not None and nonp_auc is not None else None,
                     r.get("step_time_ms_median")])
    return md_table(["mode", "ε protects", *(["method", "k"] if with_k else []), "target ε", "ε spent", "δ", "σ",
                     "batch (expected)", "examples/step", "test AUC", "logloss", "ECE", "AUC − nonprivate", "step ms"],
                    rows)


def _unit_label(r: dict) -> str:
    return {"user": "users sampled", USER_BY_EXAMPLES: "examples sampled"}.get(r["unit"], r["unit"])


def _spread(s: dict) -> Optional[str]:
    return None if s.get("min") is None else f"{s['min']:.4f}–{s['max']:.4f}"


def _utility_table_repeated(records: list) -> str:
    pts = points(records)
    nonp = next((p for p in pts if p["mode"] == "nonprivate" and p["runs"]), None)
    nonp_auc = nonp["auc"]["mean"] if nonp else None
    rows = []
    for pt in pts:
        if not pt["runs"]:
            rows.append([pt["mode"], pt["unit"], pt["k"], pt["target_epsilon"], "FAILED"] + [None] * 11)
            continue
        r = pt["runs"][0]
        private = pt["mode"] != "nonprivate"
        auc = pt["auc"]["mean"]
        rows.append([pt["mode"] + (f"/{r['selection']}" if r.get("selection") else ""),
                     (r.get("privacy_unit") or "?") if private else "–", _unit_label(r), pt["k"],
                     pt["target_epsilon"], max((x.get("epsilon") or 0.0) for x in pt["runs"]) if private else None,
                     f"{r['delta']:.2g}" if private and r.get("delta") else None,
                     r.get("noise_multiplier") if private else None,
                     f"{r['batch_size']} {r['batch_unit']}", r["expected_examples_per_step"],
                     f"{len(pt['runs'])}" + (f" ({pt['failed']} failed)" if pt["failed"] else ""),
                     auc, _spread(pt["auc"]), pt["logloss"]["mean"], _spread(pt["logloss"]), pt["ece"]["mean"],
                     (auc - nonp_auc) if private and auc is not None and nonp_auc is not None else None])
    return md_table(["mode", "ε protects", "method", "k", "target ε", "ε spent (max)", "δ", "σ", "batch (expected)",
                     "examples/step", "runs", "test AUC (mean)", "AUC min–max", "logloss (mean)", "logloss min–max",
                     "ECE (mean)", "AUC − nonprivate"], rows)


def gap_table(records: list) -> str:
    """Users-sampled against example level at each (mode, ε[, k]): mean test AUC / log loss
    over the repeats (one run each without repeats)."""
    rows = []
    pts = [p for p in points(records) if p["runs"] and p["auc"]["mean"] is not None]
    with_k = _several_k(records)
    for r in pts:
        if r["unit"] != "user" or r["mode"] == "nonprivate":
            continue
        e = next((x for x in pts if x["mode"] == r["mode"] and x["unit"] == "example"
                  and x["target_epsilon"] == r["target_epsilon"]), None)
        if e is None:
            continue
        ua, ea = r["auc"]["mean"], e["auc"]["mean"]
        rows.append([r["mode"], r["target_epsilon"], *([r["k"]] if with_k else []), ea, ua, ua - ea,
                     e["logloss"]["mean"], r["logloss"]["mean"]])
    return md_table(["mode", "ε", *(["k"] if with_k else []), "AUC example level", "AUC user level", "user − example",
                     "logloss example", "logloss user"], rows)


def k_comparison(records: list, k_stats: dict) -> list:
    """The two user-level methods at each (mode, ε, k) both ran: users sampled (`user`) against
    example sampling (`user-examples`), mean test AUC / log loss over the repeats, their
    min–max, what k keeps of the data, and which is better on each metric (higher AUC, lower log
    loss; `ranges overlap` where R > 1 and the two min–max ranges meet)."""
    pts = [p for p in points(records) if p["runs"] and p["auc"]["mean"] is not None]
    rows = []
    for u in pts:
        if u["unit"] != "user":
            continue
        x = next((p for p in pts if p["unit"] == USER_BY_EXAMPLES and p["mode"] == u["mode"] and p["k"] == u["k"]
                  and p["target_epsilon"] == u["target_epsilon"]), None)
        if x is None:
            continue
        ks = k_stats.get(str(u["k"])) or {}

        def better(metric: str, sign: float) -> str:
            a, b = u[metric], x[metric]
            win = "user" if sign * (a["mean"] - b["mean"]) > 0 else USER_BY_EXAMPLES
            overlap = a["n"] > 1 and b["n"] > 1 and a["min"] <= b["max"] and b["min"] <= a["max"]
            return win + (" (ranges overlap)" if overlap else "")
        rows.append({"mode": u["mode"], "target_epsilon": u["target_epsilon"], "k": u["k"],
                     "examples_kept": 1 - ks["examples_beyond_k"] if ks else None,
                     "users_above_k": ks.get("users_above_k"),
                     "user_batch": u["runs"][0]["batch_size"], "runs": [u["auc"]["n"], x["auc"]["n"]],
                     "user": {m: u[m] for m in ("auc", "logloss")},
                     USER_BY_EXAMPLES: {m: x[m] for m in ("auc", "logloss")},
                     "sigma": [u["runs"][0].get("noise_multiplier"), x["runs"][0].get("noise_multiplier")],
                     "sample_rate": [u["runs"][0].get("sample_rate"), x["runs"][0].get("sample_rate")],
                     "lr": [u["runs"][0].get("lr"), x["runs"][0].get("lr")],
                     "auc_difference": u["auc"]["mean"] - x["auc"]["mean"],
                     "logloss_difference": u["logloss"]["mean"] - x["logloss"]["mean"],
                     "better_auc": better("auc", 1.0), "better_logloss": better("logloss", -1.0)})
    return rows


def same_mechanism_note(rows: list) -> Optional[str]:
    """At k = 1 the two methods sample the same way (q = b/U = B/U) with the same σ: a sentence on
    what then differs (the learning rate, and a fresh example per draw against one fixed example
    per user), from the rows where q and σ agree; None where no such row."""
    same = [r for r in rows if r["k"] == 1 and None not in (*r["sigma"], *r["sample_rate"], *r["lr"])
            and math.isclose(r["sigma"][0], r["sigma"][1], rel_tol=1e-6)
            and math.isclose(r["sample_rate"][0], r["sample_rate"][1], rel_tol=1e-6)]
    if not same:
        return None
    ratios = sorted({round(r["lr"][1] / r["lr"][0], 3) for r in same})
    diffs = ", ".join(f"{r['mode']} ε = {r['target_epsilon']:g}: {r['auc_difference']:+.4f}" for r in same)
    return ("At k = 1 the two methods are the same mechanism (equal q and σ in the rows named below); what "
            f"differs is the learning rate (`user-examples` runs at {' / '.join(f'{x:g}' for x in ratios)}× the "
            "users-sampled lr: the example level's lr × B/b at the config's k) and which example a user gives "
            "(users sampled: a fresh one each time the user is drawn; example sampling: one fixed example). The AUC "
            f"differences there (user − user-examples: {diffs}) are what these two choices, not the privacy unit's "
            "sampling, do.")


def _mean_spread(s: dict) -> str:
    return f"{s['mean']:.4f}" + (f" ({s['min']:.4f}–{s['max']:.4f})" if s["n"] > 1 else "")


def k_table(rows: list) -> str:
    out = [[r["mode"], r["target_epsilon"], r["k"], r["examples_kept"], r["user_batch"],
            _mean_spread(r["user"]["auc"]), _mean_spread(r[USER_BY_EXAMPLES]["auc"]), r["auc_difference"],
            _mean_spread(r["user"]["logloss"]), _mean_spread(r[USER_BY_EXAMPLES]["logloss"]), r["logloss_difference"],
            r["better_auc"], r["better_logloss"]] for r in rows]
    return md_table(["mode", "ε", "k", "examples kept", "users/step (user)", "AUC user", "AUC user-examples",
                     "Δ AUC", "logloss user", "logloss user-examples", "Δ logloss", "better AUC", "better logloss"],
                    out)


def cost_table(c: dict) -> str:
    with_k = len({x.get("k") for x in c["rows"]}) > 1 or any(x.get("repeat") for x in c["rows"])
    rows = [[x["mode"], x["target_epsilon"], *([x.get("k"), x.get("repeat", 0)] if with_k else []), x["example_step_ms"],
             x["user_step_ms"], x["step_ratio"], x["example_norms_ms"], x["user_norms_ms"], x["norms_ratio"],
             x["example_over_floor"], x["user_over_floor"]] for x in c["rows"]]
    return md_table(["mode", "ε", *(["k", "repeat"] if with_k else []), "step ms example", "step ms user",
                     "user/example", "norms ms example",
                     "norms ms user", "norms user/example", "example/floor", "user/floor"], rows)


def group_table(g: list) -> str:
    rows = []
    for row in g:
        for grp in row["groups"]:
            d = ("≥ 1 (vacuous)" if grp["vacuous_delta"] else f"{grp['delta']:.2g}") if grp["log10_delta"] is not None else None
            rows.append([row["mode"], row["target_epsilon"], row["epsilon"], f"{grp['m']:,} ({grp['of']})",
                         grp["epsilon"], d])
    return md_table(["mode", "target ε", "ε per example", "user with m examples", "m·ε", "m·e^((m−1)ε)·δ"], rows)


# ---- main ---------------------------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    out = sorted({int(x) for x in text.split(",") if x.strip()})
    if any(k < 1 for k in out):
        raise ValueError(f"{text!r}: k must be ≥ 1")
    return out


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section for this benchmark's JSON (benchmarks/make_results.py): the
    setting, the utility table, and — where the grid has both units — the user-against-example
    gaps, the step costs and what group privacy gives the example-level runs."""
    d, m, ref, records = doc["data"], doc["matching"], doc.get("reference") or {}, doc["records"]
    per = d["examples_per_user"]
    units = ", ".join(doc["units"])
    repeats = int(doc.get("repeats") or 1)
    where = (f"Public logs `{d['source']['set']}` ({d['source']['source']}; benchmarks/public_logs.py, real users "
             "and time, not our generator)" if d.get("source") else f"`widedp synth logs` data `{d['tag']}`")
    lines = [f"{where}: {d['train_examples']:,} training examples of {d['users']:,} users "
             f"(examples per user: median {per['median']:g}, mean {per['mean']:.2f}, max {per['max']:,}), "
             f"{d['test_examples']:,} test examples ({'the newest period' if d.get('source') else 'the last day'}). Units run: {units}; {doc['steps']} steps, backend "
             f"{doc['backend']}, {'one run' if repeats == 1 else f'{repeats} runs'} per point (secret noise). Matching: {m['rule']}; example-level B = "
             f"{m['examples_per_step']} examples per step, user-level b = {m['user_batch']} users "
             f"(c̄ = {m['mean_contribution']:.2f}). Bayes AUC {_g(ref.get('bayes_auc'))}; `user-examples` runs: "
             "user level by example sampling (privacy.user_sampling = examples, each user keeps ≤ "
             "--example-sampling-k examples, groups accounted by the mixture-of-Gaussians PLD).", ""]
    if doc.get("k_statistics"):
        ks = doc["k_statistics"]
        lines[-2] += (f" k swept: users sampled at k ∈ {{{', '.join(map(str, doc.get('user_k') or []))}}} (batch b(k) = "
                      f"round(B / c̄(k)) users, the config's lr), `user-examples` at k ∈ "
                      f"{{{', '.join(map(str, doc.get('example_sampling_k') or []))}}} (B examples per step, the "
                      "example level's lr). Examples kept of the training split: " + "; ".join(
                          f"k = {k}: {100 * (1 - v['examples_beyond_k']):.1f}% (c̄ = {v['mean_contribution']:.2f}, "
                          f"{100 * v['users_above_k']:.1f}% of users above k)" for k, v in ks.items()) + "."
                      + (" Tables: the mean over the runs of each point and the min–max." if repeats > 1 else ""))
    lines += [utility_table(records), ""]
    if any(r["unit"] == "user" for r in records) and any(r["unit"] == "example" for r in records):
        lines += ["User level (users sampled) against example level, same mode and ε:", "", gap_table(records), "",
                  "Cost of the per-user step (median step and `norms` phase):", "", cost_table(doc["costs"]), ""]
    if doc.get("group_privacy"):
        lines += ["What the example-level runs give one user by group privacy:", "", group_table(doc["group_privacy"]), ""]
    kc = k_comparison(records, doc["k_statistics"]) if doc.get("k_statistics") else doc.get("k_comparison")
    if kc:
        note = same_mechanism_note(kc)
        lines += ["The two user-level methods at each k, same mode and ε: users sampled (`user`: b(k) users per step, "
                  "each ≤ k examples, one clip per user) against example sampling (`user-examples`: each user keeps "
                  "≤ k examples once, example-level steps accounted for groups of k). Δ = user − user-examples; "
                  "better: higher AUC, lower log loss" + (" (`ranges overlap`: the two min–max ranges over the "
                                                          "repeats meet)" if repeats > 1 else
                                                          "; one run per point, so small differences are within "
                                                          "run-to-run noise") + ".", "",
                  k_table(kc), "", *([note, ""] if note else [])]
    return lines, (public_data_goals(records, d["source"]["set"]) if d.get("source") else [])


def public_data_goals(records: list[dict], name: str) -> list:
    """Issue 50's floor on a public set, per mode × unit × ε over the repeats: no run's test log
    loss above the base rate + 0.005, and the mean AUC not below 0.5 by more than two standard
    errors of the runs (systematically)."""
    goals = []
    groups: dict = {}
    for r in records:
        if r["mode"] != "nonprivate" and r.get("test_metrics"):
            groups.setdefault((r["mode"], r["unit"], r["target_epsilon"]), []).append(r["test_metrics"])
    for (mode, unit, eps), ms in sorted(groups.items()):
        worst = max(m["logloss"] - m["base_rate_logloss"] for m in ms)
        aucs = [m["auc"] for m in ms]
        mean = statistics.fmean(aucs)
        se = statistics.stdev(aucs) / math.sqrt(len(aucs)) if len(aucs) > 1 else 0.0
        where = f"{name}, {mode}, {unit} level, ε = {eps:g}"
        goals.append((f"{where}: no run's log loss above the base rate + 0.005", f"worst excess {worst:+.4f}",
                      "**met**" if worst <= 0.005 else "**missed**", f"{len(ms)} runs, the config as shipped"))
        goals.append((f"{where}: AUC not systematically below 0.5", f"mean {mean:.4f} ± {se:.4f} (s.e.)",
                      "**met**" if mean + 2 * se >= 0.5 else "**missed**", f"{len(ms)} runs"))
    return goals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid: 300 users, 2 days, 3 steps, ε 8")
    parser.add_argument("--users", type=int, default=None, help="synth logs users (default 20000)")
    parser.add_argument("--days", type=int, default=None, help="synth logs days; the last is the test split (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="synth logs seed")
    parser.add_argument("--items", type=int, default=None, help="synth logs item space (default: the generator's)")
    parser.add_argument("--data", default=None, help="a converted data set with a unit column to use instead")
    parser.add_argument("--eps", default=None, help="target ε list (default 1,3,8)")
    parser.add_argument("--modes", default="sparse,dpsgd")
    parser.add_argument("--units", default="example,user",
                        help=f"example, user (users sampled) and/or {USER_BY_EXAMPLES} (user level by example "
                             "sampling: privacy.user_sampling = examples)")
    parser.add_argument("--example-sampling-k", default="4",
                        help=f"privacy.max_examples_per_user of the {USER_BY_EXAMPLES} runs, a comma list (default 4)")
    parser.add_argument("--user-k", default=None,
                        help="privacy.max_examples_per_user of the users-sampled (user) runs, a comma list (default: "
                             "the config's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each private point, each with fresh secret noise (default 1); tables give the "
                             "mean and min–max")
    parser.add_argument("--no-nonprivate", action="store_true", help="skip the nonprivate run (the floor)")
    parser.add_argument("--steps", type=int, default=None, help="train.steps of every run (default 300)")
    parser.add_argument("--examples-per-step", type=int, default=None,
                        help="example-level batch B (expected examples per step; default 368); the user-level batch "
                             "is round(B / c̄)")
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    parser.add_argument("--same-lr", action="store_true", help="the configs' learning rates at both units (no B/b scaling)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every run")
    parser.add_argument("--work-dir", default=None, help="data and runs (default runs/bench/user_level[_quick])")
    parser.add_argument("--fresh", action="store_true", help="retrain runs that already exist")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    quick = args.quick
    args.users = args.users or (QUICK["users"] if quick else 20000)
    args.days = args.days or (QUICK["days"] if quick else 4)
    args.items = args.items or (QUICK["items"] if quick else None)
    args.steps = args.steps or (QUICK["steps"] if quick else 300)
    args.examples_per_step = args.examples_per_step or (QUICK["examples_per_step"] if quick else 368)
    args.eps = _floats(args.eps or (QUICK["eps"] if quick else "1,3,8"))
    args.modes = [m for m in args.modes.split(",") if m]
    args.units = [u for u in args.units.split(",") if u]
    bad = [m for m in args.modes if m not in ("sparse", "dpsgd")] + [u for u in args.units if u not in PRIVACY_UNIT_OF]
    try:
        args.example_sampling_k = _ints(args.example_sampling_k)
        args.user_k = _ints(args.user_k) if args.user_k else None
    except ValueError as exc:
        parser.error(f"--example-sampling-k / --user-k: comma lists of positive integers ({exc})")
    if not args.example_sampling_k or (args.user_k is not None and not args.user_k) or args.repeats < 1:
        parser.error("--example-sampling-k and --user-k need at least one k, --repeats at least 1")
    if bad:
        parser.error(f"unknown modes/units {bad}: modes are sparse, dpsgd; units {', '.join(PRIVACY_UNIT_OF)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = Path(args.work_dir) if args.work_dir else REPO / "runs" / "bench" / ("user_level_quick" if quick else "user_level")
    machine = announce_machine()

    if args.data:
        data = Path(args.data)
        truth_path = find_truth(data)
        from public_logs import source_of

        source = source_of(data)  # benchmarks/public_logs.py's description of its source, if it made it
        data_tag = source.get("set", data.name) if source else data.name
    else:
        data, truth_path = logs_dataset(work / "data", args.users, args.days, args.seed, args.items)
        data_tag = data.parent.name
        source = None
    reference = truth_reference(truth_path)
    from widedp.trainer.config import load_config

    base_over = [f"data.path={data}", f"train.steps={args.steps}", f"cluster.backend={args.backend}",
                 "train.log_every=100", "train.checkpoint_every=100"]
    k = load_config(str(REPO / CONFIGS["sparse"]), [*base_over, *args.set]).privacy.max_examples_per_user
    counts = user_counts(data)
    stats = unit_statistics(data, k, counts)
    args.user_k = args.user_k or [k]
    k_sweep = len(args.user_k) > 1 or len(args.example_sampling_k) > 1 or args.repeats > 1
    ks_used = sorted({*(args.user_k if "user" in args.units else []),
                      *(args.example_sampling_k if USER_BY_EXAMPLES in args.units else [])})
    k_stats = {kk: k_statistics(counts[0], kk) for kk in sorted({*ks_used, *args.user_k})}
    specs, matching = grid(args, stats, base_over, k_stats)
    per = stats["examples_per_user"]
    print(f"\ndata {data}: {stats['train_examples']:,} training examples of {stats['users']:,} users "
          f"(examples per user: median {per['median']:g}, mean {per['mean']:.2f}, p99 {per['p99']:.0f}, max {per['max']:,}), "
          f"{stats['test_examples']:,} test examples")
    print(f"k = {k}: c̄ = mean min(n_u, k) = {stats['mean_contribution']:.3f}; {100 * stats['users_above_k']:.1f}% of "
          f"users have more than k; example level B = {matching['examples_per_step']} examples/step, user level "
          f"b = {matching['user_batch']} users/step (≈ {matching['user_expected_examples_per_step']:.0f} examples); "
          f"example-level lr × {matching['example_lr_scale']:.3f}")
    if k_sweep:
        for kk in ks_used:
            v = k_stats[kk]
            b = (matching.get("user_batch_by_k") or {}).get(str(kk), {}).get("user_batch")
            print(f"k = {kk}: keeps {100 * (1 - v['examples_beyond_k']):.1f}% of the training examples, c̄ = "
                  f"{v['mean_contribution']:.3f}, {100 * v['users_above_k']:.1f}% of users above k"
                  + (f"; users sampled: b = {b} users/step" if b and "user" in args.units and kk in args.user_k else ""))
    root = work / "runs" / data_tag
    print(f"\n{len(specs)} runs, {args.steps} steps each, backend {args.backend}, train.seed {TRAIN_SEED}, runs in {root}")
    records = [run_one(s, root, args.fresh) for s in specs]

    c = costs(records)
    g = group_privacy(records, stats)
    chk = checks(records, reference)
    print("\n" + utility_table(records))
    nonp = next((r for r in records if r["mode"] == "nonprivate" and "error" not in r), None)
    base = ((nonp or next((r for r in records if "error" not in r), {})).get("test_metrics") or {}).get("base_rate_logloss")
    print(f"\nBase-rate log loss (test split's mean label): {_g(base)}. Bayes AUC (truth.json, test day): "
          f"{_g(reference.get('bayes_auc'))}, Bayes log loss {_g(reference.get('bayes_logloss'))}, AUC of the true "
          f"logit without the per-user offset {_g(reference.get('auc_without_user_offset'))}.")
    print("\nUser level against example level, same mode and ε:\n\n" + gap_table(records))
    print("\nCost of the per-user step (median step and `norms` phase; floor: the nonprivate run, "
          f"{_g(c['floor_step_ms'], 1)} ms/step):\n\n" + cost_table(c))
    for mode, v in c["median_over_epsilon"].items():
        print(f"{mode}: median over ε of user/example step time {_g(v.get('step_ratio'), 2)}×, norms phase "
              f"{_g(v.get('norms_ratio'), 2)}×")
    print("\nWhat the example-level runs give one user by group privacy:\n\n" + group_table(g))
    kc = k_comparison(records, {str(kk): v for kk, v in k_stats.items()})
    if kc:
        print("\nThe two user-level methods at each k (Δ = user − user-examples):\n\n" + k_table(kc))
    for line in chk["failures"]:
        print(f"FAILED CHECK: {line}")
    for line in chk["flags"]:
        print(f"SUSPICIOUS: {line}")
    payload = {"data": {"path": str(data), "tag": data_tag, **stats, **({"source": source} if source else {})}, "reference": reference, "matching": matching,
               "eps": args.eps, "modes": args.modes, "units": args.units, "steps": args.steps,
               "backend": args.backend, "threads": args.threads, "train_seed": TRAIN_SEED, "configs": CONFIGS,
               "records": records, "costs": c, "group_privacy": g, "checks": chk}
    if k_sweep:
        payload |= {"user_k": args.user_k if "user" in args.units else [],
                    "example_sampling_k": args.example_sampling_k if USER_BY_EXAMPLES in args.units else [],
                    "repeats": args.repeats, "k_statistics": {str(kk): k_stats[kk] for kk in ks_used},
                    "points": [_point_summary(p) for p in points(records)], "k_comparison": kc}
    name = "user_level_k" if k_sweep else "user_level" if USER_BY_EXAMPLES not in args.units else "user_level_examples"
    write_results(name, payload, quick=quick, machine=machine, out=args.out, started=started)
    return 0 if chk["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
