"""The seed's canary exposure test (wide-network-dp §6.5, Table 2) on CBOW.

1,000 random three-word canary phrases, each inserted n_c ∈ {3, 9, 15} times into the
training text (`--placement text`, the default and the seed's: between words of the corpus, so
each insertion gives the 2·window + 3 CBOW examples within reach of the phrase; `--placement
line`: as its own line, three examples whose whole context is the phrase); after one training run,
each phrase's log-perplexity P(c) = −log Pr(c1 | c0) − log Pr(c2 | c0, c1) under the released
model, its rank among 10,000 random phrases of the same form, Pearson's χ² of the ranks
against uniform, and the exposure log2(10,001) − log2(rank) (Carlini et al. 2019). Seed Table
2: non-private p ≈ 0.00 at every n_c; DP-SGD and sparse p ≥ 0.31 at n_c ≤ 9; sparse p ≈ 0.00 at
n_c = 15 (a phrase inserted n_c times is a group of 3·n_c examples: the example-level ε covers
it only through group privacy). `trainer/run/audit.py::exposure_audit`, `widedp audit --kind
exposure`. Corpus: the config's (synthetic Zipf text) or, with `--kjv`, real English: the King
James Bible (public domain) from Debian's `bible-kjv-text` package, fetched with `apt-get
download` (plus `bible-kjv`, whose reader prints the text), one verse per line, converted by
`widedp convert text --vocab 1000` (private vocabulary, charged to each run's ledger) and
trained for about two epochs (`train.steps` 5,000 at batch 256). Never needed by `make test`.

Modes: `nonprivate`; `dpsgd` (σ calibrated to the config's ε = 8); `sparse`: OUR sparse mode, the
config's fest-threshold selection at ε = 8 (not the seed's algorithm); `alg3-em`: the seed's
Algorithm 3 with the exponential-mechanism selection (Alg 4) and its §6 hyper-parameters where our
config has them (`SEED_ALG3`: σ = 0.5, γ = 0.001, S1 = 15, S2 = 0.05, S0 = 0.1, total ε = 30; the
per-draw ε'' of the selection is calibrated in the worker so that the run's steps, as the ledger
charges them, spend the seed's ε = 30 at our δ — `seed_selection_epsilon`); its claimed ε is what
the ledger reports for that run. Every row also records how often the canary examples were seen
(`phrase_counts`: n, q, T·q, examples per phrase and their share of the training set).
`--merge` keeps the rows of the existing results file that this invocation does not rerun (and
adds the counts to those that lack them).

    python benchmarks/canary_exposure.py [--quick] [--kjv] [--config configs/cbow.toml] [--insertions 3,9,15]
        [--modes nonprivate,dpsgd,sparse,alg3-em] [--merge]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (DATA_DIR, announce_machine, ensure_config_dataset, format_table, kjv_corpus, quick_data_overrides,
                     results_path, run_worker, worker_entry, write_results)

MODES = ("nonprivate", "dpsgd", "sparse", "alg3-em")

#: The seed's Algorithm 3 + EM (wide-network-dp Alg 3 with Alg 4) at its §6 hyper-parameters
#: (Table 1; §6.4: ε = 30, δ = 1e-5, split ε 20 / δ 5e-6 for the noise and ε 10 / δ 5e-6 for the
#: selection, "by Theorem 3, we set σ = 0.5"; §6.5: the canary runs use "the same hyperparameters",
#: σ = 0.5). What our config cannot take is listed in RESULTS (make_results.section_exposure).
SEED_ALG3 = {"noise_multiplier": 0.5, "gamma": 0.001, "clip_norm": 15.0, "second_clip_norm": 0.05, "score_clip": 0.1,
             "target_epsilon": 30.0, "selection_share_epsilon": 10.0, "noise_share_epsilon": 20.0, "delta": 1e-5,
             "batch_size": 20, "optimizer": "adam", "lr": 0.001, "epochs": 20, "corpus": "Brown, vocab 1,000",
             "train_examples": 200_000}


def mode_overrides(mode: str) -> list[str]:
    """The config overrides of a benchmark mode (`alg3-em`: the seed's Alg 3 + EM, its selection ε
    added by the worker)."""
    if mode == "sparse":
        # our sparse mode over every row: no table noised densely by the table policy
        # (configs/cbow.toml's would make both 1,000-row tables dense, i.e. DP-SGD)
        return ["privacy.table_default=sparse", "train.mode=sparse"]
    if mode == "alg3-em":
        s = SEED_ALG3
        # the seed selects over every coordinate: every row here (no dense table); k = ⌊γ·rows⌋
        return ["privacy.table_default=sparse", "train.mode=sparse", "train.selection=em",
                f"privacy.noise_multiplier={s['noise_multiplier']}", f"privacy.gamma={s['gamma']}", "privacy.k=auto",
                f"privacy.clip_norm={s['clip_norm']}", f"privacy.second_clip_norm={s['second_clip_norm']}",
                f"privacy.score_clip={s['score_clip']}", f"privacy.target_epsilon={s['target_epsilon']}"]
    return [f"train.mode={mode}"]


def phrase_counts(cfg, canaries: int, insertions: int, placement: str, steps: int | None = None,
                  corpus: int | None = None) -> dict:
    """How often the canary examples are seen in a run of `cfg` (data and config only, no
    training): the training corpus's examples, the canary examples (insertions × (2·window + 3) per
    phrase with the text placement, × 3 per line), n, the sampling rate q = b/n, the expected
    times each example is sampled T·q, and a phrase's examples' share of the training set.
    `corpus`: the training corpus's examples when known otherwise (a past run's), else counted."""
    from widedp.trainer.run.train import _ensure_dataset

    train_set, _ = _ensure_dataset(cfg)
    window = int(train_set.meta.extra.get("window", 4))
    per_insertion = 2 * window + 3 if placement == "text" else 3
    if corpus is None:
        corpus = len(train_set)
        if cfg.data.validation_fraction > 0:
            corpus -= int(round(corpus * cfg.data.validation_fraction))  # approximately what build_run holds out
    per_phrase = insertions * per_insertion
    n = corpus + canaries * per_phrase
    q = min(1.0, cfg.train.batch_size / n)
    steps = int(cfg.train.steps if steps is None else steps)
    return {"corpus_examples": corpus, "window": window, "examples_per_insertion": per_insertion,
            "examples_per_phrase": per_phrase, "canary_examples": canaries * per_phrase, "n": n,
            "batch_size": cfg.train.batch_size, "sample_rate": q, "steps": steps,
            "expected_samples_per_example": steps * q, "expected_sampled_examples_per_phrase": steps * q * per_phrase,
            "phrase_share": per_phrase / n, "canary_share": canaries * per_phrase / n,
            "examples_sampled_total": steps * q * n, "lr": cfg.train.lr, "optimizer": cfg.train.optimizer}


def seed_selection_epsilon(cfg, counts: dict) -> dict:
    """The per-draw ε'' of the EM selection for the seed's budget under our ledger: σ is the
    seed's 0.5 and the run spends the seed's total ε = 30 at our δ. The seed splits its ε into 20
    (noise) + 10 (selection) through Theorem 3, which amplifies each part linearly by q; our ledger
    charges each step as one Poisson-sampled composition [selection, Gaussian] (the engine's
    `sampled_step_event`), plus the data set's one-time events (a private vocabulary), so ε'' is
    the largest value whose T steps spend at most the seed's total (bisection). Also recorded: the
    noise alone, the selection alone, and the ε'' at which the selection alone would spend the
    seed's share of 10 with the ε the composed steps would then spend."""
    from widedp.accounting import events as ev
    from widedp.accounting.base import make_accountant
    from widedp.accounting.calibration import sampled_step_event
    from widedp.selection.exponential import k_from_fraction
    from widedp.trainer.config.planning import default_delta
    from widedp.trainer.run.train import _ensure_dataset

    meta = _ensure_dataset(cfg)[0].meta
    rows = sum(int(v) for v in meta.table_sizes.values())
    k = k_from_fraction(cfg.privacy.gamma, rows)
    delta = cfg.privacy.resolved("delta") or default_delta(counts["n"])
    data = [(ev.event_from_dict(e["event"]), 1) for e in (meta.extra.get("privacy_events") or [])]
    acc = make_accountant(cfg.privacy.accountant)
    q, steps, sigma = counts["sample_rate"], counts["steps"], SEED_ALG3["noise_multiplier"]

    def total(e: float) -> float:
        return acc.epsilon([*data, (sampled_step_event(q, ev.GaussianDpEvent(sigma), ev.ExponentialTopKDpEvent(e, k)),
                                    steps)], delta)

    def alone(e: float) -> float:
        return acc.epsilon([(ev.PoissonSampledDpEvent(q, ev.ExponentialTopKDpEvent(e, k)), steps)], delta)

    def solve(f, target: float) -> float:
        lo, hi = 1e-6, 100.0
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if f(mid) > target else (mid, hi)
        return lo

    target = SEED_ALG3["target_epsilon"] * (1 - 1e-4)  # below the run's budget, so no step is refused
    chosen = solve(total, target)
    share = solve(alone, SEED_ALG3["selection_share_epsilon"])
    return {"selection_epsilon": chosen, "planned_epsilon": total(chosen), "delta": delta, "k": k,
            "selectable_rows": rows, "expected_selections_per_row": steps * k / rows,
            "noise_alone_epsilon": acc.epsilon([*data, (sampled_step_event(q, ev.GaussianDpEvent(sigma)), steps)], delta),
            "selection_alone_epsilon": alone(chosen), "data_events": len(data),
            "share_selection_epsilon": share, "share_total_epsilon": total(share)}


