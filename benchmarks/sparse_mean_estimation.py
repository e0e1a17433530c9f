"""Sparse DP mean estimation (seed D): error ‖ẑ - z̄‖₂ of the Gaussian mechanism, the projection
mechanism (Gaussian noise) and Gaussian ℓ1-recovery versus d at fixed s, n, ε, δ, beside the
poster's Table 1 (ε, δ) rates for the same settings; plus output perturbation with ℓ∞-projection
on a wide synthetic sparse logistic problem (excess empirical risk at ε ∈ {1, 3, 8}).

Two mean-estimation grids (add/remove, n public, L = 1, s = 10, δ = 1e-6):
  * "all three": n = 3000, ε = 0.1 (nε = 300). The ℓ1-recovery LP (HiGHS, dense m×d sketch with
    the poster's m ≈ nε·√(s ln(d/s)/ln(1/δ))) is run while the previous size took under 20 s;
    at the brief's nε = 10^4, m would be ~3·10^4 dense rows — no LP of that size finishes here.
  * "projection vs Gaussian": n = 10^4, ε = 1, d up to 10^6 (the projection is O(d log d)).
Data: each row is s-sparse, ‖z_i‖₂ = L(1 - 1e-9), its support s random coordinates of a fixed
set of 2s, positive entries (so ‖z̄‖₂ is of order L and the estimation problem is not trivial).
Rates carry no constants, so the comparison is of crossovers (where sparse first beats dense),
not of levels: goal "within a factor 10".

    python benchmarks/sparse_mean_estimation.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import announce_machine, format_table, write_results  # noqa: E402

from widedp.sparse_learners import mean_estimation as me  # noqa: E402
from widedp.sparse_learners import output_perturbation as op  # noqa: E402

NAME = "sparse_mean_estimation"
S, DELTA, L = 10, 1e-6, 1.0
LP_SECONDS = 20.0  # run the LP at the next d only while the previous one took less than this


def sparse_rows(n: int, d: int, s: int, rng: np.random.Generator, hot: Optional[int] = None) -> sp.csr_matrix:
    hot = min(d, 2 * s if hot is None else hot)
    idx = np.argsort(rng.random((n, hot)), axis=1)[:, :s]
    vals = np.abs(rng.normal(size=(n, s))) + 0.5
    vals *= L * (1 - 1e-9) / np.linalg.norm(vals, axis=1, keepdims=True)
    order = np.argsort(idx, axis=1)
    idx, vals = np.take_along_axis(idx, order, 1), np.take_along_axis(vals, order, 1)
    return sp.csr_matrix((vals.ravel(), idx.ravel(), np.arange(0, n * s + 1, s)), shape=(n, d))


def rate_dense(d: float, n: int, eps: float, delta: float) -> float:
    """Table 1's dense (ε, δ) term √(d ln(1/δ))/(εn), without the ∧ 1 (which would hide the crossover)."""
    return math.sqrt(d * math.log(1 / delta)) / (eps * n)


def rate_sparse(d: float, n: int, eps: float, delta: float, s: int) -> float:
    """Table 1's sparse (ε, δ) upper-bound term (s ln(d/s) ln(1/δ))^{1/4}/√(εn), without the ∧ 1."""
    return (s * math.log(max(d / s, math.e)) * math.log(1 / delta)) ** 0.25 / math.sqrt(eps * n)


def predicted_crossover(n: int, eps: float, delta: float, s: int) -> Optional[float]:
    """Smallest d (log grid, 200 per decade) where the sparse (ε, δ) rate is below the dense one."""
    for d in np.logspace(math.log10(s) + 0.01, 9, 1600):
        if rate_sparse(d, n, eps, delta, s) < rate_dense(d, n, eps, delta):
            return float(d)
    return None


