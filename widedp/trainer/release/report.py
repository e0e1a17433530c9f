"""`widedp report RUN_DIR... [--run-dir RUN_DIR]... [--out DIR] [--curve-points N] [--accountants rdp,pld,prv,paper]`:
plots and a short markdown summary of training runs.

For each run directory (what `widedp train` writes) it draws, against the **training step**
(the step counter metrics.jsonl uses: step t = after t steps; step 0 = before the first step):

- ε per accountant (the run's ledger.json re-accounted by `rdp`, `pld`, `prv` and the seed
  paper's Theorem 3 bound `paper`), with the run's target ε as a horizontal line. Only valid
  bounds are plotted: an accountant that cannot bound the run's events (unsupported) and the
  paper's bound where its conditions are violated are left off the axes, and the legend and the
  markdown say which and why — never guessed, never an invalid number beside valid ones.
  The ledger counts charged events, not steps (accounting/ledger.py): one-time events (a
  private vocabulary, DP-FEST's one-time selection) are charged before step 0 and a step may
  charge more than one event, so the events are mapped to steps first (`step_mapping`);
  one-time charges are marked at the step they were charged at.
- held-out metrics (`train.eval_every` lines of metrics.jsonl, and summary.json's final
  test_metrics) as points at the steps the evaluations ran;
- the loss: held-out loss as points, plus the raw training batch loss of a
  `train.debug_metrics` run (the only runs that record it, docs/THREAT_MODEL.md);
- rows noised per step (metrics.jsonl `rows_selected`: the selected rows plus the rows of dense
  tables, all noised; in a non-private run the rows updated, without noise);
- the median time per step phase (summary.json `phase_ms_median`).

OUT/summary.png puts the first four on one 2×2 figure (the one to send a colleague);
OUT/epsilon.png, heldout.png, loss.png, rows_noised.png and phases.png are the single plots;
OUT/report.md the tables and the notes (which accountants were plotted and why the others were
not); OUT/report_data.json the series every plot was drawn from. A non-private run (mode
nonprivate, or no ledger) gets no ε curve and is labelled "non-private". With several runs the
curves are overlaid and the tables compare them. OUT defaults to RUN_DIR/report for one run and
to PARENT/report (the first run's parent directory) for several; prints {"markdown": ...,
"plots": [...], "summary_plot": ..., "data": ...}.

The plotting helpers here are shared with benchmarks/make_results.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

ACCOUNTANT_NAMES = ("rdp", "pld", "prv", "paper")
CURVE_ACCOUNTANTS = ("rdp", "pld", "prv", "paper")
ACCOUNTANT_STYLE = {"rdp": ("-", "o"), "pld": ("--", "s"), "prv": ("-.", "^"), "paper": (":", "x")}
#: held-out metrics shown first when a run has several (the summary's "held-out metric" panel)
HEADLINE_METRICS = ("auc", "pairwise_accuracy", "accuracy")
LOSS_METRICS = ("logloss", "loss")
# The CTR model's "ece" and "base_rate_logloss" (trainer/models/calibration_metrics.py) get no panel
# of their own: they are listed with the other test metrics in report.md, and the base rate is a
# constant of the test split (benchmarks/make_results.py draws it on the logloss-vs-ε plots).
#: the longest per-step event pattern `step_mapping` looks for, and the most events it expands
MAX_EVENTS_PER_STEP = 64
MAX_EXPANDED_EVENTS = 20_000_000


# ---- reading runs -------------------------------------------------------------------------------

def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def load_run(run_dir) -> dict:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise ValueError(f"{run_dir}: no summary.json (not a finished `widedp train` run dir?)")
    summary = _read_json(summary_path)
    if not isinstance(summary, dict):
        raise ValueError(f"{summary_path}: expected a JSON object, got {type(summary).__name__}")
    run = {"dir": run_dir, "name": run_dir.name, "summary": summary, "config": {}, "metrics": []}
    if (run_dir / "config.json").exists():
        run["config"] = _read_json(run_dir / "config.json")
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {i} is not valid JSON ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
                raise ValueError(f"{path}: line {i} has no integer \"step\"")
            run["metrics"].append(record)
    return run


def is_private(run: dict) -> bool:
    """A run with a privacy ledger: not mode nonprivate (nor summary "private": false) and
    ledger.json present."""
    s = run["summary"]
    return s.get("mode") != "nonprivate" and s.get("private") is not False and (Path(run["dir"]) / "ledger.json").exists()


def run_label(run: dict) -> str:
    s = run["summary"]
    mode = s.get("mode", "?")
    label = f"{mode}/{s['selection']}" if mode == "sparse" and s.get("selection") else mode
    return f"{run['name']} ({label})"


def _last_per_step(lines: list[dict]) -> list[dict]:
    """One line per step, the last one written (a resumed run re-logs the steps it replays)."""
    by_step = {}
    for line in lines:
        by_step[line["step"]] = line
    return [by_step[s] for s in sorted(by_step)]


def _number(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


# ---- accounting -----------------------------------------------------------------------------------

def _truncate(history, steps: int):
    """The first `steps` charged events of a run-length encoded history."""
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

    out: dict[str, dict] = {}
    for name in names:
        if not history:  # nothing charged: nothing released that depends on the data
            out[name] = {"epsilon": 0.0}
            continue
        try:
            d = make_accountant(name).details(list(history), delta)
            eps = float(d["epsilon"])
            entry: dict = {"epsilon": eps if math.isfinite(eps) else None}
            if "valid" in d:
                entry["valid"] = bool(d["valid"])
                entry["violations"] = [str(v) for v in d.get("violations", [])]
            out[name] = entry
        except Exception as exc:  # unsupported event, invalid bound, numeric overflow: report, never guess
            out[name] = {"unsupported": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def epsilon_curves(history, delta: float, points: int = 12, names: Sequence[str] = CURVE_ACCOUNTANTS) -> dict:
    """ε after t *charged events* on a log-spaced grid of t, per accountant (None where
    unsupported; the paper's bound whatever its validity). For a history of one event per step
    and no one-time events (benchmarks/paper_fig1.py); a run's report uses `epsilon_over_steps`."""
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


def step_mapping(history, steps: Optional[int], resumed: bool = False) -> dict:
    """How a ledger's charged events map to training steps (`_step_mapping`), after setting
    aside the events charged once after the last step (train.recalibrate's release: an entry of
    count 1 at the end whose event occurs nowhere else), which are one-time charges at step T."""
    history = list(history)
    tail = 0
    while tail < len(history) - 1:
        event, count = history[len(history) - 1 - tail]
        if count != 1 or sum(repr(e) == repr(event) for e, _ in history) != 1:
            break
        tail += 1
    if not tail or steps is None or steps <= 0:
        return _step_mapping(history, steps, resumed)
    out = _step_mapping(history[:-tail], steps, resumed)
    if not out["mapped"]:
        return _step_mapping(history, steps, resumed)
    one_time = dict(out["one_time"])
    one_time[steps] = one_time.get(steps, 0) + tail
    by_step = list(out["events_by_step"])
    by_step[-1] += tail
    note = "; ".join(n for n in (out["note"], "the release after the last step is charged at the last step") if n)
    return {**out, "events": out["events"] + tail, "events_by_step": by_step, "one_time": one_time, "note": note}


def _step_mapping(history, steps: Optional[int], resumed: bool = False) -> dict:
    """How a ledger's charged events map to training steps.

    Returns {"mapped": bool, "steps": T, "events": E, "events_per_step": m,
    "events_by_step": [events charged by the end of step t, t = 0..T], "one_time": {step: n}
    (events that are not a step's: charged before step 0 at key 0), "extra_step_charges": r,
    "note": str}.

    Exact case: the last m·T events are T repetitions of one m-event pattern (the smallest m);
    what precedes them is charged before step 0. Repetitions beyond T (a run resumed after a
    crash charges the steps it replays again, accounting/ledger.py: over-counted, never
    under-counted) are placed at step 1, so ε at a step is never below the ledger's; a run
    that was never resumed and holds a whole multiple of T repetitions charges them all per
    step. Otherwise each occurrence of the last event is one step and the other events are
    one-time charges at the step after which they were charged. With fewer step events than
    steps (or no step count) the events cannot be mapped: "mapped" is False and the caller
    plots against charged events, saying so."""
    import numpy as np

    total = sum(c for _, c in history)
    base = {"steps": steps, "events": total, "events_per_step": 0, "one_time": {}, "extra_step_charges": 0}
    if steps is None or steps < 0:
        return {**base, "mapped": False, "events_by_step": [],
                "note": "summary.json gives no step count: plotted against charged ledger events"}
    if steps == 0 or total == 0:
        return {**base, "mapped": True, "events_by_step": [total] * (steps + 1),
                "one_time": {0: total} if total else {}, "note": ""}
    keys: dict[str, int] = {}
    ids = [keys.setdefault(repr(e), len(keys)) for e, _ in history]
    counts = [c for _, c in history]
    T = steps
    if total <= MAX_EXPANDED_EVENTS:
        seq = np.repeat(np.asarray(ids, dtype=np.int32), counts)
        for m in range(1, min(total // T, MAX_EVENTS_PER_STEP) + 1):
            n0 = total - m * T
            tail = seq[n0:].reshape(T, m)
            if not (tail == tail[0]).all():
                continue
            head_reps = n0 // m
            block = seq[n0 - head_reps * m:n0].reshape(head_reps, m)
            match = (block == tail[0]).all(axis=1)
            r = int(head_reps - (np.flatnonzero(~match)[-1] + 1 if (~match).any() else 0))
            if r and not resumed and (T + r) % T == 0 and m * (T + r) // T <= MAX_EVENTS_PER_STEP:
                m, r = m * (T + r) // T, 0  # e.g. two identical events per step
            n0 = total - m * (T + r)
            t = np.arange(T + 1)
            by_step = np.where(t == 0, n0, n0 + m * np.minimum(t + r, T + r))
            note = ""
            if r:
                note = (f"the ledger holds {T + r} step charges for {T} steps (steps replayed after a resume are "
                        f"charged again); the {r} extra are placed at step 1, so ε is never under-stated")
            return {**base, "mapped": True, "events_per_step": m, "events_by_step": by_step.tolist(),
                    "one_time": {0: n0} if n0 else {}, "extra_step_charges": r, "note": note}
    # each occurrence of the last event is a step; other events are one-time charges
    step_id = ids[-1]
    ends: list = []  # events charged by the end of each step-event occurrence
    pos, before, occ = 0, 0, 0
    one_time_at_occ: dict[int, int] = {}
    for i, c in zip(ids, counts):
        if i == step_id:
            ends.append(np.arange(pos + 1, pos + c + 1, dtype=np.int64))
            pos += c
            occ += c
        else:
            pos += c
            one_time_at_occ[occ] = one_time_at_occ.get(occ, 0) + c
            if ends:
                ends[-1][-1] = pos
            else:
                before = pos
    occurrences = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    R = int(occurrences.size)
    if R < T:
        return {**base, "mapped": False, "events_by_step": [],
                "note": f"the ledger's {total} charged events hold {R} repetitions of its last event for {T} steps: "
                        "they cannot be mapped to training steps; plotted against charged ledger events"}
    r = R - T
    by_step = [before] + occurrences[r:].tolist()
    one_time: dict = {}
    for k, n in one_time_at_occ.items():  # after the k-th step event: at step k - r (at least 1)
        step = max(1, k - r) if k else 0
        one_time[step] = one_time.get(step, 0) + n
    note = ("one-time charges between steps are placed at the step after which they were charged" if
            any(k > 0 for k in one_time) else "")
    if r:
        note = (note + "; " if note else "") + (f"the ledger holds {R} step charges for {T} steps; the {r} extra "
                                                "are placed at step 1, so ε is never under-stated")
    return {**base, "mapped": True, "events_per_step": 1, "events_by_step": by_step, "one_time": one_time,
            "extra_step_charges": r, "note": note}


def _step_grid(T: int, points: int) -> list[int]:
    import numpy as np

    if T <= 0:
        return [0]
    inner = {int(round(x)) for x in np.linspace(1, T, num=max(2, min(points, T)))} if points > 1 else {T}
    return sorted({0, T} | inner)


def _grouped(history):
    """`history` with identical events merged (first appearance kept). Composition is
    commutative under every accountant here (rdp, pld, prv, paper), so ε is the same; the
    PLD and PRV accountants then compose one distribution per distinct event, not one per
    entry of an alternating history (several events per step)."""
    out: dict = {}
    for event, count in history:
        key = repr(event)
        out[key] = (event, out[key][1] + count) if key in out else (event, count)
    return list(out.values())


def epsilon_over_steps(history, delta: float, mapping: dict, points: int = 12,
                       names: Sequence[str] = CURVE_ACCOUNTANTS, final: Optional[dict] = None) -> dict:
    """ε per accountant on a grid of training steps (0 and T included), from `step_mapping`.

    {"steps": [t...], "events_charged": [...], "x_label": ..., "accountants": {name: {"epsilon":
    [ε or None...], "plotted": bool, "reason": why not (or why some points are missing)}}}.
    A point is None where the accountant gives no valid bound (unsupported, or the paper's
    conditions violated); an accountant is plotted only if its bound at the end of the run is
    valid (so an invalid final bound never shares the axes with valid ones). `final`: the
    `epsilon_by_accountant` of the whole history, if already computed (the last point)."""
    if mapping.get("mapped"):
        xs = _step_grid(mapping["steps"], points)
        events = [mapping["events_by_step"][t] for t in xs]
        x_label = "training step"
    else:  # the events cannot be mapped to steps: say so on the axis
        total = mapping["events"]
        xs = _step_grid(total, points)
        events = xs
        x_label = "charged ledger events (not mapped to training steps)"
    out: dict = {"steps": xs, "events_charged": events, "x_label": x_label, "accountants": {}}
    total = sum(c for _, c in history)
    cache: dict = {(name, total): e for name, e in (final or {}).items()}
    for name in names:
        values: list[Optional[float]] = []
        first_problem: Optional[str] = None
        for n in events:
            if (name, n) not in cache:
                cache[(name, n)] = epsilon_by_accountant(_grouped(_truncate(history, n)), delta, [name])[name]
            e = cache[(name, n)]
            if "unsupported" in e:
                values.append(None)
                first_problem = first_problem or f"unsupported: {e['unsupported']}"
            elif e.get("valid") is False:
                values.append(None)
                first_problem = first_problem or ("conditions violated: " + "; ".join(e.get("violations", [])))
            else:
                values.append(e.get("epsilon"))
        final = cache[(name, events[-1])]
        if "unsupported" in final:
            entry = {"plotted": False, "reason": f"unsupported: {final['unsupported']}"}
        elif final.get("valid") is False:
            shown = _fmt(final.get("epsilon"))
            entry = {"plotted": False, "reason": f"conditions violated (its ε would read {shown}, not a valid bound): "
                                                 + "; ".join(final.get("violations", []))}
        elif final.get("epsilon") is None:
            entry = {"plotted": False, "reason": "no finite ε"}
        else:
            entry = {"plotted": True, "reason": "" if first_problem is None else
                     f"no valid bound at some steps (left off): {first_problem}"}
        out["accountants"][name] = {"epsilon": values if entry["plotted"] else [None] * len(values), **entry}
    return out


def ledger_accounting(run_dir, curve_points: int = 12, names: Sequence[str] = ACCOUNTANT_NAMES,
                      curve_names: Sequence[str] = CURVE_ACCOUNTANTS, steps: Optional[int] = None,
                      resumed: bool = False) -> dict:
    """The accountants compared on a run's recorded ledger: ε at the end ("final") and, with
    `curve_points`, ε per accountant over the run's training steps ("curves",
    `epsilon_over_steps`; `steps` defaults to summary.json's). {} without a ledger."""
    from widedp.accounting import PrivacyLedger

    path = Path(run_dir) / "ledger.json"
    if not path.exists():
        return {}
    ledger = PrivacyLedger.load(path)
    history = ledger.history
    if curve_points and steps is None and (Path(run_dir) / "summary.json").exists():
        summary = _read_json(Path(run_dir) / "summary.json")
        steps, resumed = summary.get("steps"), bool(summary.get("resumed", resumed))
    out: dict = {"delta": ledger.delta, "events": ledger.steps, "steps": steps, "recorded_by": ledger.accountant.name,
           "final": epsilon_by_accountant(history, ledger.delta, names), "curves": {}}
    if curve_points:
        mapping = step_mapping(history, steps if isinstance(steps, int) else None, resumed)
        out["mapping"] = {k: v for k, v in mapping.items() if k != "events_by_step"}
        out["curves"] = epsilon_over_steps(history, ledger.delta, mapping, curve_points, curve_names, out["final"])
    return out


# ---- series (what the plots are drawn from) --------------------------------------------------------

def heldout_series(run: dict) -> dict:
    """Held-out metrics at the steps the evaluations ran: {"steps": [...], "metrics": {name: [...]},
    "source": [...]} from the eval lines of metrics.jsonl, plus summary.json's final
    test_metrics at the last step when no eval line is there."""
    lines = _last_per_step([m for m in run["metrics"] if isinstance(m.get("test_metrics"), dict)])
    points = [(m["step"], m["test_metrics"], "metrics.jsonl") for m in lines]
    final, T = run["summary"].get("test_metrics"), run["summary"].get("steps")
    if isinstance(final, dict) and final and isinstance(T, int) and all(s != T for s, _, _ in points):
        points.append((T, final, "summary.json"))
    points.sort(key=lambda p: p[0])
    names: list[str] = []
    for _, metrics, _ in points:
        names += [k for k in metrics if k not in names and _number(metrics[k]) is not None]
    return {"steps": [s for s, _, _ in points], "source": [src for _, _, src in points],
            "metrics": {k: [_number(m.get(k)) for _, m, _ in points] for k in names}}


def headline_metric(metrics: dict) -> Optional[str]:
    for name in HEADLINE_METRICS + LOSS_METRICS:
        if name in metrics:
            return name
    return next(iter(metrics), None)


def loss_metric(metrics: dict) -> Optional[str]:
    return next((n for n in LOSS_METRICS if n in metrics), None)


def train_loss_series(run: dict) -> Optional[dict]:
    """The raw training batch loss of a `train.debug_metrics` run (None otherwise: it is not
    released by default, docs/THREAT_MODEL.md), with a trailing moving average."""
    lines = _last_per_step([m for m in run["metrics"] if "loss" in m])
    if not lines:
        return None
    losses = [_number(m["loss"]) for m in lines]
    return {"steps": [m["step"] for m in lines], "loss": losses,
            "smoothed": smooth(losses, max(1, len(losses) // 20))}


def rows_noised_series(run: dict) -> dict:
    """metrics.jsonl `rows_selected` per logged step: the rows a private step noised (selected
    rows plus dense tables' rows); in a non-private run the rows updated (nothing is noised)."""
    lines = _last_per_step([m for m in run["metrics"] if _number(m.get("rows_selected")) is not None])
    return {"steps": [m["step"] for m in lines], "rows": [_number(m["rows_selected"]) for m in lines],
            "noised": is_private(run)}


def run_series(run: dict, curve_points: int, accountants: Sequence[str] = ACCOUNTANT_NAMES) -> dict:
    """Everything the plots of one run are drawn from."""
    s = run["summary"]
    private = is_private(run)
    out: dict = {"label": run_label(run), "private": private, "steps": s.get("steps"),
                 "heldout": heldout_series(run), "train_loss": train_loss_series(run),
                 "rows_noised": rows_noised_series(run), "epsilon": None, "accounting": {}}
    if not private:
        out["epsilon_note"] = "non-private: no privacy guarantee (ε = ∞); no ε plotted"
        return out
    acc = ledger_accounting(run["dir"], curve_points, accountants, accountants,
                            steps=s.get("steps") if isinstance(s.get("steps"), int) else None,
                            resumed=bool(s.get("resumed")))
    out["accounting"] = acc
    if curve_points and acc.get("curves"):
        target = _number(s.get("target_epsilon"))
        out["epsilon"] = {**acc["curves"], "target_epsilon": target, "mapping": acc["mapping"]}
    return out


# ---- plots ----------------------------------------------------------------------------------------

def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.grid": True,
                         "grid.alpha": 0.3, "legend.fontsize": 8})
    return plt


def smooth(values: Sequence[Optional[float]], window: int) -> list[float]:
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


def _points(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and not (isinstance(y, float) and math.isnan(y))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _note_handle(text: str):
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle="none", marker="", label=text)


def _legend(ax, extra_notes: Sequence[str] = (), fontsize=7) -> None:
    handles, labels = ax.get_legend_handles_labels()
    handles += [_note_handle(n) for n in extra_notes]
    if handles:
        ax.legend(handles=handles, fontsize=fontsize, loc="best")


def _empty(ax, title: str, text: str) -> None:
    ax.set(title=title, xlabel="", ylabel="")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def _short(reason: str) -> str:
    return "unsupported" if reason.startswith("unsupported") else \
        "conditions violated" if reason.startswith("conditions violated") else reason[:40]


def draw_epsilon(ax, runs_series: dict, color_by_run: bool) -> dict:
    """ε per accountant over training steps on `ax`; returns what was drawn:
    {"plotted": {run: [accountants]}, "not_plotted": {run: {accountant: reason}}, "notes": [...]}."""
    drawn: dict = {"plotted": {}, "not_plotted": {}, "notes": []}
    targets: dict[float, str] = {}
    one_time_labelled = False
    x_labels = set()
    for i, (name, rs) in enumerate(runs_series.items()):
        prefix = "" if len(runs_series) == 1 else f"{name}: "
        if not rs["private"]:
            drawn["notes"].append(f"{prefix}non-private (no ε)")
            continue
        eps = rs.get("epsilon")
        if not eps:
            continue
        x_labels.add(eps["x_label"])
        drawn["plotted"][name], drawn["not_plotted"][name] = [], {}
        for j, (acc, cur) in enumerate(eps["accountants"].items()):
            if not cur["plotted"]:
                drawn["not_plotted"][name][acc] = cur["reason"]
                drawn["notes"].append(f"{prefix}{acc}: not plotted ({_short(cur['reason'])})")
                continue
            xs, ys = _points(eps["steps"], cur["epsilon"])
            linestyle, marker = ACCOUNTANT_STYLE.get(acc, ("-", "o"))
            color = f"C{i}" if color_by_run else f"C{j}"
            ax.plot(xs, ys, linestyle=linestyle, marker=marker, markersize=3.5, color=color, label=f"{prefix}{acc}")
            drawn["plotted"][name].append(acc)
            if cur["reason"]:
                drawn["notes"].append(f"{prefix}{acc}: points without a valid bound left off")
        if eps.get("target_epsilon") is not None:
            targets.setdefault(eps["target_epsilon"], f"C{i}" if color_by_run else "black")
        one_time = eps.get("mapping", {}).get("one_time") or {}
        if one_time and drawn["plotted"][name]:
            first = drawn["plotted"][name][0]
            ys_first = dict(zip(eps["steps"], eps["accountants"][first]["epsilon"]))
            for step, count in sorted(one_time.items()):
                y = ys_first.get(step)
                label = None if one_time_labelled else "one-time charges (step 0: before the first step)"
                one_time_labelled = True
                ax.axvline(step, color="grey", linewidth=0.8, linestyle=(0, (1, 2)))
                if y is not None:
                    ax.plot([step], [y], marker="D", markersize=7, markerfacecolor="none", color="black",
                            linestyle="none", label=label)
                drawn.setdefault("one_time_marks", []).append({"run": name, "step": step, "events": count})
    for target, color in targets.items():
        ax.axhline(target, color=color, linewidth=1.0, linestyle=(0, (5, 3)), alpha=0.7, label=f"target ε = {_fmt(target)}")
    ax.set(title="ε over the run, per accountant (valid bounds only)", xlabel=" / ".join(sorted(x_labels)) or "training step",
           ylabel="ε")
    if not any(rs["private"] for rs in runs_series.values()):
        _empty(ax, "ε over the run", "non-private: no privacy guarantee (ε = ∞)")
        return drawn
    if not any(drawn["plotted"].values()):
        _empty(ax, "ε over the run", "\n".join(drawn["notes"]) or "no accountant gives a valid bound")
        return drawn
    ax.set_ylim(bottom=0)
    if x_labels == {"training step"}:
        _step_axis(ax, runs_series)
    _legend(ax, drawn["notes"])
    return drawn


def draw_heldout(ax, runs_series: dict, which: str = "headline") -> dict:
    """Held-out metric(s) as points at the steps the evaluations ran (joined by a thin dashed
    line); `which`: "headline" (AUC / accuracy, else the loss), "loss", or a metric name."""
    drawn: dict = {}
    for i, (name, rs) in enumerate(runs_series.items()):
        h = rs["heldout"]
        metric = headline_metric(h["metrics"]) if which == "headline" else \
            loss_metric(h["metrics"]) if which == "loss" else (which if which in h["metrics"] else None)
        if metric is None:
            continue
        xs, ys = _points(h["steps"], h["metrics"][metric])
        if not xs:
            continue
        prefix = "" if len(runs_series) == 1 else f"{name}: "
        ax.plot(xs, ys, linestyle="--", linewidth=0.7, marker="o", markersize=5, color=f"C{i}",
                label=f"{prefix}held-out {metric}")
        drawn[name] = {"metric": metric, "steps": xs, "values": ys, "style": "points"}
    return drawn


def draw_loss(ax, runs_series: dict) -> dict:
    """Held-out loss as points plus the debug batch loss (smoothed line) where recorded."""
    drawn = {"heldout": draw_heldout(ax, runs_series, "loss"), "train": {}}
    for i, (name, rs) in enumerate(runs_series.items()):
        tl = rs["train_loss"]
        if tl is None:
            continue
        prefix = "" if len(runs_series) == 1 else f"{name}: "
        xs, ys = _points(tl["steps"], tl["smoothed"])
        ax.plot(xs, ys, linestyle="-", linewidth=1.0, color=f"C{i}", alpha=0.8,
                label=f"{prefix}training batch loss (debug, smoothed)")
        drawn["train"][name] = {"steps": xs, "values": ys, "style": "line"}
    return drawn


def draw_rows(ax, runs_series: dict) -> dict:
    drawn = {}
    for i, (name, rs) in enumerate(runs_series.items()):
        r = rs["rows_noised"]
        xs, ys = _points(r["steps"], r["rows"])
        if not xs:
            continue
        prefix = "" if len(runs_series) == 1 else f"{name}: "
        what = "rows noised" if r["noised"] else "rows updated (non-private: no noise)"
        ax.plot(xs, ys, linestyle="-", linewidth=0.8, marker=".", color=f"C{i}", label=f"{prefix}{what}")
        drawn[name] = {"steps": xs, "values": ys, "noised": r["noised"]}
    return drawn


def _step_axis(ax, runs_series: dict) -> None:
    """Integer training steps from 0 to the longest run's last step (the same x range as ε)."""
    from matplotlib.ticker import MaxNLocator

    last = max((rs["steps"] for rs in runs_series.values() if isinstance(rs.get("steps"), int)), default=None)
    if last:
        ax.set_xlim(-0.02 * last, 1.02 * last)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(ax, drawn, title, xlabel, ylabel, empty_text, notes=(), runs_series=None, y_from_zero=False) -> None:
    if not drawn:
        _empty(ax, title, empty_text)
        return
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if runs_series is not None:
        _step_axis(ax, runs_series)
    if y_from_zero:
        ax.set_ylim(bottom=0)
    _legend(ax, notes)


def _rows_title(runs_series) -> str:
    if any(rs["private"] for rs in runs_series.values()):
        return "rows noised per step (logged steps)"
    return "rows updated per step (non-private: nothing noised)"


def _no_loss_text(runs_series) -> str:
    return ("no loss recorded: held-out loss needs train.eval_every; the training batch loss is written only with "
            "train.debug_metrics = true (docs/THREAT_MODEL.md)")


def _loss_notes(runs_series) -> list[str]:
    if all(rs["train_loss"] is None for rs in runs_series.values()):
        return ["training batch loss: not recorded (train.debug_metrics = false)"]
    return []


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


def _unique_names(runs) -> None:
    seen: dict = {}
    for run in runs:
        seen[run["name"]] = seen.get(run["name"], 0) + 1
    for run in runs:
        if seen[run["name"]] > 1:
            run["name"] = f"{run['dir'].parent.name}/{run['dir'].name}"


def render(run_dirs: Sequence, out: Optional[Path] = None, curve_points: int = 12,
           accountants: Sequence[str] = ACCOUNTANT_NAMES) -> dict:
    """Write the report of `run_dirs` to `out`; returns {"markdown", "plots", "summary_plot",
    "data", "runs", "series"} — "series" (also in OUT/report_data.json) is what every plot was
    drawn from, per run, and "drawn" per plot what it shows (which accountants, which not and why)."""
    if isinstance(curve_points, bool) or not isinstance(curve_points, int) or curve_points < 2:
        raise ValueError(f"--curve-points must be an integer >= 2, got {curve_points!r}")
    accountants = tuple(accountants)
    unknown = [a for a in accountants if a not in ACCOUNTANT_NAMES]
    if unknown or not accountants:
        raise ValueError(f"--accountants must name some of {', '.join(ACCOUNTANT_NAMES)}, got {', '.join(accountants) or 'none'}")
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("report needs at least one RUN_DIR")
    _unique_names(runs)
    if out is None:
        out = runs[0]["dir"] / "report" if len(runs) == 1 else runs[0]["dir"].parent / "report"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    series = {run["name"]: run_series(run, curve_points, accountants) for run in runs}
    color_by_run = len(runs) > 1
    plt = pyplot()
    plots, drawn = [], {}

    # the 2×2 summary: ε | held-out metric / loss | rows noised
    fig, axes = plt.subplots(2, 2, figsize=(12.0, 8.0))
    drawn["summary"] = {"epsilon": draw_epsilon(axes[0][0], series, color_by_run)}
    d = draw_heldout(axes[0][1], series)
    metric_names = sorted({v["metric"] for v in d.values()})
    _finish(axes[0][1], d, "held-out " + " / ".join(metric_names) + " (points: evaluations)", "training step",
            " / ".join(metric_names), "no held-out evaluations (train.eval_every = 0)", runs_series=series)
    drawn["summary"]["heldout"] = d
    d = draw_loss(axes[1][0], series)
    _finish(axes[1][0], d["heldout"] or d["train"], "loss (points: held-out evaluations)", "training step", "loss",
            _no_loss_text(series), _loss_notes(series), runs_series=series)
    drawn["summary"]["loss"] = d
    d = draw_rows(axes[1][1], series)
    _finish(axes[1][1], d, _rows_title(series), "training step", "rows",
            "no rows_selected in metrics.jsonl", runs_series=series, y_from_zero=True)
    drawn["summary"]["rows_noised"] = d
    fig.suptitle("widedp run report: " + ", ".join(rs["label"] for rs in series.values()), fontsize=11)
    summary_plot = save(fig, out / "summary.png")
    plots.append(summary_plot)

    # the single plots
    if any(rs["private"] for rs in series.values()):
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        drawn["epsilon"] = draw_epsilon(ax, series, color_by_run)
        plots.append(save(fig, out / "epsilon.png"))
    heldout_names = []
    for rs in series.values():
        heldout_names += [k for k in rs["heldout"]["metrics"] if k not in heldout_names]
    if heldout_names:
        fig, axs = plt.subplots(1, len(heldout_names), figsize=(5.2 * len(heldout_names), 4.0), squeeze=False)
        drawn["heldout"] = {}
        for ax, metric in zip(axs[0], heldout_names):
            d = draw_heldout(ax, series, metric)
            _finish(ax, d, f"held-out {metric} (points: evaluations)", "training step", metric, "not evaluated",
                    runs_series=series)
            drawn["heldout"][metric] = d
        plots.append(save(fig, out / "heldout.png"))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    d = draw_loss(ax, series)
    if d["heldout"] or d["train"]:
        _finish(ax, d["heldout"] or d["train"], "loss (points: held-out evaluations)", "training step", "loss", "",
                _loss_notes(series), runs_series=series)
        drawn["loss"] = d
        plots.append(save(fig, out / "loss.png"))
    else:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    d = draw_rows(ax, series)
    if d:
        _finish(ax, d, _rows_title(series), "training step", "rows", "", runs_series=series,
                y_from_zero=True)
        drawn["rows_noised"] = d
        plots.append(save(fig, out / "rows_noised.png"))
    else:
        plt.close(fig)
    phases = {run["name"]: run["summary"]["phase_ms_median"] for run in runs if run["summary"].get("phase_ms_median")}
    if phases:
        plots.append(plot_phases(phases, out / "phases.png", title="where a step's time goes"))

    md = _markdown(runs, series, drawn.get("epsilon") or drawn["summary"]["epsilon"], [Path(p).name for p in plots],
                   accountants)
    (out / "report.md").write_text(md)
    data = {name: {k: v for k, v in rs.items() if k != "accounting"} for name, rs in series.items()}
    for name, rs in series.items():
        data[name]["final"] = rs["accounting"].get("final", {})
    (out / "report_data.json").write_text(json.dumps(_strict({"series": data, "drawn": drawn}), indent=1,
                                                     allow_nan=False))
    return {"markdown": str(out / "report.md"), "plots": plots, "summary_plot": summary_plot,
            "data": str(out / "report_data.json"), "runs": [str(r["dir"]) for r in runs], "series": series,
            "drawn": drawn}


def _strict(v):
    """Strict JSON: non-finite floats as null, paths and other objects as strings."""
    if isinstance(v, dict):
        return {str(k): _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


def _markdown(runs, series, eps_drawn, plot_names, accountants: Sequence[str] = ACCOUNTANT_NAMES) -> str:
    lines = ["# widedp run report", ""]
    lines += ["| run | mode | steps | examples/s | step ms (median) | test metrics | Bayes AUC | ε (recorded) | δ |",
              "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for run in runs:
        s = run["summary"]
        mode = f"{s.get('mode')}/{s['selection']}" if s.get("selection") else s.get("mode")
        metrics = ", ".join(f"{k} {_fmt(v)}" for k, v in (s.get("test_metrics") or {}).items())
        eps = f"{_fmt(s.get('epsilon'))} ({s.get('accountant')})" if series[run["name"]]["private"] else "∞ (non-private)"
        lines.append(f"| {run['name']} | {mode} | {s.get('steps')} | {_fmt(s.get('examples_per_sec'))} | "
                     f"{_fmt(s.get('step_time_ms_median'))} | {metrics} | {_fmt(s.get('bayes_auc'))} | "
                     f"{eps} | {_fmt(s.get('delta'), 3)} |")
    lines += ["", "## Privacy: the same ledger under each accountant", "",
              "| run | " + " | ".join(accountants) + " |", "|---|" + "---:|" * len(accountants)]
    for run in runs:
        acc = series[run["name"]]["accounting"]
        if not acc:
            lines.append(f"| {run['name']} | " + " | ".join(["(non-private)"] * len(accountants)) + " |")
            continue
        cells = []
        for name in accountants:
            e = acc["final"].get(name, {})
            if "unsupported" in e:
                cells.append("unsupported")
            else:
                cell = _fmt(e.get("epsilon"))
                if e.get("valid") is False:
                    cell += " (conditions violated: not a valid bound)"
                cells.append(cell)
        lines.append(f"| {run['name']} | " + " | ".join(cells) + " |")
    notes = []
    for run in runs:
        e = series[run["name"]]["accounting"].get("final", {}).get("paper", {})
        if e.get("violations"):
            notes.append(f"- {run['name']}: paper bound's conditions violated: " + "; ".join(e["violations"]))
    if notes:
        lines += [""] + notes
    lines += ["", "## ε over the run (epsilon.png, summary.png)", ""]
    for run in runs:
        name, rs = run["name"], series[run["name"]]
        if not rs["private"]:
            lines.append(f"- {name}: non-private — no privacy guarantee (ε = ∞), no ε plotted.")
            continue
        eps = rs.get("epsilon")
        if not eps:
            lines.append(f"- {name}: ε curves not computed.")
            continue
        plotted = eps_drawn.get("plotted", {}).get(name, [])
        lines.append(f"- {name}: plotted: {', '.join(plotted) if plotted else 'none'} (x: {eps['x_label']}"
                     + (f"; target ε = {_fmt(eps['target_epsilon'])} drawn as a horizontal line" if eps.get("target_epsilon")
                        is not None else "") + ").")
        for acc, reason in eps_drawn.get("not_plotted", {}).get(name, {}).items():
            lines.append(f"  - not plotted: {acc} — {reason}")
        for acc in plotted:
            if eps["accountants"][acc]["reason"]:
                lines.append(f"  - {acc}: {eps['accountants'][acc]['reason']}")
        m = eps["mapping"]
        if m.get("mapped"):
            one_time = m.get("one_time") or {}
            before = one_time.get(0, 0)
            between = sum(n for k, n in one_time.items() if k > 0)
            lines.append(f"  - ledger: {m['events']} charged events over {m['steps']} steps: {before} one-time "
                         f"event(s) charged before step 0" + (f", {between} between steps" if between else "")
                         + f", {m['events_per_step']} event(s) per step" + (f"; {m['note']}" if m.get("note") else "")
                         + ".")
        else:
            lines.append(f"  - {m.get('note')}")
    lines += ["", "Held-out metrics are drawn as points at the steps the evaluations ran (`train.eval_every` lines "
              "of metrics.jsonl and the final evaluation of summary.json); rows noised per step are "
              "metrics.jsonl's `rows_selected` at the logged steps."]
    for run in runs:
        h = series[run["name"]]["heldout"]
        if h["steps"]:
            lines.append(f"- {run['name']}: held-out evaluations at steps {', '.join(str(s) for s in h['steps'])}.")
        else:
            lines.append(f"- {run['name']}: no held-out evaluations.")
        if series[run["name"]]["train_loss"] is None:
            lines.append(f"- {run['name']}: training batch loss not recorded (train.debug_metrics = false).")
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
