"""ModelMix's accountant cross-checked (seed B; accounting/modelmix.py): the paper's headline
setting under each reading of the mixing width τ, with and without the refined clipping, against
the same noise without mixing; and ε versus the noise multiplier with and without mixing.

Headline setting (SEEDS.md §B): n = 50,000, expected batch b = 1,500, clip c = 20, T = 3,400,
noise multiplier 0.335, τ = 0.15·η, k = 100, δ = 1/(2n): the paper reports ε ≈ 8.0 at α = 4.
ε is given twice: the paper's conversion at α = 4 (T·RDP(4) + log(1/δ)/3) and our RDP
accountant's (all orders, Balle et al. 2020's conversion). The paper's Fig 3 triples are not
recomputed: the extracted text lost their settings (accounting/modelmix.py says what is known).

    python benchmarks/modelmix_accountant.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import announce_machine, format_table, write_results  # noqa: E402

from widedp.accounting import events as ev  # noqa: E402
from widedp.accounting.base import make_accountant  # noqa: E402
from widedp.accounting.modelmix import ModelMixDpEvent, epsilon_at_order, modelmix_rdp  # noqa: E402

HEADLINE = dict(n=50_000, batch=1_500, c=20.0, steps=3_400, sigma=0.335, r=0.15, k=100)
PAPER_EPSILON = 8.0


def _row(label: str, sigma: float, width: float, k: int, q: float, steps: int, delta: float) -> dict:
    event = ModelMixDpEvent(sigma, width, k)
    t0 = time.time()
    rdp4 = float(modelmix_rdp(event, q, [4.0])[0])
    ours = make_accountant("rdp").epsilon([(ev.PoissonSampledDpEvent(q, event), steps)], delta)
    return dict(label=label, noise_multiplier=sigma, mix_width=width, coordinates=k,
                epsilon_paper_alpha4=epsilon_at_order(rdp4, steps, 4, delta), epsilon_rdp=ours,
                seconds=round(time.time() - t0, 2))


def run(quick: bool) -> dict:
    h = HEADLINE
    q, delta = h["batch"] / h["n"], 1 / (2 * h["n"])
    readings = [("τ = r·η, gradients averaged over b: w = r·b/c", h["r"] * h["batch"] / h["c"], h["k"]),
                ("same width, ℓ2 clipping only (k = 1)", h["r"] * h["batch"] / h["c"], 1),
                ("τ = r·η·c, summed gradients: w = r", h["r"], h["k"]),
                ("τ = r·η, summed gradients: w = r/c", h["r"] / h["c"], h["k"]),
                ("no mixing (DP-SGD, same noise)", 0.0, h["k"])]
    headline = [_row(label, h["sigma"], w, k, q, h["steps"], delta) for label, w, k in readings]
    sigmas = (0.335, 1.0) if quick else (0.335, 0.5, 0.7, 1.0, 1.5)
    width = h["r"] * h["batch"] / h["c"]
    sweep = [_row(f"σ = {s}", s, w, h["k"], q, h["steps"], delta) for s in sigmas for w in (width, 0.0)]
    return {"setting": dict(h, q=q, delta=delta, paper_epsilon=PAPER_EPSILON), "headline": headline, "sweep": sweep}


def results_section(doc: dict) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """Markdown tables and goal rows (goal, measured, status, why) from a results doc."""
    s = doc["setting"]
    lines = [f"Headline setting: n = {s['n']}, b = {s['batch']} (q = {s['q']:.3g}), c = {s['c']:g}, T = {s['steps']}, "
             f"σ = {s['sigma']}, τ = {s['r']}·η, k = {s['k']}, δ = 1/(2n); the paper reports ε ≈ {s['paper_epsilon']:g} "
             "at α = 4. Width w = τ in units of the update's sensitivity.", "",
             "| reading | w | k | ε, paper's conversion at α = 4 | ε, our RDP accountant |", "|---|---|---|---|---|"]
    for r in doc["headline"]:
        lines.append(f"| {r['label']} | {r['mix_width']:.4g} | {r['coordinates']} | {r['epsilon_paper_alpha4']:.4g} | "
                     f"{r['epsilon_rdp']:.4g} |")
    lines += ["", "ε (our RDP accountant) versus the noise multiplier, same q, T, δ, k:", "",
              "| σ | with mixing (w = r·b/c) | without mixing |", "|---|---|---|"]
    by_sigma: dict = {}
    for r in doc["sweep"]:
        by_sigma.setdefault(r["noise_multiplier"], {})[r["mix_width"] > 0] = r["epsilon_rdp"]
    for sigma, pair in by_sigma.items():
        lines.append(f"| {sigma:g} | {pair.get(True, float('nan')):.4g} | {pair.get(False, float('nan')):.4g} |")
    lines += ["", "The paper's Fig 3 triples (57.2, 17.9, 15.3) and (40.4, 9.0, 7.9) are not recomputed: their "
              "settings were lost in the text's extraction. The amplification rests on secret mixing weights "
              "and the enforced gap (accounting/modelmix.py); `widedp train` mixes with `train.modelmix = true` "
              "(trainer/engine/modelmix.py; runs in §14)."]
    main, nomix = doc["headline"][0], doc["headline"][-1]
    ok = abs(main["epsilon_paper_alpha4"] - s["paper_epsilon"]) <= 0.02 * s["paper_epsilon"]
    goals = [("ModelMix headline ε ≈ 8.0 at α = 4 reproduced (within 2%)",
              f"{main['epsilon_paper_alpha4']:.4g} (our accountant: {main['epsilon_rdp']:.4g})",
              "**met**" if ok else "**missed**", "only with τ = r·η and gradients averaged over b (w = r·b/c)"),
             ("Without mixing the same noise costs far more (the guarantee rests on the secret mixing)",
              f"{nomix['epsilon_rdp']:.4g} vs {main['epsilon_rdp']:.4g}",
              "**met**" if nomix["epsilon_rdp"] > 10 * main["epsilon_rdp"] else "**missed**", "our RDP accountant")]
    return lines, goals


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    started = time.time()
    machine = announce_machine()
    payload = run(args.quick)
    print(format_table(("reading", "w", "k", "ε paper α=4", "ε rdp"),
                       [(r["label"], r["mix_width"], r["coordinates"], r["epsilon_paper_alpha4"], r["epsilon_rdp"])
                        for r in payload["headline"] + payload["sweep"]]))
    write_results("modelmix_accountant", payload, quick=args.quick, machine=machine, out=args.out, started=started)
    return payload


if __name__ == "__main__":
    main()
