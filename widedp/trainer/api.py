"""The Python API: the stable public surface (marked `@public`); the `widedp` command line
(trainer/cli/) is a client of the same functions.

    import widedp
    cfg = widedp.load_config("configs/quickstart.toml", ["train.steps=50"])
    run = widedp.train(cfg, "runs/nb-1")          # a RunResult: run_dir, summary, epsilon, test_metrics
    widedp.evaluate(run.run_dir)                   # the checkpoint on the test split
    widedp.export(run.run_dir, "runs/nb-1-release")
    widedp.epsilon(noise_multiplier=1.0, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)  # a float
    widedp.calibrate(target_epsilon=3.0, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)  # σ, a float

`train`, `evaluate` and `export` are the code paths `widedp train / evaluate / export` run
(trainer/run/train.py, trainer/release/export.py), so a notebook and the command line produce the
same files and numbers, and the contracts hold here too (a run directory is written by one run,
the ledger only grows). `epsilon` and `calibrate` return numbers and compute them with the
accountants directly; nothing here configures logging (the command line does, for itself).

Sampling, the way Opacus users state it: `batch_size` B and `dataset_size` n give the Poisson
rate q = B/n (B is the *expected* batch, docs/DESIGN.md §1), and `epochs` E gives T = ⌈E·n/B⌉
steps; or give `sample_rate` and `steps` directly (one form, not both).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from widedp.public import public
from widedp.trainer.config import Config
from widedp.trainer.config import load_config as _load_config

ConfigLike = Union[Config, str, Path]


@public
@dataclasses.dataclass(frozen=True)
class RunResult:
    """A finished training run: its directory and its summary.json (docs/DESIGN.md §4).

    Attributes:
        run_dir: the run directory (config.json, ledger.json, journal.jsonl, checkpoint.pt, ...).
        summary: summary.json as a mapping (`epsilon`, `delta`, `test_metrics`, ...).
    """

    run_dir: Path
    summary: Mapping[str, Any]

    @property
    def epsilon(self) -> Optional[float]:
        """ε spent (None for a non-private run)."""
        eps = self.summary.get("epsilon")
        return None if eps is None or not math.isfinite(eps) else float(eps)

    @property
    def test_metrics(self) -> Mapping[str, float]:
        """The held-out test split's metrics (auc, logloss, ece; or loss for CBOW)."""
        return self.summary.get("test_metrics", {})


@public
def load_config(path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = ()) -> Config:
    """A config from a TOML file (or the defaults) with `section.key=value` overrides.

    Args:
        path: a TOML config (its `base = "other.toml"` merged underneath); None: the defaults.
        overrides: `section.key=value` strings, as `widedp train --set` takes them.

    Returns:
        The `Config` (every key and type checked; `validate()` runs when it trains).

    Raises:
        ConfigError: (a ValueError) a missing file, bad TOML, an unknown section or key, a wrong
            type — naming the file or `--set` and the key.
    """
    return _load_config(None if path is None else str(path), list(overrides))


@public
def train(config: ConfigLike, run_dir: Optional[Union[str, Path]] = None, *, overrides: Sequence[str] = (),
          resume: bool = False, progress: bool = False) -> RunResult:
    """Train privately per `config` into `run_dir`, as `widedp train` does.

    The guarantee is (ε, δ)-DP for the config's unit (privacy.unit: add/remove one example, or
    one user with all of their examples), every step's event charged before its release; what ε
    means is fixed when the run first starts (a resume that changes it is refused).

    Args:
        config: a `Config`, or a TOML path (with `overrides`).
        run_dir: the run directory (default: the config's `run_dir`); it must not hold a run
            unless `resume`.
        overrides: `section.key=value` strings (with a TOML path only).
        resume: continue the run in `run_dir` from its checkpoint, its records verified.
        progress: show a progress bar.

    Returns:
        A `RunResult` (the run directory and its summary).

    Raises:
        ValueError: a bad config, a run directory that holds a run, a refused resume (a ledger
            that does not extend its records, a changed meaning of ε), an unreachable target ε.
    """
    from widedp.trainer.run.train import train as _train

    if isinstance(config, Config):
        if overrides:
            raise ValueError("overrides apply to a config file; set the fields of a Config object directly")
        cfg = config
    else:
        cfg = load_config(config, overrides)
    where = run_dir if run_dir is not None else cfg.run_dir
    if not where:
        raise ValueError("run_dir is required (or set run_dir in the config)")
    return RunResult(Path(where), _train(cfg, Path(where), resume=resume, progress=progress))


