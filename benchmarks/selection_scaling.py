"""Selection cost versus vocabulary size p: is it flat in p?

For p = 10^4 ... 10^9 with m = 10^5 touched rows (m = p/2 where p is too small to hold them)
and k = 10^4, times the exponential-mechanism top-k and Gaussian thresholding. For
thresholding, τ is set per p so that the expected number of false positives among untouched
rows is k (otherwise the *output* grows with p and no algorithm could be flat).
Prints medians over repeats after a warm-up, and the ratios largest-p / smallest-p (goal ≤ 1.5).
Ratios come from this one run; nothing here asserts a time.

    python benchmarks/selection_scaling.py [--repeats 7] [--max-exp 9]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
from scipy import special

from widedp.selection import exponential_top_k, gaussian_threshold


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-exp", type=int, default=4)
    parser.add_argument("--max-exp", type=int, default=9)
    parser.add_argument("--touched", type=int, default=100_000)
    parser.add_argument("--k", type=int, default=10_000)
    args = parser.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}")
    print(f"touched m = {args.touched} (p/2 when p is smaller), k = {args.k}, median of {args.repeats} after warm-up\n")
    print(f"{'p':>14} {'m':>8} {'EM top-k ms':>12} {'threshold ms':>13} {'selected(thr)':>14}")
    rows = []
    for e in range(args.min_exp, args.max_exp + 1):
        p = 10**e
        m = min(args.touched, p // 2)
        k = min(args.k, p // 4)
        rng = np.random.default_rng(e)
        ids = rng.choice(p, size=m, replace=False)
        scores = rng.exponential(1.0, size=m)
        counts = rng.poisson(3.0, size=m).astype(float) + 1.0
        sigma = 1.0
        tau = sigma * -special.ndtri(min(0.5, k / (p - m)))  # E[false positives] = k
        em = _median_time(lambda: exponential_top_k(ids, scores, p, k, 1.0, 1.0, rng), args.repeats)
        thr_sel = gaussian_threshold(ids, counts, p, tau, sigma, 1.0, rng)
        thr = _median_time(lambda: gaussian_threshold(ids, counts, p, tau, sigma, 1.0, rng), args.repeats)
        rows.append((p, m, em, thr))
        print(f"{p:>14,} {m:>8,} {em * 1e3:>12.2f} {thr * 1e3:>13.2f} {thr_sel.ids.size:>14,}")

    first, last = rows[0], rows[-1]
    print(f"\nratio p={last[0]:.0e} / p={first[0]:.0e}:  EM {last[2] / first[2]:.2f}x   threshold {last[3] / first[3]:.2f}x"
          "   (different m: the small p cannot hold 10^5 touched rows)")
    same_m = [r for r in rows if r[1] == args.touched]
    if len(same_m) >= 2:
        a, b = same_m[0], same_m[-1]
        print(f"ratio p={b[0]:.0e} / p={a[0]:.0e} (same m={args.touched:,}):  EM {b[2] / a[2]:.2f}x   "
              f"threshold {b[3] / a[3]:.2f}x   (goal <= 1.5)")


if __name__ == "__main__":
    main()
