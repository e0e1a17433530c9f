"""Generate docs/RESULTS.md and docs/plots/*.png from the benchmark JSON files.

Reads benchmarks/results/NAME.json for each benchmark (falling back to
benchmarks/results/quick/NAME.json, marked as such, when a full run is missing). Every number
in RESULTS.md is read from those files — nothing is typed by hand; rerun this after any
benchmark (`make results`).

    python benchmarks/make_results.py [--results benchmarks/results] [--out docs] [--prefer quick]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt_bytes, machine_line  # noqa: E402
from run_all import VARIANTS as RUN_VARIANTS  # noqa: E402

#: the k sweep of benchmarks/user_level.py (§18b), not one of run_all's variants
RUN_VARIANTS = {**RUN_VARIANTS, "user_level_k": (
    "user_level.py", ["--units", "user,user-examples", "--no-nonprivate", "--eps", "1,8", "--example-sampling-k",
                      "1,4,16", "--user-k", "1,4,16"])}
#: §2d: the DLRM step at DP batch sizes, ordinary calls against the compiled data plane
RAY_BATCHES = (1024, 4096, 16384)
RAY_BATCH_SYSTEMS = ("pytorch-nonprivate,opacus-ghost,widedp-sparse-sharded,widedp-sparse-ray,widedp-sparse-ray-compiled,"
                     "widedp-sparse-ray-compiled-spin,widedp-sparse-ray-eager,widedp-sparse-ray-norms-round")
#: §24–25: the public logs (benchmarks/public_logs.py builds them under runs/bench/public_logs first)
RUN_VARIANTS.update({f"user_level_{name}": ("user_level.py", [
    "--data", f"runs/bench/public_logs/{name}/data", "--repeats", "5", "--out", f"benchmarks/results/user_level_{name}.json"])
    for name in ("insteval", "movielens")})
RUN_VARIANTS.update({f"private_tuning_{name}": ("private_tuning.py", [
    "--data", f"runs/bench/public_logs/{name}/data", "--eps", "1,8", "--repeats", "2", "--expected-trials", "5",
    "--name", f"private_tuning_{name}"]) for name in ("insteval", "movielens")})
RUN_VARIANTS["phase_breakdown_16k"] = ("phase_breakdown.py", [
    "--set", "train.batch_size=16384", "--steps", "8", "--warmup", "2", "--out", "benchmarks/results/phase_breakdown_16k.json"])
#: §5 over the compiled data plane (cluster.data_plane = "compiled", its default sleeping waits)
RUN_VARIANTS.update({f"phase_breakdown_compiled_{tag}": ("phase_breakdown.py", [
    "--set", "cluster.data_plane=compiled", "--set", f"train.batch_size={b}", *extra,
    "--out", f"benchmarks/results/phase_breakdown_compiled_{tag}.json"])
    for tag, b, extra in (("1k", 1024, []), ("4k", 4096, ["--steps", "15", "--warmup", "3"]),
                          ("16k", 16384, ["--steps", "8", "--warmup", "2"]))})
RUN_VARIANTS["coordinator_scaling"] = ("trainer_scaling.py", [
    "--trainers", "1,2,4", "--dense-reduction", "coordinator,trainers", "--partitioned", "--repeats", "3", "--steps", "24",
    "--out", "benchmarks/results/coordinator_scaling.json"])
RUN_VARIANTS["trainer_scaling_16k"] = ("trainer_scaling.py", [
    "--trainers", "1,2", "--batch", "16384", "--examples", "100000", "--steps", "5", "--repeats", "3",
    "--out", "benchmarks/results/trainer_scaling_16k.json"])
#: §20: the own-model examples, run at full size by benchmarks/own_model.py (one file per example)
RUN_VARIANTS.update({f"own_model_{name}": ("own_model.py", ["--examples", name])
                     for name in ("dcn_ranking", "two_tower_retrieval", "sasrec_sequential", "transformer_lm")})
RUN_VARIANTS.update({f"ray_batch_{b}": ("dlrm_compare.py", [
    "--rows", "20000", "--batch", str(b), "--systems", RAY_BATCH_SYSTEMS, "--repeats", "3", "--steps", "10", "--warmup", "2",
    "--max-seconds", "60", "--out", f"benchmarks/results/ray_batch_{b}.json"]) for b in RAY_BATCHES})

NAMES = ("table_scaling", "opacus_compare", "dlrm_compare", "trainer_scaling", "coordinator_scaling",
         "partitioned_dry_run", "privacy_overhead",
         "communication",
         "phase_breakdown", "privacy_utility", "calibration_study", "paper_fig1", "paper_fig1_seed", "privacy_audit",
         "canary_exposure", "canary_exposure_kjv", "canary_exposure_line", "canary_exposure_kjv_line",
         "sparse_mean_estimation", "wide_linear", "dp_ambssgd", "modelmix_accountant", "engine_modelmix_adaptive",
         "noise_generators", "cli_startup", "user_level", "user_level_examples", "user_level_k", "convert_throughput",
         "ray_batch_1024", "ray_batch_4096", "ray_batch_16384", "trainer_scaling_16k", "phase_breakdown_16k",
         "phase_breakdown_compiled_1k", "phase_breakdown_compiled_4k", "phase_breakdown_compiled_16k", "cluster_model", "cbow_large",
         "modelmix_image", "data_plane_probe", "own_model_dcn_ranking", "own_model_two_tower_retrieval",
         "own_model_sasrec_sequential", "own_model_transformer_lm", "own_model_opacus",
         "ghost_transformer", "private_tuning", "private_tuning_small", "forecast_check",
         "user_level_insteval", "private_tuning_insteval", "user_level_movielens", "private_tuning_movielens",
         "lazy_noise", "audit_power", "audit_conformance")
MODE_STYLE = {"sparse": "-o", "dpsgd": "-s", "nonprivate": "-^"}


# ---- loading --------------------------------------------------------------------------------------

def load_results(results: Path, prefer: str = "full") -> dict:
    out = {}
    order = [results, results / "quick"] if prefer == "full" else [results / "quick", results]
    for name in NAMES:
        for d in order:
            p = d / f"{name}.json"
            if p.exists():
                doc = json.loads(p.read_text())
                doc["_path"] = p
                out[name] = doc
                break
    for d in order:
        p = d / "selection_scaling.txt"
        if p.exists():
            out["selection_scaling"] = {"_path": p, "text": p.read_text(), "quick": d.name == "quick"}
            break
    return out


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def f(v, digits: int = 3) -> str:
    """Numbers for prose and tables, read from the JSON (never typed)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        if math.isnan(v):
            return "nan"
        a = abs(v)
        if a >= 1e6 or (0 < a < 1e-3):
            return f"{v:.{digits}g}"
        if a >= 100:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def e10(n) -> str:
    n = int(n)
    e = round(math.log10(n)) if n > 0 else 0
    return f"10^{e}" if 10**e == n else f"{n:,}"


def met(flag) -> str:
    return "**met**" if flag else "**missed**"


def unproven(flag) -> str:
    """Status of a goal whose figure rests on an extrapolated (not measured) point."""
    return f"**unproven** (extrapolation says {'met' if flag else 'missed'})"


# ---- sections -----------------------------------------------------------------------------------

def section_scaling(doc, plots, out_dir) -> tuple[list, list]:
    from widedp.trainer.release.report import plot_curves

    lines, goals = [], []
    res = [r for r in doc["results"] if "error" not in r]
    by_mode = {}
    for r in res:
        by_mode.setdefault(r["mode"], []).append(r)
    series = []
    for mode, rs in by_mode.items():
        rs.sort(key=lambda r: r["rows"])
        series.append((mode, [r["rows"] for r in rs], [r["step_ms_median"] for r in rs],
                       {"marker": MODE_STYLE.get(mode, "-o")[1:], "linestyle": "-"}))
    sp_rows = sorted(by_mode.get("sparse", []), key=lambda r: r["rows"])
    if len(sp_rows) >= 2:
        ref = 1.3 * sp_rows[0]["step_ms_median"]
        series.append((f"goal: 1.3 × sparse at {e10(sp_rows[0]['rows'])}", [sp_rows[0]["rows"], sp_rows[-1]["rows"]],
                       [ref, ref], {"color": "gray", "linestyle": ":"}))
    if series:
        plots["step_time_vs_rows"] = plot_curves(
            series, out_dir / "step_time_vs_rows.png", title=f"step time vs total table rows (batch {doc['batch']}, k {doc['k']})",
            xlabel="rows (all tables)", ylabel="median step time (ms)", logx=True, logy=True)
    lines += [f"Model `{doc['config']}` (26 tables, dim {doc['dim']}), expected batch {doc['batch']}, k = {doc['k']}, "
              f"embedding optimizer {doc['optimizer']}; median of up to {doc['steps']} steps after warm-up; "
              f"one fresh process per (rows, mode).", "",
              "| rows | mode | step ms (median) | examples/s | rows touched | rows selected | to shards/step | from shards/step | peak memory (tree) |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(res, key=lambda r: (r["rows"], r["mode"])):
        lines.append(f"| {e10(r['rows'])} | {r['mode']} | {f(r['step_ms_median'])} | {f(r['examples_per_sec'])} | "
                     f"{f(r['rows_touched_mean'])} | {f(r['rows_selected_mean'])} | {fmt_bytes(r['bytes_to_shards_per_step'])} | "
                     f"{fmt_bytes(r['bytes_from_shards_per_step'])} | {fmt_bytes(r.get('peak_tree_rss_bytes'))} |")
    for s in doc.get("skipped", []):
        lines.append(f"| {e10(s['rows'])} | (all) | skipped: {s['reason']} | | | | | | |")
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"| {e10(r['rows'])} | {r['mode']} | FAILED: {r['error'][:80]} | | | | | | |")
    ratios = doc.get("ratios", {})
    lines.append("")
    for mode in ("sparse", "dpsgd", "nonprivate"):
        rr = ratios.get(f"{mode}_largest_over_smallest")
        if rr:
            lines.append(f"- {mode}: step time at {e10(rr['rows'][1])} rows / at {e10(rr['rows'][0])} rows = **{f(rr['ratio'])}×**"
                         + (f" (fastest steps: {f(rr['ratio_min'])}×)" if rr.get("ratio_min") else ""))
    g = ratios.get("sparse_1e7_over_1e4")
    sp = {r["rows"]: r for r in by_mode.get("sparse", [])}
    why = ""
    if sp:
        lo, hi = sp[min(sp)], sp[max(sp)]
        deltas = {p: hi["phase_ms_median"].get(p, 0) - lo["phase_ms_median"].get(p, 0) for p in hi["phase_ms_median"]}
        if deltas:
            worst = max(deltas, key=deltas.get)
            why = (f"the phase that grew most from {e10(min(sp))} to {e10(max(sp))} rows is `{worst}` "
                   f"({f(lo['phase_ms_median'].get(worst))} → {f(hi['phase_ms_median'].get(worst))} ms); rows touched per step "
                   f"grew {f(lo['rows_touched_mean'])} → {f(hi['rows_touched_mean'])} (fewer id collisions in bigger tables)")
    if g:
        goals.append(("Sparse step time at 10^7 rows ≤ 1.3× its time at 10^4", f"{f(g['ratio'])}× (medians)"
                      + (f"; {f(g['ratio_min'])}× (fastest steps)" if g.get("ratio_min") else ""), met(g["met"]), why))
    elif sp:
        goals.append(("Sparse step time at 10^7 rows ≤ 1.3× its time at 10^4",
                      f"not measured at both sizes (measured {', '.join(e10(x) for x in sorted(sp))})", "–", why))
    dp = ratios.get("dpsgd_1e7_over_1e4")
    if dp:
        goals.append(("dpsgd (lazy noise) step time at 10^7 rows ≤ 1.3× its time at 10^4", f"{f(dp['ratio'])}× (medians)"
                      + (f"; {f(dp['ratio_min'])}× (fastest steps)" if dp.get("ratio_min") else ""), met(dp["met"]),
                      "a step draws the pending noise of the rows it reads only; what grows with the rows is the "
                      "rows touched per step (fewer id collisions in bigger tables)"))
    if why:
        lines.append(f"- Why: {why}.")
    return lines, goals


def section_opacus(doc, plots, out_dir) -> tuple[list, list]:
    from widedp.trainer.release.report import pyplot, save

    lines, goals = [], []
    res = doc["results"]
    systems = []
    for r in res:
        if r["system"] not in systems:
            systems.append(r["system"])
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, s in enumerate(systems):
        rs = sorted([r for r in res if r["system"] == s and r.get("examples_per_sec")], key=lambda r: r["vocab"])
        if not rs:
            continue
        meas = [r for r in rs if not r.get("extrapolated")]
        color = f"C{i}"
        ax1.plot([r["vocab"] for r in rs], [r["examples_per_sec"] for r in rs], "-", color=color, label=s)
        ax1.plot([r["vocab"] for r in meas], [r["examples_per_sec"] for r in meas], "o", color=color)
        ext = [r for r in rs if r.get("extrapolated")]
        if ext:
            ax1.plot([r["vocab"] for r in ext], [r["examples_per_sec"] for r in ext], "o", mfc="none", color=color)
        mem = [(r["vocab"], r.get("peak_tree_rss_bytes") or r.get("ru_maxrss_bytes")) for r in meas]
        mem = [m for m in mem if m[1]]
        if mem:
            ax2.plot([m[0] for m in mem], [m[1] / 2**30 for m in mem], "-o", color=color, label=s)
    ax1.set(xscale="log", yscale="log", xlabel="vocabulary V (rows per table)", ylabel="examples / s",
            title="CBOW throughput (hollow: extrapolated)")
    ax2.set(xscale="log", xlabel="vocabulary V", ylabel="peak memory (GiB, process tree)", title="peak memory")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    plots["throughput_vs_opacus"] = save(fig, out_dir / "throughput_vs_opacus.png")
    lines += [f"CBOW, dim {doc['dim']}, expected batch {doc['batch']}, σ {doc['sigma']}, S1 {doc['clip']}, SGD lr {doc['lr']}, "
              f"{f(doc['examples'])} examples (same train split for every system); widedp sparse uses `{doc['selection']}` "
              f"selection with k = {doc['k']}. Opacus {doc['machine'].get('versions', {}).get('opacus', '')}: "
              "`nn.Embedding` ×2, `make_private` with Poisson sampling; ghost clipping; hooks only at small V.", "",
              "| V | system | step ms | examples/s | peak RSS (worker) | peak RSS (process tree) | note |",
              "|---:|---|---:|---:|---:|---:|---|"]
    for r in res:
        note = ""
        if r.get("extrapolated"):
            err = re.sub(r"\s*[WI]\d{4} \d.*", "", r.get("error", ""))[:80]
            why = r.get("skipped") or (f"run failed: {err}" + (f"; peak memory before that {fmt_bytes(r['peak_tree_rss_bytes'])}"
                                                               if r.get("peak_tree_rss_bytes") else ""))
            note = (f"**extrapolated** ({why}): {r.get('extrapolation', '')}"
                    + (f"; a power law through the same points gives {f(r['power_law_ms'])} ms" if r.get("power_law_ms") else ""))
        elif r.get("skipped"):
            note = "skipped: " + r["skipped"]
        elif r.get("error"):
            note = "FAILED: " + r["error"][:100]
        elif r.get("steps_timed") == 1:
            note = "one timed step (a step outlasts the time budget)"
        lines.append(f"| {e10(r['vocab'])} | {r['system']} | {f(r.get('step_ms_median'))} | {f(r.get('examples_per_sec'))} | "
                     f"{fmt_bytes(None if r.get('extrapolated') else r.get('ru_maxrss_bytes'))} | "
                     f"{fmt_bytes(None if r.get('extrapolated') else r.get('peak_tree_rss_bytes'))} | {note} |")
    lines.append("")
    summ = doc.get("summary", {})
    for v, e in summ.get("ratios", {}).items():
        parts = []
        if "sparse_over_opacus_ghost" in e:
            parts.append(f"widedp sparse / Opacus ghost = **{f(e['sparse_over_opacus_ghost'])}×**"
                         + (" (extrapolated)" if e.get("extrapolated") else ""))
        if "sparse_inprocess_over_opacus_ghost" in e:
            parts.append(f"in-process sparse / Opacus ghost = {f(e['sparse_inprocess_over_opacus_ghost'])}×")
        if "dpsgd_over_opacus_ghost" in e:
            parts.append(f"widedp dpsgd / Opacus ghost = {f(e['dpsgd_over_opacus_ghost'])}×")
        if "dpsgd_inprocess_over_opacus_ghost" in e:
            parts.append(f"in-process dpsgd / Opacus ghost = {f(e['dpsgd_inprocess_over_opacus_ghost'])}×")
        if "sparse_over_pytorch_nonprivate" in e:
            parts.append(f"widedp sparse / non-private PyTorch = {f(e['sparse_over_pytorch_nonprivate'])}×")
        if parts:
            lines.append(f"- V = {e10(int(v))}: " + "; ".join(parts))
    # growth exponents: why the ratio grows with V
    expo = {}
    for s in ("opacus-ghost", "widedp-sparse", "widedp-dpsgd"):
        rs = sorted([r for r in res if r["system"] == s and r.get("step_ms_median") and not r.get("extrapolated")],
                    key=lambda r: r["vocab"])
        if len(rs) >= 2:
            expo[s] = math.log(rs[-1]["step_ms_median"] / rs[0]["step_ms_median"]) / math.log(rs[-1]["vocab"] / rs[0]["vocab"])
    if expo:
        lines.append("- Step time grows as V^x with x = " + ", ".join(f"{s}: {f(x)}" for s, x in expo.items())
                     + " (measured points only): Opacus materializes, noises and updates the dense V×D gradient of "
                       "both tables every step; widedp sparse touches only the batch's rows and k selected rows.")
    g = summ.get("goal")
    if g:
        goals.append((f"widedp sparse ≥ 100× Opacus throughput at V = {e10(g['vocab'])}",
                      f"{f(g['ratio'])}×" + (" (extrapolated Opacus step)" if g.get("extrapolated") else ""),
                      unproven(g["met"]) if g.get("extrapolated") else met(g["met"]),
                      "Opacus's step has a cost per table row (it materializes, noises and updates the dense V×D "
                      "gradient of both tables), widedp sparse's does not"
                      + (f"; measured Opacus growth V^{f(expo.get('opacus-ghost'))} between its measured points"
                         if "opacus-ghost" in expo else "")))
    labels = {"dpsgd_over_opacus_ghost": "widedp dpsgd on Ray (lazy noise)",
              "dpsgd_inprocess_over_opacus_ghost": "widedp dpsgd in-process (lazy noise)"}
    for key, g in summ.get("dpsgd_goals", {}).items():
        goals.append((f"{labels.get(key, key)} ≥ {f(g['goal'])}× Opacus ghost's throughput at V = {e10(g['vocab'])}",
                      f"{f(g['ratio'])}×" + (" (extrapolated step)" if g.get("extrapolated") else ""),
                      unproven(g["met"]) if g.get("extrapolated") else met(g["met"]),
                      "lazy noise: a step draws the pending noise of the rows it reads only (one draw per row and "
                      "pending interval), so its cost follows the batch, not V; Opacus materializes, noises and "
                      "updates the dense V×D gradient of both tables every step"))
    return lines, goals


