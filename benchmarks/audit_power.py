"""White-box audits with teeth: how close the lower bounds come to the claimed ε, per model,
mode, ε and threat model, and which subtle broken variants they catch.

Every row trains a small model once with m gradient canaries (`widedp audit --canary-kind
gradient`: a member's clipped gradient is ≈ S1 along a secret direction on a row of its own;
Steinke et al.'s Dirac canaries), each a member with probability ½ by the audit's secret coins,
10 steps of plain SGD with σ calibrated to the row's ε. Models: the small DLRM of the test suite
(benchmarks/_common.ctr_dataset: 26 tables summing to 13,000 rows, 3,000 examples; embedding dim
4, MLPs [8]) and a small CBOW (benchmarks/_common.text_dataset: V = 1,000, 3,000 examples, dim
16). Modes: DP-SGD, and sparse mode's value channel (threshold selection with the canaries' rows
added to every step's selection, `--channel value`: a data-independent post-processing of the
selection, so the run's claim covers it unchanged; each canary row then receives every step's
noisy value) beside the same runs as they execute (`sparse as run`: a canary's row moves only
when selected, the score counts those steps), and user level (DP-SGD over the users of small click logs; each canary a user
of k = 2 examples that both carry it; the variant `clip-per-example` clips each of them on its
own while the ledger claims user level, so a canary user moves its row by up to 2·S1). Guesses,
fixed before any run: "member" for the 5% highest scores, no non-member
guesses. Two one-run bounds from the same guesses at 95% confidence: the (ε, δ) one-run bound
(Steinke, Nasr & Jagielski 2023) and the Gaussian-DP bound (Mahloujifar, Melis & Chaudhuri 2025;
auditing/fdp_one_run.py). Beside them the threshold audit (Nasr et al. 2023's many-run method,
auditing/threshold_audit.py) over the same scores, the canaries taken as independent trials
(white-box canaries on rows no other example reads): a threshold chosen on a coin-independent
half, Clopper–Pearson rates counted on the other half, as (ε, δ) and as Gaussian DP.

Settings: q = 1 (every example in every step: the claim is exactly μ-GDP, the Gaussian-DP bound's
null) and q ≈ ½ (a subsampled Gaussian: the Gaussian-DP null is approximate, the (ε, δ) bound is
the one that can refute the claim). Threat models (`--observe`): `steps` (the model after every
step; score: the claimed mechanism's likelihood ratio of each step's update) and `final` (the
released model only, DLRM DP-SGD only; score: the total movement along the canary's
direction). Variants: the
correct run, σ/2 (the ledger told σ) and clipping to 2·S1 (the noise sized for S1). Each cell is
`--repeats` runs (fresh noise keys and coins); the table gives the median and the range.

The false-alarm blocks repeat the correct q = 1 audit of the DLRM (DP-SGD, and sparse value)
`--false-alarm-runs` times each at ε = 4 and count bounds above the claim (a valid audit exceeds
it in at most 5% of runs), for each of the four bounds.

    python benchmarks/audit_power.py [--quick] [--canaries 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import announce_machine, ctr_dataset, format_table, one_torch_thread, text_dataset, write_results

COMMON = ["cluster.backend=local", "cluster.num_shards=2", "privacy.noise_multiplier=auto", "train.optimizer=sgd",
          "train.steps=10", "train.log_every=100", "train.checkpoint_every=1000"]
#: The audited models: name -> (data set, overrides). Both have 3,000 examples (2,400 to train).
MODELS = {
    "DLRM": ("ctr", ["model.embedding_dim=4", "model.bottom_mlp=[8]", "model.top_mlp=[8]"]),
    "CBOW": ("text", ["model.name=cbow", "model.embedding_dim=16", "train.lr=1.0", "privacy.clip_norm=1.0",
                      "privacy.second_clip_norm=none", "privacy.tables.input=sparse", "privacy.tables.output=sparse"]),
}
MODEL_NOTES = {"DLRM": "small DLRM: 26 tables, 13,000 rows, 3,000 examples, dim 4, MLPs [8] (user level: the same "
                       "model on click logs of 800 users, `widedp synth logs`)",
               "CBOW": "small CBOW: V = 1,000 (input and output tables), 3,000 examples, dim 16, 8 negatives"}
#: The audited modes: name -> (overrides, `--channel`). Sparse mode's value channel: threshold
#: selection, the canaries' rows added to every step's selection (trainer/run/audit.py). User
#: level: DP-SGD over users of the click logs (`widedp synth logs`, 800 users), each canary a
#: user of k = 2 examples that both carry it.
MODES = {"dpsgd": (["train.mode=dpsgd"], "as-run"),
         "sparse value": (["train.mode=sparse", "train.selection=threshold"], "value"),
         "sparse as run": (["train.mode=sparse", "train.selection=threshold"], "as-run"),
         "user level": (["train.mode=dpsgd", "privacy.unit=user", "privacy.max_examples_per_user=2",
                         "train.recalibrate=false"], "as-run")}
#: The (model, mode) pairs audited, and each one's data set.
GRID = {("DLRM", "dpsgd"): "ctr", ("DLRM", "sparse value"): "ctr", ("DLRM", "sparse as run"): "ctr",
        ("DLRM", "user level"): "logs",
        ("CBOW", "dpsgd"): "text", ("CBOW", "sparse value"): "text"}
#: The broken variants per mode: σ/2, the factor 2 of the sensitivity missed (each example
#: clipped to 2·S1), and at user level each of a user's k = 2 examples clipped on its own.
MODE_VARIANTS = {"user level": (None, "sigma-over-2", "clip-per-example"),
                 "sparse as run": (None, "sigma-over-2", "skip-untouched")}
#: Modes audited for what they can show, not held to the ≥ 0.5·ε goal nor to catching every break.
DIAGNOSTIC_MODES = ("sparse as run",)
#: Expected batch per setting: above n (q = 1), or about half of the training split plus members.
SETTINGS = {"q = 1": "train.batch_size=1000000", "q ≈ ½": None}
EPSILONS = (1.0, 4.0, 8.0)
VARIANTS = (None, "sigma-over-2", "clip-doubled")
MEMBER_FRACTION = 0.05


def audit_once(data: Path, model: str, mode: str, epsilon: float, setting: str, observe: str, broken, canaries: int,
               seed: int) -> dict:
    from widedp.trainer.config import load_config
    from widedp.trainer.run.audit import one_run_audit

    units = _train_units(data) if mode == "user level" else 2400
    batch = SETTINGS[setting] or f"train.batch_size={int((units + canaries / 2) / 2)}"
    mode_overrides, channel = MODES[mode]
    cfg = load_config(None, [f"data.path={data}", *COMMON, *MODELS[model][1], *mode_overrides, batch,
                             f"privacy.target_epsilon={epsilon}"]).validate()
    t0 = time.perf_counter()
    r = one_run_audit(cfg, canaries=canaries, member_fraction=MEMBER_FRACTION, non_member_fraction=0.0,
                      confidence=0.95, seed=seed, broken=broken, canary_kind="gradient", observe=observe,
                      channel=channel)
    keep = ("claimed_epsilon", "epsilon_lower_bound", "epsilon_lower_bound_gdp", "gdp_correct", "gdp_guesses",
            "sample_rate", "noise_multiplier", "steps", "delta", "members", "value_claimed_epsilon")
    threshold = r["threshold_audit"]
    return {**{k: r[k] for k in keep}, "threshold_epsilon_delta": threshold["epsilon"]["epsilon_lower_bound"],
            "threshold_gdp": threshold["gdp"]["epsilon_lower_bound_gdp"], "threshold_mu": threshold["gdp"]["mu_lower_bound"],
            # a threshold fixed from the claimed mechanism, every canary counted (every-step audits only)
            "claim_threshold_gdp": (threshold.get("gdp_at_claimed_threshold") or {}).get("epsilon_lower_bound_gdp"),
            # the same rates against the run's own accountant at several δ (max over δ of bound / claim)
            "claim_curve_ratio": r["claim_curve"]["ratio"] if r.get("claim_curve") else None,
            "seconds": time.perf_counter() - t0}


def _train_units(data: Path) -> int:
    """The number of users in the training split (public at user level, as n is)."""
    import numpy as np
    from widedp.trainer.data.format.dataset import open_dataset

    train, _ = open_dataset(data)
    return int(np.unique(train.units()).size)


def logs_dataset() -> Path:
    """Click logs with users (`widedp synth logs`: 800 users, 3 days), converted by their schema
    with the last day as the test split, cached on disk (as the test suite's user logs)."""
    from _common import DATA_DIR
    from widedp.trainer.data.convert.table import convert_table
    from widedp.trainer.data.synthetic.synth_logs import synth_logs

    root = DATA_DIR / "audit_logs_u800_s2"
    if not (root / "data" / "dataset.json").exists():
        truth = synth_logs(root / "logs", users=800, days=3, seed=2)
        convert_table([str(root / "logs" / "day=*" / "*.parquet")], root / "data", schema=root / "logs" / "schema.toml",
                      test_after=truth["evaluation_day"]["date"])
    return root / "data"


def summarize(runs: list[dict]) -> dict:
    def stat(key):
        values = [r[key] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    value = [r["value_claimed_epsilon"] for r in runs if r["value_claimed_epsilon"] is not None]
    return {"claimed_epsilon": statistics.median(r["claimed_epsilon"] for r in runs),
            "value_claimed_epsilon": statistics.median(value) if value else None,
            "sample_rate": statistics.median(r["sample_rate"] for r in runs),
            "epsilon_delta": stat("epsilon_lower_bound"), "gdp": stat("epsilon_lower_bound_gdp"),
            "threshold_epsilon_delta": stat("threshold_epsilon_delta"), "threshold_gdp": stat("threshold_gdp"),
            "claim_threshold_gdp": stat("claim_threshold_gdp") if all(r["claim_threshold_gdp"] is not None for r in runs)
            else None,
            "claim_curve_ratio": stat("claim_curve_ratio") if all(r["claim_curve_ratio"] is not None for r in runs)
            else None,
            "correct": stat("gdp_correct"), "guesses": runs[0]["gdp_guesses"],
            "seconds": statistics.median(r["seconds"] for r in runs), "runs": runs}


BOUNDS = {"epsilon_delta": "one-run (ε, δ)", "gdp": "one-run GDP", "threshold_epsilon_delta": "threshold (ε, δ)",
          "threshold_gdp": "threshold GDP", "claim_threshold_gdp": "claim-threshold GDP"}
_RUN_KEYS = {"epsilon_delta": "epsilon_lower_bound", "gdp": "epsilon_lower_bound_gdp",
             "threshold_epsilon_delta": "threshold_epsilon_delta", "threshold_gdp": "threshold_gdp",
             "claim_threshold_gdp": "claim_threshold_gdp"}


def false_alarms(runs: list[dict], model: str, mode: str) -> dict:
    """Per bound, how many of the correct audits `runs` gave a bound above their claim."""
    return {"model": model, "mode": mode, "runs": len(runs), "setting": "q = 1", "epsilon": 4.0, "observe": "steps",
            **{f"exceed_{k}": sum(r[key] is not None and r[key] > r["claimed_epsilon"] for r in runs)
               for k, key in _RUN_KEYS.items()},
            "exceed_claim_curve": sum(r["claim_curve_ratio"] is not None and r["claim_curve_ratio"] > 1.0 for r in runs),
            "gdp_bounds": [r["epsilon_lower_bound_gdp"] for r in runs],
            "threshold_gdp_bounds": [r["threshold_gdp"] for r in runs],
            "epsilon_delta_bounds": [r["epsilon_lower_bound"] for r in runs],
            "claimed_epsilon": statistics.median(r["claimed_epsilon"] for r in runs)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="ε = 4 only, 1 repeat, 10 false-alarm runs")
    parser.add_argument("--canaries", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--false-alarm-runs", type=int, default=40)
    parser.add_argument("--delta-runs", type=int, default=8, help="runs of each of the δ = 1/n block's two variants")
    parser.add_argument("--delta-canaries", type=int, default=40_000)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    one_torch_thread()
    started = time.time()
    machine = announce_machine()
    data = {"ctr": ctr_dataset(13_000, 3_000, seed=3), "text": text_dataset(1_000, 3_000, seed=5),
            "logs": logs_dataset()}
    epsilons = (4.0,) if args.quick else EPSILONS
    repeats = 1 if args.quick else args.repeats
    seed = 1000
    cells = []
    for (model, mode), kind in GRID.items():
        # the final-model threat model on the first model's DP-SGD only: every other row observes steps
        observes = ("steps", "final") if (model, mode) == ("DLRM", "dpsgd") else ("steps",)
        for setting in SETTINGS:
            for epsilon in epsilons:
                for observe in observes:
                    for broken in MODE_VARIANTS.get(mode, VARIANTS):
                        runs = []
                        for _ in range(repeats):
                            seed += 1
                            runs.append(audit_once(data[kind], model, mode, epsilon, setting, observe, broken,
                                                   args.canaries, seed))
                        cell = {"model": model, "mode": mode, "setting": setting, "epsilon": epsilon,
                                "observe": observe, "broken": broken, **summarize(runs)}
                        cells.append(cell)
                        print(f"{model} {mode} {setting} ε={epsilon:g} {observe:>5} {broken or 'correct':>12}: "
                              f"claimed {cell['claimed_epsilon']:.3g}, (ε, δ) {cell['epsilon_delta']['median']:.3g}, "
                              f"GDP {cell['gdp']['median']:.3g}, threshold (ε, δ) "
                              f"{cell['threshold_epsilon_delta']['median']:.3g}, GDP "
                              f"{cell['threshold_gdp']['median']:.3g}, {cell['seconds']:.1f} s", flush=True)
    alarms = []
    for model, mode in (("DLRM", "dpsgd"), ("DLRM", "sparse value")):
        runs = []
        for _ in range(10 if args.quick else args.false_alarm_runs):
            seed += 1
            runs.append(audit_once(data["ctr"], model, mode, 4.0, "q = 1", "steps", None, args.canaries, seed))
        alarms.append(false_alarms(runs, model, mode))
    delta_runs = {}
    for broken in (None, "delta-one-over-n"):
        delta_runs[broken or "correct"] = []
        for _ in range(2 if args.quick else args.delta_runs):
            seed += 1
            delta_runs[broken or "correct"].append(audit_once(data["ctr"], "DLRM", "dpsgd", 8.0, "q = 1", "steps", broken,
                                                              args.delta_canaries, seed))
    delta_block = {"canaries": args.delta_canaries, "epsilon": 8.0, "setting": "q = 1", "observe": "steps",
                   "runs": {k: [{b: r[_RUN_KEYS[b]] for b in BOUNDS} | {"claimed_epsilon": r["claimed_epsilon"],
                                                                         "delta": r["delta"],
                                                                         "noise_multiplier": r["noise_multiplier"]}
                                for r in v] for k, v in delta_runs.items()}}
    for k, v in delta_block["runs"].items():
        print(f"δ = 1/n block, {k}: claim-threshold GDP "
              + ", ".join(f"{r['claim_threshold_gdp']:.3g}" for r in v) + f" against {v[0]['claimed_epsilon']:.3g}")
    print()
    print(format_table(["model", "mode", "setting", "ε", "observe", "run", "claimed", "(ε, δ)", "GDP",
                        "threshold (ε, δ)", "threshold GDP", "best / claim"],
                       [[c["model"], c["mode"], c["setting"], c["epsilon"], c["observe"], c["broken"] or "correct",
                         c["claimed_epsilon"], c["epsilon_delta"]["median"], c["gdp"]["median"],
                         c["threshold_epsilon_delta"]["median"], c["threshold_gdp"]["median"],
                         best_bound(c) / c["claimed_epsilon"]] for c in cells]))
    for a in alarms:
        print(f"false alarms over {a['runs']} correct audits ({a['model']} {a['mode']}): "
              + ", ".join(f"{BOUNDS[k]} {a[f'exceed_{k}']}" for k in BOUNDS))
    payload = {"canaries": args.canaries, "member_fraction": MEMBER_FRACTION, "confidence": 0.95,
               "repeats": repeats, "models": MODEL_NOTES, "cells": cells, "false_alarms": alarms,
               "delta_one_over_n": delta_block}
    write_results("audit_power", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.3g}"


def _present(cell: dict, keys) -> list:
    return [k for k in keys if cell.get(k) is not None]


def best_bound(cell: dict, keys=tuple(BOUNDS)) -> float:
    """The largest median lower bound of a cell over the named bounds it has."""
    return max(cell[k]["median"] for k in _present(cell, keys))


def _best_name(cell: dict, keys=tuple(BOUNDS)) -> str:
    return BOUNDS[max(_present(cell, keys), key=lambda k: cell[k]["median"])]


def _range(stat) -> str:
    return "—" if stat is None else f"{_fmt(stat['median'])} ({_fmt(stat['min'])}–{_fmt(stat['max'])})"


def results_section(doc: dict) -> tuple[list, list]:
    """RESULTS §27 (benchmarks/make_results.py): the cells, the fractions of the claim and the goal rows."""
    cells, alarms = doc["cells"], doc["false_alarms"]
    guesses = cells[0]["guesses"] if cells else 0
    lines = ["; ".join(f"{name}: {note}" for name, note in doc["models"].items())
             + f". 10 steps of plain SGD, σ calibrated to each ε; m = {doc['canaries']:,} gradient canaries "
             f"(a member's clipped gradient ≈ S1 along a secret direction on a row of its own), each a member with "
             f"probability ½; one-run bounds: \"member\" guessed for the {100 * doc['member_fraction']:g}% highest scores "
             f"({guesses}), no non-member guesses, fixed before any run; 95% confidence; "
             f"{doc['repeats']} runs per cell (median, and the range). Modes: `dpsgd`; `user level`: DP-SGD over "
             "users, each canary a user of k = 2 examples, `clip-per-example` clipping each of them on its own; "
             "`sparse as run`: the same sparse runs without the canaries' rows added, the every-step score the number "
             "of steps a canary's row was selected (its values breaking ties) — the selection channel, shown for what "
             "it can see and held to no goal; `sparse value`: threshold "
             "selection, the canaries' rows added to every step's selection (`--channel value`, a data-independent "
             "post-processing of it: the claim covers the run unchanged), so the audit sees the noisy values alone; "
             "`value ε` is the ε of the value events alone, what such an audit can approach (the selection's events "
             "make up the rest of the claim). One-run `(ε, δ)`: Steinke, Nasr & Jagielski (2023); "
             "one-run `GDP`: the Gaussian-DP null of Mahloujifar, Melis & Chaudhuri (2025). Threshold: Nasr et al. "
             "(2023)'s many-run method over the canaries as independent trials (each canary's score depends only on its "
             "own coin and its own row's noise) — a threshold chosen on a coin-independent half, Clopper–Pearson rates "
             "counted on the other half, each at 97.5%, as (ε, δ) and as Gaussian DP; claim-threshold: the same test at "
             "a threshold fixed from the claimed mechanism alone (simulated) before the run, every canary counted "
             "(every-step audits only); claim curve: the claim-threshold rates tested against the run's own accountant "
             "at δ ∈ {stated, 10⁻³, 10⁻², 10⁻¹} — the largest bound / claim over those δ, above 1 a refutation of the "
             "run's claim at that δ, rigorous at every q. The GDP bounds are exact at q = 1 "
             "(the claim is μ-GDP) and approximate at q ≈ ½, where the (ε, δ) bounds are the ones that can refute the "
             "claim. `steps`: the auditor sees the model after every step, scored by the claimed mechanism's likelihood "
             "ratio; `final`: the released model only. Verdicts by the largest median bound against the whole claim. "
             "Cost: each audit is one training run with the canaries; `s / audit` is its median wall time here (2 cores, "
             "one torch thread), the canaries' rows read after every step and every bound computed included. "
             "Run: `python benchmarks/audit_power.py`.",
             "",
             "Anchors (their settings, not re-run here): Nasr et al. (2023) report (nearly) tight estimates for DP-SGD "
             "when the adversary sees every update, from two runs; Steinke, Nasr & Jagielski (2023)'s one-run bound is "
             "capped by m and the number of guesses (here: all 500 right gives 7.3, below a claimed 8); Cebere, Bellet "
             "& Papernot (2024) find that with the crafted gradient inserted at every step, hiding the intermediate "
             "updates does not improve the guarantee — here, at q = 1, the `final` rows' threshold bounds match the `steps` rows'. "
             "Reported fractions: Mahloujifar, Melis & Chaudhuri (ICML 2025, Table 1: the idealized Gaussian mechanism, "
             "an optimal adversary, 10⁵–10⁶ canaries, δ = 10⁻⁵) give one-run bounds of 8.16, 3.61, 1.59 and 0.82 "
             "against claimed 9.99, 4.37, 1.99 and 0.92 (0.82, 0.83, 0.80, 0.89 of the claim: our division) with their "
             "f-DP method, and 4.99, 2.61, 1.33, 0.61 (0.50–0.67) with Steinke et al.'s; for white-box DP-SGD on "
             "CIFAR-10 (5,000 Dirac canaries, every iterate observed) both appear only in their figures. Nasr et al.'s "
             "and Steinke et al.'s own white-box numbers were not available to this project in text form and are not "
             "quoted. Our one-run GDP bound at ε = 8, q = 1 (m = 10,000, 500 guesses) is the row's `one-run GDP`; the "
             "threshold bounds, which take the canaries as independent trials (checked against genuine repeated runs "
             "in §27b), go further.",
             "", "| model | mode | q | ε | observe | run | claimed ε | value ε | one-run (ε, δ) | one-run GDP (range) | "
                 "threshold (ε, δ) | threshold GDP (range) | claim-threshold GDP (range) | best / claim | "
                 "claim curve ε̂/ε (range) | verdict | s / audit |",
             "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for c in cells:
        claimed, gdp, tgdp = c["claimed_epsilon"], c["gdp"], c["threshold_gdp"]
        curve = c.get("claim_curve_ratio")
        if c["broken"]:
            verdict = "caught" if best_bound(c) > claimed or (curve and curve["median"] > 1.0) else "not caught"
        else:
            verdict = ("holds" if max(c[k]["max"] for k in _present(c, BOUNDS)) <= claimed
                       and not (curve and curve["max"] > 1.0) else "**above the claim**")
        lines.append(f"| {c['model']} | {c['mode']} | {c['setting']} | {c['epsilon']:g} | {c['observe']} | "
                     f"{c['broken'] or 'correct'} | {_fmt(claimed)} | {_fmt(c['value_claimed_epsilon'])} | "
                     f"{_fmt(c['epsilon_delta']['median'])} | {_fmt(gdp['median'])} "
                     f"({_fmt(gdp['min'])}–{_fmt(gdp['max'])}) | {_fmt(c['threshold_epsilon_delta']['median'])} | "
                     f"{_range(tgdp)} | {_range(c.get('claim_threshold_gdp'))} | "
                     f"{best_bound(c) / claimed:.2f} | {_range(curve)} | {verdict} | {c['seconds']:.0f} |")
    lines.append("")
    for a in alarms:
        lines.append(f"False alarms (bounds above the claim) over {a['runs']} correct audits ({a['model']} {a['mode']}, "
                     f"{a['setting']}, ε = {a['epsilon']:g}, observe {a['observe']}): "
                     + ", ".join(f"{BOUNDS[k]} {a[f'exceed_{k}']}" for k in BOUNDS)
                     + f"; largest one-run GDP bound {_fmt(max(a['gdp_bounds']))}, largest threshold GDP bound "
                     f"{_fmt(max(a['threshold_gdp_bounds']))}, against {_fmt(a['claimed_epsilon'])} claimed.")
    block = doc.get("delta_one_over_n")
    delta_goal = None
    if block:
        key = "claim_threshold_gdp"
        correct, broken_runs = block["runs"]["correct"], block["runs"]["delta-one-over-n"]
        caught = sum(r[key] > r["claimed_epsilon"] for r in broken_runs)
        false = sum(r[key] > r["claimed_epsilon"] for r in correct)
        half = sum(r["threshold_gdp"] > r["claimed_epsilon"] for r in broken_runs)
        lines.append(f"δ = 1/n (σ calibrated and ε computed at δ = 1/n while the run states the auto δ = 1/(10n); "
                     f"DLRM DP-SGD, {block['setting']}, ε = {block['epsilon']:g}, every step, m = {block['canaries']:,}): "
                     f"claim-threshold GDP bound, correct runs " + ", ".join(_fmt(r[key]) for r in correct)
                     + f" against {_fmt(statistics.median(r['claimed_epsilon'] for r in correct))} claimed; δ = 1/n "
                     + ", ".join(_fmt(r[key]) for r in broken_runs)
                     + f" — caught in {caught} of {len(broken_runs)} (the half-split threshold bound: {half}); "
                     f"σ {_fmt(statistics.median(r['noise_multiplier'] for r in broken_runs))} against "
                     f"{_fmt(statistics.median(r['noise_multiplier'] for r in correct))}.")
        delta_goal = ("δ taken as 1/n caught (DLRM DP-SGD, q = 1, ε = 8, every step, claim-threshold GDP)",
                      f"{caught} of {len(broken_runs)} caught; correct runs above the claim: {false} of {len(correct)}",
                      "**met**" if broken_runs and caught == len(broken_runs) and false == 0 else "**missed**",
                      f"m = {block['canaries']:,}: the under-count is ~14% at ε = 8, within the reach of a bound at "
                      "0.95 of the claim only")
    at8 = [c for c in cells if c["setting"] == "q = 1" and c["epsilon"] == 8.0 and c["observe"] == "steps"
           and c["broken"] is None and c["mode"] not in DIAGNOSTIC_MODES]
    weak = [c for c in at8 if best_bound(c) < 0.5 * c["claimed_epsilon"]]
    broken = [c for c in cells if c["setting"] == "q = 1" and c["observe"] == "steps" and c["broken"]
              and c["mode"] not in DIAGNOSTIC_MODES]
    uncaught = [f"{c['model']} {c['mode']} {c['broken']} at ε = {c['epsilon']:g}" for c in broken
                if best_bound(c) <= c["claimed_epsilon"]]
    one_run = ("epsilon_delta", "gdp")
    one_run_caught = sum(best_bound(c, one_run) > c["claimed_epsilon"] for c in broken)
    exceeded = sum(a[f"exceed_{k}"] for a in alarms for k in BOUNDS) + sum(a.get("exceed_claim_curve", 0) for a in alarms)
    bounds_counted = sum((len(BOUNDS) + ("exceed_claim_curve" in a)) * a["runs"] for a in alarms)
    half = [c for c in cells if c["setting"] == "q ≈ ½" and c["observe"] == "steps" and c["broken"]
            and c["mode"] not in DIAGNOSTIC_MODES and c.get("claim_curve_ratio")]
    refuted = [c for c in half if c["claim_curve_ratio"]["median"] > 1.0]
    goals = [("White-box every-step audits at a claimed ε = 8 (q = 1) reach ≥ 0.5·ε for DP-SGD, sparse mode's "
              "value channel and user level, on the small DLRM and CBOW",
              "; ".join(f"{c['model']} {c['mode']}: {_best_name(c)} {_fmt(best_bound(c))} = "
                        f"{best_bound(c) / c['claimed_epsilon']:.2f}·ε" for c in at8) or "not measured",
              "**met**" if at8 and not weak else "**missed**",
              f"m = {doc['canaries']:,}; the one-run bounds alone reach "
              + ", ".join(f"{best_bound(c, one_run) / c['claimed_epsilon']:.2f}" for c in at8)),
             ("Subtle breaks (σ/2, clipping at 2·S1, per-example clipping at user level with k = 2) caught at every ε "
              "(q = 1, every step), per model and mode",
              f"{len(broken) - len(uncaught)} of {len(broken)} caught" + (f"; not: {', '.join(uncaught)}" if uncaught else "")
              + f"; by the one-run bounds alone {one_run_caught}",
              "**met**" if broken and not uncaught else "**missed**",
              "the threshold bound takes the canaries as independent trials; the one-run bounds' cap with this m is "
              "below the claim at ε = 8"),
             ("False-alarm rate of correct audits ≤ 5% (95% confidence)",
              f"{exceeded} of {bounds_counted} bounds above the claim",
              "**met**" if bounds_counted and exceeded <= 0.05 * bounds_counted else "**missed**",
              f"{' and '.join(str(a['runs']) + ' ' + a['model'] + ' ' + a['mode'] for a in alarms)} whole-run audits, "
              f"{len(BOUNDS)} bounds each and the claim-curve test")]
    if half:
        goals.insert(2, ("Subtle breaks at q ≈ ½ refuted by the run's own claim curve (every step; rigorous where the "
                         "Gaussian-DP nulls are approximate)",
                         f"{len(refuted)} of {len(half)} refuted; smallest median ε̂/ε "
                         f"{min(c['claim_curve_ratio']['median'] for c in half):.2f}",
                         "**met**" if len(refuted) == len(half) else "**missed**",
                         "the claim-threshold rates tested against the accountant's ε at δ ∈ {stated, 10⁻³, 10⁻², "
                         "10⁻¹}; jointly bounded rates, so one test"))
    if delta_goal:
        goals.insert(2, delta_goal)
    return lines, goals


if __name__ == "__main__":
    main()
