"""User-level against example-level differential privacy on click logs with users.

Data: `widedp synth logs` (trainer/data/synth_logs.py: raw click logs with a user id per row,
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

Runs are kept under WORK/runs/<data>/ and reused when their config is unchanged up to keys of
placement, logging and recovery (--fresh retrains). The script exits 1 when a run failed, lacks
finite test metrics, or its summary does not name the requested privacy unit.

    python benchmarks/user_level.py [--users 20000] [--days 4] [--seed 0] [--data DIR] [--eps 1,3,8]
        [--modes sparse,dpsgd] [--units example,user] [--no-nonprivate] [--steps 300]
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
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, train_or_reuse, write_results  # noqa: E402

CONFIGS = {"sparse": "configs/logs.toml", "dpsgd": "configs/logs_dpsgd.toml", "nonprivate": "configs/logs.toml"}
TRAIN_SEED = 0
#: The --units values and the privacy.unit each runs at: "user-examples" is user level by example
#: sampling (privacy.user_sampling = "examples": each user keeps ≤ --example-sampling-k examples,
#: example-level steps accounted for groups of that many).
USER_BY_EXAMPLES = "user-examples"
PRIVACY_UNIT_OF = {"example": "example", "user": "user", USER_BY_EXAMPLES: "user"}
#: --quick: a tiny grid (seconds per run): few users, two days, three steps, one ε
QUICK = {"users": 300, "days": 2, "items": 2000, "steps": 3, "eps": "8", "examples_per_step": 64}


# ---- data -----------------------------------------------------------------------------------------

def logs_dataset(root: Path, users: int, days: int, seed: int, items: Optional[int]) -> tuple[Path, Path]:
    """(converted data set, truth.json) of `widedp synth logs` at these parameters, made under
    `root` if absent: raw logs in root/TAG/raw, the data set (last day = test split) in root/TAG/data."""
    from widedp.trainer.data.synth_logs import synth_logs
    from widedp.trainer.data.table import convert_table

    tag = f"logs_u{users}_d{days}_s{seed}" + (f"_i{items}" if items else "")
    raw, data = root / tag / "raw", root / tag / "data"
    if not (raw / "truth.json").exists():
        print(f"generating {raw}")
        synth_logs(raw, users=users, days=days, seed=seed, **({"items": items} if items else {}))
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


def unit_statistics(data: Path, k: int) -> dict:
    """Per-user counts of the training split: users U, examples n, examples per user (median,
    mean, p90, p99, max), c̄ = mean min(n_u, k) and the share of users above k."""
    import numpy as np

    from widedp.trainer.data import open_dataset
    from widedp.trainer.data.sampler import unit_indices

    train_set, test_set = open_dataset(data)
    units = train_set.units()
    if units is None:
        raise ValueError(f"{data}: no unit column (user level needs one: `widedp convert table` with a schema unit)")
    idx, num_units = unit_indices(units)
    counts = np.bincount(idx, minlength=num_units)
    return {"train_examples": int(len(train_set)), "test_examples": int(len(test_set)), "users": int(num_units),
            "k": int(k), "examples_per_user": {
                "median": float(np.median(counts)), "mean": float(counts.mean()),
                "p90": float(np.percentile(counts, 90)), "p99": float(np.percentile(counts, 99)),
                "max": int(counts.max())},
            "mean_contribution": float(np.minimum(counts, k).mean()),
            "users_above_k": float((counts > k).mean()),
            "examples_beyond_k": float(np.maximum(counts - k, 0).sum() / counts.sum())}


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
    mode, unit, eps = spec["mode"], spec["unit"], spec["target_epsilon"]
    name = "nonprivate" if mode == "nonprivate" else f"{mode}-{unit}-eps{eps:g}"
    run_dir = root / name
    config = CONFIGS[mode]
    cfg = load_config(str(REPO / config), spec["overrides"])
    cfg.validate()
    record = {"name": name, "mode": mode, "unit": unit, "target_epsilon": eps, "config": config,
              "selection": cfg.train.selection if mode == "sparse" else None, "overrides": spec["overrides"],
              "batch_size": cfg.train.batch_size, "batch_unit": "users" if unit == "user" else "examples",
              "privacy_unit_requested": PRIVACY_UNIT_OF[unit],
              "expected_examples_per_step": spec["expected_examples_per_step"], "lr": cfg.train.lr,
              "dense_lr": cfg.train.dense_lr, "lr_scale": spec["lr_scale"],
              "run_dir": str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir)}
    t0 = time.perf_counter()
    try:
        summary, reused = train_or_reuse(cfg, run_dir, fresh)
    except Exception as exc:  # one failed point must not lose the grid
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"  {name}: FAILED: {record['error']}")
        return record
    if reused:
        record["reused"] = True
    record["wall_s"] = time.perf_counter() - t0
    for key in ("privacy_unit", "epsilon", "delta", "noise_multiplier", "sample_rate", "expected_batch_size", "steps",
                "stopped_by_budget", "test_metrics", "step_time_ms_median", "phase_ms_median", "rows_selected_mean",
                "vocabulary_size", "accountant", "selection_params", "table_policy"):
        record[key] = summary.get(key)
    record["norms_ms_median"] = (summary.get("phase_ms_median") or {}).get("norms")
    record["recalibration_applied"] = (summary.get("recalibration") or {}).get("applied")
    m = record.get("test_metrics") or {}
    eps_txt = f", ε {record['epsilon']:.3g} ({record['privacy_unit']})" if mode != "nonprivate" and record.get("epsilon") else ""
    print(f"  {name}: AUC {_g(m.get('auc'))}, logloss {_g(m.get('logloss'))}, ECE {_g(m.get('ece'))}{eps_txt}, "
          f"step {_g(record['step_time_ms_median'], 1)} ms (norms {_g(record['norms_ms_median'], 2)})"
          + (" (reused)" if record.get("reused") else f" ({record['wall_s']:.0f} s)"))
    return record


def _g(v, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def grid(args, stats: dict, base_over: list) -> tuple[list, dict]:
    """The run specs and the batch/learning-rate matching they use."""
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
    specs = []

    def spec(mode: str, unit: str, eps: Optional[float]) -> dict:
        cfg = load_config(str(REPO / CONFIGS[mode]), base_over)
        over = [*base_over, f"train.mode={mode}", f"privacy.unit={unit}", f"train.seed={TRAIN_SEED}"]
        over[over.index(f"privacy.unit={unit}")] = f"privacy.unit={PRIVACY_UNIT_OF[unit]}"
        if unit == USER_BY_EXAMPLES:  # each user keeps ≤ k_e examples once; example-level steps, groups of k_e
            over += ["privacy.user_sampling=examples", f"privacy.max_examples_per_user={args.example_sampling_k}"]
        if unit in ("example", USER_BY_EXAMPLES):  # batches of examples (the user-level config's lr × B/b)
            over += [f"train.batch_size={B}", f"train.lr={cfg.train.lr * scale:.6g}",
                     f"train.dense_lr={cfg.train.dense_lr * scale:.6g}"]
        else:
            over.append(f"train.batch_size={b_user}")
        if eps is not None:
            over.append(f"privacy.target_epsilon={eps:g}")
        over += args.set  # --set wins
        return {"mode": mode, "unit": unit, "target_epsilon": eps, "overrides": over,
                "lr_scale": scale if unit != "user" else 1.0,
                "expected_examples_per_step": float(B) if unit != "user" else b_user * c_bar}

    if not args.no_nonprivate:
        specs.append(spec("nonprivate", "example", None))
    for mode in args.modes:
        for eps in args.eps:
            for unit in args.units:  # the two units of one (mode, ε) back to back: alike machine load
                specs.append(spec(mode, unit, eps))
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
                  and x["target_epsilon"] == r["target_epsilon"]), None)
        if e is None:
            continue
        rows.append({"mode": r["mode"], "target_epsilon": r["target_epsilon"],
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


def utility_table(records: list) -> str:
    nonp = next((r for r in records if r["mode"] == "nonprivate" and "error" not in r), None)
    nonp_auc = ((nonp or {}).get("test_metrics") or {}).get("auc")
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["mode"], r["unit"], r["target_epsilon"], "FAILED"] + [None] * 9)
            continue
        m = r.get("test_metrics") or {}
        private = r["mode"] != "nonprivate"
        rows.append([r["mode"] + (f"/{r['selection']}" if r.get("selection") else ""),
                     (r.get("privacy_unit") or "?") if private else "–",
                     r["target_epsilon"], r.get("epsilon") if private else None,
                     f"{r['delta']:.2g}" if private and r.get("delta") else None,
                     r.get("noise_multiplier") if private else None,
                     f"{r['batch_size']} {r['batch_unit']}", r["expected_examples_per_step"],
                     m.get("auc"), m.get("logloss"), m.get("ece"),
                     (m["auc"] - nonp_auc) if private and m.get("auc") is not None and nonp_auc is not None else None,
                     r.get("step_time_ms_median")])
    return md_table(["mode", "ε protects", "target ε", "ε spent", "δ", "σ", "batch (expected)", "examples/step",
                     "test AUC", "logloss", "ECE", "AUC − nonprivate", "step ms"], rows)


def gap_table(records: list) -> str:
    rows = []
    ok = [r for r in records if "error" not in r]
    for r in ok:
        if r["unit"] != "user" or r["mode"] == "nonprivate":
            continue
        e = next((x for x in ok if x["mode"] == r["mode"] and x["unit"] == "example"
                  and x["target_epsilon"] == r["target_epsilon"]), None)
        if e is None:
            continue
        ua, ea = r["test_metrics"]["auc"], e["test_metrics"]["auc"]
        rows.append([r["mode"], r["target_epsilon"], ea, ua, ua - ea,
                     e["test_metrics"]["logloss"], r["test_metrics"]["logloss"]])
    return md_table(["mode", "ε", "AUC example level", "AUC user level", "user − example",
                     "logloss example", "logloss user"], rows)


def cost_table(c: dict) -> str:
    rows = [[x["mode"], x["target_epsilon"], x["example_step_ms"], x["user_step_ms"], x["step_ratio"],
             x["example_norms_ms"], x["user_norms_ms"], x["norms_ratio"], x["example_over_floor"],
             x["user_over_floor"]] for x in c["rows"]]
    return md_table(["mode", "ε", "step ms example", "step ms user", "user/example", "norms ms example",
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


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section for this benchmark's JSON (benchmarks/make_results.py): the
    setting, the utility table, and — where the grid has both units — the user-against-example
    gaps, the step costs and what group privacy gives the example-level runs."""
    d, m, ref, records = doc["data"], doc["matching"], doc.get("reference") or {}, doc["records"]
    per = d["examples_per_user"]
    units = ", ".join(doc["units"])
    lines = [f"`widedp synth logs` data `{d['tag']}`: {d['train_examples']:,} training examples of {d['users']:,} users "
             f"(examples per user: median {per['median']:g}, mean {per['mean']:.2f}, max {per['max']:,}), "
             f"{d['test_examples']:,} test examples (the last day). Units run: {units}; {doc['steps']} steps, backend "
             f"{doc['backend']}, one run per point (secret noise). Matching: {m['rule']}; example-level B = "
             f"{m['examples_per_step']} examples per step, user-level b = {m['user_batch']} users "
             f"(c̄ = {m['mean_contribution']:.2f}). Bayes AUC {_g(ref.get('bayes_auc'))}; `user-examples` runs: "
             "user level by example sampling (privacy.user_sampling = examples, each user keeps ≤ "
             "--example-sampling-k examples, groups accounted by the mixture-of-Gaussians PLD).", "",
             utility_table(records), ""]
    if any(r["unit"] == "user" for r in records) and any(r["unit"] == "example" for r in records):
        lines += ["User level (users sampled) against example level, same mode and ε:", "", gap_table(records), "",
                  "Cost of the per-user step (median step and `norms` phase):", "", cost_table(doc["costs"]), ""]
    if doc.get("group_privacy"):
        lines += ["What the example-level runs give one user by group privacy:", "", group_table(doc["group_privacy"]), ""]
    return lines, []


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
    parser.add_argument("--example-sampling-k", type=int, default=4,
                        help=f"privacy.max_examples_per_user of the {USER_BY_EXAMPLES} runs (default 4)")
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
        data_tag = data.name
    else:
        data, truth_path = logs_dataset(work / "data", args.users, args.days, args.seed, args.items)
        data_tag = data.parent.name
    reference = truth_reference(truth_path)
    from widedp.trainer.config import load_config

    base_over = [f"data.path={data}", f"train.steps={args.steps}", f"cluster.backend={args.backend}",
                 "train.log_every=100", "train.checkpoint_every=100"]
    k = load_config(str(REPO / CONFIGS["sparse"]), [*base_over, *args.set]).privacy.max_examples_per_user
    stats = unit_statistics(data, k)
    specs, matching = grid(args, stats, base_over)
    per = stats["examples_per_user"]
    print(f"\ndata {data}: {stats['train_examples']:,} training examples of {stats['users']:,} users "
          f"(examples per user: median {per['median']:g}, mean {per['mean']:.2f}, p99 {per['p99']:.0f}, max {per['max']:,}), "
          f"{stats['test_examples']:,} test examples")
    print(f"k = {k}: c̄ = mean min(n_u, k) = {stats['mean_contribution']:.3f}; {100 * stats['users_above_k']:.1f}% of "
          f"users have more than k; example level B = {matching['examples_per_step']} examples/step, user level "
          f"b = {matching['user_batch']} users/step (≈ {matching['user_expected_examples_per_step']:.0f} examples); "
          f"example-level lr × {matching['example_lr_scale']:.3f}")
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
    for line in chk["failures"]:
        print(f"FAILED CHECK: {line}")
    for line in chk["flags"]:
        print(f"SUSPICIOUS: {line}")
    payload = {"data": {"path": str(data), "tag": data_tag, **stats}, "reference": reference, "matching": matching,
               "eps": args.eps, "modes": args.modes, "units": args.units, "steps": args.steps,
               "backend": args.backend, "threads": args.threads, "train_seed": TRAIN_SEED, "configs": CONFIGS,
               "records": records, "costs": c, "group_privacy": g, "checks": chk}
    write_results("user_level" if USER_BY_EXAMPLES not in args.units else "user_level_examples", payload, quick=quick,
                  machine=machine, out=args.out, started=started)
    return 0 if chk["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
