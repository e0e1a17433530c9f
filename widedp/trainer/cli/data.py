"""`widedp convert ...` and `widedp synth ...` (registered through trainer/cli/__init__.py).

    widedp convert criteo INPUT.tsv[.gz]... OUT_DIR [--hash-size N | --hash-sizes a,b,...(26)]
    widedp convert table INPUT... OUT_DIR --schema SCHEMA.toml [--test INPUT... | --test-after T]
    widedp convert text INPUT.txt OUT_DIR (--vocab N | --vocab-file PATH [--vocab N])
                        [--window 4 --negatives 8 --seed 0]
                        [--vocab-noise-multiplier 4.0 --vocab-max-words-per-line 32
                         --vocab-unseen-delta 1e-9 --vocab-noise-seed INT --allow-small-vocab]
    widedp synth ctr OUT_DIR --examples N [--table-size N | --table-sizes a,b,...] [--seed S]
                              [--zipf-exponent A]
    widedp synth text OUT_DIR --examples N --vocab V [--seed S] [--topics K]
    widedp synth logs OUT_DIR [--users 2000 --days 3 --seed 0 --start-date 2026-11-01
                               --examples-per-user-median 4 --examples-per-user-sigma 1.5
                               --max-examples-per-user 5000 --items 20000 --topics 20
                               --history-length 20]
        raw day-partitioned Parquet click logs with users, a planted per-user model, truth.json
        and a `convert table` schema (trainer/data/synthetic/synth_logs.py); it prints out_dir, kind,
        num_examples, num_users, days, test_day, test_examples, base_rate, bayes_auc,
        max_examples_per_user, convert_command and seconds.

Each prints one JSON object: out_dir, kind, num_examples, table_sizes, bayes_auc, seconds,
test_examples and test_split (a data set with a test file only), and privacy_events (the descriptions of the DP mechanisms run on the private input, whose
events dataset.json records for the trainer to charge; [] when none).

`convert text` without --vocab-file selects the vocabulary from the private text by Gaussian
partition selection (trainer/data/convert/text.py); its noise comes from fresh OS entropy unless
--vocab-noise-seed is given (tests only: the vocabulary's ε then holds only while the seed is
secret). `--seed` only drives the negatives' draws. A private vocabulary of fewer than half of
--vocab words is an error (exit 2, nothing written) unless --allow-small-vocab.

Importing this module is cheap (no torch, no pyarrow): handlers import what they need.
"""

from __future__ import annotations

import argparse
import math
import time


def _int_arg(name: str, low: int):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {text}")
        return value
    return parse


def _float_arg(name: str, low: float):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}")
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{name} must be finite and >= {low}, got {text}")
        return value
    return parse


def _table_sizes(text):
    parts = [p.strip() for p in text.split(",")]
    parse = _int_arg("--table-sizes", 1)
    sizes = [parse(p) for p in parts]
    if len(sizes) not in (1, 26):
        raise argparse.ArgumentTypeError(f"--table-sizes needs 26 comma-separated values (or one), "
                                         f"got {len(sizes)}")
    return sizes


def _hash_sizes(text):
    parts = [p.strip() for p in text.split(",")]
    parse = _int_arg("--hash-sizes", 2)
    sizes = [parse(p) for p in parts]
    if len(sizes) != 26:
        raise argparse.ArgumentTypeError(f"--hash-sizes needs 26 comma-separated values (one per "
                                         f"categorical feature C1..C26), got {len(sizes)}")
    return sizes


def _probability_arg(name: str):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}")
        if not 0 < value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be in (0, 1), got {text}")
        return value
    return parse