def section_dlrm(doc, rounds_by_batch: Optional[dict] = None) -> tuple[list, list]:
    """benchmarks/dlrm_compare.py: step time per system and size, × floor, Opacus / system, goals.
    `rounds_by_batch`: {expected batch: phase_breakdown doc over the compiled plane}, whose
    recorded rounds explain a missed compiled-plane goal at that batch."""
    lines, goals = [], []
    sizes, summ = doc["rows"], doc.get("summary", {})
    ratios = summ.get("ratios", {})
    labels = doc.get("labels", {})
    lines += [f"`{doc['config']}` (DLRM: {doc['tables']} tables × rows below, dim {doc['dim']}, bottom MLP {doc['bottom_mlp']}, "
              f"top MLP {doc['top_mlp']}, interaction {doc['interaction']}), expected batch {doc['batch']} (Poisson), "
              f"σ {doc['sigma']}, S1 {doc['clip']}, SGD lr {doc['lr']} (dense {doc['dense_lr']}), {f(doc['examples'])} "
              f"examples (same train split for every system); widedp sparse uses `{doc['selection']}` selection "
              f"(k = {doc['k']}); \"in-process\" runs hold one shard (every table in one TBE), Ray and \"Ray's "
              f"shards\" (the same placement in one process, what the Ray goal compares with) {doc['num_shards']} shards"
              + (" (this run predates the one-shard rows: its in-process rows held them too)"
                 if "widedp-sparse-sharded" not in doc.get("systems", []) else "") + f". Opacus {doc['machine'].get('versions', {}).get('opacus', '')}: "
              "`nn.Embedding` per table, `make_private` with Poisson sampling, ghost clipping. Median ms per step; "
              "× floor = system / plain PyTorch; Opacus / system = how many times faster than Opacus ghost.", "",
              "| system | " + " | ".join(f"{doc['tables']} × {r:,} ms | × floor | Opacus / system" for r in sizes) + " |",
              "|---|" + "---:|---:|---:|" * len(sizes)]
    systems = []
    for r in doc["results"]:
        if r["system"] not in systems:
            systems.append(r["system"])
    by = {(r["system"], r["rows"]): r for r in doc["results"] if not r.get("repeat")}
    for s in systems:
        cells = []
        for rows in sizes:
            e, r = ratios.get(str(rows), {}).get(s), by.get((s, rows), {})
            if e:
                cells += [f(e["step_ms"]), f"{f(e['x_floor'])}×" if e.get("x_floor") else "–",
                          f"{f(e['opacus_over'])}×" if e.get("opacus_over") else "–"]
            else:
                why = r.get("skipped") or (f"FAILED: {r['error'][:60]}" if r.get("error") else "not run")
                cells += [why, "–", "–"]
        lines.append(f"| {labels.get(s, s)} | " + " | ".join(cells) + " |")
    repeats = int(doc.get("repeats", 1))
    if repeats > 1:
        lines += ["", f"Every system ran {repeats} times, interleaved (A B C … A B C …: load that drifts over the run "
                      "falls on all); each step time above is the median of its repeats' median steps, and the goals "
                      "are taken on those. Each repeat's median step (ms):", ""]
        for rows in sizes:
            lines.append(f"- {doc['tables']} × {rows:,}: " + "; ".join(
                f"{s} " + " / ".join(f(v) for v in e.get("repeats_ms", []))
                for s, e in ratios.get(str(rows), {}).items()))
    lines += ["", "| system | rows | examples/s | peak RSS (worker) | peak RSS (process tree) |", "|---|---:|---:|---:|---:|"]
    if repeats > 1:
        lines[-2] = "| system (first repeat) | rows | examples/s | peak RSS (worker) | peak RSS (process tree) |"
    for r in doc["results"]:
        if r.get("step_ms_median") and not r.get("repeat"):
            lines.append(f"| {r['system']} | {r['tables']} × {r['rows']:,} | {f(r.get('examples_per_sec'))} | "
                         f"{fmt_bytes(r.get('ru_maxrss_bytes'))} | {fmt_bytes(r.get('peak_tree_rss_bytes'))} |")
    for g in summ.get("goals", []):
        measured = "; ".join(f"{doc['tables']} × {int(rows):,}: " + ("not measured" if p["value"] is None else f"{f(p['value'])}×")
                             + f" (goal {g['op']} {p['target']:g}×)" for rows, p in g["per_size"].items())
        goals.append((g["goal"], f"{g['unit']}: {measured}", "not measured at every size" if g["met"] is None
                      else met(g["met"]), _dlrm_why(g, ratios, doc, rounds_by_batch) if g["met"] is False else ""))
    return lines, goals


#: the per-step methods of the compiled plane whose rounds a missed compiled goal is explained by,
#: and the phase of the step (phase_breakdown) each one is
COMPILED_STEP_ROUNDS = {"lookup": "lookup", "add_clipped_row_sums": "row_sums", "clipped_row_sums": "row_sums",
                        "reduced_row_sums": "row_sums", "select_rows": "selection"}


def compiled_rounds_why(breakdown: dict) -> str:
    """Where a step's compiled rounds spend their time, from a phase_breakdown doc's recorded
    rounds (`runs.ray.call_timings`): per round, when the shards began after it was sent (the
    first and the last) against a shard's own part, and the shards' CPU summed against the cores
    there are. Empty when the doc has no recorded rounds."""
    rounds = ((breakdown.get("runs") or {}).get("ray") or {}).get("call_timings") or {}
    in_process = {p: v.get("local") for p, v in ((breakdown.get("summary") or {}).get("phases") or {}).items()}
    parts = []
    for method, phase in COMPILED_STEP_ROUNDS.items():
        r = rounds.get(method)
        if not r:
            continue
        local = in_process.get(phase)
        parts.append(f"{method} {f(r['round_ms'])} ms: shards begin {f(r['start_first_ms'])}–{f(r['start_last_ms'])} ms "
                     f"after it is sent, a shard's part {f(r['shard_wall_ms'])} ms (CPU {f(r['shard_cpu_ms'])}), "
                     f"{r['shards']} parts' CPU {f(r['shards_cpu_sum_ms'])} ms"
                     + (f" (the phase in one process: {f(local)} ms)" if local is not None else ""))
    if not parts:
        return ""
    cores = breakdown.get("machine", {}).get("logical_cores", "?")
    return (f"the rounds (medians, {breakdown.get('steps')} steps of phase_breakdown at this batch): " + "; ".join(parts)
            + f". With {next(iter(rounds.values()))['shards']} single-threaded shard processes on {cores} cores the "
            "last shard begins after the others' parts, not after the transport (RESULTS §2f: a round's transport "
            "alone is ~1/4 of ordinary calls'); a core per shard would start them together")


def _dlrm_why(goal: dict, ratios: dict, doc: dict, rounds_by_batch: Optional[dict] = None) -> str:
    """Why a missed dlrm_compare goal is missed, from the same step times: for the Ray goal, the
    overhead per step against what 1.3× allows; for the compiled-plane goal, the same against its
    target and the recorded rounds at this batch (`compiled_rounds_why`); for the speed-up goal,
    the step time it needs against the floor."""
    def ms(system, rows):
        return (ratios.get(str(rows), {}).get(system) or {}).get("step_ms")

    parts = []
    for rows in goal["per_size"]:
        ray, local = ms("widedp-sparse-ray", rows), ms("widedp-sparse-inprocess", rows)
        sharded = ms("widedp-sparse-sharded", rows)
        peer, floor = ms("opacus-ghost", rows), ms("pytorch-nonprivate", rows)
        compiled = ms("widedp-sparse-ray-compiled", rows)
        if goal["unit"].startswith("Ray") and ray and sharded:
            parts.append(f"{int(rows):,}: Ray adds {f(ray - sharded)} ms per step, 1.3× allows {f(0.3 * sharded)} ms")
        elif goal["unit"].startswith("compiled") and compiled and sharded:
            target = goal["per_size"][rows]["target"]
            parts.append(f"{int(rows):,}: the compiled plane adds {f(compiled - sharded)} ms per step, {target:g}× allows "
                         f"{f((target - 1) * sharded)} ms")
        elif goal["unit"].startswith("Opacus / sparse") and peer and local and floor and not goal["per_size"][rows]["met"]:
            need = peer / goal["per_size"][rows]["target"]
            parts.append(f"{int(rows):,}: needs ≤ {f(need)} ms per step ({f(need / floor)}× the floor), measured {f(local)} ms")
    if goal["unit"].startswith("Ray"):
        folded, norms_here = doc.get("fold_write_back", False), doc.get("norms_on_trainer", False)
        names = (["lookup with the last step's write-back" if folded else "lookup"] + ([] if norms_here else ["norms"])
                 + ["row sums with the selection" + (" and the pooled-output gradients" if norms_here else "")]
                 + ([] if folded else ["write-back"]))
        rounds = f"{len(names)} rounds of calls to the {doc['num_shards']} shard actors per step ({', '.join(names)})"
        parts.append(f"one trainer makes {rounds}; on "
                     f"{doc['machine'].get('logical_cores', '?')} cores the actors' calls queue behind each other "
                     "(RESULTS §5 splits the overhead by round)")
    if goal["unit"].startswith("compiled"):
        breakdown = (rounds_by_batch or {}).get(int(doc.get("batch") or 0))
        why = compiled_rounds_why(breakdown) if breakdown else ""
        parts.append(why or "no recorded rounds at this batch (RESULTS §5, compiled: run phase_breakdown_compiled_*)")
    return "; ".join(parts)


def section_trainers(doc) -> tuple[list, list]:
    """benchmarks/trainer_scaling.py: N trainer actors on a loopback multi-node Ray cluster."""
    lines, goals = [], []
    ok = [r for r in doc["results"] if "error" not in r]
    one = next((r for r in ok if r["label"] == "ray N=1"), None)
    lines += [f"CTR model of `configs/ctr.toml` (26 tables, {doc['rows']:,} rows in all, D = 16, expected batch {doc.get('batch', 1024):,}), "
              f"`{doc['selection']}` selection on the shards, {doc['shards']} shard actors, N trainer actors "
              f"(`cluster.trainer_placement = \"actors\"`) on a loopback cluster of {doc['nodes']} Ray nodes "
              "(`ray.cluster_utils.Cluster`: each node its own raylet and object store, all on this machine). "
              "Per trainer: CPU time of its own process per step and bytes it exchanges with the shards per step "
              "(the in-process row: the one process and all its shard traffic). On a 2-core machine the trainers "
              "share two cores, so the scaling shows in work per trainer, not in wall clock.", "",
              "| system | step ms | examples/s | vs N=1 | trainer CPU ms/step (mean / max) | CPU per trainer vs N=1 | "
              "bytes per trainer per step | coordinator bytes per step | nodes with a trainer |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = {}
    for r in ok:
        cpu = [t["cpu_ms_per_step"] for t in r["trainers"]]
        traffic = [t["bytes_to_shards_per_step"] + t["bytes_from_shards_per_step"] for t in r["trainers"]]
        c = r["coordinator_bytes_per_step"]
        cpu_ratio = (sum(cpu) / len(cpu)) / (sum(t["cpu_ms_per_step"] for t in one["trainers"]) / len(one["trainers"])) \
            if one and r["label"].startswith("ray") else None
        bytes_ratio = (sum(traffic) / len(traffic)) / sum(t["bytes_to_shards_per_step"] + t["bytes_from_shards_per_step"]
                                                          for t in one["trainers"]) if one and r["label"].startswith("ray") else None
        if r["label"].startswith("ray"):
            ratios[r["num_trainers"]] = (cpu_ratio, bytes_ratio)
        lines.append(f"| {r['label']} | {f(r['step_ms_median'])} | {f(r['examples_per_sec'])} | "
                     f"{f(r['examples_per_sec'] / one['examples_per_sec']) + '×' if one else '–'} | "
                     f"{f(sum(cpu) / len(cpu))} / {f(max(cpu))} | {f(cpu_ratio) if cpu_ratio else '–'} | "
                     f"{fmt_bytes(sum(traffic) / len(traffic))} | {fmt_bytes(c['to'] + c['from'])} | "
                     f"{len({t['node'] for t in r['trainers']})} |")
    failed = [r for r in doc["results"] if "error" in r]
    for r in failed:
        lines.append(f"| {r['label']} | FAILED: {r['error'][:80]} | | | | | | | |")
    measured = "; ".join(f"N = {n}: CPU per trainer {f(c)}× and bytes per trainer {f(b)}× N = 1's"
                         for n, (c, b) in sorted(ratios.items()) if c is not None)
    wanted = {1, 2, 4}
    goals.append(("Throughput with N = 1, 2, 4 trainer actors on a loopback multi-node cluster, with per-trainer CPU "
                  "time and bytes", measured or "not measured",
                  "reported" if wanted <= set(ratios) else "not measured at every N",
                  "2 cores: work per trainer, not wall clock (run trainer_scaling.py where a core per trainer exists)"))
    goals += trainer_wall_clock_goal(doc, ok)
    return lines, goals


def section_coordinator_scaling(doc) -> tuple[list, list]:
    """benchmarks/trainer_scaling.py --dense-reduction coordinator,trainers --partitioned: the
    coordinator's CPU per step against the number of trainer actors N (issue 52)."""
    lines, goals = [], []
    ok = [r for r in doc["results"] if "error" not in r and r["label"].startswith("ray")]
    data = "a data set written as parts, each trainer reading and sampling its own" if doc.get("partitioned") \
        else "the training set shared through the object store"
    lines += [f"CTR model of `configs/ctr.toml` (26 tables, {doc['rows']:,} rows in all, expected batch "
              f"{doc.get('batch', 1024):,}), {doc['shards']} shard actors, N trainer actors on a loopback cluster of "
              f"{doc['nodes']} Ray nodes, {data}; {doc.get('repeats', 1)} interleaved repeat(s) per row. "
              "`coordinator`: each trainer returns its dense clipped sum to the coordinator, which adds them and "
              "sends every trainer the dense parameters (one call per trainer per round). `trainers` "
              "(`cluster.dense_reduction`): trainer 0 leads each round — the coordinator sends it every sample and "
              "the dense parameters once and gets every part back in one answer — and the dense sums are reduced "
              "to it over gloo. Coordinator CPU: the driver process's CPU seconds per timed step (its Ray client "
              "threads included); of which main thread: the engine's own work and the serialization of its calls "
              "(the rest is Ray's transport threads). On 2 cores every process shares them, so wall clock is not "
              "the claim.", "",
              "| system | step ms | coordinator CPU ms/step | of which main thread | vs N = 1 | coordinator bytes to/from shards per step |",
              "|---|---:|---:|---:|---:|---:|"]
    one = next((r for r in ok if r["num_trainers"] == 1), None)
    by_reduction: dict = {}
    for r in ok:
        label = r["label"]
        reduction = "trainers" if "(trainers)" in label else "coordinator" if "(coordinator)" in label else "both"
        cpu = r["coordinator_cpu_ms_per_step"]
        for key in ("coordinator", "trainers") if reduction == "both" else (reduction,):
            by_reduction.setdefault(key, {})[r["num_trainers"]] = cpu
        c = r["coordinator_bytes_per_step"]
        main = r.get("coordinator_main_thread_cpu_ms_per_step")
        lines.append(f"| {label} | {f(r['step_ms_median'])} | {f(cpu)} | {f(main) if main is not None else '–'} | "
                     f"{f(cpu / one['coordinator_cpu_ms_per_step']) + '×' if one else '–'} | {fmt_bytes(c['to'] + c['from'])} |")
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"| {r['label']} | FAILED: {r['error'][:80]} | | | | |")
    for key in ("coordinator", "trainers"):
        cpu = by_reduction.get(key, {})
        name = (f"The coordinator's CPU per step flat in N (largest ≤ 1.3× smallest over N), dense part "
                f"reduced by the {'trainers' if key == 'trainers' else 'coordinator'}")
        if len(cpu) < 2:
            goals.append((name, "not measured", "not measured", "run trainer_scaling.py --trainers 1,2,4 "
                          "--dense-reduction coordinator,trainers --partitioned"))
            continue
        ns = sorted(cpu)
        ratio = max(cpu.values()) / min(cpu.values())
        goals.append((name, ", ".join(f"N = {n}: {f(cpu[n])} ms" for n in ns) + f" ({f(ratio)}×)",
                      "met" if ratio <= 1.3 else "missed",
                      "2 cores shared by every process; the Ray client threads' CPU is the driver's"))
    return lines, goals


