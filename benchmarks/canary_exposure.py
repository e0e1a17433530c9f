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
it only through group privacy). `trainer/audit.py::exposure_audit`, `widedp audit --kind
exposure`. Corpus: the config's (synthetic Zipf text) or, with `--kjv`, real English: the King
James Bible (public domain) from Debian's `bible-kjv-text` package, fetched with `apt-get
download` (plus `bible-kjv`, whose reader prints the text), one verse per line, converted by
`widedp convert text --vocab 1000` (private vocabulary, charged to each run's ledger) and
trained for about two epochs (`train.steps` 5,000 at batch 256). Never needed by `make test`.

    python benchmarks/canary_exposure.py [--quick] [--kjv] [--config configs/cbow.toml] [--insertions 3,9,15]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (DATA_DIR, announce_machine, ensure_config_dataset, format_table, quick_data_overrides, run_worker,
                     worker_entry, write_results)

MODES = ("nonprivate", "dpsgd", "sparse")


def exposure_worker(spec: dict) -> dict:
    from widedp.trainer.audit import exposure_audit
    from widedp.trainer.config import load_config

    cfg = load_config(spec["config"], spec["overrides"])
    cfg.validate()
    t0 = time.perf_counter()
    record = exposure_audit(cfg, canaries=spec["canaries"], insertions=spec["insertions"],
                            references=spec["references"], placement=spec.get("placement", "text"))
    record.pop("exposures")  # the ranks stay: RESULTS plots their histograms
    record["seconds"] = time.perf_counter() - t0
    return record


def kjv_dataset(root: Path = DATA_DIR / "kjv") -> Path:
    """The King James Bible as a CBOW data set under `root` (fetched and converted once)."""
    out = root / "cbow_vocab1000"
    if (out / "dataset.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for package in ("bible-kjv-text", "bible-kjv"):
            subprocess.run(["apt-get", "download", package], cwd=tmp, check=True, capture_output=True)
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "root")], check=True)
        reader, data = Path(tmp) / "root/usr/bin/bible", Path(tmp) / "root/usr/lib"
        verses = subprocess.run([str(reader), "-f", "-p", str(data), "gen1:1-rev22:21"], check=True,
                                capture_output=True, text=True).stdout.splitlines()
        if len(verses) < 31000:
            raise RuntimeError(f"the bible reader printed {len(verses)} verses, expected 31,102")
        corpus = root / "kjv.txt"
        corpus.write_text("\n".join(v.split(" ", 1)[1] for v in verses if " " in v) + "\n")  # drop "Ge1:1"
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
    args = parser.parse_args(argv)
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
    results = []
    for n_c in [int(x) for x in args.insertions.split(",") if x]:
        for mode in [m for m in args.modes.split(",") if m]:
            # the seed's sparse model selects over every row: no table noised densely by the table
            # policy (configs/cbow.toml's would make both 1,000-row tables dense, i.e. DP-SGD)
            sparse_tables = ["privacy.table_default=sparse"] if mode == "sparse" else []
            r = run_worker(__file__, {"config": args.config, "overrides": [*sparse_tables, *base, f"train.mode={mode}"],
                                      "canaries": canaries, "insertions": n_c, "references": references,
                                      "placement": args.placement}, timeout=3600)
            r.update(mode=mode, insertions=n_c)
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
    payload = {"config": args.config, "corpus": "King James Bible (bible-kjv-text)" if args.kjv else "the config's",
               "canaries": canaries, "references": references, "placement": args.placement, "results": results}
    name = "canary_exposure" + ("_kjv" if args.kjv else "") + ("_line" if args.placement == "line" else "")
    write_results(name, payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    if not worker_entry(exposure_worker):
        main()
