"""`widedp wide-linear`: seed A's Algorithm 2 on a data set's categorical ids (trainer/run/wide_linear.py)."""

from __future__ import annotations

from widedp.trainer.run.wide_linear import ALGORITHMS, run_wide_linear


def add_commands(sub) -> dict:
    from widedp.trainer.cli import _positive_float, _positive_int

    p = sub.add_parser("wide-linear", help="wide logistic model on a data set's categorical ids, by seed A's Alg 2")
    p.add_argument("--data", required=True, help="a widedp data directory (dataset.json + data.parquet)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="alg2")
    p.add_argument("--epsilon", type=_positive_float("--epsilon"), default=8.0, help="target ε of the run")
    p.add_argument("--delta", type=_positive_float("--delta"), default=1e-5)
    p.add_argument("--steps", type=_positive_int("--steps"), default=100)
    p.add_argument("--num-groups", type=_positive_int("--num-groups"), help="m (default ⌈10√T⌉, Theorem 1)")
    p.add_argument("--max-answers", type=_positive_int("--max-answers"), default=100,
                   help="c₁: coordinates NumericSparse may update per step")
    p.add_argument("--learning-rate", type=_positive_float("--learning-rate"), default=1.0)
    p.add_argument("--l2", type=float, default=1e-4, help="ridge λ (post-processing in Alg 2)")
    p.add_argument("--threshold", type=_positive_float("--threshold"),
                   help="α of NumericSparse (default: the seed's Lemma 4 value, which answers nothing on small data)")
    p.add_argument("--calibration", choices=("rdp", "seed"), default="rdp",
                   help="rdp: ε' so that the RDP accountant spends exactly --epsilon; seed: the paper's ε'")
    p.add_argument("--test-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, help="reproducible mode (ε then holds only while the seed is secret)")
    p.add_argument("--run-dir", help="write summary.json and model.npz here")
    return {"wide-linear": cmd_wide_linear}


def cmd_wide_linear(args) -> dict:
    if args.delta >= 1:
        raise ValueError(f"--delta must be in (0, 1), got {args.delta}")
    if not 0 < args.test_fraction < 1:
        raise ValueError(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    return run_wide_linear(args.data, algorithm=args.algorithm, epsilon=args.epsilon, delta=args.delta,
                           steps=args.steps, num_groups=args.num_groups, max_answers=args.max_answers,
                           learning_rate=args.learning_rate, l2=args.l2, threshold=args.threshold,
                           calibration=args.calibration,
                           test_fraction=args.test_fraction, seed=args.seed, run_dir=args.run_dir)