def section_partitioned_dry_run(doc) -> tuple[list, list]:
    """benchmarks/partitioned_dry_run.py: a data set larger than the coordinator's enforced memory,
    trained by trainer actors reading their own parts (issue 52)."""
    gib = 2 ** 30
    cap, disk, decoded = doc["coordinator_cap_bytes"], doc["data_bytes_on_disk"], doc["data_bytes_decoded"]
    peak_rss = doc["peak_rss_bytes"]
    peak = doc.get("coordinator_peak_bytes_cgroup")
    reads = doc.get("storage_read_bytes_per_trainer_per_step") or []
    lines = [f"A synthetic CTR data set of {doc['examples']:,} training examples (`configs/ctr.toml`'s model, 26 tables "
             f"of {doc['rows']:,} rows in all, `threshold` selection) written as {doc['parts']} parts; "
             f"{doc['trainers']} trainer actors (parts {doc.get('trainer_parts')}) and {doc['shards']} shard actors on a "
             f"loopback cluster of {doc['nodes']} Ray nodes; the dense part reduced among the trainers. The coordinator "
             f"(`widedp train`) ran under a {cap / gib:.2f} GiB cap ({doc['cap_kind']}, set before its first "
             "instruction; the raylets and actors are outside it: the kernel keeps what is charged to it — its own "
             "memory and the page cache it fills — under the cap, reclaiming page cache at the cap and killing the "
             "process if that is not enough). Peak RSS per role: the largest VmHWM of any of its processes (it counts "
             "the file pages a process mapped, e.g. a trainer's memory-mapped parts, which the page cache holds); "
             "peak anonymous memory: the largest RssAnon, polled once a second.", "",
             "| quantity | value |", "|---|---:|",
             f"| data set on disk (Parquet) | {disk / gib:.2f} GiB ({disk / cap:.1f}× the cap) |",
             f"| data set decoded (what holding it in memory takes) | {decoded / gib:.2f} GiB ({decoded / cap:.1f}× the cap) |",
             f"| coordinator: peak charged to its cgroup | {'–' if peak is None else f'{peak / gib:.2f} GiB'} |",
             *[f"| peak RSS / peak anonymous memory, {role} ({doc['processes'].get(role, '?')} process(es)) | "
               f"{v / gib:.2f} / {doc.get('peak_anon_bytes', {}).get(role, float('nan')) / gib:.2f} GiB |"
               for role, v in sorted(peak_rss.items())],
             f"| steps, examples/s, median step | {doc['steps']}, {f(doc['examples_per_sec'])}, "
             f"{f(doc['step_time_ms_median'])} ms |",
             f"| per trainer per step: its sampled rows, decoded | {doc['sampled_bytes_per_trainer_per_step'] / 1e6:.2f} MB |",
             f"| per trainer per step: storage reads while training | "
             f"{', '.join(f'{b / 1e6:.2f} MB' for b in reads) or '–'} |",
             f"| held-out AUC / logloss | {f(doc['test_metrics']['auc'])} / {f(doc['test_metrics']['logloss'])} |", ""]
    anon = doc.get("peak_anon_bytes", {}).get("coordinator")
    within = (peak if peak is not None else anon if anon is not None else float("inf")) <= cap
    ratio = min(disk, decoded) / cap
    goals = [("A run whose data set is ≥ 10× the coordinator's enforced memory trains on a loopback multi-node "
              "cluster, trainers reading their own parts",
              f"{doc['steps']} steps; data {disk / cap:.1f}× the cap on disk, {decoded / cap:.1f}× decoded; coordinator "
              f"charged at most {(peak or 0) / gib:.2f} GiB of its {cap / gib:.2f} GiB cap"
              + (f" (anonymous {anon / gib:.2f} GiB)" if anon is not None else ""),
              "met" if within and ratio >= 10 and doc["steps"] == doc.get("steps_planned", doc["steps"]) > 0
              else "missed",
              "one machine: the trainers' page cache holds what they read; storage reads are the misses")]
    return lines, goals


def trainer_wall_clock_goal(doc, ok) -> list:
    """Issue 31's wall-clock goal, at expected batch 16,384 only: N = 2 trainer actors not slower than N = 1."""
    batch = doc.get("batch", 1024)
    if batch < 16384:
        return []
    by_n = {r["num_trainers"]: r for r in ok if r["label"].startswith("ray")}
    name = f"N = 2 trainer actors not slower than N = 1 (wall clock) at expected batch {batch:,}"
    if 1 not in by_n or 2 not in by_n:
        return [(name, "not measured", "not measured", "run trainer_scaling.py --trainers 1,2 --batch 16384")]
    one, two = by_n[1], by_n[2]
    ratio = two["examples_per_sec"] / one["examples_per_sec"]
    cpu = [sum(t["cpu_ms_per_step"] for t in r["trainers"]) / len(r["trainers"]) for r in (one, two)]
    reps = [r.get("repeat_step_ms_medians") or [] for r in (one, two)]
    spread, met, split = "", ratio >= 1.0, ""
    if len(reps[0]) > 1 and len(reps[0]) == len(reps[1]):  # interleaved repeats: each one's N=1 / N=2 step time
        per_repeat = [a / b for a, b in zip(*reps)]
        won = sum(x >= 1.0 for x in per_repeat)
        spread = (f"; {len(reps[0])} interleaved repeats, steps pooled; per repeat N = 1 / N = 2 step time: "
                  + ", ".join(f"{f(x)}×" for x in per_repeat))
        # met only where the pooled median and at least half of the repeats agree
        met = met and 2 * won >= len(per_repeat)
        split = f"; N = 2 not slower in {won} of {len(per_repeat)} repeats"
    if met:
        why = (f"each trainer's CPU per step {f(cpu[0])} → {f(cpu[1])} ms: at this batch the trainers' per-example "
               "work dominates the per-round overhead, so splitting it pays even with the two trainers and the "
               "shards on 2 cores")
    else:
        why = (f"each trainer's CPU per step {f(cpu[0])} → {f(cpu[1])} ms, but the two trainers and the shards "
               "share 2 cores")
    return [(name, f"N = 2: {f(two['examples_per_sec'])} examples/s against N = 1's {f(one['examples_per_sec'])} "
             f"({f(ratio)}×){spread}", "**met**" if met else "**missed**", why + split)]


def section_overhead(doc) -> tuple[list, list]:
    lines, goals = [], []
    res = [r for r in doc["results"] if "error" not in r]
    lines += [f"Timing only, no training to a result: the product configs ({', '.join(f'`{c}`' for c in doc.get('configs', []))}) "
              "as they are (their data, batch, k, optimizer, shards, backend), each in `sparse` (the config's "
              "selection), `nonprivate` and `dpsgd` mode in a fresh process; "
              f"{doc.get('warmup', '?')} warm-up steps, then the median of {doc.get('steps', '?')} steps. σ and the "
              "selection budget are fixed (a step's cost does not depend on their values), so no ε is spent or "
              "claimed here.", "",
              "| config | mode | backend | rows | batch | step ms | examples/s |", "|---|---|---|---:|---:|---:|---:|"]
    for r in res:
        lines.append(f"| `{r['config']}` | {r['mode']}{'/' + r['selection'] if r.get('selection') else ''} | {r['backend']} | "
                     f"{f(r['vocabulary_size'])} | {f(r['batch_mean'])} | {f(r['step_ms_median'])} | {f(r['examples_per_sec'])} |")
    lines.append("")
    for config, rr in doc.get("ratios", {}).items():
        by = {r["mode"]: r for r in res if r["config"] == config}
        why = ""
        if "sparse" in by and "nonprivate" in by:
            d = {p: by["sparse"]["phase_ms_median"].get(p, 0) - by["nonprivate"]["phase_ms_median"].get(p, 0)
                 for p in by["sparse"]["phase_ms_median"]}
            top = sorted(d, key=d.get, reverse=True)[:2]
            why = "largest extra phases of the private step: " + ", ".join(f"`{p}` +{f(d[p])} ms" for p in top)
        lines.append(f"- `{config}`: sparse / nonprivate throughput = **{f(rr['sparse_over_nonprivate'])}**"
                     + (f"; dpsgd / nonprivate = {f(rr['dpsgd_over_nonprivate'])}" if "dpsgd_over_nonprivate" in rr else "")
                     + (f" ({why})" if why else ""))
        goals.append((f"Privacy overhead `{config}`: sparse / nonprivate throughput ≥ 0.5", f(rr["sparse_over_nonprivate"]),
                      met(rr["met"]), why))
    return lines, goals