def measured_crossover(rows: list[dict], method: str) -> Optional[int]:
    """Smallest d from which `method`'s median error stays below the Gaussian mechanism's AND
    below ‖z̄‖₂ (the error of answering 0): beating the Gaussian mechanism while both are worse
    than the zero estimate is no crossover (it made the ℓ1-recovery goal vacuously "met")."""
    ds = sorted(r["d"] for r in rows if r.get(method) is not None)
    by_d = {r["d"]: r for r in rows}
    wins = [d for d in ds if by_d[d][method] < by_d[d]["gaussian"] and by_d[d][method] < by_d[d]["norm_zbar"]]
    for i, d in enumerate(ds):
        if all(x in wins for x in ds[i:]):
            return d
    return None


def mean_grid(n: int, eps: float, ds: list[int], repeats: int, with_lp: bool, seed: int) -> list[dict]:
    rows = []
    lp_ok = with_lp
    for d in ds:
        errs: dict[str, list[float]] = {"gaussian": [], "projection": [], "l1_recovery": []}
        lp_secs = []
        m = me.default_sketch_rows(n, d, S, eps, DELTA)
        for rep in range(repeats):
            rng = np.random.default_rng([seed, d, rep])
            Z = sparse_rows(n, d, S, rng)
            zbar = np.bincount(Z.indices, weights=Z.data, minlength=d) / n
            est, _ = me.gaussian_mean(Z, n=n, L=L, epsilon=eps, delta=DELTA, rng=rng)
            errs["gaussian"].append(float(np.linalg.norm(est - zbar)))
            est, _ = me.projection_mechanism(Z, n=n, s=S, L=L, epsilon=eps, delta=DELTA, rng=rng)
            errs["projection"].append(float(np.linalg.norm(est - zbar)))
            if lp_ok and m * d <= 4e7 and (rep == 0 or not lp_secs or lp_secs[0] < 10.0):
                t = time.perf_counter()
                est, _ = me.gaussian_l1_recovery(Z, n=n, s=S, L=L, epsilon=eps, delta=DELTA, rng=rng)
                lp_secs.append(time.perf_counter() - t)
                errs["l1_recovery"].append(float(np.linalg.norm(est - zbar)))
        row = {"d": d, "m": m, "norm_zbar": float(np.linalg.norm(zbar)),
               **{k: (statistics.median(v) if v else None) for k, v in errs.items()},
               "l1_recovery_seconds": statistics.median(lp_secs) if lp_secs else None,
               "rate_dense": rate_dense(d, n, eps, DELTA), "rate_sparse": rate_sparse(d, n, eps, DELTA, S)}
        rows.append(row)
        if lp_secs and statistics.median(lp_secs) > LP_SECONDS:
            lp_ok = False
        lp_note = f", LP {statistics.median(lp_secs):.1f}s" if lp_secs else ""
        l1 = "-" if row["l1_recovery"] is None else format(row["l1_recovery"], ".4g")
        print(f"  d={d:>8}: gaussian {row['gaussian']:.4g}  projection {row['projection']:.4g}  "
              f"l1-recovery {l1} (m={m}{lp_note})", flush=True)
    return rows


