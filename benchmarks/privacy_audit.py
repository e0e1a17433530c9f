"""One-run privacy audits of whole training runs: every mode and selector, and broken runs.

Each row trains a model once with m canaries (trainer/run/audit.py: each canary an example with a
row of its own, a member with probability ½ by the audit's secret coins) and turns the
white-box scores (how far each canary's row moved in the released model) into an ε lower
bound (Steinke, Nasr & Jagielski 2023) at 95% confidence. Guess rule, fixed before any run:
"member" for the 10% highest scores, abstain on the rest (a canary's row that never moved
says little either way). Rows: `nonprivate`, `dpsgd`, `sparse` with every selector the
config can run, and the deliberately broken variants of `widedp audit --broken` (noise off
while the ledger is told σ; a selection that takes every touched row, or one that never selects
an untouched row, while charging the selector's event). A correct private run must stay at or below its claimed ε; non-private
and broken runs should exceed 1, up to what m allows (with m canaries and r = m/10 guesses
all correct the bound is logit(0.05^(1/r)): 3.49 at m = 1000).

CTR canaries with a row of their own in every table (`--feature all`, rows marked so): each
table's selection gets a chance to give a member away, which a selection that never picks an
untouched row needs (with one row, a member's row is selected only when its single count beats
the threshold's noise, rarely at the config's τ).

Gradient canaries (`--canary-kind gradient`, the second block of rows): the same canaries
with their pooled-output gradient set to 1000·S1 along a secret direction, so a member's
clipped gradient is ≈ S1 on its own row (Steinke et al.'s Dirac canaries), scored by the
row's movement along that direction. Their runs use the setting where a final-model audit
sees most (GRADIENT_SETTING: q ≈ ½, 10 steps, σ = 5, SGD): a member is sampled ~5 times and
the noise accumulates over 10 steps only. That block holds the σ ÷ 10 broken variant. Its
sparse rows make every table sparse and fix σ_sel (GRADIENT_SPARSE: at q ≈ ½ the automatic
policy would noise every table densely and no selection would run) at one of two thresholds.

Each run in a fresh process, in-process shards (`cluster.backend = "local"`: the audited
computation does not depend on placement).

    python benchmarks/privacy_audit.py [--quick] [--models ctr,cbow] [--canaries 1000]
                                       [--only-broken skip-untouched --merge]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (announce_machine, ensure_config_dataset, format_table, quick_data_overrides, results_path, run_worker,
                     worker_entry, write_results)

CONFIGS = {"ctr": "configs/ctr.toml", "cbow": "configs/cbow.toml"}
SELECTORS = ("threshold", "fest-threshold", "em", "em-count", "noisy-max", "noisy-max-count", "svt", "fest", "random")
MEMBER_FRACTION = 0.1
#: Guess share of the rows with a canary row in every table, fixed from a pilot run (seed 11,
#: not reported): its skip-untouched selection moved ~60 members' rows and no non-member's, so
#: 10% guesses mixed ~40 coin flips in (80 of 100 right, bound 0.96) where 3% are all informative.
ALL_FEATURE_MEMBER_FRACTION = 0.03


#: Sparse rows of the gradient block: every table sparse (at q ≈ ½ the automatic policy makes
#: every table of at most b rows dense, and a dense table never meets the selection, so its
#: broken variants would change nothing there), σ_sel = 6 on the threshold counts, and one of
#: two thresholds: "auto τ" (about k pure-noise rows pass: an untouched canary row almost never
#: moves, so a selection that takes every touched row shows) or "τ = 1" (a touched canary row
#: passes in about half its steps, an untouched one in about a third: the rows move, so wrong
#: noise shows, and so does a selection that never picks an untouched row).
GRADIENT_SPARSE = {"auto τ": ["privacy.table_default=sparse", "privacy.selection_sigma=6"],
                   "τ = 1": ["privacy.table_default=sparse", "privacy.selection_sigma=6", "privacy.threshold=1"]}


def rows_for(model: str) -> list[dict]:
    """(label, mode, selection, broken, canary kind, canary feature, setting) of every audited run of one model."""
    out = [{"mode": "nonprivate"}, {"mode": "dpsgd"}]
    out += [{"mode": "sparse", "selection": s} for s in SELECTORS]
    out += [{"mode": "dpsgd", "broken": "noise-off"}, {"mode": "sparse", "broken": "noise-off"},
            {"mode": "sparse", "broken": "every-touched-row"}, {"mode": "sparse", "broken": "skip-untouched"}]
    if model == "ctr":  # a CTR canary with a row of its own in every table (`widedp audit --feature all`)
        every = {"mode": "sparse", "feature": "all", "member_fraction": ALL_FEATURE_MEMBER_FRACTION}
        out += [every, {**every, "broken": "skip-untouched"}]
    threshold = {"mode": "sparse", "selection": "threshold"}
    gradient = [{"mode": "nonprivate"}, {"mode": "dpsgd"},
                {"mode": "dpsgd", "broken": "sigma-over-10"}, {"mode": "dpsgd", "broken": "noise-off"},
                {**threshold, "setting": "τ = 1"},
                {**threshold, "setting": "τ = 1", "broken": "sigma-over-10"},
                {**threshold, "setting": "τ = 1", "broken": "noise-off"},
                {**threshold, "setting": "τ = 1", "broken": "skip-untouched"},
                {**threshold, "setting": "auto τ"},
                {**threshold, "setting": "auto τ", "broken": "every-touched-row"}]
    return out + [{**r, "canary_kind": "gradient"} for r in gradient]


def row_label(row: dict) -> str:
    return (row["mode"] + (f"/{row['selection']}" if row.get("selection") else "")
            + (f" ({row['setting']})" if row.get("setting") else "")
            + (f" BROKEN {row['broken']}" if row.get("broken") else "")
            + (" [gradient canaries]" if row.get("canary_kind") == "gradient" else "")
            + (" [canary rows in every table]" if row.get("feature") == "all" else ""))


#: Gradient-canary runs: σ = 5, 10 steps of plain SGD, expected batch = half the split
#: (`gradient_batch`): claimed ε ≈ 1.2 for dpsgd; σ ÷ 10 moves a member's row ~3 noise
#: standard deviations per sampling along its direction.
GRADIENT_SETTING = ["train.steps=10", "privacy.noise_multiplier=5", "train.optimizer=sgd"]


def gradient_batch(cfg, canaries: int) -> int:
    """Expected batch size for q ≈ ½: half of the training split plus the ~m/2 member canaries."""
    import json

    meta = json.loads((Path(cfg.data.path) / "dataset.json").read_text())
    train = int(meta["num_examples"] * (1 - cfg.data.test_fraction))
    return max(1, (train + canaries // 2) // 2)


def audit_worker(spec: dict) -> dict:
    from widedp.trainer.run.audit import one_run_audit
    from widedp.trainer.config import load_config

    overrides = list(spec["overrides"])
    if spec.get("canary_kind") == "gradient":
        cfg = load_config(spec["config"], overrides)
        overrides += [*GRADIENT_SETTING, f"train.batch_size={gradient_batch(cfg, spec['canaries'])}"]
    cfg = load_config(spec["config"], overrides)
    cfg.validate()
    t0 = time.perf_counter()
    record = one_run_audit(cfg, canaries=spec["canaries"], member_fraction=spec.get("member_fraction") or MEMBER_FRACTION,
                           non_member_fraction=0.0,
                           confidence=0.95, seed=spec.get("seed"), broken=spec.get("broken"),
                           canary_kind=spec.get("canary_kind") or "example", feature=spec.get("feature"))
    import numpy as np

    members, others = np.asarray(record.pop("member_scores")), np.asarray(record.pop("non_member_scores"))
    quantiles = [0.1, 0.5, 0.9]
    record["member_score_quantiles"] = np.quantile(members, quantiles).tolist() if members.size else []
    record["non_member_score_quantiles"] = np.quantile(others, quantiles).tolist() if others.size else []
    record["seconds"] = time.perf_counter() - t0
    return record


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, 40 steps, 400 canaries, fewer selectors")
    parser.add_argument("--models", default="ctr,cbow")
    parser.add_argument("--canaries", type=int, default=None, help="m (default 1000; quick 400)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    parser.add_argument("--only-broken", default="", metavar="NAMES",
                        help="comma list of broken variants: run only their rows")
    parser.add_argument("--only", default="", metavar="TEXTS",
                        help="comma list: run only the rows whose label contains one of these texts")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other rows of the existing results file (each row keeps its own 'created' "
                             "time; the payload lists the rows rerun and the machine of the rest)")
    args = parser.parse_args(argv)
    only_broken = {b for b in args.only_broken.split(",") if b}
    started = time.time()
    machine = announce_machine()
    canaries = args.canaries or (400 if args.quick else 1000)
    results = []
    for model in [m for m in args.models.split(",") if m]:
        config = CONFIGS[model]
        base = [*(quick_data_overrides(config) if args.quick else []), "cluster.backend=local", *args.set]
        if args.quick:
            base.append("train.steps=40")
        ensure_config_dataset(config, base)
        runs = rows_for(model)
        if args.quick:
            runs = [r for r in runs if r.get("selection") in (None, "threshold", "fest-threshold", "em")
                    and (r.get("canary_kind") != "gradient" or r["mode"] == "dpsgd")]
        if only_broken:
            runs = [r for r in runs if r.get("broken") in only_broken]
        if args.only:
            runs = [r for r in runs if any(t in row_label(r) for t in args.only.split(",") if t)]
        for row in runs:
            over = [*base, f"train.mode={row['mode']}"] + ([f"train.selection={row['selection']}"] if row.get("selection") else [])
            over += GRADIENT_SPARSE.get(row.get("setting"), [])
            label = row_label(row)
            r = run_worker(__file__, {"config": config, "overrides": over, "canaries": canaries,
                                      "broken": row.get("broken"), "canary_kind": row.get("canary_kind"),
                                      "feature": row.get("feature"), "member_fraction": row.get("member_fraction")},
                           timeout=3600)
            r.update(model=model, label=label, created=time.strftime("%Y-%m-%d %H:%M:%S"))
            results.append(r)
            if "error" in r:
                print(f"{model} {label}: FAILED: {r['error'][:200]}")
            else:
                print(f"{model:>5} {label:>60}: claimed ε {r['claimed_epsilon']:.3g}, lower bound "
                      f"{r['epsilon_lower_bound']:.3g} ({r['correct']}/{r['guesses']} correct), {r['seconds']:.0f} s",
                      flush=True)
    payload = {"canaries": canaries, "member_fraction": MEMBER_FRACTION, "confidence": 0.95, "results": results}
    if args.merge:
        payload = merged(payload, results_path("privacy_audit", args.quick, args.out))
        results = payload["results"]
    ok = [r for r in results if "error" not in r]
    print()
    print(format_table(["model", "run", "claimed ε", "ε lower bound (95%)", "correct / guesses", "members", "verdict"],
                       [[r["model"], r["label"], r["claimed_epsilon"], r["epsilon_lower_bound"],
                         f"{r['correct']}/{r['guesses']}", r["members"], verdict(r)] for r in ok]))
    write_results("privacy_audit", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def merged(payload: dict, path: Path) -> dict:
    """`payload`'s rows in place of the same (model, label) rows of the results file at `path`
    (same m, guess share and confidence required); the file's other rows kept in their order,
    except rows this benchmark no longer defines (`rows_for`), which are dropped."""
    import json

    old = json.loads(path.read_text())
    for key in ("canaries", "member_fraction", "confidence"):
        if old[key] != payload[key]:
            raise SystemExit(f"--merge: {path} has {key} = {old[key]}, this run {payload[key]}")
    new = {(r["model"], r["label"]): r for r in payload["results"]}
    defined = {(m, row_label(row)) for m in CONFIGS for row in rows_for(m)}
    rows = [new.pop((r["model"], r["label"]), r) for r in old["results"]
            if (r["model"], r["label"]) in defined or (r["model"], r["label"]) in new] + list(new.values())
    return {**payload, "results": rows,
            "merged": {"rerun": [f"{m} {label}" for m, label in {(r["model"], r["label"]) for r in payload["results"]}],
                       "other_rows_created": old.get("created"), "other_rows_machine": old.get("machine")}}


def verdict(r: dict) -> str:
    """'holds' (bound ≤ claim), 'VIOLATED' (a private claim exceeded), 'flagged' (non-private or
    broken run with bound ≥ 1), 'not flagged' (non-private or broken run below 1)."""
    if r.get("broken") or r["mode"] == "nonprivate":
        return "flagged" if r["epsilon_lower_bound"] >= 1.0 else "not flagged"
    return "holds" if r["epsilon_lower_bound"] <= r["claimed_epsilon"] else "VIOLATED"


if __name__ == "__main__":
    if not worker_entry(audit_worker):
        main()