def section_calibration_study(doc) -> tuple[list, list]:
    """Why the private CTR models were miscalibrated (runs without train.recalibrate, measured on
    the training split) and what the private recalibration buys (runs with it)."""
    lines, goals = [], []
    runs = sorted({(r["dataset"], r.get("config", "?"), r["mode"] + ("/" + r["selection"] if r.get("selection") else ""),
                    r["target_epsilon"]) for r in doc["rows"]})
    lines += ["What runs: " + "; ".join(f"{m} on {d} (`{c}`) at target ε = {f(e)}" for d, c, m, e in runs)
              + ", each trained twice at its config's settings for that ε (steps, batch, `[by_epsilon]` row): once "
              "with `train.recalibrate = false`, once with it (the default).", "",
              "Without `train.recalibrate` (diagnosis on the **training** split; test metrics on the test split):", "",
              "| data set | mode | ε | train mean p / base rate | train Platt a, b | test AUC | test logloss | "
              "with the train-fitted Platt | base-rate logloss |", "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        d, raw = r["diagnosis"], r["raw"]["test_metrics"]
        lines.append(f"| {r['dataset']} | {r['mode']}{'/' + r['selection'] if r.get('selection') else ''} | "
                     f"{f(r['target_epsilon'])} | {d['train_mean_prediction']:.3f} / {d['train_base_rate']:.3f} | "
                     f"{d['train_platt_a']:.2f}, {d['train_platt_b']:+.2f} | {raw['auc']:.4f} | {raw['logloss']:.4f} | "
                     f"{d['test_logloss_with_train_platt']:.4f} | {d['test_base_rate_logloss']:.4f} |")
    lines += ["", "With it (the default: one noisy histogram of the training logits, Platt fitted to it, inside the "
              "same target ε):", "",
              "| data set | mode | ε | test AUC | test logloss | ECE | σ of the histogram | a, b | accountant |",
              "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["rows"]:
        rec, m = r["recalibrated"], r["recalibrated"]["test_metrics"]
        cal = rec.get("recalibration") or {}
        lines.append(f"| {r['dataset']} | {r['mode']}{'/' + r['selection'] if r.get('selection') else ''} | "
                     f"{f(r['target_epsilon'])} | {m['auc']:.4f} | {m['logloss']:.4f} | {m.get('ece', float('nan')):.4f} | "
                     f"{f(cal.get('noise_multiplier'))} | {cal.get('a', float('nan')):.2f}, {cal.get('b', float('nan')):+.2f} | "
                     f"{rec.get('accountant')} |")
        d = r["diagnosis"]
        below = d["train_mean_prediction"] < d["train_base_rate"] - 0.02
        goals.append((f"{r['dataset']} {r['mode']} ε = {f(r['target_epsilon'])}: recalibrated test logloss below the "
                      "base-rate predictor's", f"{m['logloss']:.4f} vs {d['test_base_rate_logloss']:.4f} "
                      f"(without: {r['raw']['test_metrics']['logloss']:.4f})",
                      met(m["logloss"] < d["test_base_rate_logloss"]),
                      ("clipping bias: the mean prediction on the training split is "
                       f"{d['train_mean_prediction']:.3f} against its base rate {d['train_base_rate']:.3f}; " if below else "")
                      + f"logit spread: Platt slope {d['train_platt_a']:.2f} on the training split"))
    return lines, goals


def section_communication(doc, plots, out_dir) -> tuple[list, list]:
    from widedp.trainer.release.report import pyplot, save

    lines, goals = [], []
    res = [r for r in doc["results"] if "error" not in r]
    s = doc.get("summary", {})
    lines += [f"`{doc['config']}` at p = {e10(doc['rows'])} rows (26 tables), dim {doc['dim']}, expected batch {doc['batch']}, "
              f"k = {doc['k']}; bytes of the payload arrays per step, per shard call.", "",
              "| mode | shard call | to shards / step | from shards / step |", "|---|---|---:|---:|"]
    for r in res:
        for m, b in r["bytes_per_step"].items():
            lines.append(f"| {r['mode']} | `{m}` | {fmt_bytes(b['to'])} | {fmt_bytes(b['from'])} |")
        lines.append(f"| {r['mode']} | **total** | {fmt_bytes(r['bytes_to_shards_per_step'])} | "
                     f"{fmt_bytes(r['bytes_from_shards_per_step'])} |")
    wb = s.get("write_back_bytes", {})
    if wb:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        labels = [f"{m}\n(measured)" for m in wb] + ["dense DP-SGD\n(p·D·4 B)"]
        vals = list(wb.values()) + [s["dense_write_back_bytes"]]
        ax.bar(labels, vals, color=[f"C{i}" for i in range(len(vals))])
        ax.set(yscale="log", ylabel="write-back bytes / step", title=f"write-back per step at p = {e10(doc['rows'])} rows")
        plots["write_back_bytes"] = save(fig, out_dir / "write_back_bytes.png")
    lines.append("")
    if "dense_over_sparse_write_back" in s and s["dense_over_sparse_write_back"]:
        r = s["dense_over_sparse_write_back"]
        lines.append(f"- dense write-back (p·D·4 = {fmt_bytes(s['dense_write_back_bytes'])}) / sparse write-back "
                     f"({fmt_bytes(wb.get('sparse'))}) = **{f(r)}×**; {f(s['sparse_bytes_per_row'])} B per selected row.")
        if "dpsgd" in wb:
            lines.append(f"- widedp's own dpsgd ships {fmt_bytes(wb['dpsgd'])} per step (touched rows' clipped sums + a seed; "
                         "the shards draw the noise for all their rows), i.e. it trades O(p) bytes for O(p) shard work.")
        need_k = s["dense_write_back_bytes"] / (1e4 * s["sparse_bytes_per_row"]) if s.get("sparse_bytes_per_row") else None
        goals.append((f"dense / sparse write-back ≥ 10^4 at p = {e10(doc['rows'])}", f"{f(r)}×", met(s.get("met")),
                      f"the ratio is p·D·4 / (k·(4D + 16)): it meets 10^4 only for k ≤ {f(need_k)} at this p and D"
                      if need_k else ""))
    tot = s.get("total_bytes_per_step")
    if tot:
        lines.append("- Total traffic per step (to + from): " + ", ".join(f"{m} {fmt_bytes(v)}" for m, v in tot.items())
                     + ". Most of it is the dense [B, F, D] partial pooled embeddings each shard returns and the pooled "
                       "gradient broadcast to every shard (∝ shards × batch × features × D, independent of p).")
    return lines, goals


def section_phases(doc, plots, out_dir, name: str = "phase_breakdown") -> tuple[list, list]:
    from widedp.trainer.release.report import plot_phases

    s = doc.get("summary") or {}
    if not s:
        return ["Phase breakdown failed: " + "; ".join(r.get("error", "") for r in doc["runs"].values())], []
    from phase_breakdown import PHASE_LABELS

    labels = {**doc.get("phase_labels", {}), **PHASE_LABELS}
    phases = {f"{b} ({f(s['step_ms'][b])} ms)": {labels.get(p, p): max(0.0, v[b]) for p, v in s["phases"].items()}
              for b in ("local", "ray")}
    batch = f", expected batch {doc['batch']:,}" if doc.get("batch") else ""
    plots[name] = plot_phases(phases, out_dir / f"{name}.png", title=f"sparse/{doc['selection']} step, {doc['config']}{batch}")
    lines = [f"`{doc['config']}`{' ' + ' '.join(f'`{o}`' for o in doc.get('overrides', []))}, sparse/{doc['selection']}, "
             f"median of {doc['steps']} steps after {doc['warmup']} warm-up; "
             "same config and data in-process (`local`) and on Ray actors"
             + (" (on Ray each step's write-back travels with the next step's lookup, `cluster.fold_write_back`: "
                "its shard time is in the lookup row, the write-back row holds the coordinator's part)"
                if doc.get("fold_write_back") else "") + ".", "",
             "| phase | in-process ms | Ray ms | Ray overhead ms | share of Ray step |", "|---|---:|---:|---:|---:|"]
    for p, v in s["phases"].items():
        lines.append(f"| {labels.get(p, p)} | {f(v['local'])} | {f(v['ray'])} | {f(v['ray_overhead'])} | {100 * v['share']:.0f}% |")
    lines += ["", f"- Step: in-process {f(s['step_ms']['local'])} ms, Ray {f(s['step_ms']['ray'])} ms; Ray overhead "
                  f"**{f(s['ray_overhead_ms'])} ms/step** ({100 * s['ray_overhead_share']:.0f}% of the Ray step)."]
    rounds = (doc["runs"].get("ray") or {}).get("call_timings") or {}
    if rounds:
        lines += ["", "The Ray run's rounds of calls to the shards (`RayShardGroup.record_call_timings`, medians over the "
                      "timed steps; ms after the round was sent, one machine's clock; a shard's CPU is its thread's):", "",
                  "| method | plane | rounds | first shard begins | median shard | last shard | a shard's part: wall / CPU | "
                  "parts' CPU summed | last end → answers | round |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m, r in rounds.items():
            lines.append(f"| {m} | {r['plane']} | {r['rounds']} | {f(r['start_first_ms'])} | {f(r['start_median_ms'])} | "
                         f"{f(r['start_last_ms'])} | {f(r['shard_wall_ms'])} / {f(r['shard_cpu_ms'])} | "
                         f"{f(r['shards_cpu_sum_ms'])} | {f(r['return_ms'])} | {f(r['round_ms'])} |")
        lines.append("")
    if s["ray_overhead_ms"] < 0:
        lines.append("- A negative overhead means the in-process run was slower: in-process shards run FBGEMM/OpenMP "
                     "with all torch threads in the driver, which on a busy machine spin-waits (see Notes); Ray actors "
                     "get one thread each.")
    return lines, []


MISSING = "—"  # a metric the results do not carry (written before it was measured)


def _m4(point: dict, metric: str, key: str = "median") -> str:
    v = (point["metrics"].get(metric) or {}).get(key)
    return MISSING if v is None else f"{v:.4f}"


def _plot_vs_eps(pts: list, dataset: str, metric: str, plots: dict, out_dir: Path, references: list) -> None:
    """`metric` (median over seeds, bars min–max) against target ε per (mode, selection); the
    nonprivate point and `references` ((value, label, style)) as horizontal lines."""
    from widedp.trainer.release.report import pyplot, save

    pts = [p for p in pts if (p["metrics"].get(metric) or {}).get("median") is not None]
    if not pts:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    keys = []
    for p in pts:
        k = (p["mode"], p["selection"])
        if k not in keys and p["mode"] != "nonprivate":
            keys.append(k)
    for i, (mode, sel) in enumerate(keys):
        ps = sorted([p for p in pts if (p["mode"], p["selection"]) == (mode, sel)], key=lambda p: p["target_epsilon"])
        xs = [p["target_epsilon"] for p in ps]
        ys = [p["metrics"][metric]["median"] for p in ps]
        lo = [y - p["metrics"][metric]["min"] for y, p in zip(ys, ps)]
        hi = [p["metrics"][metric]["max"] - y for y, p in zip(ys, ps)]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="-o", capsize=3, label=mode + (f"/{sel}" if sel else ""), color=f"C{i}")
    nonp = [p for p in pts if p["mode"] == "nonprivate"]
    if nonp:
        ax.axhline(nonp[0]["metrics"][metric]["median"], color="k", linestyle="--", label="nonprivate")
    for value, label, style in references:
        ax.axhline(value, color="gray", linestyle=style, label=label)
    eps_ticks = sorted({p["target_epsilon"] for p in pts if p["target_epsilon"] is not None})
    ax.set_xscale("log")
    ax.set_xticks(eps_ticks, [f(e) for e in eps_ticks])
    ax.minorticks_off()
    ax.set(xlabel="target ε (δ = 1/n)", ylabel=f"test {metric} (median over seeds; bars min–max)",
           title=f"{dataset}: test {metric} vs ε")
    ax.legend(fontsize=7)
    plots[f"{metric}_vs_eps_{dataset}"] = save(fig, out_dir / f"{metric}_vs_eps_{dataset}.png")


def _base_rate_text(pts: list) -> str:
    """The base-rate predictor's test log loss (one test split: one value) from the points, and
    what ECE is."""
    vals = sorted({round(p["metrics"]["base_rate_logloss"]["median"], 4) for p in pts
                   if (p["metrics"].get("base_rate_logloss") or {}).get("median") is not None})
    value = (f"{MISSING} (not measured: these results predate it)" if not vals else
             f"{vals[0]:.4f}" if len(vals) == 1 else f"{vals[0]:.4f}–{vals[-1]:.4f}")
    return (f"Base-rate log loss (always predicting the test split's mean label; a model's log loss must be below it): "
            f"{value}. ECE: expected calibration error over 15 equal-width probability bins, "
            "Σ_b (n_b/n)·|mean(y)_b − mean(p)_b|.")


def section_utility(doc, plots, out_dir) -> tuple[list, list]:
    lines, goals = [], []
    points = doc["points"]
    sets = [d for d in ("criteo_like", "heavytail", "ctr", "cbow") if any(p["dataset"] == d for p in points)]
    steps = {d: sorted({p["steps_median"] for p in points if p["dataset"] == d and p.get("steps_median")}) for d in sets}
    if sets:
        lines += [f"What runs: widedp's engine (Algorithm 3 at row granularity in `sparse` mode, DP-SGD in `dpsgd` "
                  f"mode, and `nonprivate`) on {', '.join(sets)}, each data set's shipped config (named below) at "
                  f"target ε ∈ {{{', '.join(f(e) for e in doc.get('eps', []))}}}, seeds {doc.get('seeds', '–')}, sparse "
                  f"selectors {', '.join(doc.get('selections', [])) or '–'} where run; steps: "
                  + "; ".join(f"{d} {', '.join(f(x) for x in steps[d])}" for d in sets)
                  + ". Each run takes its config's `[by_epsilon]` row for its ε (§9); train on the training split, "
                  "report on the test split.", ""]
    for dataset, metric, better in (("criteo_like", "auc", "max"), ("heavytail", "auc", "max"), ("ctr", "auc", "max"),
                                    ("cbow", "loss", "min")):
        pts = [p for p in points if p["dataset"] == dataset and metric in p["metrics"]]
        if not pts:
            continue
        ctr = metric == "auc"
        bayes = [(pts[0]["bayes_auc"], "Bayes AUC (planted)", ":")] if ctr and pts[0].get("bayes_auc") else []
        _plot_vs_eps(pts, dataset, metric, plots, out_dir, bayes)
        if ctr:
            base = [p["metrics"]["base_rate_logloss"]["median"] for p in pts
                    if (p["metrics"].get("base_rate_logloss") or {}).get("median") is not None]
            _plot_vs_eps(pts, dataset, "logloss", plots, out_dir,
                         [(max(base), "base-rate predictor (test mean label)", ":")] if base else [])
        settings = doc.get("settings", {}).get(dataset, {})
        extra = " test logloss median | ECE median |" if ctr else ""
        lines += [f"**{dataset}** (`{settings.get('config', '')}`{(' ' + ' '.join('`' + o + '`' for o in settings.get('overrides', []))) if settings.get('overrides') else ''}); "
                  f"seeds {doc['seeds']}.", "",
                  f"| mode | target ε | seeds | test {metric} median | min | max |{extra} steps | rows noised/step | "
                  "dpsgd/sparse rows | ε spent (rdp ledger) | ε by paper's Thm 3 |",
                  "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if ctr else "") + "---:|---:|---:|---:|---:|"]
        for p in pts:
            noised = p.get("rows_noised_median") if p["mode"] != "nonprivate" else None
            ratio = p.get("rows_noised_ratio") if p["mode"] == "sparse" else None
            cells = f" {_m4(p, 'logloss')} | {_m4(p, 'ece')} |" if ctr else ""
            lines.append(f"| {p['mode']}{'/' + p['selection'] if p['selection'] else ''} | {f(p['target_epsilon'])} | {p['seeds']} | "
                         f"{_m4(p, metric)} | {_m4(p, metric, 'min')} | {_m4(p, metric, 'max')} |{cells} {f(p['steps_median'])} | {f(noised)} | "
                         f"{f(ratio) + '×' if ratio else '–'} | {f(p['epsilon_spent_median'])} | {f(p['paper_epsilon_median'])} |")
        if ctr and pts[0].get("bayes_auc"):
            lines.append(f"\nBayes AUC of the planted model: {pts[0]['bayes_auc']:.4f}.")
        if ctr:
            lines.append(("" if pts[0].get("bayes_auc") else "\n") + _base_rate_text(pts))
        lines.append("")
    tuned = sorted({(r["dataset"], r["mode"], r["target_epsilon"], " ".join(r["tuned"]), r["tuned_from"])
                    for r in doc.get("records", []) if r.get("tuned_from")}, key=str)
    if tuned:
        lines.append("Tuned values (each sweep chose on a validation split carved from the training data; the "
                     "runs above train on the whole training split; tuning is not charged to ε):")
        lines += [f"- {d} {m} ε = {f(e)}: `{o}` (`{src}`)" for d, m, e, o, src in tuned] + [""]
    fails = [r for r in doc.get("records", []) if "error" in r]
    for r in fails:
        lines.append(f"- FAILED: {r['dataset']} {r['mode']}/{r.get('selection')} ε={r.get('target_epsilon')} seed {r['seed']}: {r['error'][:160]}")
    for dataset, g in doc.get("goals", {}).items():
        why = _UtilityReasons(doc, dataset, g["metric"], g["better"])
        for sel, c in g["sparse_vs_dpsgd"].items():
            if not c["per_epsilon"]:
                continue
            detail = "; ".join(f"ε={f(float(e))}: {v['sparse']:.4f} vs {v['dpsgd']:.4f}" for e, v in c["per_epsilon"].items())
            goals.append((f"{dataset}: sparse/{sel} {'≥' if g['better'] == 'max' else '≤'} dpsgd test {g['metric']} at every ε",
                          detail, met(c["all"]), why.versus_dpsgd(sel, c)))
        best = g.get("best_sparse_vs_dpsgd", {})
        if best.get("per_epsilon"):
            detail = "; ".join(f"ε={f(float(e))}: {v['selection']} {v['sparse']:.4f} vs {v['dpsgd']:.4f}"
                               for e, v in best["per_epsilon"].items())
            goals.append((f"{dataset}: best sparse within {best['tolerance']:g} of dpsgd test {g['metric']} at every ε",
                          detail, met(best["all"]), why.best(best)))
        em_random = g.get("em_beats_random", {})
        if "per_epsilon" in em_random:  # results written before em-count existed
            em_random = {"em": em_random}
        for em, er in em_random.items():
            detail = "; ".join(f"ε={f(float(e))}: {v['em']:.4f} vs {v['random']:.4f}" for e, v in er["per_epsilon"].items())
            goals.append((f"{dataset}: sparse/{em} beats sparse/random at every ε", detail, met(er["all"]),
                          why.em_random(em, er)))
        if dataset == "criteo_like" and best.get("per_epsilon"):
            goals.append(why.rows_noised_goal(best))
        for sel, v in g.get("gap_to_nonprivate_at_eps8", {}).items():
            goals.append((f"{dataset}: sparse/{sel} at ε = 8 within 0.01 AUC of nonprivate ({g['nonprivate']:.4f})",
                          f"gap {v['gap']:+.4f}", met(v["met"]), why.nonprivate_gap(sel, g["nonprivate"])))
        if g["metric"] == "auc":
            goals += calibration_goal_rows(doc, dataset, g.get("calibration"))
    return lines, goals


def measured(flag) -> str:
    """met / missed, or "not measured" (None: the results lack the numbers the goal needs)."""
    return "**not measured**" if flag is None else met(flag)


def calibration_goal_rows(doc: dict, dataset: str, cal: "dict | None") -> list:
    """The CTR calibration goals' rows: the JSON's `goals[dataset]["calibration"]`, or computed from
    its points (privacy_utility.calibration_goals) when the results were written before those
    goals; with the reason beside each, from the points' seed ranges, ECE and AUC."""
    if cal is None:
        from privacy_utility import calibration_goals

        cal = calibration_goals(doc["points"], dataset)
    pts = {(p["mode"], p["selection"], p["target_epsilon"]): p for p in doc["points"] if p["dataset"] == dataset}

    def metric(key, name, stat="median"):
        v = (pts[key]["metrics"].get(name) or {}).get(stat) if key in pts else None
        return None if v is None else float(v)

    def q(v, digits=4):
        return MISSING if v is None else f"{v:.{digits}f}"

    rows = []
    best = cal["best_sparse_logloss"]
    per = best["per_epsilon"]
    detail = "; ".join(f"ε={f(float(e))}: {v['selection']} {v['sparse']:.4f} vs {v['dpsgd']:.4f}" for e, v in per.items())
    why = []
    for e, v in per.items():
        s_key, d_key = ("sparse", v["selection"], float(e)), ("dpsgd", None, float(e))
        calib = ", ".join(f"{label} {q(metric(s_key, name), digits)} vs {q(metric(d_key, name), digits)}"
                          for name, label, digits in (("ece", "ECE", 3), ("auc", "AUC", 4))
                          if metric(s_key, name) is not None or metric(d_key, name) is not None)
        if v["ok"]:
            why.append(f"ε={f(float(e))}: {v['dpsgd'] + best['tolerance'] - v['sparse']:.4f} to spare"
                       + (f"; {calib}" if calib else ""))
        else:
            why.append(f"ε={f(float(e))}: short by {v['sparse'] - v['dpsgd'] - best['tolerance']:.4f} beyond the tolerance "
                       f"(seeds {q(metric(s_key, 'logloss', 'min'))}–{q(metric(s_key, 'logloss', 'max'))} vs dpsgd "
                       f"{q(metric(d_key, 'logloss', 'min'))}–{q(metric(d_key, 'logloss', 'max'))})"
                       + (f"; {calib}" if calib else ""))
    rows.append((f"{dataset}: best sparse test logloss ≤ dpsgd's + {best['tolerance']:g} at every ε", detail or MISSING,
                 measured(best["all"]), "; ".join(why) if per else "no test log loss in the results"))
    below = cal["below_base_rate"]["per_epsilon"]
    cells, why = [], []
    for e, v in below.items():
        eps = f(float(e))
        if not v["measured"]:
            cells.append(f"ε={eps}: {MISSING}")
            continue
        cells.append(f"ε={eps}: worst {v['worst']} {v['worst_logloss']:.4f} vs base rate {v['base_rate']:.4f}")
        if v["ok"]:
            why.append(f"ε={eps}: all {v['models']} below, the worst by {v['base_rate'] - v['worst_logloss']:.4f}")
        else:
            above = ", ".join(f"{k} +{ll - v['base_rate']:.4f} (ECE {q(metric(_key(k, float(e)), 'ece'), 3)})"
                              for k, ll in sorted(v["above"].items(), key=lambda kv: -kv[1]))
            why.append(f"ε={eps}: {len(v['above'])} of {v['models']} at or above: {above}")
    unmeasured = [e for e, v in below.items() if not v["measured"]]
    if unmeasured:
        why.append(f"ε={', '.join(f(float(e)) for e in unmeasured)}: not measured — the results predate "
                   "base_rate_logloss/ECE (rerunning benchmarks/privacy_utility.py re-evaluates reused runs' checkpoints)")
    rows.append((f"{dataset}: every private model's test logloss below the base-rate predictor's at every ε",
                 "; ".join(cells) or MISSING, measured(cal["below_base_rate"]["all"]),
                 "; ".join(why) or "no private points in the results"))
    return rows


def _key(label: str, eps: float) -> tuple:
    """(mode, selection, ε) of a "mode[/selection]" label."""
    mode, _, sel = label.partition("/")
    return mode, sel or None, eps


class _UtilityReasons:
    """The measured reason beside each privacy-utility goal, from the grid's own numbers: seed
    ranges (is a difference bigger than the spread?), rows noised, and for EM the per-draw ε
    against what a row's count must reach to beat the untouched rows."""

    def __init__(self, doc: dict, dataset: str, metric: str, better: str):
        self.metric, self.better = metric, better
        self.points = {(p["mode"], p["selection"], p["target_epsilon"]): p
                       for p in doc["points"] if p["dataset"] == dataset and metric in p["metrics"]}
        self.records = [r for r in doc.get("records", []) if r["dataset"] == dataset and "error" not in r]

    def _range(self, mode, sel, eps):
        m = self.points[(mode, sel, eps)]["metrics"][self.metric]
        return m["min"], m["max"]

    def _overlap(self, sel, eps) -> bool:
        (a, b), (c, d) = self._range("sparse", sel, eps), self._range("dpsgd", None, eps)
        return a <= d and c <= b

    def _short(self, v: dict, tolerance: float = 0.0) -> float:
        return (v["dpsgd"] - tolerance - v["sparse"]) if self.better == "max" else (v["sparse"] - v["dpsgd"] - tolerance)

    def versus_dpsgd(self, sel: str, c: dict) -> str:
        missed = [(float(e), v) for e, v in c["per_epsilon"].items() if not v["ok"]]
        if not missed:
            return ""
        parts = [f"ε={f(e)}: short by {self._short(v):.4f} ({'within' if self._overlap(sel, e) else 'beyond'} the seed ranges)"
                 + self._same_mechanism(sel, e) for e, v in missed]
        return "; ".join(parts)

    def _same_mechanism(self, sel, eps) -> str:
        """Where sparse noises every row (ratio 1: every table dense by the public rule) at DP-SGD's σ, the two
        modes run one mechanism and a difference between them is the noise draw, not the method."""
        point = self.points.get(("sparse", sel, eps))
        sparse, dpsgd = ({r["noise_multiplier"] for r in self.records if r["mode"] == mode and r.get("selection") == s
                          and r["target_epsilon"] == eps and r.get("noise_multiplier") is not None}
                         for mode, s in (("sparse", sel), ("dpsgd", None)))
        if point is None or point.get("rows_noised_ratio") != 1.0 or len(dpsgd) != 1 or sparse != dpsgd:
            return ""
        return (f"; every row noised by both at σ {min(dpsgd):.3g}: sparse runs DP-SGD's mechanism here "
                "(every table dense by the public rule), so the difference is the noise draw")

    def best(self, best: dict) -> str:
        parts = []
        for e, v in best["per_epsilon"].items():
            e = float(e)
            ratio = self.points[("sparse", v["selection"], e)].get("rows_noised_ratio")
            rows = f"{f(ratio)}× fewer rows noised" if ratio else ""
            if v["ok"]:
                parts.append(f"ε={f(e)}: {rows}")
            else:
                (a, b), (c, d) = self._range("sparse", v["selection"], e), self._range("dpsgd", None, e)
                parts.append(f"ε={f(e)}: short by {self._short(v, best['tolerance']):.4f} beyond the tolerance; seeds "
                             f"{a:.4f}–{b:.4f} vs dpsgd {c:.4f}–{d:.4f}; {rows}" + self._same_mechanism(v["selection"], e))
        return "; ".join(parts)

    def em_random(self, em: str, er: dict) -> str:
        parts = []
        for e, v in er["per_epsilon"].items():
            e = float(e)
            (a, b), (c, d) = self._range("sparse", em, e), self._range("sparse", "random", e)
            spread = "within" if a <= d and c <= b else "beyond"
            parts.append(f"ε={f(e)}: {v['em'] - v['random']:+.4f} ({spread} the seed ranges)")
        reason = "; ".join(parts)
        runs = [r for r in self.records if r.get("selection") == em and r.get("selection_epsilon") and r.get("k")]
        if em == "em-count" and runs:
            import math
            import statistics
            by_eps = {}
            for r in runs:
                by_eps.setdefault(r["target_epsilon"], []).append(r)
            from widedp.trainer.config import load_config

            b = load_config(runs[0]["config"], []).train.batch_size
            need, counts = [], []
            for e, rs in sorted(by_eps.items()):
                eps_draw = statistics.median(r["selection_epsilon"] for r in rs)
                k, p = rs[0]["k"], rs[0]["vocabulary_size"]
                # count utility, sensitivity 1: a row is favoured over an untouched one by e^{ε''·c/2}; it
                # beats the p - k untouched rows' Gumbel maxima only when ε''·c/2 ≳ ln(p/k)
                counts.append(2 * math.log(p / k) / eps_draw)
                need.append(f"ε={f(e)}: ε'' = {eps_draw:.3g} per draw (k = {f(k)}), count ≳ {counts[-1]:,.0f}")
            reason += (f"; a row needs about 2·ln(p/k)/ε'' of the b = {b:,} examples of a batch to stand out from the "
                       "untouched rows: " + "; ".join(need))
            if min(counts) > b:
                reason += " — more than a batch holds, so EM's choice is close to uniform"
            else:
                reason += " — only rows in that many of the batch's examples are favoured; the rest are chosen about uniformly"
        return reason

    def rows_noised_goal(self, best: dict) -> tuple:
        """Issue 10's ≥ 10³× fewer rows noised per step than dpsgd, for the best sparse point at each ε."""
        cells, ok = [], True
        for e, v in best["per_epsilon"].items():
            p = self.points[("sparse", v["selection"], float(e))]
            ratio = p.get("rows_noised_ratio") or 0.0
            ok = ok and ratio >= 1000
            cells.append(f"ε={f(float(e))}: {v['selection']} {f(ratio)}× ({f(p.get('rows_noised_median'))} rows)")
        d = next((p for k, p in self.points.items() if k[0] == "dpsgd"), None)
        allowed = d["rows_noised_median"] / 1000 if d and d.get("rows_noised_median") else None
        thr = self.points.get(("sparse", "threshold", 8.0))
        why = (f"10³× allows {f(allowed)} rows per step; the best selector noises every row of the small tables the "
               "dense policy keeps (every step) plus DP-FEST's fixed rows and the rows passing τ, together more than "
               "that" + (f"; threshold alone noises {f(thr['rows_noised_median'])} ({f(thr['rows_noised_ratio'])}×)"
                         if thr and thr.get("rows_noised_ratio") else "") if allowed else "")
        return ("criteo_like: best sparse noises ≥ 10³× fewer rows per step than dpsgd", "; ".join(cells), met(ok), why)

    def nonprivate_gap(self, sel: str, nonprivate: float) -> str:
        d = self.points.get(("dpsgd", None, 8))
        if not d:
            return ""
        gap = nonprivate - d["metrics"][self.metric]["median"]
        return f"dpsgd itself is {gap:.4f} behind nonprivate at ε = 8"


def section_tuning(doc: dict, path: Path) -> list:
    metric, better = doc["metric"], doc["better"]
    chosen_on = doc.get("chosen_on", "test")  # sweeps written before the validation split chose on test
    key = f"{chosen_on}_metrics"
    fixed = " ".join(f"`{x}`" for x in doc.get("set", []))
    seeds = f"; every point the median over train.seed {doc['seeds']}" if doc.get("seeds") else ""
    lines = [f"**{doc['name']}** (`{doc['config']}`{' ' + fixed if fixed else ''}; `{_rel(path)}`, {doc.get('created', '')}; "
             f"best point chosen on the {chosen_on} split{' (optimistic)' if chosen_on == 'test' else ''}{seeds}):", "",
             f"| point | {chosen_on} {metric} | test {metric} | other test metrics | σ | rows selected/step |",
             "|---|---:|---:|---|---:|---:|"]
    ok = [r for r in doc["records"] if metric in (r.get(key) or {})]
    ok.sort(key=lambda r: r[key][metric], reverse=(better == "max"))
    n_fixed = len(doc.get("set", []))
    for i, r in enumerate(ok):
        point = " ".join(r["overrides"][n_fixed:]) or "(config as is)"
        test = r.get("test_metrics") or {}
        others = ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != metric)
        mark = "**" if i == 0 else ""
        spread = (r.get(key.replace("metrics", "range")) or {}).get(metric)
        chosen = f"{r[key][metric]:.4f}" + (f" ({spread[0]:.4f}–{spread[1]:.4f})" if spread else "")
        lines.append(f"| {mark}{point}{mark} | {chosen} | {'–' if test.get(metric) is None else f'{test[metric]:.4f}'} | {others} | "
                     f"{f(r.get('noise_multiplier'))} | {f(r.get('rows_selected_mean'))} |")
    for r in doc["records"]:
        if "error" in r:
            lines.append(f"| {' '.join(r['overrides'][n_fixed:])} | FAILED: {r['error'][:120]} | | | | |")
    return lines + [""]


#: §9a's clip-only sweeps (σ ≈ 0: not private), by the suffix after `{dataset}_{mode}_clip_only`
CLIP_ONLY_SWEEPS = {"": "clip only (σ ≈ 0: not private) at the private lr",
                    "_nplr": "clip only (σ ≈ 0: not private) at non-private's lr"}


def gap_levers(tuning: dict, points: list) -> tuple[list, list]:
    """RESULTS §9a: the sweeps `{dataset}_{mode}_eps8_*` (benchmarks/tune.py, chosen on validation)
    against their `_eps8_levers` sweep's config-as-is point (constant lr, no EMA), and what closing
    half of the test-split gap to non-private at ε = 8 (the privacy-utility grid's medians) would
    take. `tuning`: {sweep name: doc}; `points`: privacy_utility's points (may be empty)."""
    lines: list = []
    goals: list = []
    for name, base_doc in sorted(tuning.items()):
        if not name.endswith("_eps8_levers"):
            continue
        prefix = name[: -len("levers")]
        metric = base_doc["metric"]
        base = next((r for r in base_doc["records"] if "train.lr_schedule=constant" in r["overrides"]
                     and "train.ema_decay=0" in r["overrides"] and metric in (r.get("validation_metrics") or {})), None)
        if base is None:
            continue
        ref = base["validation_metrics"][metric]
        rows = []
        clip_only = name[: -len("eps8_levers")] + "clip_only"
        for other, doc in sorted(tuning.items()):
            clip_sweep = other == clip_only or other.startswith(clip_only + "_")
            if not other.startswith(prefix) and not clip_sweep:
                continue
            ok = [r for r in doc["records"] if metric in (r.get("validation_metrics") or {})]
            if not ok:
                continue
            best = max(ok, key=lambda r: r["validation_metrics"][metric])
            fixed = [o for o in doc.get("set", []) if not o.startswith("privacy.target_epsilon")]
            point = " ".join(o for o in [*fixed, *best["overrides"][len(doc.get("set", [])):]]
                             if not o.startswith("data.validation_fraction"))
            sweep = (CLIP_ONLY_SWEEPS.get(other[len(clip_only):], "clip only " + other[len(clip_only):])
                     if clip_sweep else other[len(prefix):])
            if best.get("stopped_by_budget"):
                point += f" [stopped by the budget after {best.get('steps')} steps]"
            rows.append((sweep, point or "(config as is)", best["validation_metrics"][metric],
                         (best.get("test_metrics") or {}).get(metric)))
        dataset, mode = name.split("_")[0], name.split("_")[1]
        if not lines:
            lines += ["Which levers move a model toward non-private at ε = 8 (issue 29): each sweep chosen on the "
                      "validation split (one run per point, the same data; two runs of one point differ by ≈ 0.001 "
                      "here: every run draws fresh secret noise), against the config as it is (constant lr, no "
                      "EMA, its batch and steps) in the `_levers` sweep.", "",
                      "| data set | mode | sweep | best point | validation AUC | vs the config | test AUC |",
                      "|---|---|---|---|---:|---:|---:|"]
        for sweep, point, val, test in rows:
            lines.append(f"| {dataset} | {mode} | {sweep} | `{point}` | {val:.4f} | {val - ref:+.4f} | "
                         f"{'–' if test is None else f'{test:.4f}'} |")
        levers = sorted(((v - ref, sweep) for sweep, _, v, _ in rows if not sweep.startswith("clip only")), reverse=True)
        gain = levers[0][0]
        median = {(p["mode"], p["target_epsilon"]): p["metrics"].get(metric, {}).get("median")
                  for p in points if p.get("dataset") == dataset and p.get("selection") in (None, "fest-threshold")}
        nonprivate = next((v for (m, _), v in median.items() if m == "nonprivate"), None)
        private = median.get((mode, 8.0))
        if nonprivate is not None and private is not None:
            half = (nonprivate - private) / 2
            goals.append((f"{dataset} {mode}: a lever closes half the gap to non-private at ε = 8",
                          f"best lever {gain:+.4f} validation AUC (sweeps in §9a); half the gap {half:.4f} "
                          f"(test medians: non-private {nonprivate:.4f}, {mode} {private:.4f})", met(gain >= half),
                          "" if gain >= half else "largest: " + ", ".join(f"{sw} {d:+.4f}" for d, sw in levers[:3])
                          + "; each run's noise alone moves validation AUC by ≈ 0.001"))
    return ([""] + lines + [""] if lines else []), goals


def section_fig1(doc, plots, out_dir) -> tuple[list, list]:
    from widedp.trainer.release.report import plot_curves, pyplot, save

    lines, goals = [], []
    runs = [r for r in doc["runs"] if "error" not in r]
    st = doc["settings"]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for i, r in enumerate(runs):
        c = r["curve"]
        for ax, key in zip(axes, ("train_loss", "test_loss")):
            ax.plot(c["step"], c[key], "-", color=f"C{i}", label=r["name"])
        if r["mode"] != "nonprivate":
            axes[2].plot(c["step"], c["test_loss"], "-", color=f"C{i}", label=r["name"])
    for ax, t in zip(axes, ("train loss (fixed train subset)", "test loss (fixed test subset)",
                            "test loss, private runs (zoom)")):
        ax.set(title=t, xlabel="step")
    axes[0].set_ylabel("CBOW loss (negative sampling)")
    axes[0].legend(fontsize=7)
    plots["fig1_loss_curves"] = save(fig, out_dir / "fig1_loss_curves.png")
    series = []
    styles = {"rdp": "-", "pld": "--", "paper": ":"}
    for i, r in enumerate(runs):
        cur = r.get("epsilon_curves")
        if not cur:
            continue
        for name in ("rdp", "pld", "paper"):
            if cur.get(name) and any(v is not None for v in cur[name]):
                series.append((f"{r['name']}: {name}", cur["steps"], cur[name], {"color": f"C{i}", "linestyle": styles[name]}))
    if series:
        plots["epsilon_vs_step"] = plot_curves(series, out_dir / "epsilon_vs_step.png",
                                               title="ε vs step per accountant (Fig 1 runs; dotted: paper Thm 3)",
                                               xlabel="step", ylabel="ε", logx=True, logy=True)
    ov = dict(o.split("=", 1) for o in st.get("overrides", []) if "=" in o)
    r0 = runs[0] if runs else {}
    k_rows = next((r["k"] for r in runs if r.get("k")), None)
    epochs = st["steps"] * r0["sample_rate"] if r0.get("sample_rate") else None

    def run_eps(r):
        acc = r.get("accountants", {})
        got = [f"{f(acc[a]['epsilon'])} ({a})" for a in ("pld", "rdp") if (acc.get(a) or {}).get("epsilon") is not None]
        return f"{r['name']} {' / '.join(got)}" if got else None
    eps_text = "; ".join(e for e in (run_eps(r) for r in runs if r["mode"] != "nonprivate") if e)
    lines += [f"What runs: widedp's engine (Algorithm 3 at row granularity: pooled-window CBOW with negative sampling, "
              f"two {f(r0.get('vocabulary_size', 0) // 2)}-row tables, input and output) on a synthetic Zipf corpus, "
              f"vocab 1,000, {f(r0.get('train_examples'))} train / {f(r0.get('test_examples'))} test examples; "
              f"{f(st['steps'])} steps at expected batch {ov.get('train.batch_size', '?')} (q = {r0.get('sample_rate')}), "
              f"i.e. {f(epochs)} epochs (the paper: 20); backend {st['backend']}. The paper's other hyper-parameters: "
              f"dim {ov.get('model.embedding_dim', '?')}, {ov.get('train.optimizer', '?')} lr {ov.get('train.lr', '?')}, S1 {ov.get('privacy.clip_norm', '?')}, "
              f"S2 {ov.get('privacy.second_clip_norm', '?')}, γ {ov.get('privacy.gamma', '?')} → k = {f(k_rows)} "
              f"rows per step, S0 {ov.get('privacy.score_clip', '?')}, δ {ov.get('privacy.delta', '?')}. The runs are NOT at "
              "equal ε: the DP-SGD runs use the paper's fixed σ, the sparse runs are calibrated to the paper's sparse budget; "
              "ε spent as recorded: "
              f"{eps_text}.", "",
              "| run | steps | σ | selection ε/draw | final train loss | final test loss | ε rdp | ε pld | ε paper Thm 3 | Thm 3 conditions |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        acc = r.get("accountants", {})

        def e(n):
            v = acc.get(n, {})
            return f(v.get("epsilon")) if v.get("epsilon") is not None else ("unsupported" if "unsupported" in v else "–")
        paper = acc.get("paper", {})
        cond = "–" if not paper else ("hold" if paper.get("valid") else "violated" if "valid" in paper else
                                      "unsupported" if "unsupported" in paper else "–")
        lines.append(f"| {r['name']} | {f(r['steps'])} | {f(r['noise_multiplier'])} | {f(r.get('selection_epsilon') or None)} | "
                     f"{f(r['final_train_loss'], 4)} | {f(r['final_test_loss'], 4)} | {e('rdp')} | {e('pld')} | {e('paper')} | {cond} |")
    for r in doc["runs"]:
        if "error" in r:
            lines.append(f"| {r['name']} | FAILED: {r['error'][:120]} | | | | | | | | |")
    from paper_fig1 import ordering

    o = ordering(runs)  # from the runs' final losses in the JSON
    verdict = {True: "holds", False: "does not hold", None: "cannot be decided"}[o["holds"]]
    missing = [n for n in ("sparse em", "sparse svt", "sparse random") if n not in o["test_loss"]]
    lines.append("")
    lines.append(f"- Paper's ordering (sparse EM ≳ SVT ≫ DP-SGD, final test loss): **{verdict}** "
                 f"(EM ≤ SVT: {f(o['em_le_svt'])}; EM below the best DP-SGD: {f(o['em_beats_dpsgd'])}; "
                 f"SVT below the best DP-SGD: {f(o['svt_beats_dpsgd'])}; random below the best DP-SGD: "
                 f"{f(o['random_beats_dpsgd'])})" + (f"; missing: {', '.join(missing)}" if missing else "") + ".")
    if o.get("dpsgd_minus_em_test_loss") is not None:
        lines.append(f"- Best DP-SGD test loss {f(o['best_dpsgd_test_loss'], 4)} vs sparse EM {f(o['test_loss']['sparse em'], 4)} "
                     f"(initial loss {f(runs[0]['curve']['test_loss'][0], 4)}).")
    why = ""
    em_run = next((r for r in runs if r["name"] == "sparse em"), None)
    if em_run and em_run.get("k") and em_run.get("vocabulary_size"):
        why = (f"k = {em_run['k']} of {f(em_run['vocabulary_size'])} rows per step: each row is updated about "
               f"{f(em_run['steps'] * em_run['k'] / em_run['vocabulary_size'])} times in {f(em_run['steps'])} steps, "
               "while DP-SGD updates every row every step")
    initial = runs[0]["curve"]["test_loss"][0] if runs and runs[0].get("curve") else None
    still = [r["name"] for r in runs if r["mode"] == "sparse" and initial is not None
             and abs(r["final_test_loss"] - initial) < 0.01]
    if still:
        why = (why + "; " if why else "") + (f"{', '.join(still)} ended within 0.01 of the initial test loss "
                                             f"{f(initial, 4)}: in {f(epochs)} epochs the sparse runs did not move")
    goals.append(("Fig 1 ordering sparse EM ≳ SVT ≫ DP-SGD (our engine: pooled-window CBOW, row selection)",
                  f"test loss: EM {f(o['test_loss'].get('sparse em'), 4)}, SVT {f(o['test_loss'].get('sparse svt'), 4)}, "
                  f"best DP-SGD {f(o['best_dpsgd_test_loss'], 4)} (initial {f(initial, 4)}; {f(epochs)} epochs; "
                  f"ε not equal: {eps_text})",
                  {True: "**holds**", False: "**does not hold**", None: "undecided"}[o["holds"]], why))
    violated = {re.sub(r",? got .*", "", v) for r in runs for v in r.get("accountants", {}).get("paper", {}).get("violations", [])}
    if violated:
        lines.append("- Paper's Theorem 3 conditions violated in these runs: " + "; ".join(sorted(violated))
                     + " — so its ε is not a valid guarantee at these σ (it can come out below the tight accountants' ε).")
    return lines, goals


def plot_audit(results: list, ceiling: float, path: Path) -> str:
    """One horizontal bar per audited run: its ε lower bound, with its claimed ε as a tick
    and the most m canaries can show as a dashed line."""
    from widedp.trainer.release.report import pyplot, save

    plt = pyplot()
    labels = [f"{r['model']} {r['label']}" for r in results]
    fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.3 * len(labels)))
    colors = ["tab:red" if (r.get("broken") or r["mode"] == "nonprivate") else "tab:blue" for r in results]
    ax.barh(labels, [r["epsilon_lower_bound"] for r in results], color=colors)
    claimed = [(i, r["claimed_epsilon"]) for i, r in enumerate(results) if math.isfinite(r["claimed_epsilon"])]
    ax.scatter([c for _, c in claimed], [i for i, _ in claimed], marker="|", s=200, color="black", label="claimed ε")
    ax.axvline(ceiling, ls="--", color="gray", label=f"most m canaries can show ({ceiling:.2f})")
    ax.invert_yaxis()
    ax.set(xlabel="ε lower bound at 95% (red: non-private or broken)", title="One-run audits")
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, path)