def output_perturbation_experiment(n: int, d: int, lam: float, epsilons: list[float], repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    X = sparse_rows(n, d, S, rng, hot=d)  # supports spread over all d coordinates (a wide problem)
    signs = np.where(rng.random(X.nnz) < 0.5, -1.0, 1.0)
    X = sp.csr_matrix((X.data * signs, X.indices, X.indptr), shape=X.shape)
    w = np.zeros(d)
    w[rng.choice(d, min(d, 2000), replace=False)] = rng.normal(0, 3, min(d, 2000))
    y = np.where(rng.random(n) < 1 / (1 + np.exp(-(X @ w))), 1.0, -1.0)
    L_, _H = op.lipschitz_and_smoothness("logistic", 1.0, lam, n)
    t = time.perf_counter()
    x_star, _ = op.solve_regularized_erm(X, y, loss="logistic", lam=lam, n=n, tol=1e-6 * L_ / n)
    solve_s = time.perf_counter() - t
    radius = math.sqrt(2 * math.log(2) / lam)  # data-independent: F(x*) ≤ F(0) = ln 2 ⇒ ‖x*‖ ≤ √(2 ln 2/λ)

    def risk(x):
        return float(np.logaddexp(0.0, -y * (X @ x)).mean())

    base = risk(x_star)
    out = {"n": n, "d": d, "s": S, "lam": lam, "radius": radius, "solve_seconds": solve_s,
           "risk_nonprivate": base, "excess_risk_zero": risk(np.zeros(d)) - base, "by_epsilon": []}
    for eps in epsilons:
        for delta in (DELTA, 0.0):
            excess = []
            for rep in range(repeats):
                x, _ = op.output_perturbation(X, y, loss="logistic", lam=lam, s=S, feature_bound=1.0, radius=radius,
                                              epsilon=eps, delta=delta, rng=np.random.default_rng([seed, rep, int(eps * 10)]))
                excess.append(risk(x) - base)
            out["by_epsilon"].append({"epsilon": eps, "delta": delta, "excess_risk": statistics.median(excess)})
            print(f"  output perturbation ε={eps:g} δ={delta:g}: excess empirical risk {statistics.median(excess):.4g} "
                  f"(x = 0: {out['excess_risk_zero']:.4g})", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grids, one repeat (a few seconds)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    repeats = 1 if args.quick else 3
    grids = []
    settings = [("all three", 200 if args.quick else 3000, 0.1, [100, 300, 1000] if args.quick else
                 [100, 300, 1000, 3000, 10_000, 100_000, 1_000_000], True),
                ("projection vs Gaussian", 10_000 if not args.quick else 2000, 1.0,
                 [100, 1000, 10_000] if args.quick else [100, 1000, 10_000, 100_000, 1_000_000], False)]
    for label, n, eps, ds, lp in settings:
        print(f"{label}: n={n} ε={eps} δ={DELTA} s={S}", flush=True)
        rows = mean_grid(n, eps, ds, repeats, lp, seed=len(grids))
        grids.append({"label": label, "n": n, "epsilon": eps, "delta": DELTA, "s": S, "L": L, "rows": rows,
                      "predicted_crossover": predicted_crossover(n, eps, DELTA, S),
                      "measured_crossover": {m: measured_crossover(rows, m) for m in ("projection", "l1_recovery")}})
        print(format_table(["d", "m", "gaussian", "projection", "l1-recovery", "rate dense", "rate sparse"],
                           [[r["d"], r["m"], r["gaussian"], r["projection"], r["l1_recovery"], r["rate_dense"],
                             r["rate_sparse"]] for r in rows]))
    print("output perturbation (logistic, Gaussian δ = 1e-6 and Laplace δ = 0):", flush=True)
    opx = output_perturbation_experiment(2000 if args.quick else 10_000, 10_000 if args.quick else 100_000,
                                         lam=1e-2, epsilons=[1.0, 3.0, 8.0], repeats=repeats, seed=7)
    payload = {"grids": grids, "output_perturbation": opx}
    doc = dict(payload)
    lines, goals = results_section(doc)
    print("\n".join(lines))
    write_results(NAME, payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


def _fmt(x) -> str:
    return "–" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def plot_error_vs_d(grids: list, path) -> None:
    """Median error vs d per method and grid (log-log), the Table 1 rates dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grids), figsize=(5.5 * len(grids), 4), squeeze=False)
    for ax, g in zip(axes[0], grids):
        d = [r["d"] for r in g["rows"]]
        for key, label in (("gaussian", "Gaussian"), ("projection", "projection"), ("l1_recovery", "ℓ1-recovery")):
            pts = [(r["d"], r[key]) for r in g["rows"] if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), "-o", label=label)
        ax.plot(d, [r["rate_dense"] for r in g["rows"]], "--", color="gray", label="rate dense (Table 1)")
        ax.plot(d, [r["rate_sparse"] for r in g["rows"]], ":", color="black", label="rate sparse (Table 1)")
        ax.set(xscale="log", yscale="log", xlabel="d", ylabel="median ‖ẑ − z̄‖₂",
               title=f"{g['label']}: n = {g['n']}, ε = {g['epsilon']:g}, s = {g['s']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def crossover_bracket(rows: list[dict], method: str, meas: Optional[int]) -> tuple[float, Optional[int]]:
    """(lo, hi]: where the crossover lies on the grid of d where `method` was measured — hi the
    measured crossover (the first grid d from which it stays ahead), lo the grid point before it
    (where it is not ahead), 0 when hi is the smallest d measured (the crossover is then only
    known to be at or below it)."""
    ds = sorted(r["d"] for r in rows if r.get(method) is not None)
    if meas is None or meas not in ds:
        return math.nan, None
    i = ds.index(meas)
    return (float(ds[i - 1]) if i else 0.0), meas


def crossover_goal(g: dict, method: str, meas: Optional[int], pred: Optional[float]) -> tuple[str, str, str, str]:
    """The goal 'measured crossover within a factor 10 of the predicted one', decided on the
    bracket (lo, hi] the grid gives: met when the whole bracket lies in [pred/10, 10·pred],
    missed when none of it does (or no crossover was measured), undecided otherwise — in
    particular when the crossover sits at the grid's smallest d, which bounds it only from above."""
    lo, hi = crossover_bracket(g["rows"], method, meas)
    at = next((r for r in g["rows"] if r["d"] == meas), None)
    margin = "" if at is None else f" (its error there {_fmt(at[method])} against ‖z̄‖₂ = {_fmt(at['norm_zbar'])})"
    name = f"measured {method} crossover within a factor 10 of the poster's predicted one ({g['label']})"
    if hi is None or pred is None:
        return (name, f"no crossover on the grid, predicted d ≈ {_fmt(pred)}", "**missed**",
                "no grid d from which it stays below both the Gaussian mechanism's error and ‖z̄‖₂")
    window = f"[{_fmt(pred / 10)}, {_fmt(pred * 10)}]"
    where = (f"at or below d = {_fmt(hi)}, the smallest d measured" if lo == 0 else
             f"in ({_fmt(int(lo))}, {_fmt(hi)}]")
    measured = f"crossover {where}{margin}; predicted d ≈ {_fmt(pred)} (factor-10 window {window})"
    if pred / 10 <= lo and hi <= pred * 10:
        return name, measured, "**met**", "the whole grid bracket lies inside the window"
    if hi < pred / 10 or lo > pred * 10:
        return name, measured, "**missed**", "the whole grid bracket lies outside the window"
    why = ("the crossover sits at the grid's first point, which bounds it only from above: the grid cannot tell "
           f"whether it lies inside the window; a grid point below d = {_fmt(pred / 10)} would decide" if lo == 0 else
           "the grid bracket straddles an end of the window: a finer grid would decide")
    return name, measured, "**undecided**", why


def results_section(doc: dict, plot_dir=None) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """Markdown lines (tables) and goal rows (goal, measured, status, why) from the JSON `doc`;
    with `plot_dir`, the error-vs-d plot saved there and referenced."""
    lines: list[str] = [
        "Seed D's mean estimators (`widedp.sparse_learners.mean_estimation`: the Gaussian mechanism, the projection "
        "mechanism, Gaussian ℓ1-recovery) on synthetic s-sparse rows of ℓ2 norm L, add/remove-one, n public, error "
        "‖ẑ − z̄‖₂ (median of repeats) against d on two grids: "
        + "; ".join(f"{g['label']} (n = {g['n']}, ε = {g['epsilon']:g}, δ = {g['delta']:g}, s = {g['s']}, d = "
                    f"{_fmt(min(r['d'] for r in g['rows']))} … {_fmt(max(r['d'] for r in g['rows']))})"
                    for g in doc["grids"])
        + ". Then output perturbation (`widedp.sparse_learners.output_perturbation`) on a wide sparse logistic problem."
        " Predicted crossovers are the poster's Table 1 rates (no constants), compared within a factor 10.", ""]
    if plot_dir is not None and doc["grids"]:
        plot_error_vs_d(doc["grids"], plot_dir / "sparse_mean_error_vs_d.png")
        lines += ["![sparse_mean_error_vs_d](plots/sparse_mean_error_vs_d.png)", ""]
    goals: list[tuple[str, str, str, str]] = []
    for g in doc["grids"]:
        lines += [f"### {g['label']}: n = {g['n']}, ε = {g['epsilon']:g}, δ = {g['delta']:g}, s = {g['s']}, L = {g['L']:g}",
                  "", "Median ‖ẑ − z̄‖₂; Table 1 rates (no constants) beside them.", "",
                  "| d | m (sketch) | ‖z̄‖₂ | Gaussian | projection | ℓ1-recovery | LP s | rate dense | rate sparse |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            lines.append(f"| {r['d']} | {r['m']} | {_fmt(r['norm_zbar'])} | {_fmt(r['gaussian'])} | {_fmt(r['projection'])} | "
                         f"{_fmt(r['l1_recovery'])} | {_fmt(r['l1_recovery_seconds'])} | {_fmt(r['rate_dense'])} | "
                         f"{_fmt(r['rate_sparse'])} |")
        pred = g["predicted_crossover"]
        # recomputed from the rows (the rule counts only errors below ‖z̄‖₂; files written before it hold the old value)
        crossover = {m: measured_crossover(g["rows"], m) for m in ("projection", "l1_recovery")}
        lines += ["", f"Predicted crossover (sparse rate < dense rate from d ≈ {_fmt(pred)}); measured (error below the "
                      f"Gaussian mechanism's and below ‖z̄‖₂, the zero estimate's): projection from "
                      f"d = {_fmt(crossover['projection'])}, ℓ1-recovery from d = {_fmt(crossover['l1_recovery'])}.", ""]
        big = [r for r in g["rows"] if r["d"] >= 100 * g["s"]]
        beats = bool(big) and all(r["projection"] < r["gaussian"] for r in big)
        worst = max((r["projection"] / r["gaussian"] for r in big), default=None)
        goals.append((f"projection mechanism beats the Gaussian mechanism for d ≥ 100·s ({g['label']})",
                      f"largest error ratio projection/Gaussian over d ≥ {100 * g['s']}: {_fmt(worst)}",
                      "**met**" if beats else "**missed**", f"{len(big)} sizes, medians of repeats"))
        for method in ("projection", "l1_recovery"):
            if method == "l1_recovery" and not any(r["l1_recovery"] is not None for r in g["rows"]):
                continue
            goals.append(crossover_goal(g, method, crossover[method], pred))
    opx = doc.get("output_perturbation")
    if opx:
        lines += [f"### Output perturbation with ℓ∞-projection: logistic, n = {opx['n']}, d = {opx['d']}, s = {opx['s']}, "
                  f"λ = {opx['lam']:g}, R = {opx['radius']:.3g}", "",
                  f"Non-private regularized minimizer's empirical risk {opx['risk_nonprivate']:.4g} "
                  f"(solved in {opx['solve_seconds']:.1f} s); x = 0 has excess {opx['excess_risk_zero']:.4g}.", "",
                  "| ε | δ | excess empirical risk |", "|---|---|---|"]
        for r in opx["by_epsilon"]:
            lines.append(f"| {r['epsilon']:g} | {r['delta']:g} | {r['excess_risk']:.4g} |")
        lines.append("")
        gauss = [r for r in opx["by_epsilon"] if r["delta"] > 0]
        decreasing = all(a["excess_risk"] >= b["excess_risk"] for a, b in zip(gauss, gauss[1:]))
        goals.append(("output perturbation's excess empirical risk shrinks as ε grows (Gaussian, ε = 1, 3, 8)",
                      ", ".join(f"{r['excess_risk']:.3g}" for r in gauss), "**met**" if decreasing else "**missed**",
                      "medians of repeats"))
        best = gauss[-1]["excess_risk"] if gauss else None
        goals.append(("output perturbation at ε = 8 beats the trivial x = 0",
                      f"{_fmt(best)} vs {_fmt(opx['excess_risk_zero'])}",
                      "**met**" if best is not None and best < opx["excess_risk_zero"] else "**missed**", ""))
    return lines, goals


if __name__ == "__main__":
    main()