@public
def evaluate(run_dir: Union[str, Path]) -> dict:
    """The run's checkpoint evaluated on its held-out test split (as `widedp evaluate`).

    Args:
        run_dir: a run directory with a checkpoint.

    Returns:
        {"run_dir", "steps", "test_metrics", "bayes_auc", "epsilon"}.

    Raises:
        ValueError: no readable checkpoint there, or one that does not match its config and data.
    """
    from widedp.trainer.run.train import evaluate as _evaluate

    return _evaluate(Path(run_dir))


@public
def export(run_dir: Union[str, Path], out_dir: Union[str, Path]) -> dict:
    """Write the releasable model and its privacy report (as `widedp export RUN_DIR OUT_DIR`).

    Only what the privacy report covers is written (weights, a plain-PyTorch loader, the config
    without secrets, PRIVACY.md); the run's records are verified first, as a resume verifies them.

    Args:
        run_dir: a finished run directory.
        out_dir: a new (or empty) directory.

    Returns:
        What was written: {"out_dir", "files", "epsilon", "delta", ...}.

    Raises:
        ValueError: a run whose records do not verify, or an out_dir that holds files.
    """
    from widedp.trainer.release.export import export_run

    return export_run(Path(run_dir), Path(out_dir))


@public
def sampling(*, sample_rate: Optional[float] = None, steps: Optional[int] = None, batch_size: Optional[float] = None,
             dataset_size: Optional[int] = None, epochs: Optional[float] = None,
             names: Optional[Mapping[str, str]] = None) -> tuple[float, int]:
    """(q, T) from either (sample_rate, steps) or (batch_size, dataset_size, epochs).

    q = B/n and T = ⌈E·n/B⌉, B the *expected* Poisson batch.

    Args:
        sample_rate: q, the direct form (with `steps`).
        steps: T, the direct form.
        batch_size: B, the Opacus form (with `dataset_size` and `epochs`).
        dataset_size: n, the Opacus form.
        epochs: E, the Opacus form.
        names: how to spell each parameter in errors (the CLI passes its flags).

    Returns:
        (q, T).

    Raises:
        ValueError: a mix of the two forms, or a missing or out-of-range value, naming it.
    """
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    direct = {"sample_rate": sample_rate, "steps": steps}
    opacus = {"batch_size": batch_size, "dataset_size": dataset_size, "epochs": epochs}
    given = [name(k) for k, v in {**direct, **opacus}.items() if v is not None]
    forms = (f"{name('sample_rate')} and {name('steps')}, or {name('batch_size')}, {name('dataset_size')} "
             f"and {name('epochs')}")
    if any(v is not None for v in direct.values()) and any(v is not None for v in opacus.values()):
        raise ValueError(f"give {forms} — not both (got {', '.join(given)})")
    if any(v is not None for v in opacus.values()):
        missing = [name(k) for k, v in opacus.items() if v is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing: {name('batch_size')}, {name('dataset_size')} and "
                             f"{name('epochs')} go together")
        assert batch_size is not None and dataset_size is not None and epochs is not None
        if not (int(dataset_size) == dataset_size and dataset_size >= 1):
            raise ValueError(f"{name('dataset_size')} must be a positive integer, got {dataset_size!r}")
        if not 0 < batch_size <= dataset_size:
            raise ValueError(f"{name('batch_size')} must be in (0, {name('dataset_size')} = {dataset_size}], "
                             f"got {batch_size!r}")
        if not (epochs > 0 and math.isfinite(epochs)):
            raise ValueError(f"{name('epochs')} must be > 0, got {epochs!r}")
        q = float(batch_size) / int(dataset_size)
        return q, max(1, math.ceil(float(epochs) / q - 1e-9))
    missing = [name(k) for k, v in direct.items() if v is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: give {forms}")
    assert sample_rate is not None and steps is not None
    return float(sample_rate), int(steps)


def _check_privacy_args(delta: float, accountant: str) -> None:
    from widedp.accounting.base import accountant_names

    if not (isinstance(delta, (int, float)) and not isinstance(delta, bool) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in accountant_names():
        raise ValueError(f"accountant must be one of {accountant_names()}, got {accountant!r}")


@public
def epsilon(*, noise_multiplier: float, delta: float, accountant: str = "auto", sample_rate: Optional[float] = None,
            steps: Optional[int] = None, batch_size: Optional[float] = None, dataset_size: Optional[int] = None,
            epochs: Optional[float] = None) -> float:
    """ε spent by T Poisson-subsampled Gaussian steps (DP-SGD, no selection), at δ.

    Neighbouring relation: add/remove one example (one unit at user level). Sensitivity: the
    clip norm S1 of the per-example gradients (sums normalized by the expected batch size), so
    `noise_multiplier` σ is the noise std divided by that sensitivity. The same ε as `widedp
    epsilon` prints for these arguments and as a training ledger charges for such steps.

    Args:
        noise_multiplier: σ, the noise std over the ℓ2 sensitivity.
        delta: δ in (0, 1).
        accountant: "auto" (PLD where it applies, else RDP), "rdp", "pld", "prv" or "paper".
        sample_rate: the Poisson rate q (with `steps`).
        steps: the number of steps T (with `sample_rate`).
        batch_size: the expected batch B (with `dataset_size` and `epochs`: q = B/n).
        dataset_size: n (with `batch_size` and `epochs`).
        epochs: E (with `batch_size` and `dataset_size`: T = ⌈E·n/B⌉).

    Returns:
        ε as a float.

    Raises:
        ValueError: a missing or mixed sampling form, δ outside (0, 1), an unknown accountant.
    """
    from widedp.accounting import make_accountant, step_event

    _check_privacy_args(delta, accountant)
    q, t = sampling(sample_rate=sample_rate, steps=steps, batch_size=batch_size, dataset_size=dataset_size,
                    epochs=epochs)
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier!r}")
    return float(make_accountant(accountant).epsilon([(step_event(q, float(noise_multiplier)), t)], float(delta)))


@public
def calibrate(*, target_epsilon: float, delta: float, accountant: str = "auto", sample_rate: Optional[float] = None,
              steps: Optional[int] = None, batch_size: Optional[float] = None, dataset_size: Optional[int] = None,
              epochs: Optional[float] = None) -> float:
    """The noise multiplier σ that spends at most `target_epsilon` over T Poisson-subsampled
    Gaussian steps (DP-SGD, no selection), as Opacus's `get_noise_multiplier`.

    Neighbouring relation and sensitivity as `epsilon`; the same σ as `widedp calibrate` prints.

    Args:
        target_epsilon: the ε to spend, > 0.
        delta: δ in (0, 1).
        accountant: as `epsilon`.
        sample_rate: as `epsilon`.
        steps: as `epsilon`.
        batch_size: as `epsilon`.
        dataset_size: as `epsilon`.
        epochs: as `epsilon`.

    Returns:
        σ as a float (ε(σ) ≤ target_epsilon, within the calibration's tolerance of it).

    Raises:
        ValueError: bad arguments as `epsilon`; `UnreachableTargetError` (a ValueError) when no σ
            reaches the target (the accountant's (ε, δ) conversion alone spends more), naming
            the smallest reachable ε.
    """
    from widedp.accounting.calibration import UnreachableTargetError
    from widedp.selection.calibration import calibrate as calibrate_step

    _check_privacy_args(delta, accountant)
    q, t = sampling(sample_rate=sample_rate, steps=steps, batch_size=batch_size, dataset_size=dataset_size,
                    epochs=epochs)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    try:
        return float(calibrate_step(float(target_epsilon), float(delta), q, t, accountant=accountant).noise_multiplier)
    except UnreachableTargetError as exc:
        raise exc.renamed("target_epsilon") from None