#: Why a broken variant can stay below 1 in a one-run audit (what the white-box score of a
#: canary's row cannot see), by variant; the goal row lists those of the variants not flagged.
UNSEEN_BY_ROW_SCORE = {
    "noise-off": "noise off in sparse mode with example canaries, where a canary's row moves only when the (still "
                 "private) selection picks it (gradient canaries, whose rows the selection picks far more often, do "
                 "catch σ ÷ 10 there)",
    "every-touched-row": "a selection that adds the touched rows where the threshold already passes pure-noise rows "
                         "every step, so almost every canary row, member or not, is noised at some step (see the "
                         "non-member score quantiles)",
    "skip-untouched": "a selection that never picks an untouched row shows only through members' rows that pass it "
                      "and move; where τ lets a canary's count of 1 pass rarely (CTR's fest-threshold) one row per "
                      "canary gives too few of them (canaries with a row in every table catch it there, and gradient "
                      "canaries at τ = 1)",
}


def section_audit(doc, plots: "dict | None" = None, plot_dir: "Path | None" = None) -> tuple[list, list]:
    """benchmarks/privacy_audit.py: one-run audits of whole training runs."""
    ok = [r for r in doc["results"] if "error" not in r]
    m, frac = doc["canaries"], doc["member_fraction"]
    r_guesses = int(frac * m)
    ceiling = math.log(0.05 ** (1 / r_guesses) / (1 - 0.05 ** (1 / r_guesses))) if r_guesses else float("nan")
    lines = [f"m = {m} canaries per run (each a member with probability ½, by the audit's secret coins), each with a "
             "row of its own appended to the table of the config's first feature (unless marked otherwise); white-box score = how far the "
             f"canary's row moved in the released model; guesses: \"member\" for the {f(100 * frac)}% highest scores, "
             "abstain on the rest (fixed before any run); bound of Steinke, Nasr & Jagielski (2023) at 95% confidence, "
             f"with the run's δ. With all {r_guesses} guesses right the bound is {f(ceiling)}: no run here can show more. "
             "`widedp audit --config FILE` runs one row; `--broken` trains a broken variant. Rows marked "
             "[gradient canaries] (`--canary-kind gradient`) set each canary's pooled-output gradient to 1000·S1 "
             "along a secret direction (after clipping ≈ S1 on its own row: the strongest canary clipping allows) and "
             "score the row's movement along that direction; they run 10 steps of SGD at q ≈ ½ and σ = 5, where a "
             "final-model audit sees most (benchmarks/privacy_audit.py GRADIENT_SETTING); their sparse rows make every "
             "table sparse (at q ≈ ½ the automatic policy would noise every table densely, where no selection runs "
             "and a broken selection changes nothing) with σ_sel = 6 and either the automatic τ (an untouched canary "
             "row almost never moves) or τ = 1 (a touched row passes in about half its steps, an untouched one in a "
             "third) (GRADIENT_SPARSE). Rows marked [canary rows in every table] (`--feature all`, CTR) give each "
             "canary a row of its own in all 26 tables and nothing else, so each table's selection can give a member "
             "away; they guess 3% (fixed from a pilot run, ALL_FEATURE_MEMBER_FRACTION).", "",
             "| model | run | claimed ε | ε lower bound (95%) | correct / guesses | members | member score p10 / p50 / p90 "
             "| non-member score p10 / p50 / p90 | verdict |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]

    def q(values):
        return " / ".join(f(v) for v in values) if values else "–"

    def verdict(r):
        if r.get("broken") or r["mode"] == "nonprivate":
            return "flagged" if r["epsilon_lower_bound"] >= 1.0 else "not flagged"
        return "holds" if r["epsilon_lower_bound"] <= r["claimed_epsilon"] else "**VIOLATED**"

    for r in ok:
        lines.append(f"| {r['model']} | {r['label']} | {f(r['claimed_epsilon'])} | {f(r['epsilon_lower_bound'])} | "
                     f"{r['correct']}/{r['guesses']} | {r['members']} | {q(r['member_score_quantiles'])} | "
                     f"{q(r['non_member_score_quantiles'])} | {verdict(r)} |")
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['label']} | FAILED: {r['error'][:80]} | | | | | | |")
    if plots is not None and plot_dir is not None and ok:
        plots["privacy_audit"] = plot_audit(ok, ceiling, plot_dir / "privacy_audit.png")
    private = [r for r in ok if r["mode"] != "nonprivate" and not r.get("broken")]
    exposed = [r for r in ok if r["mode"] == "nonprivate" or r.get("broken")]
    worst = max(private, key=lambda r: r["epsilon_lower_bound"] - r["claimed_epsilon"], default=None)
    held = all(r["epsilon_lower_bound"] <= r["claimed_epsilon"] for r in private)
    missed = [f"{r['model']} {r['label']}" for r in exposed if r["epsilon_lower_bound"] < 1.0]
    goals = [("One-run ε lower bound ≤ claimed ε for every private mode and selector",
              f"{len(private)} runs; largest bound {f(worst['epsilon_lower_bound'])} ({worst['model']} {worst['label']}, "
              f"claimed {f(worst['claimed_epsilon'])})" if worst else "not measured",
              "**met**" if private and held else "**missed**", f"m = {m}"),
             ("Non-private and broken runs: one-run ε lower bound ≥ 1 at 95% confidence",
              f"{len(exposed) - len(missed)} of {len(exposed)} flagged" + (f"; not flagged: {', '.join(missed)}" if missed else ""),
              "**met**" if exposed and not missed else "**missed**",
              "what the white-box row score cannot see stays below 1: "
              + "; ".join(why for variant, why in UNSEEN_BY_ROW_SCORE.items()
                          if any(label.endswith(f"BROKEN {variant}") or f"BROKEN {variant} " in label
                                 for label in missed)) if missed
              else f"m = {m}")]
    variants: dict = {}
    for r in exposed:
        if r.get("broken"):
            variants.setdefault((r["model"], r["mode"], r["broken"]), []).append(r)
    uncaught = [f"{model} {mode} {broken}" for (model, mode, broken), rs in variants.items()
                if all(r["epsilon_lower_bound"] < 1.0 for r in rs)]
    if variants:
        goals.append(("Every broken variant flagged (bound ≥ 1) by example or gradient canaries, per model and mode",
                      f"{len(variants) - len(uncaught)} of {len(variants)} caught"
                      + (f"; by neither: {', '.join(uncaught)}" if uncaught else ""),
                      "**met**" if not uncaught else "**missed**",
                      "gradient canaries put ≈ S1 on the canary's row each time it is sampled, so its row is selected "
                      "and moves far more often than an example canary's" + (
                          "; a count-based selection ignores that size, so skip-untouched needs a τ a count of 1 passes"
                          if any("skip-untouched" in u for u in uncaught) else "")))
    return lines, goals