def exposure_worker(spec: dict) -> dict:
    from widedp.trainer.run.audit import exposure_audit
    from widedp.trainer.config import load_config

    placement = spec.get("placement", "text")
    cfg = load_config(spec["config"], spec["overrides"])
    counts = phrase_counts(cfg, spec["canaries"], spec["insertions"], placement)
    seed = None
    if spec.get("seed_alg3"):
        seed = seed_selection_epsilon(cfg, counts)
        cfg = load_config(spec["config"], [*spec["overrides"], f"privacy.selection_epsilon={seed['selection_epsilon']!r}"])
    cfg.validate()
    t0 = time.perf_counter()
    record = exposure_audit(cfg, canaries=spec["canaries"], insertions=spec["insertions"],
                            references=spec["references"], placement=placement)
    record.pop("exposures")  # the ranks stay: RESULTS plots their histograms
    record["seconds"] = time.perf_counter() - t0
    record["counts"] = dict(counts, steps=record["steps"], expected_samples_per_example=record["steps"] * counts["sample_rate"],
                            expected_sampled_examples_per_phrase=record["steps"] * counts["sample_rate"]
                            * counts["examples_per_phrase"],
                            examples_sampled_total=record["steps"] * counts["sample_rate"] * counts["n"])
    p = cfg.privacy
    record["privacy_settings"] = None if cfg.train.mode == "nonprivate" else {
        "noise_multiplier": p.noise_multiplier, "clip_norm": p.clip_norm, "second_clip_norm": p.second_clip_norm,
        "target_epsilon": p.target_epsilon, "selection": cfg.train.selection if cfg.train.mode == "sparse" else None,
        "k": p.k, "gamma": p.gamma, "score_clip": p.score_clip, "selection_epsilon": p.selection_epsilon}
    if seed is not None:
        record["seed_alg3"] = dict(seed, seed_settings=SEED_ALG3)
    return record


