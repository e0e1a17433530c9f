"""`widedp report RUN_DIR... [--out DIR]`: plots and a short markdown summary of training runs.

For each run directory (what `widedp train` writes): the loss versus step (metrics.jsonl:
held-out loss from `train.eval_every` lines, or the raw batch loss of a `train.debug_metrics` run), ε versus step under each accountant (the run's ledger.json re-accounted by
`rdp`, `pld` and the seed paper's Theorem 3 bound `paper`; an accountant that cannot bound the
run's events is listed as unsupported, never guessed), and the median time per step phase
(summary.json `phase_ms_median`). With several runs the curves are overlaid and the summary
table compares them. Writes OUT/report.md and OUT/*.png — OUT defaults to RUN_DIR/report for
one run and to PARENT/report (the first run's parent directory) for several — and prints
{"markdown": ..., "plots": [...]}.

The plotting helpers here are shared with benchmarks/make_results.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

ACCOUNTANT_NAMES = ("rdp", "pld", "prv", "paper")
CURVE_ACCOUNTANTS = ("rdp", "pld", "paper")


# ---- reading runs -------------------------------------------------------------------------------

def load_run(run_dir) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise ValueError(f"{run_dir}: no summary.json (not a finished `widedp train` run dir?)")
    run = {"dir": run_dir, "name": run_dir.name, "summary": json.loads(summary_path.read_text()),
           "config": {}, "metrics": []}
    if (run_dir / "config.json").exists():
        run["config"] = json.loads((run_dir / "config.json").read_text())
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            if line.strip():
                run["metrics"].append(json.loads(line))
    return run


def run_label(run: dict) -> str:
    s = run["summary"]
    mode = s.get("mode", "?")
    label = f"{mode}/{s['selection']}" if mode == "sparse" and s.get("selection") else mode
    return f"{run['name']} ({label})"


# ---- accounting -----------------------------------------------------------------------------------

def _truncate(history, steps: int):
    out, left = [], steps
    for event, count in history:
        if left <= 0:
            break
        out.append((event, min(count, left)))
        left -= count
    return out


def epsilon_by_accountant(history, delta: float, names: Sequence[str] = ACCOUNTANT_NAMES) -> dict:
    """ε of one history under each accountant: {"rdp": {"epsilon": e}, "paper": {"epsilon": e,
    "valid": bool, "violations": [...]}, "pld": {"unsupported": reason}, ...}."""
    from widedp.accounting import make_accountant

    out = {}
    for name in names:
        try:
            d = make_accountant(name).details(list(history), delta)
            eps = float(d["epsilon"])
            entry = {"epsilon": eps if math.isfinite(eps) else None}
            if "valid" in d:
                entry["valid"] = bool(d["valid"])
                entry["violations"] = [str(v) for v in d.get("violations", [])]
            out[name] = entry
        except Exception as exc:  # unsupported event, invalid bound, numeric overflow: report, never guess
            out[name] = {"unsupported": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def epsilon_curves(history, delta: float, points: int = 12, names: Sequence[str] = CURVE_ACCOUNTANTS) -> dict:
    """ε after t steps on a log-spaced grid of t, per accountant (None where unsupported)."""
    import numpy as np

    total = sum(c for _, c in history)
    curves: dict = {"steps": []}
    if total == 0:
        return {**curves, **{n: [] for n in names}}
    grid = sorted({int(round(x)) for x in np.geomspace(1, total, num=max(2, min(points, total)))} | {total})
    curves["steps"] = grid
    for name in names:
        values = []
        for t in grid:
            values.append(epsilon_by_accountant(_truncate(history, t), delta, [name])[name].get("epsilon"))
            if values[-1] is None and len(values) == 1:  # unsupported at t=1: unsupported everywhere
                values += [None] * (len(grid) - 1)
                break
        curves[name] = values
    return curves


def ledger_accounting(run_dir, curve_points: int = 12, names: Sequence[str] = ACCOUNTANT_NAMES,
                      curve_names: Sequence[str] = CURVE_ACCOUNTANTS) -> dict:
    """The accountants compared on a run's recorded ledger: ε at the end and ε versus step."""
    from widedp.accounting import PrivacyLedger

    path = Path(run_dir) / "ledger.json"
    if not path.exists():
        return {}
    ledger = PrivacyLedger.load(path)
    history = ledger.history
    return {"delta": ledger.delta, "steps": ledger.steps, "recorded_by": ledger.accountant.name,
            "final": epsilon_by_accountant(history, ledger.delta, names),
            "curves": epsilon_curves(history, ledger.delta, curve_points, curve_names) if curve_points else {}}