def plot_exposure_ranks(results: list, references: int, path: Path, title: str) -> str:
    """Histograms of the canaries' ranks, one panel per n_c, one line per mode: uniform is flat."""
    from widedp.trainer.release.report import pyplot, save

    plt = pyplot()
    insertions = sorted({r["insertions"] for r in results})
    fig, axes = plt.subplots(1, len(insertions), figsize=(4.0 * len(insertions), 3.2), squeeze=False)
    edges = [1 + references * i / 20 for i in range(21)]
    for ax, n_c in zip(axes[0], insertions):
        for r in (r for r in results if r["insertions"] == n_c):
            ax.hist(r["ranks"], bins=edges, histtype="step", linewidth=1.5, label=f"{exposure_label(r)} (p {r['p_value']:.1g})")
        ax.axhline(len(results[0]["ranks"]) / 20, ls="--", color="gray", linewidth=1)
        ax.set(title=f"n_c = {n_c}", xlabel="rank among random phrases", ylabel="canaries")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


#: benchmarks/canary_exposure.py's modes as RESULTS names them: whose method each row is.
EXPOSURE_LABELS = {"nonprivate": "non-private", "dpsgd": "DP-SGD", "alg3-em": "Alg 3 + EM (seed)"}


def exposure_label(r: dict) -> str:
    """A row's label: our sparse mode says its selector and that it is ours (not the seed's
    Algorithm 3); the seed's Alg 3 + EM rows say so; a sparse row without a recorded selector
    stays "sparse"."""
    if r["mode"] == "sparse":
        return f"sparse ({r['selection']}, ours)" if r.get("selection") else "sparse"
    return EXPOSURE_LABELS.get(r["mode"], r["mode"])


def _low_rank_count(r: dict, references: int) -> "int | None":
    """Canaries in the lowest twentieth of ranks (the most exposed bin of the χ² test, 5% under
    uniform ranks)."""
    ranks = r.get("ranks")
    return None if not ranks else sum(1 for x in ranks if x < 1 + references / 20)


def _binomial_tail(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p), exactly."""
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(max(k, 0), n + 1)))


def _sibling_exposure(doc, name: str) -> "dict | None":
    """Another canary_exposure results file beside this one (for comparing corpora), or None."""
    path = doc.get("_path")
    other = Path(path).parent / f"{name}.json" if path else None
    if other is None or not other.exists() or Path(path).name == other.name:
        return None
    try:
        return json.loads(other.read_text())
    except ValueError:
        return None


def _exposure_counts_line(r: dict) -> str:
    c = r["counts"]
    return (f"n_c = {r['insertions']}: {f(c['examples_per_phrase'])} examples per phrase ({r['insertions']} × "
            f"{c['examples_per_insertion']}) among n = {f(c['n'])} (share {c['phrase_share']:.2g}); each example "
            f"sampled T·q = {f(c['steps'])} × {c['sample_rate']:.3g} = {f(c['expected_samples_per_example'])} times, "
            f"so ≈ {f(c['expected_sampled_examples_per_phrase'])} of the phrase's example gradients among "
            f"{f(c['examples_sampled_total'])} sampled in training" + (f" ({c['note']})" if c.get("note") else ""))


def _exposure_unflagged_nonprivate(doc, ok: list) -> list:
    """For each non-private row that is not flagged: why, from the run's own numbers — how often
    its canary examples were seen and what share of the training they are, against the non-private
    rows that are flagged (here and, if beside, in the synthetic run), and the ranks' lowest bin."""
    refs = doc["references"]
    nonprivate = [r for r in ok if r["mode"] == "nonprivate"]
    out = []
    for r in (r for r in nonprivate if not r["flagged"]):
        if "counts" not in r:
            out.append(f"- Non-private at n_c = {r['insertions']} is not flagged (p {r['p_value']:.2g}); this file "
                       "records no counts of how often the canaries were seen (rerun the benchmark).")
            continue
        flagged = [x for x in nonprivate if x["flagged"] and "counts" in x]
        other_doc = _sibling_exposure(doc, "canary_exposure") if "kjv" in doc["benchmark"] else None
        other = [] if other_doc is None or other_doc.get("placement", "line") != doc.get("placement", "line") else [
            x for x in other_doc.get("results", []) if x.get("mode") == "nonprivate" and "error" not in x
            and x.get("counts") and x["insertions"] == r["insertions"]]
        low = _low_rank_count(r, refs)
        lines = [f"- **Why non-private is not flagged at n_c = {r['insertions']}** (p {r['p_value']:.2g}): "
                 + _exposure_counts_line(r) + "."]
        if flagged:
            smallest = min(flagged, key=lambda x: x["counts"]["phrase_share"])
            lines.append(f"  In this run non-private is flagged from n_c = {smallest['insertions']} on (p "
                         f"{smallest['p_value']:.2g}): " + _exposure_counts_line(smallest) + f" — "
                         f"{smallest['counts']['phrase_share'] / r['counts']['phrase_share']:.3g}× the share.")
        for x in other:
            assert other_doc is not None
            lines.append(f"  The synthetic corpus (`{other_doc['benchmark']}.json`, same placement) at n_c = "
                         f"{x['insertions']}, where non-private is {'flagged' if x['flagged'] else 'not flagged'} (p "
                         f"{x['p_value']:.2g}): n = {f(x['counts']['n'])} (corpus {f(x['counts']['corpus_examples'])} "
                         f"examples against {f(r['counts']['corpus_examples'])} here), share "
                         f"{x['counts']['phrase_share']:.2g} ({x['counts']['phrase_share'] / r['counts']['phrase_share']:.3g}× "
                         f"this row's), each example sampled {f(x['counts']['expected_samples_per_example'])} times.")
        if low is not None:
            lines.append(f"  Its ranks: {low} of {len(r['ranks'])} canaries in the lowest twentieth (uniform: "
                         f"{len(r['ranks']) / 20:.0f} ± {math.sqrt(len(r['ranks']) * 0.05 * 0.95):.1f}), mean exposure "
                         f"{f(r['mean_exposure'])} bits (uniform ranks: ≈ 1/ln 2 = {f(1 / math.log(2))}); that bin "
                         f"alone, one-sided binomial, p = {_binomial_tail(low, len(r['ranks']), 0.05):.2g} (a post-hoc "
                         "look, not the χ² test over all 20 bins, which spreads the excess over 19 degrees of freedom).")
        shares = [x["counts"]["phrase_share"] for x in [*flagged, *other] if x["flagged"]]
        if shares and min(shares) > r["counts"]["phrase_share"]:
            lines.append(f"  Every flagged non-private run above gives a phrase a larger share of the training examples "
                         f"(≥ {min(shares) / r['counts']['phrase_share']:.3g}× this row's {r['counts']['phrase_share']:.2g}): "
                         "at this share the memorization shifts the ranks by less than the χ² test resolves at p < 0.01 "
                         "with these canaries (a test's miss, not a guarantee).")
        elif shares:
            lines.append("  A flagged non-private run above has no larger share than this row: the share alone does not "
                         "explain the miss.")
        out += lines
    return out


