"""The own-model examples at full size: each example script run as a subprocess, its JSON kept.

`examples/dcn_ranking.py` (a DCN-v2-style ranking model) and `examples/two_tower_retrieval.py`
(a user tower and an item tower over one shared item table) train the user's own EBC and
module through `make_private` at user level on `widedp synth logs` click logs (shared code:
examples/own_model_common.py). Each prints one JSON object, runs[mode][ε][metric] =
[median, min, max] over the seeds; this script runs it with the sizes of docs/guide/own-model.md
(3,000 users, 4 days, 300 steps, 64 expected users per step, ε = 1 and 8, seeds 0, 1, 2; with
`--quick`, the examples' own smoke size) and writes benchmarks/results/own_model_<name>.json
(`--quick`: benchmarks/results/quick/) with the machine record every benchmark carries.
`results_section` renders one such file, whatever metrics it holds (a SASRec-style example's
hit-rate@10 / NDCG@10 as well as AUC, logloss, ECE, recall@10).

    python benchmarks/own_model.py [--quick] [--examples dcn_ranking,two_tower_retrieval] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, announce_machine, write_results  # noqa: E402

#: name -> the example script (under REPO) that writes own_model_<name>.json
EXAMPLES = {"dcn_ranking": "examples/dcn_ranking.py", "two_tower_retrieval": "examples/two_tower_retrieval.py",
            "sasrec_sequential": "examples/sasrec_sequential.py", "transformer_lm": "examples/transformer_lm.py"}
#: the full size (docs/guide/own-model.md), passed explicitly so the file records it
FULL_ARGS = ["--users", "3000", "--days", "4", "--steps", "300", "--batch-size", "64", "--epsilons", "1,8",
             "--seeds", "0,1,2"]
#: the language model's full size: public text (WordNet glosses + the King James Bible, Debian packages fetched
#: once by benchmarks/text_large.py) with WordNet's lemma index as the public vocabulary
LM_ARGS = ["--vocab", "50000", "--test-lines", "3000", "--steps", "500", "--batch-size", "256", "--epsilons", "1,8",
           "--seeds", "0,1"]


def full_args(name: str) -> list:
    """The example's full-size arguments (the LM's corpus built here first)."""
    if name != "transformer_lm":
        return list(FULL_ARGS)
    from text_large import build_corpus

    root = build_corpus()
    return ["--corpus", str(root / "corpus.txt"), "--vocab-file", str(root / "vocab_public.txt"), *LM_ARGS]
DESCRIPTIONS = {
    "dcn_ranking": "a DCN-v2-style ranking model (two cross layers beside a deep MLP)",
    "two_tower_retrieval": "a two-tower retrieval model (a user tower and an item tower over one shared item table, "
                           "the click logit their dot product)",
    "transformer_lm": "a small transformer language model (one causal self-attention block over a line's first 24 "
                      "words; a sampled softmax over 32 public negatives per example in training, the full softmax "
                      "over 50,000 words held out)",
    "sasrec_sequential": "a SASRec-style sequential recommender (the item history as a sequence through one "
                         "self-attention block with LayerNorm, the candidate ad attending over it)",
}
#: per example: (what it trains on, how its settings were chosen)
DATA_TEXT = {
    "click_logs": ("at user level on `widedp synth logs` click logs, the last day held out",
                   "the private modes use configs/logs.toml's settings (tuned for the DLRM on these logs), non-private "
                   "widedp's Adam defaults; the private DCN-v2 and SASRec-style runs end with the private "
                   "recalibration of their logit layer (inside the target ε)."),
    "transformer_lm": ("at example level (one line of text) on public text — WordNet 3.0's glosses and the King James "
                       "Bible (Debian packages) — with 3,000 lines held out by a public seed",
                       "every mode uses Adam at widedp's non-private defaults (tables 0.01, dense 0.002) and the "
                       "private modes clip at 1; not tuned for this model. The vocabulary is public (English "
                       "function words, then WordNet's lemma index); every other word is the unknown-word token."),
}
MODE_ORDER = ("sparse", "dpsgd", "nonprivate")
MODE_NAMES = {"sparse": "sparse", "dpsgd": "DP-SGD", "nonprivate": "non-private"}
METRIC_NAMES = {"auc": "AUC", "logloss": "logloss", "ece": "ECE", "ndcg@10": "NDCG@10", "hit_rate@10": "hit-rate@10",
                "hr@10": "hit-rate@10", "hit@10": "hit-rate@10", "perplexity": "perplexity (full softmax)", "epsilon": "ε spent", "seconds": "seconds per run"}
#: recorded per run but not model quality: shown after the metrics
BOOKKEEPING = ("epsilon", "seconds")


# ---- the runner ----------------------------------------------------------------------------------

def run_example(name: str, quick: bool, timeout: float = 4 * 3600) -> dict:
    """Run the example in a fresh process; its JSON (the last line of its stdout) with the
    arguments it ran with. Raises RuntimeError with the stderr's tail when it fails."""
    argv = ["--quick"] if quick else full_args(name)
    cmd = [sys.executable, str(REPO / EXAMPLES[name]), *argv]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{EXAMPLES[name]} failed (exit {done.returncode}):\n{tail}")
    out = json.loads(lines[-1])
    return {"example": name, "script": EXAMPLES[name], "argv": argv, "example_wall_s": time.perf_counter() - t0, **out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the examples' own --quick (a smoke run)")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated, of: " + ", ".join(EXAMPLES))
    parser.add_argument("--out-dir", help="write own_model_<name>.json here instead of benchmarks/results[/quick]")
    args = parser.parse_args(argv)
    names = args.examples.split(",")
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        parser.error(f"--examples: unknown {unknown} (choose from {', '.join(EXAMPLES)})")
    machine = announce_machine()
    failed = 0
    for name in names:
        started = time.time()
        print(f"{EXAMPLES[name]} {'--quick' if args.quick else '(full size)'}", flush=True)
        try:
            payload = run_example(name, args.quick)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            failed += 1
            continue
        for line in section_lines(payload):
            print(line)
        out = str(Path(args.out_dir) / f"own_model_{name}.json") if args.out_dir else None
        write_results(f"own_model_{name}", payload, quick=args.quick, machine=machine, out=out, started=started)
    return 1 if failed else 0


# ---- RESULTS -------------------------------------------------------------------------------------

def _eps_key(eps: str) -> float:
    try:
        return float(eps)
    except ValueError:
        return float("inf")


def _cell(triple, metric: str) -> str:
    """'median [min–max]' of a [median, min, max] triple ('–' when absent)."""
    if not triple:
        return "–"
    if metric == "seconds":
        fmt = "{:.1f}"
    elif metric == "epsilon":
        fmt = "{:.3g}"
    else:
        fmt = "{:.3f}"
    med, lo, hi = triple
    return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def metric_keys(runs: dict) -> list[str]:
    """Every metric the runs hold, in the order first seen; ε spent and seconds last."""
    keys: list[str] = []
    for by_eps in runs.values():
        for row in by_eps.values():
            keys += [k for k in row if k not in keys]
    return [k for k in keys if k not in BOOKKEEPING] + [k for k in BOOKKEEPING if k in keys]


def _example_name(doc: dict) -> Optional[str]:
    if doc.get("example"):
        return doc["example"]
    stem = Path(str(doc.get("_path", ""))).stem
    return stem[len("own_model_"):] if stem.startswith("own_model_") else None


def section_lines(doc: dict) -> list[str]:
    """The tables: per private ε, one row per metric, one column per mode, non-private beside."""
    runs = doc["runs"]
    name = _example_name(doc)
    script = doc.get("script") or (EXAMPLES.get(name) if name else None)
    what = DESCRIPTIONS.get(name or "", f"`{script}`" if script else "the example's model")
    argv = doc.get("argv")
    settings = []
    if doc.get("examples"):
        settings.append(f"{doc['examples']['train']:,} training and {doc['examples']['test']:,} test examples")
    if doc.get("steps") is not None:
        settings.append(f"{doc['steps']:,} steps")
    seeds = None
    if argv and "--seeds" in argv:
        seeds = argv[argv.index("--seeds") + 1]
    elif argv and "--quick" in argv:
        seeds = "0"
    where, tuned = DATA_TEXT.get(name or "", DATA_TEXT["click_logs"])
    oov = (doc.get("out_of_vocabulary") or {}).get("test")
    if oov is not None:
        tuned += f" Vocabulary {doc.get('vocabulary', 0):,} words; {100 * oov:.1f}% of the test words are unknown."
    lines = [f"{what[0].upper() + what[1:]}" + (f" (`{script}`)" if script and what != f"`{script}`" else "")
             + f" trained through `make_private` {where}: " + ", ".join(settings)
             + ". Each cell: median [min–max] over the seeds"
             + (f" ({seeds.replace(',', ', ')})" if seeds else " (which seeds: not recorded in this file)")
             + f", on the test split; {tuned}", ""]
    if argv is None:
        lines += ["This file was written by the example script itself (no arguments or machine recorded beyond the "
                  "line above); `python benchmarks/own_model.py` reruns it and records them.", ""]
    modes = [m for m in MODE_ORDER if m in runs and m != "nonprivate"] + \
            [m for m in runs if m not in MODE_ORDER]
    nonprivate = next(iter(runs.get("nonprivate", {}).values()), None)
    eps_values = sorted({e for m in modes for e in runs[m]}, key=_eps_key)
    keys = metric_keys(runs)
    for eps in eps_values:
        header = [f"{MODE_NAMES.get(m, m)}, ε = {eps}" for m in modes]
        if nonprivate is not None:
            header.append("non-private")
        lines += [f"ε = {eps}:", "", "| metric | " + " | ".join(header) + " |",
                  "|---|" + "---:|" * len(header)]
        for key in keys:
            cells = [_cell(runs[m].get(eps, {}).get(key), key) for m in modes]
            if nonprivate is not None:
                cells.append(_cell(nonprivate.get(key), key))
            lines.append(f"| {METRIC_NAMES.get(key, key)} | " + " | ".join(cells) + " |")
        lines.append("")
    if not eps_values and nonprivate is not None:
        lines += ["| metric | non-private |", "|---|---:|"]
        lines += [f"| {METRIC_NAMES.get(k, k)} | {_cell(nonprivate.get(k), k)} |" for k in keys] + [""]
    return lines


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section for one own_model_*.json (benchmarks/make_results.py); no goal rows."""
    return section_lines(doc), []


if __name__ == "__main__":
    sys.exit(main())