# ---- plots ----------------------------------------------------------------------------------------

def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.grid": True,
                         "grid.alpha": 0.3, "legend.fontsize": 8})
    return plt


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (NaNs skipped) — batch losses are noisy."""
    out, buf = [], []
    for v in values:
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            buf.append(v)
        buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def save(fig, path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def plot_curves(series, path, *, title: str, xlabel: str, ylabel: str, logx=False, logy=False,
                figsize=(6.4, 4.0)) -> str:
    """series: [(label, xs, ys, style dict or None)] on one axis."""
    plt = pyplot()
    outside = len(series) > 6  # many curves: legend beside the axes, not over the lines
    fig, ax = plt.subplots(figsize=(figsize[0] + 2.6, figsize[1]) if outside else figsize)
    for label, xs, ys, style in series:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not (isinstance(y, float) and math.isnan(y))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **(style or {}))
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ax.get_legend_handles_labels()[0]:
        if outside:
            ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
        else:
            ax.legend()
    return save(fig, path)


def plot_phases(phases: dict, path, *, title: str) -> str:
    """Stacked horizontal bars: {label: {phase: ms}}."""
    plt = pyplot()
    labels = list(phases)
    names = []
    for p in phases.values():
        names += [n for n in p if n not in names]
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.45 * len(labels)))
    left = [0.0] * len(labels)
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        widths = [max(0.0, phases[lb].get(name, 0.0)) for lb in labels]
        ax.barh(labels, widths, left=left, label=name, color=cmap(i % 20))
        left = [a + b for a, b in zip(left, widths)]
    ax.set(title=title, xlabel="ms per step (medians)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1 if len(names) <= 8 else 2)
    return save(fig, path)


# ---- the report -----------------------------------------------------------------------------------

def _fmt(v, digits=4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}g}"
    return str(v)


def render(run_dirs: Sequence, out: Optional[Path] = None, curve_points: int = 12) -> dict:
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("report needs at least one RUN_DIR")
    if out is None:
        out = runs[0]["dir"] / "report" if len(runs) == 1 else runs[0]["dir"].parent / "report"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    # loss: held-out loss from `train.eval_every` lines; the raw training batch loss only for
    # runs that opted into train.debug_metrics (docs/THREAT_MODEL.md)
    series = [line for line in (_loss_series(run) for run in runs) if line is not None]
    if series:
        plots.append(plot_curves(series, out / "loss.png", title="loss versus step (held-out, or debug batch loss)",
                                 xlabel="step", ylabel="loss"))
    # ε per accountant
    accounting = {}
    eps_series = []
    styles = {"rdp": "-", "pld": "--", "prv": "-.", "paper": ":"}
    for run in runs:
        acc = ledger_accounting(run["dir"], curve_points) if run["summary"].get("mode") != "nonprivate" else {}
        accounting[run["name"]] = acc
        for name in CURVE_ACCOUNTANTS:
            ys = acc.get("curves", {}).get(name)
            if ys and any(y is not None for y in ys):
                label = f"{name}" if len(runs) == 1 else f"{run['name']}: {name}"
                eps_series.append((label, acc["curves"]["steps"], ys, {"linestyle": styles[name]}))
    if eps_series:
        plots.append(plot_curves(eps_series, out / "epsilon.png", title="ε versus step, per accountant",
                                 xlabel="step", ylabel="ε", logx=True, logy=True))
    # phases
    phases = {run["name"]: run["summary"]["phase_ms_median"] for run in runs if run["summary"].get("phase_ms_median")}
    if phases:
        plots.append(plot_phases(phases, out / "phases.png", title="where a step's time goes"))
    md = _markdown(runs, accounting, [Path(p).name for p in plots])
    (out / "report.md").write_text(md)
    return {"markdown": str(out / "report.md"), "plots": plots, "runs": [str(r["dir"]) for r in runs]}


def _loss_series(run: dict):
    """(label, steps, losses, style) of one run: held-out loss if logged, else the debug batch loss."""
    held = [(m["step"], m["test_metrics"].get("logloss", m["test_metrics"].get("loss")))
            for m in run["metrics"] if m.get("test_metrics")]
    if held:
        return (f"{run_label(run)} held-out", [s for s, _ in held], [v for _, v in held], None)
    raw = [(m["step"], m["loss"]) for m in run["metrics"] if "loss" in m]
    if raw:
        losses = [v for _, v in raw]
        return (f"{run_label(run)} batch loss (debug)", [s for s, _ in raw], smooth(losses, max(1, len(losses) // 20)),
                None)
    return None


def _markdown(runs, accounting, plot_names) -> str:
    lines = ["# widedp run report", ""]
    lines += ["| run | mode | steps | examples/s | step ms (median) | test metrics | Bayes AUC | ε (recorded) | δ |",
              "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for run in runs:
        s = run["summary"]
        mode = f"{s.get('mode')}/{s['selection']}" if s.get("selection") else s.get("mode")
        metrics = ", ".join(f"{k} {_fmt(v)}" for k, v in (s.get("test_metrics") or {}).items())
        lines.append(f"| {run['name']} | {mode} | {s.get('steps')} | {_fmt(s.get('examples_per_sec'))} | "
                     f"{_fmt(s.get('step_time_ms_median'))} | {metrics} | {_fmt(s.get('bayes_auc'))} | "
                     f"{_fmt(s.get('epsilon'))} ({s.get('accountant')}) | {_fmt(s.get('delta'), 3)} |")
    lines += ["", "## Privacy: the same ledger under each accountant", "",
              "| run | " + " | ".join(ACCOUNTANT_NAMES) + " |", "|---|" + "---:|" * len(ACCOUNTANT_NAMES)]
    for run in runs:
        acc = accounting.get(run["name"]) or {}
        if not acc:
            lines.append(f"| {run['name']} | " + " | ".join(["(non-private)"] * len(ACCOUNTANT_NAMES)) + " |")
            continue
        cells = []
        for name in ACCOUNTANT_NAMES:
            e = acc["final"].get(name, {})
            if "unsupported" in e:
                cells.append("unsupported")
            else:
                cell = _fmt(e.get("epsilon"))
                if e.get("valid") is False:
                    cell += " (conditions violated)"
                cells.append(cell)
        lines.append(f"| {run['name']} | " + " | ".join(cells) + " |")
    notes = []
    for run in runs:
        e = (accounting.get(run["name"]) or {}).get("final", {}).get("paper", {})
        if e.get("violations"):
            notes.append(f"- {run['name']}: paper bound's conditions violated: " + "; ".join(e["violations"]))
    if notes:
        lines += [""] + notes
    s0 = runs[0]["summary"]
    bytes_rows = [f"| {r['name']} | {_fmt(r['summary'].get('bytes_to_shards'))} | {_fmt(r['summary'].get('bytes_from_shards'))} | "
                  f"{_fmt(r['summary'].get('rows_touched_mean'))} | {_fmt(r['summary'].get('rows_selected_mean'))} |"
                  for r in runs]
    if "bytes_to_shards" in s0:
        lines += ["", "## Traffic and rows", "", "| run | bytes to shards | bytes from shards | rows touched/step | rows selected/step |",
                  "|---|---:|---:|---:|---:|", *bytes_rows]
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in plot_names] + [""]
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------------

def add_commands(sub) -> dict:
    r = sub.add_parser("report", help="plots and a markdown summary of one or more run directories")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", help="output directory (default RUN_DIR/report, or PARENT/report for several runs)")
    r.add_argument("--curve-points", type=int, default=12, help="steps at which ε is re-accounted per accountant")
    return {"report": cmd_report}


def cmd_report(args) -> dict:
    return render(args.run_dirs, Path(args.out) if args.out else None, curve_points=args.curve_points)
