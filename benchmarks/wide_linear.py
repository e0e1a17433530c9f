"""Wide linear models: excess empirical risk of seed A's Alg 2, seed D's bias-reduced DP-SGD and dense DP-SGD.

Synthetic wide hashed-feature logistic problem: n rows, each with s hashed feature ids drawn
from a Zipf(1.1) law over d ≥ 10^5 buckets (popular features recur, as hashed CTR features do),
values 1/√s (so ‖x‖₂ = 1, ‖x‖∞ = 1/√s), labels from a planted logistic model. Excess risk =
L_λ(w) − L_λ(w*_λ), the ridge-regularized logistic loss on the same data minus its non-private
optimum (L-BFGS). All three methods at the same (ε, δ) ∈ {1, 3, 8} × {1e-5}, each certified by
our RDP accountant (add/remove-one):
- Alg 2 (`sparse_learners.dp_erm`, calibration "rdp"): m groups, T = m²/100 steps (Thm 1's
  condition m ≥ 10√T holds with equality), c₁ answers per step, c₂ = 1/√s (no clipping for the
  logistic loss), two thresholds: Lemma 4's α (the seed's) and α = b_q·ln d, b_q the query
  noise scale (≈ ½ expected false positive among the d untouched coordinates per step);
- bias-reduced DP-SGD (`sparse_learners.bias_reduced_sgd`), clip L = 1, radius R, with both DP
  mean estimators at the same z (same privacy event): "gaussian" (noisy means; the level
  correction is then zero-mean noise) and "projection" (the poster's: noisy means projected onto
  the ℓ1 ball of radius L√s, s = the public row sparsity; the levels cancel the projection's bias);
- dense DP-SGD (here, numpy): Poisson batches at rate b/n, per-example ℓ2 clipping to 1,
  N(0, σ²) on all d coordinates, σ from the RDP accountant, projection onto the same ball.
Each method takes the best of a small learning-rate grid (the tuning itself is not accounted,
for every method alike; bias-reduced DP-SGD gets its own grid, down to 0.005, because its
heavy-tailed correction term calls for small steps). One seed per configuration.

    python benchmarks/wide_linear.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy import optimize

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import announce_machine, format_table, write_results  # noqa: E402

from widedp.accounting import events as ev  # noqa: E402
from widedp.accounting.base import make_accountant  # noqa: E402
from widedp.accounting.calibration import svt_event  # noqa: E402
from widedp.sparse_learners import bias_reduced_sgd as br  # noqa: E402
from widedp.sparse_learners import dp_erm  # noqa: E402
from widedp.sparse_learners import linear_models as lm  # noqa: E402
from widedp.sparse_learners import output_perturbation as op  # noqa: E402

EPSILONS = (1.0, 3.0, 8.0)
DELTA = 1e-5


def make_problem(n: int, d: int, s: int, seed: int) -> tuple[sp.csr_matrix, np.ndarray]:
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(1.1, size=(n, 4 * s))
    perm = rng.permutation(d)  # "hash": popular ranks land on random buckets
    cols = np.empty((n, s), dtype=np.int64)
    for i in range(n):
        ids = np.unique(perm[(ranks[i] - 1) % d])
        if ids.size < s:
            ids = np.unique(np.concatenate([ids, rng.choice(d, size=s, replace=False)]))
        cols[i] = np.sort(rng.choice(ids, size=s, replace=False))
    X = sp.csr_matrix((np.full(n * s, 1.0 / math.sqrt(s)), cols.ravel(), np.arange(0, n * s + 1, s)), shape=(n, d))
    w_planted = rng.normal(scale=2.0, size=d)
    y = np.where(rng.random(n) < 1.0 / (1.0 + np.exp(-(X @ w_planted))), 1.0, -1.0)
    return X, y


def optimum(data: lm.Dataset, l2: float) -> tuple[np.ndarray, float]:
    def f(w):
        return lm.empirical_loss(data, w, l2), lm.full_gradient(data, w, l2)

    res = optimize.minimize(f, np.zeros(data.X.shape[1]), jac=True, method="L-BFGS-B",
                            options={"maxiter": 500, "gtol": 1e-9})
    return res.x, float(res.fun)


def dense_dp_sgd(data: lm.Dataset, epsilon: float, steps: int, batch: int, lr: float, radius: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, float, float]:
    """Plain DP-SGD: Poisson rate q = b/n, clip 1 in ℓ2, N(0, σ²I_d), sum / b; σ by the RDP accountant."""
    n, d = data.X.shape
    q = batch / n
    acc = make_accountant("rdp")

    def spent(log_sigma):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return acc.epsilon([(ev.PoissonSampledDpEvent(q, ev.GaussianDpEvent(math.exp(log_sigma))), steps)], DELTA) - epsilon

    sigma = math.exp(optimize.brentq(spent, math.log(0.05), math.log(500.0), xtol=1e-6)) * (1 + 1e-6)
    norms = lm.row_norms(data.X, "2")
    w = np.zeros(d)
    total = np.zeros(d)
    for _ in range(steps):
        rows = np.flatnonzero(rng.random(n) < q)
        scal = lm.clip_scalars(lm.per_example_scalars(data, rows, w), norms[rows], 1.0)
        ids, vals = lm.sparse_weighted_sum(data.X, rows, scal)
        g = rng.normal(0.0, sigma, size=d)
        g[ids] += vals
        w = lm.project_l2(w - lr * g / batch, radius)
        total += w
    eps = spent(math.log(sigma)) + epsilon
    return total / steps, float(eps), sigma


def run(quick: bool) -> dict[str, Any]:
    if quick:
        n, d, s, m, c1, br_steps, sgd_steps, batch = 2000, 2**17, 10, 50, 20, 30, 30, 200
    else:
        n, d, s, m, c1, br_steps, sgd_steps, batch = 50_000, 2**17, 20, 400, 50, 300, 600, 1000
    T = m * m // 100
    l2, radius = 1e-4, 10.0
    X, y = make_problem(n, d, s, seed=0)
    data = lm.check_data(X, y, "logistic")
    t0 = time.time()
    w_opt, f_opt = optimum(data, l2)
    f_zero = lm.empirical_loss(data, np.zeros(d), l2)
    print(f"n={n} d={d} s={s}: L(0)={f_zero:.4f}  L(w*)={f_opt:.4f}  ({time.time() - t0:.1f}s)")
    c2 = 1.0 / math.sqrt(s)
    lrs = (2.0,) if quick else (0.5, 2.0)
    br_lrs = (0.2,) if quick else (0.005, 0.05, 0.2)
    # Output perturbation's own ridge λ (its sensitivity is L/(λn)); excess is measured on the shared
    # objective (ridge l2) like every other method's.
    op_lams = (1e-2,) if quick else (3e-4, 1e-3, 1e-2, 1e-1)
    rows: list[dict[str, Any]] = []

    def excess(w):
        return lm.empirical_loss(data, w, l2) - f_opt

    for eps in EPSILONS:
        for label, thr_mode in (("alg2 (Lemma 4 α)", "lemma4"), ("alg2 (α = b_q·ln d)", "noise")):
            best = None
            for lr in lrs:
                rng = np.random.default_rng(1)
                t1 = time.time()
                _, dp_ = dp_erm.seed_epsilon_prime(eps, DELTA, m, T)
                thr = None
                if thr_mode == "noise":
                    ep = dp_erm.rdp_epsilon_prime(eps, DELTA, c1, m, T, dp_)
                    # data-independent: ≈ ½ expected false positive among d untouched coordinates per step
                    thr = svt_event(ep, dp_, c1, release_values=True).query_noise * (c2 * m / n) * math.log(d)
                res = dp_erm.dp_erm_sparse(X, y, epsilon=eps, delta=DELTA, num_groups=m, steps=T, max_answers=c1,
                                           learning_rate=lr, gradient_bound=c2, rng=rng, calibration="rdp",
                                           threshold=thr, l2=l2, radius=radius)
                row = dict(method=label, epsilon=eps, lr=lr, excess=excess(res.w), epsilon_rdp=res.accounting["rdp"],
                           theorem1_printed=res.accounting["theorem1_printed"],
                           theorem1_corrected=res.accounting["theorem1_corrected"],
                           theorem1_condition_met=res.theorem1_condition_met, m=m, T=T, c1=c1,
                           threshold=res.threshold, mean_answered=float(res.answered.mean()),
                           seconds=round(time.time() - t1, 2))
                if best is None or row["excess"] < best["excess"]:
                    best = row
            assert best is not None
            rows.append(best)
            print(f"eps={eps} {label}: excess {best['excess']:.4f} (lr {best['lr']}, answered/step "
                  f"{best['mean_answered']:.1f}, rdp ε {best['epsilon_rdp']:.3f})")
        for variant in ("gaussian", "projection"):
            best = None
            for lr in br_lrs:
                rng = np.random.default_rng(2)
                t1 = time.time()
                res_b = br.bias_reduced_dp_sgd(X, y, epsilon=eps, delta=DELTA, steps=br_steps, learning_rate=lr,
                                               clip=1.0, radius=radius, rng=rng, l2=l2, mean_estimator=variant,
                                               sparsity=s if variant == "projection" else None)
                row = dict(method=f"bias-reduced DP-SGD ({variant})", epsilon=eps, lr=lr,
                           excess=excess(res_b.w_average), excess_last=excess(res_b.w), epsilon_rdp=res_b.epsilon,
                           noise_multiplier=res_b.noise_multiplier, T=br_steps, seconds=round(time.time() - t1, 2))
                if best is None or row["excess"] < best["excess"]:
                    best = row
            assert best is not None
            rows.append(best)
            print(f"eps={eps} bias-reduced ({variant}): excess {best['excess']:.4f} (lr {best['lr']}, "
                  f"z {best['noise_multiplier']:.2f})")
        best = None
        for lam in op_lams:
            rng = np.random.default_rng(4)
            t1 = time.time()
            # Rows have ℓ2 norm 1 up to rounding: the bound gets 1e-9 of slack (a looser bound is still valid).
            w_op, op_event = op.output_perturbation(X, y, loss="logistic", lam=lam, s=s, feature_bound=1.0 + 1e-9,
                                             radius=radius, epsilon=eps, delta=DELTA, rng=rng)
            row = dict(method="output perturbation (ℓ∞ projection)", epsilon=eps, lam=lam, excess=excess(w_op),
                       epsilon_rdp=make_accountant("pld").epsilon([(op_event, 1)], DELTA), accountant="pld", seconds=round(time.time() - t1, 2))
            if best is None or row["excess"] < best["excess"]:
                best = row
        assert best is not None
        rows.append(best)
        print(f"eps={eps} output perturbation: excess {best['excess']:.4f} (λ {best['lam']})")
        best = None
        for lr in lrs:
            rng = np.random.default_rng(3)
            t1 = time.time()
            w, e_spent, sigma = dense_dp_sgd(data, eps, sgd_steps, batch, lr, radius, rng)
            row = dict(method="dense DP-SGD", epsilon=eps, lr=lr, excess=excess(w), epsilon_rdp=e_spent,
                       noise_multiplier=sigma, T=sgd_steps, batch=batch, seconds=round(time.time() - t1, 2))
            if best is None or row["excess"] < best["excess"]:
                best = row
        assert best is not None
        rows.append(best)
        print(f"eps={eps} dense DP-SGD: excess {best['excess']:.4f} (lr {best['lr']}, σ {best['noise_multiplier']:.2f})")
    return {"problem": dict(n=n, d=d, s=s, l2=l2, radius=radius, delta=DELTA, loss_at_zero=f_zero, loss_optimum=f_opt,
                            excess_at_zero=f_zero - f_opt, learning_rates=list(lrs),
                            bias_reduced_learning_rates=list(br_lrs), output_perturbation_lams=list(op_lams)),
            "rows": rows}


def _best(doc: dict, method_prefix: str, eps: float) -> dict | None:
    rows = [r for r in doc.get("rows", []) if r["method"].startswith(method_prefix) and r["epsilon"] == eps]
    return min(rows, key=lambda r: r["excess"]) if rows else None


def plot_excess_vs_epsilon(doc: dict, path) -> None:
    """Excess risk vs ε per method (best row per method and ε), w = 0's excess dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in dict.fromkeys(r["method"] for r in doc["rows"]):
        pts = sorted((r["epsilon"], r["excess"]) for r in doc["rows"] if r["method"] == method)
        ax.plot(*zip(*pts), "-o", label=method)
    ax.axhline(doc["problem"]["excess_at_zero"], ls="--", color="gray", label="w = 0")
    ax.set(xscale="log", yscale="log", xlabel="ε", ylabel="excess empirical risk",
           title=f"wide logistic: n = {doc['problem']['n']}, d = {doc['problem']['d']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_section(doc: dict, plot_dir=None) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """Markdown lines (the table) and goal rows (goal, measured, status, why) from a results doc;
    with `plot_dir`, the excess-vs-ε plot saved there and referenced."""
    prob = doc.get("problem", {})
    lines = [f"Wide logistic regression, n = {prob.get('n')}, d = {prob.get('d')}, s = {prob.get('s')} hashed "
             f"features per row, δ = {prob.get('delta')}; excess = regularized loss − non-private optimum "
             f"(w = 0 has excess {prob.get('excess_at_zero', float('nan')):.4f}). Best of learning rates "
             f"{prob.get('learning_rates')} per method ({prob.get('bias_reduced_learning_rates')} for bias-reduced "
             f"DP-SGD; output perturbation: best of its own ridge λ in {prob.get('output_perturbation_lams')}, "
             f"excess measured on the shared objective; tuning not accounted).", "",
             "| method | ε | excess risk | ε spent (RDP unless marked) | Thm 1 printed / corrected | answered/step (or λ) |",
             "|---|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        thm = (f"{r['theorem1_printed']:.3g} / {r['theorem1_corrected']:.3g}"
               if isinstance(r.get("theorem1_corrected"), float) else "-")
        ans = f"{r['mean_answered']:.1f}" if "mean_answered" in r else "-"
        spent = f"{r['epsilon_rdp']:.3f}" + (f" ({r['accountant']})" if r.get("accountant") else "")
        if "lam" in r:
            ans = f"λ = {r['lam']:g}"
        lines.append(f"| {r['method']} | {r['epsilon']:g} | {r['excess']:.4f} | {spent} | {thm} | {ans} |")
    if plot_dir is not None and doc.get("rows"):
        plot_excess_vs_epsilon(doc, plot_dir / "wide_linear_excess_vs_eps.png")
        lines += ["", "![wide_linear_excess_vs_eps](plots/wide_linear_excess_vs_eps.png)"]
    goals: list[tuple[str, str, str, str]] = []
    a2, dense = _best(doc, "alg2", 8.0), _best(doc, "dense", 8.0)
    gauss, proj = _best(doc, "bias-reduced DP-SGD (gaussian)", 8.0), _best(doc, "bias-reduced DP-SGD (projection)", 8.0)
    at_zero = prob.get("excess_at_zero", math.nan)
    if a2 and dense:
        ok = a2["excess"] < dense["excess"]
        goals.append(("Alg 2 reaches lower excess risk than dense DP-SGD at ε = 8",
                      f"{a2['excess']:.4f} vs {dense['excess']:.4f}", "**met**" if ok else "**missed**",
                      "NumericSparse noise (ε₂ = 0.05ε' on values, √(32c₁ log(2/δ')) scale) vs d-dimensional Gaussian"))
    out_p = _best(doc, "output perturbation", 8.0)
    if out_p and dense:
        ok = out_p["excess"] < dense["excess"]
        goals.append(("Output perturbation with ℓ∞ projection reaches lower excess risk than dense DP-SGD at ε = 8",
                      f"{out_p['excess']:.4f} (λ = {out_p['lam']:g}) vs {dense['excess']:.4f}",
                      "**met**" if ok else "**missed**",
                      "one Gaussian on the regularized minimizer (sensitivity L/(λn)) instead of noise at each of T "
                      "steps; λ trades that noise against bias toward 0 (best λ at the grid's low end)"))
    if proj and dense:
        ok = proj["excess"] < dense["excess"]
        goals.append(("Bias-reduced DP-SGD (projection, the poster's) reaches lower excess risk than dense DP-SGD "
                      "at ε = 8", f"{proj['excess']:.4f} vs {dense['excess']:.4f}", "**met**" if ok else "**missed**",
                      "no amplification claimed (conservative calibration); heavy-tailed level correction"))
    if proj and gauss:
        ok = proj["excess"] < gauss["excess"] - 1e-3  # one seed: smaller gaps are not evidence
        goals.append(("Projection mean estimator beats the Gaussian one inside bias-reduced DP-SGD by more than "
                      "1e-3 at ε = 8", f"{proj['excess']:.4f} vs {gauss['excess']:.4f}", "**met**" if ok else "**missed**",
                      "same z and privacy event; projection bounds each release to the ℓ1 ball of radius L√s"))
    for label, r in (("gaussian", gauss), ("projection", proj)):
        if r and math.isfinite(at_zero):
            ok = r["excess"] < at_zero - 1e-3
            goals.append((f"Bias-reduced DP-SGD ({label}) improves on w = 0 by more than 1e-3 at ε = 8",
                          f"{r['excess']:.4f} vs {at_zero:.4f}", "**met**" if ok else "**missed**",
                          "does the private run learn anything at all on this problem"))
    alg2 = [r for r in doc.get("rows", []) if r["method"].startswith("alg2")]
    if alg2:
        cond = all(r["theorem1_condition_met"] for r in alg2)
        goals.append(("Thm 1's condition m ≥ 10√T holds in every Alg 2 run",
                      f"m = {alg2[0]['m']}, T = {alg2[0]['T']}", "**met**" if cond else "**missed**",
                      "T = m²/100 by construction"))
        valid = all(isinstance(r["theorem1_corrected"], float) and r["theorem1_corrected"] <= r["epsilon"] for r in alg2)
        worst = max((r["theorem1_corrected"] for r in alg2 if isinstance(r["theorem1_corrected"], float)), default=math.nan)
        goals.append(("Theorem 1 (with the correct amplification) certifies the Alg 2 runs at their ε",
                      f"largest corrected bound {worst:.3g}", "**met**" if valid else "**missed**",
                      "Lemma 1 as printed (qε') under-counts; the runs are certified by RDP instead"))
    rows = doc.get("rows", [])
    if rows:
        ok = all(r["epsilon_rdp"] <= r["epsilon"] * (1 + 1e-6) for r in rows)
        goals.append(("Every run's accounted ε (RDP; PLD for the single Gaussian of output perturbation) is at most its target ε", f"{len(rows)} runs",
                      "**met**" if ok else "**missed**", "calibrated by bisection on the accountant"))
    return lines, goals


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small n, few steps (seconds)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    payload = run(args.quick)
    lines, goals = results_section(payload)
    print("\n".join(lines))
    print(format_table(("goal", "measured", "status", "why"), goals))
    write_results("wide_linear", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
