"""The Python API: what `widedp train / evaluate / export / epsilon / calibrate` do, as functions.

    import widedp
    cfg = widedp.load_config("configs/quickstart.toml", ["train.steps=50"])
    run = widedp.train(cfg, "runs/nb-1")          # a RunResult: run_dir, summary, epsilon, test_metrics
    widedp.evaluate(run.run_dir)                   # the checkpoint on the test split
    widedp.export(run.run_dir, "runs/nb-1-release")
    widedp.epsilon(noise_multiplier=1.0, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)
    widedp.calibrate(target_epsilon=3.0, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)

Each function is the CLI command's own code path (trainer/run/train.py, trainer/release/export.py, the
`widedp epsilon` / `calibrate` commands of trainer/cli/__init__.py), so a notebook and `widedp ...` produce
the same files and numbers, and the contracts hold here too (a run directory is written by one
run, the ledger only grows).

Sampling, the way Opacus users state it: `batch_size` B and `dataset_size` n give the Poisson
rate q = B/n (B is the *expected* batch, docs/DESIGN.md §1), and `epochs` E gives T = ⌈E·n/B⌉
steps; or give `sample_rate` and `steps` directly (one form, not both).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from widedp.trainer.config import Config
from widedp.trainer.config import load_config as _load_config

ConfigLike = Union[Config, str, Path]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A finished training run: its directory and its summary.json (docs/DESIGN.md §4)."""

    run_dir: Path
    summary: Mapping[str, Any]

    @property
    def epsilon(self) -> Optional[float]:
        """ε spent (None for a non-private run)."""
        eps = self.summary.get("epsilon")
        return None if eps is None or not math.isfinite(eps) else float(eps)

    @property
    def test_metrics(self) -> Mapping[str, float]:
        return self.summary.get("test_metrics", {})


def load_config(path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = ()) -> Config:
    """A config from a TOML file (or the defaults) with `section.key=value` overrides, checked."""
    return _load_config(None if path is None else str(path), list(overrides))


def train(config: ConfigLike, run_dir: Optional[Union[str, Path]] = None, *, overrides: Sequence[str] = (),
          resume: bool = False, progress: bool = False) -> RunResult:
    """Train per `config` (a Config, or a TOML path with `overrides`) into `run_dir` (default: the
    config's `run_dir`), which must not hold a run unless `resume` (then the run continues from its
    checkpoint, its ledger verified). Returns the run's summary."""
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


def evaluate(run_dir: Union[str, Path]) -> dict:
    """The run's checkpoint evaluated on its test split (as `widedp evaluate --run-dir`)."""
    from widedp.trainer.run.train import evaluate as _evaluate

    return _evaluate(Path(run_dir))


def export(run_dir: Union[str, Path], out_dir: Union[str, Path]):
    """The releasable model and its privacy report (as `widedp export RUN_DIR OUT_DIR`)."""
    from widedp.trainer.release.export import export_run

    return export_run(Path(run_dir), Path(out_dir))


def sampling(*, sample_rate: Optional[float] = None, steps: Optional[int] = None, batch_size: Optional[float] = None,
             dataset_size: Optional[int] = None, epochs: Optional[float] = None,
             names: Optional[Mapping[str, str]] = None) -> tuple[float, int]:
    """(q, T) from either (sample_rate, steps) or (batch_size, dataset_size, epochs): q = B/n,
    T = ⌈E·n/B⌉ — B the expected Poisson batch. Refuses a mix of the two forms or a missing value,
    naming the parameter (as `names` spells it: the CLI passes its flags)."""
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


def _command(argv: list[str], sample_rate, steps, batch_size, dataset_size, epochs) -> dict:
    from widedp.trainer.cli import main_result

    q, t = sampling(sample_rate=sample_rate, steps=steps, batch_size=batch_size, dataset_size=dataset_size,
                    epochs=epochs)
    return main_result(argv + ["--sample-rate", repr(q), "--steps", str(t)])


def epsilon(*, noise_multiplier: float, delta: float, accountant: str = "auto", sample_rate: Optional[float] = None,
            steps: Optional[int] = None, batch_size: Optional[float] = None, dataset_size: Optional[int] = None,
            epochs: Optional[float] = None) -> dict:
    """ε of T Poisson-subsampled Gaussian steps (no selection), as `widedp epsilon` prints it."""
    return _command(["epsilon", "--noise-multiplier", repr(float(noise_multiplier)), "--delta", repr(float(delta)),
                     "--accountant", accountant], sample_rate, steps, batch_size, dataset_size, epochs)


def calibrate(*, target_epsilon: float, delta: float, accountant: str = "auto", sample_rate: Optional[float] = None,
              steps: Optional[int] = None, batch_size: Optional[float] = None, dataset_size: Optional[int] = None,
              epochs: Optional[float] = None) -> dict:
    """The noise multiplier that spends exactly `target_epsilon` (no selection), as `widedp calibrate`."""
    return _command(["calibrate", "--target-epsilon", repr(float(target_epsilon)), "--delta", repr(float(delta)),
                     "--accountant", accountant], sample_rate, steps, batch_size, dataset_size, epochs)