def _positive_float_arg(name: str):
    def parse(text):
        value = _float_arg(name, 0.0)(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value
    return parse


def _fraction_arg(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number in [0, 1), got {text!r}") from None
        if not 0.0 <= value < 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1), got {text}")
        return value
    return parse


def _partition_args(parser, by_unit: bool) -> None:
    parser.add_argument("--parts", type=_int_arg("--parts", 1),
                        help="write OUT_DIR as this many parts, each read only by the trainer that owns it "
                             "(as `convert partition` does, from a temporary conversion beside OUT_DIR)")
    if by_unit:
        parser.add_argument("--by", choices=("example", "unit"),
                            help="with --parts: hash of each example's row (default) or of its unit")
    parser.add_argument("--test-fraction", type=_fraction_arg("--test-fraction"),
                        help="with --parts and no test file: the held-out share, data.test_fraction's rule "
                             "(default 0.1)")


def _partitioned_output(args, convert) -> dict:
    """`convert(out_dir)` into a temporary sibling of args.out_dir, written as --parts parts into
    args.out_dir, the temporary conversion removed (also on failure)."""
    import shutil
    import uuid
    from pathlib import Path

    from widedp.trainer.data._util import missing_directories, remove_empty_directories
    from widedp.trainer.data.format.partitioned import write_partitioned

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory; a data set is never overwritten")
    created = missing_directories(out.absolute().parent)  # OUT_DIR's missing parents: removed on failure
    whole = out.parent / f".{out.name}.{uuid.uuid4().hex}.whole"
    done = False
    try:
        convert(whole)
        manifest = write_partitioned(whole, out, args.parts, partition_by=getattr(args, "by", None) or "example",
                                     test_fraction=0.1 if args.test_fraction is None else args.test_fraction)
        done = True
    finally:
        shutil.rmtree(whole, ignore_errors=True)
        if not done:
            remove_empty_directories(created)
    return {"parts": manifest.num_parts, "partition_by": manifest.partition_by,
            "part_examples": [p.num_examples for p in manifest.parts], "test_examples": manifest.test_examples,
            "split": manifest.split}


def add_commands(subparsers) -> dict:
    conv = subparsers.add_parser("convert", help="convert Criteo TSV, your own table (by a schema) or plain text "
                                                 "to a data set")
    csub = conv.add_subparsers(dest="convert_kind", required=True, parser_class=type(conv))
    c = csub.add_parser("criteo", help="Criteo TSV (label, 13 ints, 26 hex ids) -> ctr data set")
    c.add_argument("input", nargs="+", help="TSV files (plain or .gz) or globs, converted in order")
    c.add_argument("out_dir")
    hashing = c.add_mutually_exclusive_group()
    hashing.add_argument("--hash-size", type=_int_arg("--hash-size", 2),
                         help="rows per categorical table (ids 1..N-1 hashed, 0 = empty; default 2^20)")
    hashing.add_argument("--hash-sizes", type=_hash_sizes,
                         help="26 comma-separated per-feature table sizes (C1..C26), each >= 2")
    c.add_argument("--chunk-rows", type=_int_arg("--chunk-rows", 1), default=100_000)
    tb = csub.add_parser("table", help="Parquet or CSV/TSV (plain or .gz) described by a TOML schema -> ctr "
                                       "data set (trainer/data/convert/table.py)")
    tb.add_argument("input", nargs="+", help="Parquet or CSV files or globs (each glob's matches sorted)")
    tb.add_argument("out_dir")
    tb.add_argument("--schema", required=True, help="the TOML schema: columns, label, dense transforms, "
                                                    "categorical features and their tables, unit, timestamp")
    split = tb.add_mutually_exclusive_group()
    split.add_argument("--test", nargs="+", metavar="INPUT", help="separate evaluation files -> test.parquet")
    split.add_argument("--test-after", metavar="TIMESTAMP",
                       help="ISO date/datetime (UTC): examples with timestamp >= it go to test.parquet")
    tb.add_argument("--chunk-rows", type=_int_arg("--chunk-rows", 1), default=65_536,
                    help="Parquet rows decoded at once (bounds memory)")
    _partition_args(c, by_unit=False)  # a Criteo file has no unit column
    _partition_args(tb, by_unit=True)
    t = csub.add_parser("text", help="plain text -> cbow data set (word2vec CBOW + negatives)")
    t.add_argument("input")
    t.add_argument("out_dir")
    t.add_argument("--vocab", type=_int_arg("--vocab", 1),
                   help="maximum vocabulary size (required unless --vocab-file)")
    t.add_argument("--window", type=_int_arg("--window", 1), default=4)
    t.add_argument("--negatives", type=_int_arg("--negatives", 1), default=8)
    t.add_argument("--seed", type=_int_arg("--seed", 0), default=0,
                   help="seed of the negatives' draws only (never of the vocabulary noise)")
    t.add_argument("--vocab-file", help="PUBLIC vocabulary, one word per line (word or word<TAB>...): "
                                        "no private selection, nothing charged")
    t.add_argument("--vocab-noise-multiplier", type=_positive_float_arg("--vocab-noise-multiplier"),
                   help="σ of the private vocabulary selection (default 4.0, or sized by --target-epsilon)")
    t.add_argument("--target-epsilon", type=_positive_float_arg("--target-epsilon"),
                   help="the ε you intend to train at: the vocabulary's σ is then the one whose selection alone "
                        "spends --vocab-budget-share of it at --vocab-delta")
    t.add_argument("--vocab-budget-share", type=_probability_arg("--vocab-budget-share"), default=0.2,
                   help="with --target-epsilon: the share of it the vocabulary may spend (default 0.2)")
    t.add_argument("--vocab-delta", type=_probability_arg("--vocab-delta"), default=1e-8,
                   help="with --target-epsilon: the δ the share is computed at (default 1e-8, below the trainer's "
                        "automatic δ for every data set under 10^7 examples)")
    t.add_argument("--vocab-max-words-per-line", type=_int_arg("--vocab-max-words-per-line", 1),
                   default=32, help="distinct words a line contributes to the selection (default 32)")
    t.add_argument("--vocab-unseen-delta", type=_probability_arg("--vocab-unseen-delta"), default=1e-9,
                   help="δ of a word of a single line entering the vocabulary (default 1e-9)")
    t.add_argument("--vocab-noise-seed", type=_int_arg("--vocab-noise-seed", 0),
                   help="TESTS ONLY: fixed seed for the vocabulary noise (its ε holds only while "
                        "the seed is secret); default: fresh OS entropy")
    t.add_argument("--allow-small-vocab", action="store_true",
                   help="keep a private vocabulary of fewer than half of --vocab words (default: an error "
                        "saying what corpus size would do)")

    pt = csub.add_parser("partition", help="a data set -> K Parquet parts with a manifest, each read only by the "
                                           "trainer that owns it (trainer/data/format/partitioned.py)")
    pt.add_argument("input", help="a widedp data set directory (from convert criteo / table / text or synth)")
    pt.add_argument("out_dir")
    pt.add_argument("--parts", type=_int_arg("--parts", 1), required=True, help="number of parts K")
    pt.add_argument("--by", choices=("example", "unit"), default="example",
                    help="hash of each example's row (default) or of its unit, so a user's examples stay in one "
                         "part (user-level training needs --by unit)")
    pt.add_argument("--test-fraction", type=float, default=0.1,
                    help="without a test file: the rows `widedp train` would hold out at data.test_fraction "
                         "(default 0.1) and data.seed (--seed) go to the test split")
    pt.add_argument("--seed", type=_int_arg("--seed", 0), default=0, help="data.seed of that split (public)")

    up = csub.add_parser("upload", help="a partitioned data set -> object storage (a URI: s3://bucket/prefix; "
                                        "trainer/data/format/remote.py), its budget with it")
    up.add_argument("input", help="a partitioned widedp data set directory (from convert partition or --parts)")
    up.add_argument("uri", help="where: s3://bucket/prefix[?endpoint_override=HOST:PORT&scheme=http&region=R] "
                                "(credentials from the environment); refused where a data set is already")

    syn = subparsers.add_parser("synth", help="synthetic data set with planted ground truth")
    ssub = syn.add_subparsers(dest="synth_kind", required=True, parser_class=type(syn))
    s = ssub.add_parser("ctr", help="Zipf ids + known logistic model (known Bayes AUC)")
    s.add_argument("out_dir")
    s.add_argument("--examples", type=_int_arg("--examples", 1), required=True)
    sizes = s.add_mutually_exclusive_group()
    sizes.add_argument("--table-size", type=_int_arg("--table-size", 1))
    sizes.add_argument("--table-sizes", type=_table_sizes)
    s.add_argument("--zipf-exponent", type=_float_arg("--zipf-exponent", 0.0), default=1.1)
    s.add_argument("--seed", type=_int_arg("--seed", 0), default=0)
    x = ssub.add_parser("text", help="Zipf language with planted topics, as cbow examples")
    x.add_argument("out_dir")
    x.add_argument("--examples", type=_int_arg("--examples", 1), required=True)
    x.add_argument("--vocab", type=_int_arg("--vocab", 2), required=True)
    x.add_argument("--topics", type=_int_arg("--topics", 1), default=10)
    x.add_argument("--seed", type=_int_arg("--seed", 0), default=0)
    lg = ssub.add_parser("logs", help="raw day-partitioned Parquet click logs with users (heavy-tailed "
                                      "examples per user, planted per-user effects) + truth.json + a "
                                      "`convert table` schema")
    lg.add_argument("out_dir")
    lg.add_argument("--users", type=_int_arg("--users", 1), default=2000)
    lg.add_argument("--days", type=_int_arg("--days", 2), default=3,
                    help="days of logs (the last one is the evaluation day; default 3)")
    lg.add_argument("--seed", type=_int_arg("--seed", 0), default=0)
    lg.add_argument("--start-date", default="2026-11-01", help="first day, YYYY-MM-DD (UTC; default 2026-11-01)")
    lg.add_argument("--examples-per-user-median", type=_positive_float_arg("--examples-per-user-median"),
                    default=4.0, help="median of the log-normal examples per user over all days (default 4)")
    lg.add_argument("--examples-per-user-sigma", type=_float_arg("--examples-per-user-sigma", 0.0), default=1.5,
                    help="σ of log(examples per user): its tail (default 1.5)")
    lg.add_argument("--max-examples-per-user", type=_int_arg("--max-examples-per-user", 1), default=5000)
    lg.add_argument("--items", type=_int_arg("--items", 2), default=20_000,
                    help="item space of ad_id and history (default 20000)")
    lg.add_argument("--topics", type=_int_arg("--topics", 1), default=20)
    lg.add_argument("--history-length", type=_int_arg("--history-length", 1), default=20,
                    help="items kept in history (and the schema's max_length; default 20)")
    return {"convert": cmd_convert, "synth": cmd_synth}


def _result(meta, out_dir, started: float) -> dict:
    return {"out_dir": str(out_dir), "kind": meta.kind, "num_examples": meta.num_examples,
            "table_sizes": meta.table_sizes, "bayes_auc": meta.bayes_auc,
            "privacy_events": [e["description"] for e in meta.extra.get("privacy_events", [])],
            **({"test_examples": meta.test_examples, "test_split": meta.test_split}
               if meta.test_examples is not None else {}),
            "seconds": round(time.perf_counter() - started, 3)}


def _os_errors_as_value_errors(fn):
    # the CLI reports ValueError (DataError included) as one line, exit 2; an unwritable
    # output directory should be reported the same way, not as a traceback
    def run(args):
        try:
            return fn(args)
        except OSError as exc:
            raise ValueError(f"{getattr(exc, 'filename', None) or getattr(args, 'out_dir', None) or args.uri}: "
                             f"{exc.strerror or exc}") from exc
    return run


@_os_errors_as_value_errors
def cmd_convert(args) -> dict:
    started = time.perf_counter()
    if args.convert_kind in ("criteo", "table"):
        given = [f for f, v in (("--by", getattr(args, "by", None)), ("--test-fraction", args.test_fraction))
                 if v is not None]
        if given and args.parts is None:
            raise ValueError(f"convert {args.convert_kind}: {' and '.join(given)} apply with --parts only")
        if args.test_fraction is not None and (getattr(args, "test", None) or getattr(args, "test_after", None)):
            raise ValueError("convert table: --test-fraction holds out rows of a data set without a test file; "
                             "with --test or --test-after the test split is that one")
    if args.convert_kind in ("criteo", "table") and args.parts is not None:
        metas: list = []
        done = _partitioned_output(args, lambda out: metas.append(_convert_one(args, out)))
        return {**_result(metas[0], args.out_dir, started), **done, "num_examples": sum(done["part_examples"])}
    if args.convert_kind in ("criteo", "table"):
        return _result(_convert_one(args, args.out_dir), args.out_dir, started)
    if args.convert_kind == "upload":
        from widedp.trainer.data.format.remote import upload

        copied = upload(args.input, args.uri)
        return {"input": str(args.input), "uri": args.uri, "files": len(copied),
                "seconds": round(time.perf_counter() - started, 3)}
    if args.convert_kind == "partition":
        from widedp.trainer.data.format.partitioned import write_partitioned

        manifest = write_partitioned(args.input, args.out_dir, args.parts, partition_by=args.by,
                                     test_fraction=args.test_fraction, seed=args.seed)
        return {"out_dir": str(args.out_dir), "parts": manifest.num_parts, "partition_by": manifest.partition_by,
                "num_examples": manifest.num_examples, "num_units": manifest.num_units,
                "part_examples": [p.num_examples for p in manifest.parts], "test_examples": manifest.test_examples,
                "split": manifest.split, "seconds": round(time.perf_counter() - started, 3)}
    else:
        if args.vocab is None and args.vocab_file is None:
            raise ValueError("convert text: --vocab N is required unless --vocab-file PATH is given")
        if args.allow_small_vocab and args.vocab_file is not None:
            raise ValueError("convert text: --allow-small-vocab applies to a private vocabulary only, not with "
                             "--vocab-file")
        from widedp.trainer.data.convert.text import DEFAULT_VOCAB_NOISE_MULTIPLIER, convert_text, vocab_noise_for

        sigma = args.vocab_noise_multiplier
        if args.target_epsilon is not None:
            if sigma is not None:
                raise ValueError("convert text: give --vocab-noise-multiplier or --target-epsilon, not both")
            if args.vocab_file is not None:
                raise ValueError("convert text: --target-epsilon sizes the private vocabulary's noise; with "
                                 "--vocab-file the vocabulary is public and costs nothing")
            sigma = vocab_noise_for(args.target_epsilon, args.vocab_budget_share, args.vocab_delta,
                                    args.vocab_unseen_delta)
        meta = convert_text(args.input, args.out_dir, vocab=args.vocab, window=args.window,
                            negatives=args.negatives, seed=args.seed, vocab_file=args.vocab_file,
                            vocab_noise_multiplier=DEFAULT_VOCAB_NOISE_MULTIPLIER if sigma is None else sigma,
                            vocab_max_words_per_line=args.vocab_max_words_per_line,
                            vocab_unseen_delta=args.vocab_unseen_delta,
                            vocab_noise_seed=args.vocab_noise_seed, allow_small_vocab=args.allow_small_vocab)
    return _result(meta, args.out_dir, started)


def _convert_one(args, out_dir):
    """`convert criteo` or `convert table` of args into out_dir; its meta."""
    if args.convert_kind == "criteo":
        from widedp.trainer.data.convert.criteo import convert_criteo

        return convert_criteo(args.input, out_dir, hash_size=args.hash_size, hash_sizes=args.hash_sizes,
                              chunk_rows=args.chunk_rows)
    from widedp.trainer.data.convert.table import convert_table

    return convert_table(args.input, out_dir, schema=args.schema, test_inputs=args.test, test_after=args.test_after,
                         chunk_rows=args.chunk_rows)


@_os_errors_as_value_errors
def cmd_synth(args) -> dict:
    started = time.perf_counter()
    if args.synth_kind == "ctr":
        from widedp.trainer.data.synthetic.synth import synth_ctr

        kw = {}
        if args.table_size is not None:
            kw["table_sizes"] = args.table_size
        elif args.table_sizes is not None:
            kw["table_sizes"] = args.table_sizes if len(args.table_sizes) > 1 else args.table_sizes[0]
        meta = synth_ctr(args.out_dir, num_examples=args.examples, seed=args.seed,
                         zipf_exponent=args.zipf_exponent, **kw)
    elif args.synth_kind == "logs":
        from widedp.trainer.data.synthetic.synth_logs import LogsParams, result, synth_logs

        truth = synth_logs(args.out_dir, LogsParams(
            users=args.users, days=args.days, seed=args.seed, start_date=args.start_date,
            examples_per_user_median=args.examples_per_user_median,
            examples_per_user_sigma=args.examples_per_user_sigma,
            max_examples_per_user=args.max_examples_per_user, items=args.items, topics=args.topics,
            history_length=args.history_length))
        return result(truth, args.out_dir)
    else:
        from widedp.trainer.data.synthetic.synth import synth_text

        if args.topics > args.vocab:
            raise ValueError(f"--topics ({args.topics}) must be <= --vocab ({args.vocab})")
        meta = synth_text(args.out_dir, num_examples=args.examples, vocab=args.vocab,
                          num_topics=args.topics, seed=args.seed)
    return _result(meta, args.out_dir, started)