def kjv_dataset(root: Path = DATA_DIR / "kjv") -> Path:
    """The King James Bible as a CBOW data set under `root` (fetched and converted once)."""
    out = root / "cbow_vocab1000"
    if (out / "dataset.json").exists():
        return out
    corpus = kjv_corpus(root)
    subprocess.run([sys.executable, "-m", "widedp.trainer.cli", "convert", "text", str(corpus), str(out), "--vocab", "1000"],
                   check=True, capture_output=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpus, 60 steps, 200 canaries, 2,000 references")
    parser.add_argument("--config", default="configs/cbow.toml")
    parser.add_argument("--kjv", action="store_true", help="real text: the King James Bible (apt-get download)")
    parser.add_argument("--insertions", default="3,9,15")
    parser.add_argument("--placement", choices=("text", "line"), default="text")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--canaries", type=int, default=None)
    parser.add_argument("--references", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--out")
    parser.add_argument("--add-counts", action="store_true",
                        help="train nothing: add `counts` to the existing results file's rows that lack them")
    parser.add_argument("--merge", action="store_true",
                        help="keep the existing results file's rows this run does not redo (same n_c and mode)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m and m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    started = time.time()
    machine = announce_machine()
    canaries = args.canaries or (200 if args.quick else 1000)
    references = args.references or (2000 if args.quick else 10_000)
    if args.kjv:
        base = [f"data.path={kjv_dataset()}", "data.synth=", "cluster.backend=local",
                f"train.steps={300 if args.quick else 5000}", *args.set]
    else:
        base = [*(quick_data_overrides(args.config) if args.quick else []), "cluster.backend=local", *args.set]
        if args.quick:
            base.append("train.steps=60")
        ensure_config_dataset(args.config, base)
    name = "canary_exposure" + ("_kjv" if args.kjv else "") + ("_line" if args.placement == "line" else "")
    if args.add_counts:  # no training: the counts of how often the canaries were seen, from the data and config
        path = results_path(name, args.quick, args.out)
        doc = json.loads(path.read_text())
        add_counts(doc["results"], args.config, base, doc["canaries"], doc.get("placement", "line"))
        doc["counts_added"] = (f"`counts` added {time.strftime('%Y-%m-%dT%H:%M:%S%z')} by `--add-counts` from the data "
                               "and config (no training)")
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"added counts to {path}")
        return doc
    results = []
    for n_c in [int(x) for x in args.insertions.split(",") if x]:
        for mode in [m for m in args.modes.split(",") if m]:
            overrides = mode_overrides(mode)
            r = run_worker(__file__, {"config": args.config, "overrides": [*overrides, *base],  # --set wins
                                      "canaries": canaries, "insertions": n_c, "references": references,
                                      "placement": args.placement, "seed_alg3": mode == "alg3-em"}, timeout=3600)
            r.update(mode=mode, insertions=n_c, overrides=overrides)
            results.append(r)
            if "error" in r:
                print(f"n_c {n_c} {mode}: FAILED: {r['error'][:200]}")
            else:
                print(f"n_c {n_c:>2} {mode:>10}: claimed ε {r['claimed_epsilon']:.3g}, χ² p {r['p_value']:.3g}, mean exposure "
                      f"{r['mean_exposure']:.2f} bits, {r['seconds']:.0f} s", flush=True)
    ok = [r for r in results if "error" not in r]
    print()
    print(format_table(["n_c", "mode", "claimed ε", "χ² p-value", "flagged (p < 0.01)", "mean exposure", "median exposure"],
                       [[r["insertions"], r["mode"], r["claimed_epsilon"], r["p_value"], r["flagged"], r["mean_exposure"],
                         r["median_exposure"]] for r in ok]))
    kept: list = []
    if args.merge and results_path(name, args.quick, args.out).exists():
        old = json.loads(results_path(name, args.quick, args.out).read_text())
        if (old.get("canaries"), old.get("references"), old.get("placement")) != (canaries, references, args.placement):
            raise SystemExit(f"--merge: {results_path(name, args.quick, args.out)} has other canaries/references/placement")
        redone = {(r["mode"], r["insertions"]) for r in results}
        kept = [r for r in old["results"] if (r["mode"], r["insertions"]) not in redone]
        add_counts(kept, args.config, base, canaries, args.placement)
    order = {m: i for i, m in enumerate(MODES)}
    merged = sorted([*kept, *results], key=lambda r: (r["insertions"], order.get(r["mode"], len(order))))
    payload = {"config": args.config, "corpus": "King James Bible (bible-kjv-text)" if args.kjv else "the config's",
               "canaries": canaries, "references": references, "placement": args.placement, "results": merged}
    if kept:  # the shape benchmarks/make_results.py reads (as privacy_audit.py's); counts added without training
        payload["merged"] = {"rerun": sorted(f"{r['mode']} n_c {r['insertions']}" for r in results),
                             "other_rows_created": old.get("created"), "other_rows_command": old.get("command"),
                             "other_rows_machine": old.get("machine"),
                             "counts_added": "the kept rows' `counts` computed afterwards from the data and config"}
    write_results(name, payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def add_counts(rows: list, config: str, base: list, canaries: int, placement: str) -> None:
    """`phrase_counts` for kept rows that lack them (computed from the data and the config of
    the row's mode at its recorded steps; no training)."""
    from widedp.trainer.config import load_config

    # the runs' n, from a private row's δ = min(0.1/n, n^-1.1) (privacy.delta auto), per n_c: the
    # rows of one n_c trained on the same data set
    n_runs = {r["insertions"]: round(0.1 / r["delta"]) for r in rows if r.get("delta") and "error" not in r}
    for r in rows:
        if "counts" not in r and "error" not in r:
            overrides = mode_overrides(r["mode"])
            cfg = load_config(config, [*overrides, *base])
            r["counts"] = phrase_counts(cfg, canaries, r["insertions"], placement, steps=r.get("steps"))
            n_run = n_runs.get(r["insertions"])
            if n_run is not None and abs(n_run - r["counts"]["n"]) > 1:
                now = r["counts"]["n"]
                r["counts"] = phrase_counts(cfg, canaries, r["insertions"], placement, steps=r.get("steps"),
                                            corpus=n_run - r["counts"]["canary_examples"])
                r["counts"]["note"] = (f"n = {n_run:,} from the run's δ; the data set at that path now has n = {now:,} "
                                       "(converted again since; a private vocabulary differs from one conversion to "
                                       "the next)")


if __name__ == "__main__":
    if not worker_entry(exposure_worker):
        main()