def _exposure_seed_differences(doc, seed_rows: list) -> list:
    """The seed's Alg 3 + EM setting against this run's, every difference listed from the row's
    recorded settings and counts."""
    r = seed_rows[0]
    s, c, ps, sa = r["seed_alg3"]["seed_settings"], r["counts"], r["privacy_settings"], r["seed_alg3"]
    eps = "; ".join(f"n_c {x['insertions']}: ε'' = {x['seed_alg3']['selection_epsilon']:.3g} per draw, ledger ε "
                    f"{f(x['claimed_epsilon'])} at δ = {x['delta']:.2g} after {f(x['steps'])} steps (the noise alone "
                    f"{f(x['seed_alg3']['noise_alone_epsilon'])}, the selection alone "
                    f"{f(x['seed_alg3']['selection_alone_epsilon'])}; the seed's selection share, ε = "
                    f"{s['selection_share_epsilon']:g} for the selection alone, would be ε'' = "
                    f"{x['seed_alg3']['share_selection_epsilon']:.3g} and ε {f(x['seed_alg3']['share_total_epsilon'])} "
                    "in all)" for x in seed_rows)
    seed_steps = s["epochs"] * s["train_examples"] // s["batch_size"]
    return [
        f"**Alg 3 + EM (seed)** — the seed's Algorithm 3 with the exponential-mechanism selection (Alg 4) at its §6 "
        f"hyper-parameters where our config has them: `train.selection = em`, σ = {ps['noise_multiplier']} "
        f"(`privacy.noise_multiplier`; seed: \"by Theorem 3, we set σ = 0.5\", the same σ in §6.5), γ = {ps['gamma']} "
        f"(k = ⌊γ·rows⌋ = {sa['k']} of {f(sa['selectable_rows'])} rows per step; both tables selected, none noised "
        f"densely), S1 = {ps['clip_norm']}, S2 = {ps['second_clip_norm']}, S0 = {ps['score_clip']} "
        f"(`privacy.score_clip`), the seed's total ε = {s['target_epsilon']:g} as the run's budget "
        f"(`privacy.target_epsilon`). The seed splits ε = {s['target_epsilon']:g}, δ = {s['delta']:g} into ε "
        f"{s['noise_share_epsilon']:g} for the noise and {s['selection_share_epsilon']:g} for the selection through its "
        "Theorem 3, which amplifies each part by q separately and linearly; our ledger charges each step as one "
        "Poisson-sampled composition of the selection and the noise (plus the data set's one-time events), so the "
        f"selection's per-draw ε'' is the largest whose steps spend at most ε = {s['target_epsilon']:g} at our δ "
        "in all, and the claimed ε is what the run's ledger spent: " + eps + ".",
        "",
        "Differences from the seed's setting (Alg 3 + EM rows; the DP-SGD and fest-threshold rows are ours throughout):",
        "",
        f"- Model: our CBOW with negative sampling, two {f(sa['selectable_rows'] // 2)}-row tables (input and output) of "
        "dimension 100 — the seed counts one 1K × 100 table (100K parameters).",
        f"- Corpus: {doc.get('corpus', 'the config')} ({f(c['corpus_examples'])} training examples, window "
        f"{c['window']}) — seed: {s['corpus']}, {f(s['train_examples'])} training examples.",
        f"- Steps, batch, optimizer: T = {f(c['steps'])} at expected batch b = {c['batch_size']} (each example sampled "
        f"T·q = {f(c['expected_samples_per_example'])} times), {c['optimizer']} lr {f(c['lr'])} (the other rows' "
        f"settings) — seed: {s['epochs']} epochs at b = {s['batch_size']} (≈ {f(seed_steps)} steps), "
        f"{s['optimizer']} lr {s['lr']:g}. With k = {sa['k']}, each row is selected T·k/rows = "
        f"{f(sa['expected_selections_per_row'])} times in the whole run.",
        "- Selection granularity: whole rows, utility min(‖G_r‖, S0) of a row's averaged gradient, k draws without "
        "replacement — seed: single coordinates |ĝ(j)| clipped to S0, ⌊γp⌋ = 100 coordinate draws (one row's worth).",
        f"- σ and S2: our σ multiplies the step's ℓ2 sensitivity min(S1/b, 2·S2) on the average; the seed's noise is "
        f"σ·min(S1/b, S2), with S2 binding at its b = {s['batch_size']} (S1/b = {s['clip_norm'] / s['batch_size']:g} > "
        f"S2); at b = {c['batch_size']}, S1/b = {ps['clip_norm'] / c['batch_size']:.3g} < 2·S2, so S2 does not bind.",
        f"- ε and δ: the seed's ε = {s['target_epsilon']:g} is its Theorem 3 bound at δ = {s['delta']:g}; ours is the "
        "ledger's (Rényi for the exponential mechanism, composed with the noise inside each sampled step) at our "
        "δ = min(0.1/n, n^-1.1), with the selection given what σ = 0.5 leaves of ε = 30 rather than the seed's 10.",
        "- The seed's DP-SGD canary runs use σ = 0.5 too; our DP-SGD rows are calibrated to ε = 8.",
    ]


def _exposure_seed_not_a_goal(seed_rows: list) -> str:
    """Why the seed's Alg 3 + EM rows are no goal: as run, the model barely trained (each example
    sampled ~T·q times, each row selected T·k/rows times, no utility recorded), so not being
    flagged cannot fail. Every number from the rows."""
    pv = ", ".join(f"n_c = {r['insertions']}: p {r['p_value']:.2g} ({'flagged' if r['flagged'] else 'not flagged'})"
                   for r in seed_rows)
    run = next((r for r in seed_rows if r.get("counts") and r.get("seed_alg3")), None)
    trained = ""
    if run is not None:
        c, sa = run["counts"], run["seed_alg3"]
        trained = (f" The audited model barely trained: T = {f(c['steps'])} steps at expected batch {c['batch_size']} "
                   f"sample each training example T·q = {f(c['expected_samples_per_example'])} times (about "
                   f"{f(c['expected_samples_per_example'])} epochs; the seed: {sa['seed_settings']['epochs']}), and with "
                   f"k = {sa['k']} of {f(sa['selectable_rows'])} rows per step each row is selected T·k/rows = "
                   f"{f(sa['expected_selections_per_row'])} times in the whole run; no utility (loss) of the model is "
                   "recorded.")
    return (f"**Alg 3 + EM (seed) is reported, not a goal.** Its rows: {pv} (seed Table 2: p .85 and .68 at "
            f"n_c = 3 and 9, .00 (flagged) at n_c = 15).{trained} With so few updates per row the model holds little of "
            "any phrase, and nothing recorded shows it learnt at all; so \"not flagged\" says nothing about the "
            "algorithm's privacy here: the row could not fail as run" + (
                " (it passes at n_c = 15 too, where the seed's DP Sparse is flagged)."
                if any(r["insertions"] == 15 and not r["flagged"] for r in seed_rows) else "."))


def section_exposure(doc, plots: "dict | None" = None, plot_dir: "Path | None" = None) -> tuple[list, list]:
    """benchmarks/canary_exposure.py: the seed's canary exposure test (§6.5, Table 2)."""
    ok = [r for r in doc["results"] if "error" not in r]
    with_ranks = [r for r in ok if r.get("ranks")]
    if plots is not None and plot_dir is not None and with_ranks:
        plots[doc["benchmark"]] = plot_exposure_ranks(with_ranks, doc["references"], plot_dir / f"{doc['benchmark']}.png",
                                                      f"canary ranks, corpus: {doc.get('corpus', 'the config')}")
    placement = doc.get("placement", "line")
    how = ("into the running text between corpus words (the seed's placement: each insertion gives the 2·window + 3 "
           "CBOW examples within reach of the phrase, their contexts mixing its words with the corpus's)"
           if placement == "text" else "as a line of its own (three CBOW examples per insertion, each context the "
           "phrase's other two words: the most an example can memorize of it)")
    ours = sorted({exposure_label(r) for r in ok if r["mode"] == "sparse"})
    seed_rows = [r for r in ok if r["mode"] == "alg3-em" and r.get("seed_alg3") and r.get("counts")]
    lines = [f"`{doc['config']}`, corpus: {doc.get('corpus', 'the config')}; {doc['canaries']:,} random 3-word canary "
             f"phrases, each inserted n_c times {how}; each phrase's log-perplexity ranked among {doc['references']:,} random phrases; "
             "Pearson's χ² of the ranks against uniform (flagged: p < 0.01); exposure in bits (at most "
             f"{f(math.log2(doc['references'] + 1))}). Seed Table 2: non-private p ≈ 0.00; DP-SGD and sparse p ≥ 0.31 at "
             "n_c ≤ 9; sparse p ≈ 0.00 at n_c = 15 (the seed's \"DP Sparse\" is its Algorithm 3 with the exponential "
             "mechanism, σ = 0.5).", ""]
    if ours:
        lines += [f"{', '.join(ours)}: OUR sparse mode (`{doc['config']}`'s selection, DP-FEST's fixed frequent rows ∪ "
                  "Gaussian thresholding where it is fest-threshold, calibrated to the config's ε = 8, clip S1 = 1) — "
                  "not the seed's Algorithm 3 + EM." + (" The seed's algorithm is the Alg 3 + EM (seed) rows." if seed_rows
                                                         else " The seed's algorithm was not run in this file."), ""]
    if seed_rows:
        lines += _exposure_seed_differences(doc, seed_rows) + [""]
    lines += ["| n_c | mode | claimed ε | χ² p-value | flagged | mean exposure (bits) | median exposure |",
              "|---:|---|---:|---:|---|---:|---:|"]
    order = {m: i for i, m in enumerate(("nonprivate", "dpsgd", "sparse", "alg3-em"))}
    for r in sorted(ok, key=lambda r: (r["insertions"], order.get(r["mode"], len(order)), r["mode"])):
        lines.append(f"| {r['insertions']} | {exposure_label(r)} | {f(r['claimed_epsilon'])} | {r['p_value']:.2g} | "
                     f"{'yes' if r['flagged'] else 'no'} | {f(r['mean_exposure'])} | {f(r['median_exposure'])} |")
    for r in doc["results"]:
        if "error" in r:
            lines.append(f"| {r['insertions']} | {exposure_label(r)} | FAILED: {r['error'][:80]} | | | | |")
    if isinstance(doc.get("merged"), dict) and doc["merged"].get("counts_added"):
        lines += ["", f"The rows not rerun ({doc['merged'].get('other_rows_created')}): {doc['merged']['counts_added']} "
                      "(no training)."]
    if doc.get("counts_added"):
        lines += ["", f"Rows' counts of how often the canaries were seen: {doc['counts_added']}."]
    if isinstance(doc.get("merged"), dict) and doc["merged"].get("not_run"):
        lines += ["", "Not measured: " + "; ".join(doc["merged"]["not_run"]) + "."]
    why = _exposure_unflagged_nonprivate(doc, ok)
    if why:
        lines += [""] + why
    nonprivate = [r for r in ok if r["mode"] == "nonprivate"]
    private_small = [r for r in ok if r["mode"] != "nonprivate" and r["insertions"] <= 9 and r["claimed_epsilon"] <= 8 + 1e-6]
    corpus = (" (real text" if "kjv" in doc["benchmark"] else " (synthetic") + f", placement {placement})"
    goals = [(f"Canary exposure{corpus}: non-private flagged (p < 0.01) at every n_c",
              ", ".join(f"n_c {r['insertions']}: p {r['p_value']:.2g}" for r in nonprivate) or "not measured",
              "**met**" if nonprivate and all(r["flagged"] for r in nonprivate) else "**missed**",
              "not flagged: see the counts under the table" if any(not r["flagged"] for r in nonprivate) else ""),
             (f"Canary exposure{corpus}: DP runs at ε ≤ 8 not flagged at n_c ≤ 9",
              ", ".join(f"{exposure_label(r)} n_c {r['insertions']}: p {r['p_value']:.2g}" for r in private_small)
              or "not measured",
              "**met**" if private_small and not any(r["flagged"] for r in private_small) else "**missed**",
              f"a phrase inserted n_c times is a group of {'(2·window + 3)' if placement == 'text' else '3'}·n_c "
              "examples; the example-level ε bounds it only by group privacy (seed §6.5)")]
    seed_all = sorted((r for r in ok if r["mode"] == "alg3-em"), key=lambda r: r["insertions"])
    if seed_all:
        lines += ["", _exposure_seed_not_a_goal(seed_all)]
    return lines, goals


# ---- the document ---------------------------------------------------------------------------------

def _own_section(name: str, plot_dir: Path):
    """The section a benchmark script renders itself: its `results_section(doc[, plot_dir])`
    (plot_dir passed to those that make plots)."""
    def section(doc):
        fn = importlib.import_module(name).results_section
        return fn(doc, plot_dir) if len(inspect.signature(fn).parameters) > 1 else fn(doc)
    return section


def section_slug(title: str) -> str:
    """The file name of a section's page: docs/results/<slug>.md ("2b-dlrm-style-ctr-step-...")."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return slug[:64].rstrip("-")


def _render_sections(sections: list, docs: dict, plots: dict, machines: dict) -> tuple[list, list]:
    """Each section's page ((title, markdown lines) each) and the goal rows of `sections`
    ((name, title, fn, plot keys) each); records each document's machine line in `machines`."""
    pages: list = []
    goals: list = []
    for name, title, fn, plot_keys in sections:
        body: list = []
        doc = docs.get(name)
        if doc is None:
            script, extra = RUN_VARIANTS.get(name, (f"{name}.py", []))
            body += [f"Not run yet: `python benchmarks/{' '.join([script, *extra])}` writes "
                     f"`benchmarks/results/{name}.json`.", ""]
            pages.append((title, body))
            continue
        machine = doc.get("machine") or {}
        if machine:
            machines.setdefault(machine_line(machine, load=False), []).append(name)
        src = _rel(doc["_path"])
        made = [f"{'**--quick run** (small sizes, few steps)' if doc.get('quick') else 'full run'}",
                *([doc["created"]] if doc.get("created") else []), *([f"`{doc['command']}`"] if doc.get("command") else [])]
        body += [f"Source: `{src}` — " + ", ".join(made)
                 + (f", {f(doc['wall_seconds'])} s" if doc.get("wall_seconds") else "")
                 + (f"; load average {f(machine.get('load_average_start', [None])[0])} → "
                    f"{f((machine.get('load_average_end') or [None])[0])}." if machine else "; no machine recorded.")
                 + (f" Only these rows ran in that command: {', '.join(sorted(doc['merged']['rerun']))}; the others "
                    f"come from the run of {doc['merged']['other_rows_created']}." if doc.get("merged") else ""), ""]
        lines, g = fn(doc)
        body += lines + [""]
        for key in plot_keys:
            if key in plots:
                body.append(f"![{key}](../plots/{Path(plots[key]).name})")
        body.append("")
        pages.append((title, body))
        goals += [(t, m, ok, why, name, title) for t, m, ok, why in g]
    return pages, goals


def read_rendered(summary: Path) -> str:
    """The summary page and every section page, as one text (for readers that search them all)."""
    pages = sorted((summary.parent / "results").glob("*.md")) if (summary.parent / "results").is_dir() else []
    return "\n".join([summary.read_text(), *(p.read_text() for p in pages)])


def _utility_and_fig1_notes(docs: dict) -> list:
    """The Notes' lines on privacy-utility and Fig 1, every number read from the results."""
    out = []
    pu = docs.get("privacy_utility")
    if pu:
        private = [r for r in pu.get("records", []) if r.get("target_epsilon") is not None and "error" not in r]
        own = [r for r in private if r.get("tuned_for_epsilon") == r["target_epsilon"]]
        eps = sorted({r["target_epsilon"] for r in private})
        tuning = ("hyper-parameters are set per ε, not tuned once at ε = 8: each private run takes its config's "
                  "`[by_epsilon]` row for its target ε (learning rates chosen per ε by `benchmarks/tune.py` sweeps on "
                  f"a validation split, §9; each config's comments name its sweeps): {len(own)} of {len(private)} "
                  f"private runs record `tuned_for_epsilon` equal to their target ε (ε ∈ "
                  f"{', '.join(f(e) for e in eps)})") if private else "no private runs recorded"
        out.append(f"- Privacy-utility: {tuning}. EM and SVT score a row by min(‖G_r‖, S0) with ℓ∞ sensitivity "
                   "min(S1/b, S0) (one example moves a row's clipped, b-normalized gradient sum by at most S1/b, and "
                   "the score by at most S0; `widedp/selection/registry.py` `norm_utilities`); with k draws per step "
                   "the per-draw ε is so small that a hot row's score is worth only a fraction of a nat, so they select "
                   "about as well as random selection does" + _em_vs_uniform(docs.get("paper_fig1_seed")) + ". Gaussian "
                   "thresholding scores a row by its (ℓ2-clipped) number of contributing examples, which picks the hot "
                   "rows far better. Our reading of sparse trailing DP-SGD at ε ≥ 3 (not separately measured): "
                   "DP-SGD's noise on untouched rows costs little test utility here (rarely seen ids carry little of "
                   "the metric), while a touched row that the selection misses gets no update at all.")
    fig = docs.get("paper_fig1")
    if fig:
        runs = [r for r in fig["runs"] if "error" not in r]
        ov = dict(o.split("=", 1) for o in fig["settings"].get("overrides", []) if "=" in o)
        rows = next((r["vocabulary_size"] for r in runs if r.get("vocabulary_size")), None)
        k = next((r["k"] for r in runs if r.get("k")), None)
        dim = int(ov["model.embedding_dim"]) if "model.embedding_dim" in ov else None
        seed = (docs.get("paper_fig1_seed") or {}).get("settings", {})
        paper = (f"the paper's p is one table of 1K × 100 = {f(seed['p'])} coordinates, so γp = {f(seed['k'])} "
                 "coordinates per step (§7a runs that)") if seed.get("p") else "the paper's p is one 1K × 100 table"
        per_step = f(k * dim) if k and dim else "–"
        sample = next((r["sample_rate"] for r in runs if r.get("sample_rate")), None)
        epochs = f(fig["settings"]["steps"] * sample) if sample else "–"
        out.append(f"- Fig 1 (§7): the paper selects coordinates, widedp whole rows: γ = {ov.get('privacy.gamma', '?')} "
                   f"of p = {f(rows)} rows (two tables, input and output) = {f(k)} rows = {per_step} coordinates per "
                   f"step; {paper}. EM/SVT score rows by min(‖G_r‖, S0), sensitivity min(S1/b, S0). Sparse runs spend "
                   "ε = 30 split 2:1 between noise and selection by widedp's calibration (tight RDP accountant) "
                   f"instead of the paper's σ = 0.5; {f(fig['settings']['steps'])} steps = {epochs} epochs (the "
                   "paper: 20); the synthetic corpus replaces the Brown corpus.")
    return out


def _em_vs_uniform(seed_doc) -> str:
    """', as §7a measures: ...' from paper_fig1_seed's EM diagnostics (first corpus), or ''."""
    for corpus in (seed_doc or {}).get("corpora", [])[:1]:
        em = next((r for r in corpus["runs"] if r.get("method") == "em" and r.get("diagnostics")), None)
        d = (em or {}).get("diagnostics", {})
        if d.get("selected_touched_fraction") is not None and d.get("touched_fraction_of_p") is not None:
            return (f" (§7a, {corpus['name']} corpus: {100 * d['selected_touched_fraction']:.2f}% of EM's selected "
                    f"coordinates had a nonzero gradient, against {100 * d['touched_fraction_of_p']:.2f}% for uniform "
                    "selection)")
    return ""


def render(results_dir: Path, out_dir: Path, prefer: str = "full") -> Path:
    docs = load_results(results_dir, prefer)
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots: dict = {}
    compiled_rounds = {int(d["batch"]): d for name, d in docs.items()
                       if name.startswith("phase_breakdown_compiled") and d.get("batch")}
    sections = [
        ("table_scaling", "1. Step time versus table size", lambda d: section_scaling(d, plots, plot_dir),
         ["step_time_vs_rows"]),
        ("opacus_compare", "2. Against Opacus DP-SGD (CBOW)", lambda d: section_opacus(d, plots, plot_dir),
         ["throughput_vs_opacus"]),
        ("dlrm_compare", "2b. DLRM-style CTR step: plain PyTorch, Opacus, widedp",
         lambda d: section_dlrm(d, compiled_rounds), []),
        ("trainer_scaling", "2c. Data-parallel trainer actors on a multi-node Ray cluster", section_trainers, []),
        ("trainer_scaling_16k", "2c (b = 16k). Data-parallel trainer actors at expected batch 16,384",
         section_trainers, []),
        ("coordinator_scaling", "2c′. The coordinator's CPU against the number of trainers (partitioned data, "
         "dense part reduced among the trainers)", section_coordinator_scaling, []),
        ("partitioned_dry_run", "2c″. A data set larger than the coordinator's memory, read by the trainers",
         section_partitioned_dry_run, []),
        *[(f"ray_batch_{b}", f"2d. The Ray data planes at a DP batch size: expected batch {b:,}",
           lambda d: section_dlrm(d, compiled_rounds), [])
          for b in RAY_BATCHES],
        ("cluster_model", "2e. A model of many machines, checked on a loopback cluster",
         _own_section("cluster_model", plot_dir), []),
        ("data_plane_probe", "2f. The per-step data plane: ordinary calls, a compiled graph, torch.distributed (gloo)",
         _own_section("data_plane_probe", plot_dir), []),
        ("privacy_overhead", "3. Privacy overhead (sparse vs non-private)", section_overhead, []),
        ("communication", "4. Communication", lambda d: section_communication(d, plots, plot_dir), ["write_back_bytes"]),
        ("phase_breakdown", "5. Where the time of a sparse step goes", lambda d: section_phases(d, plots, plot_dir),
         ["phase_breakdown"]),
        ("phase_breakdown_16k", "5 (b = 16k). Where the time of a sparse step goes at expected batch 16,384",
         lambda d: section_phases(d, plots, plot_dir, "phase_breakdown_16k"), ["phase_breakdown_16k"]),
        ("phase_breakdown_compiled_1k", "5 (compiled, b = 1k). The step over the compiled data plane, expected batch 1,024",
         lambda d: section_phases(d, plots, plot_dir, "phase_breakdown_compiled_1k"), ["phase_breakdown_compiled_1k"]),
        ("phase_breakdown_compiled_4k", "5 (compiled, b = 4k). The step over the compiled data plane, expected batch 4,096",
         lambda d: section_phases(d, plots, plot_dir, "phase_breakdown_compiled_4k"), ["phase_breakdown_compiled_4k"]),
        ("phase_breakdown_compiled_16k", "5 (compiled, b = 16k). The step over the compiled data plane, expected batch 16,384",
         lambda d: section_phases(d, plots, plot_dir, "phase_breakdown_compiled_16k"), ["phase_breakdown_compiled_16k"]),
        ("privacy_utility", "6. Privacy-utility", lambda d: section_utility(d, plots, plot_dir),
         ["auc_vs_eps_criteo_like", "logloss_vs_eps_criteo_like", "auc_vs_eps_heavytail", "logloss_vs_eps_heavytail",
          "auc_vs_eps_ctr", "logloss_vs_eps_ctr", "loss_vs_eps_cbow"]),
        ("calibration_study", "6b. Why the private CTR models were miscalibrated, and the recalibration",
         section_calibration_study, []),
        ("cbow_large", "6c. CBOW on a large vocabulary (50,000 words): sparse against DP-SGD",
         _own_section("text_large", plot_dir), []),
        ("paper_fig1", "7. The seed's Fig 1 hyper-parameters on our engine's pooled-window CBOW (row selection), and the accountants compared",
         lambda d: section_fig1(d, plots, plot_dir), ["fig1_loss_curves", "epsilon_vs_step"]),
        ("paper_fig1_seed", "7a. Fig 1 with the seed's own model (target, one context word, 8 negatives)",
         _own_section("paper_fig1_seed", plot_dir), []),
        ("privacy_audit", "7b. One-run privacy audits of whole training runs",
         lambda d: section_audit(d, plots, plot_dir), ["privacy_audit"]),
        ("canary_exposure", "7c. The seed's canary exposure test (§6.5, Table 2), synthetic corpus",
         lambda d: section_exposure(d, plots, plot_dir), ["canary_exposure"]),
        ("canary_exposure_kjv", "7d. The canary exposure test on real English (King James Bible)",
         lambda d: section_exposure(d, plots, plot_dir), ["canary_exposure_kjv"]),
        ("canary_exposure_line", "7e. Canary exposure with each phrase as a line of its own, synthetic corpus",
         lambda d: section_exposure(d, plots, plot_dir), ["canary_exposure_line"]),
        ("canary_exposure_kjv_line", "7f. Canary exposure with each phrase as a line of its own, King James Bible",
         lambda d: section_exposure(d, plots, plot_dir), ["canary_exposure_kjv_line"]),
    ]
    # Benchmarks that render their own section (`results_section(doc, plot_dir)` in the script).
    late_sections = [
        ("sparse_mean_estimation", "10. Sparse mean estimation and output perturbation (seed D)",
         _own_section("sparse_mean_estimation", plot_dir), []),
        ("wide_linear", "11. Wide linear models: Algorithm 2 and bias-reduced DP-SGD (seeds A and D)",
         _own_section("wide_linear", plot_dir), []),
        ("dp_ambssgd", "12. DP-STAT adaptive clipping on linear regression (seed C)",
         _own_section("dp_ambssgd", plot_dir), []),
        ("modelmix_accountant", "13. ModelMix's accountant cross-checked (seed B)",
         _own_section("modelmix_accountant", plot_dir), []),
        ("engine_modelmix_adaptive", "14. ModelMix and DP-STAT adaptive S1 on our models (seeds B, C)",
         _own_section("engine_modelmix_adaptive", plot_dir), []),
        ("modelmix_image", "14b. ModelMix on an image classifier (seed B's kind of model): a small CNN on digits",
         _own_section("modelmix_image", plot_dir), []),
        ("noise_generators", "15. Noise generators keyed with the full secret: the cost",
         _own_section("noise_generators", plot_dir), []),
        ("cli_startup", "16. CLI start-up: help, config errors, privacy commands",
         _own_section("cli_startup", plot_dir), []),
        ("user_level", "17. User-level privacy on click logs with users: users sampled against example level",
         _own_section("user_level", plot_dir), []),
        ("user_level_examples", "18. User-level privacy by example sampling (groups accounted)",
         _own_section("user_level", plot_dir), []),
        ("user_level_k", "18b. User-level privacy against k: users sampled against example sampling",
         _own_section("user_level", plot_dir), []),
        ("convert_throughput", "19. `convert table` throughput and memory on multi-file logs",
         _own_section("convert_throughput", plot_dir), []),
        ("own_model_dcn_ranking", "20. Your own model through make_private: DCN-v2 ranking on click logs",
         _own_section("own_model", plot_dir), []),
        ("own_model_two_tower_retrieval", "20b. Your own model through make_private: two-tower retrieval on click logs",
         _own_section("own_model", plot_dir), []),
        ("own_model_sasrec_sequential",
         "20c. Your own model through make_private: a SASRec-style sequential recommender on click logs",
         _own_section("own_model", plot_dir), []),
        ("own_model_transformer_lm",
         "20d. Your own model through make_private: a transformer language model over 50,000 words",
         _own_section("own_model", plot_dir), []),
        ("own_model_opacus", "20e. Your own model: the same models under Opacus, beside widedp and the floor",
         _own_section("own_model_opacus", plot_dir), []),
        ("ghost_transformer", "21. Ghost norms on a transformer block: against the floor, torch.func and Opacus",
         _own_section("ghost_transformer", plot_dir), []),
        ("private_tuning", "22. Private hyper-parameter selection (`widedp tune`) against the defaults and the "
                           "non-private model tuned on validation", _own_section("private_tuning", plot_dir), []),
        ("private_tuning_small", "22b. Private hyper-parameter selection on a small set (2,000 users): where the "
                                 "score's noise decides", _own_section("private_tuning", plot_dir), []),
        ("forecast_check", "23. The forecast before training against the runs that did and did not learn",
         _own_section("forecast_check", plot_dir), []),
        ("user_level_insteval", "24. Real users and time we did not generate: InstEval lecture ratings (development set)",
         _own_section("user_level", plot_dir), []),
        ("private_tuning_insteval", "24b. `widedp tune` on InstEval against the defaults and the non-private model "
                                    "tuned on validation", _own_section("private_tuning", plot_dir), []),
        ("user_level_movielens", "25. MovieLens ratings with users and time: no value tuned on it, reported last",
         _own_section("user_level", plot_dir), []),
        ("private_tuning_movielens", "25b. `widedp tune` on the MovieLens set (no value tuned on it)",
         _own_section("private_tuning", plot_dir), []),
        ("lazy_noise", "26. Lazy against eager DP-SGD noise: held-out metrics of whole runs",
         _own_section("lazy_noise", plot_dir), []),
        ("audit_power", "27. White-box audits with teeth: every-step audits, the Gaussian-DP bound, subtle breaks",
         _own_section("audit_power", plot_dir), []),
        ("audit_conformance", "27b. Conformance audits: shuffled batches and the selection's σ, which no ε bound "
                              "here can see", _own_section("audit_conformance", plot_dir), []),
    ]
    machines: dict = {}
    pages, goals = _render_sections(sections, docs, plots, machines)
    late_pages, late_goals = _render_sections(late_sections, docs, plots, machines)
    goals += late_goals
    if "selection_scaling" in docs:
        s = docs["selection_scaling"]
        pages.append(("8. Selection alone versus vocabulary size", [
            "Selection alone, no training: the exponential-mechanism top-k and Gaussian thresholding timed on "
            "synthetic scores as the vocabulary size p grows (τ set per p so that the expected number of false "
            "positives among untouched rows is k); the sizes are in the output's second line.", "",
            f"Output of `benchmarks/selection_scaling.py` ({'quick' if s['quick'] else 'full'}; `{_rel(s['_path'])}`):",
            "", "```", s["text"].rstrip(), "```", ""]))
    tuning = sorted((results_dir / "tuning").glob("*.json")) if (results_dir / "tuning").is_dir() else []
    if tuning:
        tuning_lines = [
            "Each sweep: `benchmarks/tune.py`, one run per point on in-process shards (sweeps run with `--seeds`: "
            "one per seed, each point the median, min–max beside it); the best point is chosen "
            "on the split each table names (validation: held out of training, never the test split; older "
            "sweeps chose on test, labelled optimistic). The configs' comments cite these tables.", ""]
        for path in tuning:
            tuning_lines += section_tuning(json.loads(path.read_text()), path)
        pages.append(("9. Hyperparameter tuning (how the configs' values were chosen)", tuning_lines))
        lever_lines, lever_goals = gap_levers({p.stem: json.loads(p.read_text()) for p in tuning},
                                              docs.get("privacy_utility", {}).get("points", []))
        if lever_lines:
            title = "9a. Levers against the gap to non-private at ε = 8"
            pages.append((title, list(lever_lines)))
            goals += [(*g, "tune", title) for g in lever_goals]
    pages += late_pages
    head = ["# widedp benchmark results: the goals", "",
            "Generated by `make results` (`benchmarks/make_results.py`) from `benchmarks/results/*.json`; every number "
            "here and on the section pages is read from those files. Regenerate the measurements with `make bench` "
            "(full) or `make bench QUICK=1`, then `make results`. Each goal below says what it measured, whether it is "
            "met, why where it is not, and the section that ran it (the algorithm and setting are on that page).", "",
            "## Machines", ""]
    for line, names in machines.items():
        head.append(f"- {line} — {', '.join(names)}")
    busy = [n for n in NAMES if n in docs and (docs[n].get("machine") or {}).get("load_average_start", [0])[0]
            > 0.5 * ((docs[n].get("machine") or {}).get("logical_cores") or 1)]
    if busy:
        head += ["", f"**Caution:** {', '.join(busy)} started with a 1-minute load average above half the cores "
                     "(which also counts the benchmark that ran just before in a sequence such as `make bench`, and any "
                     "other work on the machine); where other work was running, their timings are noisy."]
    quick = [n for n in NAMES if n in docs and docs[n].get("quick")]
    if quick:
        head += ["", f"**Caution:** {', '.join(quick)} are `--quick` runs (small sizes, few steps, one seed): they show "
                     "the pipeline works, not the final figures."]
    head += ["", "## Goals", "", "| goal | measured | status | why / notes | section |", "|---|---|---|---|---|"]
    for t, m, ok, why, name, title in goals:
        head.append(f"| {t} | {m} | {ok} | {why} | [{title.split(' ', 1)[0].rstrip('.')}](results/{section_slug(title)}.md) |")
    head += ["", "## Sections", ""] + [f"- [{title}](results/{section_slug(title)}.md)" for title, _ in pages] + [""]
    notes = ["## Notes", "",
             "- Timings are medians over repeated steps after warm-up, each configuration in a fresh process; the "
             "machine line above gives cores and torch threads. Throughput = mean realized (Poisson) batch / median step time.",
             "- Peak memory: the worker's own peak RSS (getrusage) and the peak summed RSS of its process tree "
             "(Ray's raylet/GCS and the shard actors included), polled every 0.2 s.",
             "- Opacus points marked extrapolated were not measured (estimated memory above what the machine has, "
             "or the run was killed) — their step time is extrapolated affinely in V (fixed per-step cost + cost per "
             "table row) from the same system's two largest measured vocabularies; the table gives the fit.",
             *_utility_and_fig1_notes(docs),
             ""]
    md = "\n".join(head + notes)
    out = out_dir / "RESULTS.md"
    out.write_text(md)
    section_dir = out_dir / "results"
    section_dir.mkdir(parents=True, exist_ok=True)
    for old in section_dir.glob("*.md"):
        old.unlink()  # a section that is gone leaves no page behind
    for title, lines in pages:
        text = "\n".join([f"# {title}", "", "[All goals](../RESULTS.md)", "", *lines]).rstrip() + "\n"
        (section_dir / f"{section_slug(title)}.md").write_text(text.replace("](plots/", "](../plots/"))
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--out", default=str(REPO / "docs"))
    parser.add_argument("--prefer", choices=("full", "quick"), default="full")
    args = parser.parse_args(argv)
    t0 = time.time()
    path = render(Path(args.results), Path(args.out), args.prefer)
    print(f"wrote {path} and {Path(args.out) / 'plots'}/*.png in {time.time() - t0:.1f} s")
    return path


if __name__ == "__main__":
    main()
