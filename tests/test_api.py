"""The Python API (widedp/trainer/api.py): the README's notebook block runs as written, the
functions are the CLI's code paths, and sampling can be stated as Opacus users state it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import widedp
from widedp.trainer.cli import main

REPO = Path(__file__).resolve().parents[1]


def _readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"README has no python block after <!-- {marker} -->"
    return match.group(1)


def test_the_readme_notebook_block_runs_as_written(tmp_path):
    """In a fresh directory (its relative paths land there), with the repository's configs."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    out = subprocess.run([sys.executable, "-c", _readme_block("python-api")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    eps, auc = map(float, lines[0].split())
    summary = json.loads((tmp_path / "runs/notebook-1/summary.json").read_text())
    assert eps == pytest.approx(summary["epsilon"]) and 0 < eps <= 8.0 and 0.5 < auc <= 1.0
    assert (tmp_path / "runs/notebook-1-release/model.json").exists()
    assert float(lines[-2]) > 0 and float(lines[-1]) > 0


def test_sampling_as_opacus_users_state_it():
    assert widedp.sampling(batch_size=256, dataset_size=50_000, epochs=3) == (256 / 50_000, 586)
    assert widedp.sampling(sample_rate=0.01, steps=7) == (0.01, 7)
    with pytest.raises(ValueError, match="not both"):
        widedp.sampling(sample_rate=0.01, batch_size=256, dataset_size=100, epochs=1)
    with pytest.raises(ValueError, match="epochs missing"):
        widedp.sampling(batch_size=256, dataset_size=50_000)
    with pytest.raises(ValueError, match=r"batch_size must be in \(0, dataset_size = 100\]"):
        widedp.sampling(batch_size=256, dataset_size=100, epochs=1)


def test_epsilon_and_calibrate_return_numbers_that_agree_with_the_cli_in_either_form(capsys):
    by_epochs = widedp.epsilon(noise_multiplier=1.0, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)
    by_rate = widedp.epsilon(noise_multiplier=1.0, sample_rate=256 / 50_000, steps=586, delta=1e-6)
    assert isinstance(by_epochs, float) and by_epochs == by_rate
    assert main(["epsilon", "--noise-multiplier", "1", "--delta", "1e-6", "--batch-size", "256",
                 "--dataset-size", "50000", "--epochs", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == by_epochs
    sigma = widedp.calibrate(target_epsilon=by_epochs, batch_size=256, dataset_size=50_000, epochs=3, delta=1e-6)
    assert isinstance(sigma, float) and sigma == pytest.approx(1.0, rel=1e-3)
    assert main(["calibrate", "--target-epsilon", str(by_epochs), "--delta", "1e-6", "--batch-size", "256",
                 "--dataset-size", "50000", "--epochs", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["noise_multiplier"] == sigma
    assert main(["calibrate", "--target-epsilon", "2", "--delta", "1e-6", "--batch-size", "256", "--steps", "3"]) == 2
    assert "give --sample-rate and --steps, or --batch-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="accountant must be one of"):
        widedp.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-6, accountant="exact")
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        widedp.calibrate(target_epsilon=1.0, sample_rate=0.01, steps=10, delta=2.0)


def test_the_api_leaves_logging_alone():
    """A notebook's logging configuration is the notebook's: the API functions set no level."""
    import logging

    widedp_logger = logging.getLogger("widedp")
    before = (widedp_logger.level, list(widedp_logger.handlers), logging.getLogger().level)
    widedp.epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=1e-6, accountant="rdp")
    widedp.calibrate(target_epsilon=1.0, sample_rate=0.01, steps=10, delta=1e-6, accountant="rdp")
    assert (widedp_logger.level, list(widedp_logger.handlers), logging.getLogger().level) == before


def test_every_public_name_is_marked_and_documented_with_args_and_returns():
    import inspect

    from widedp.public import is_public

    for name in widedp.__all__:
        obj = getattr(widedp, name)
        assert is_public(obj), f"widedp.{name} is in __all__ but not marked @public"
        doc = inspect.getdoc(obj) or ""
        if inspect.isfunction(obj):
            assert "Args:" in doc and "Returns:" in doc, f"widedp.{name}: its docstring needs Args: and Returns:"
        else:
            assert "Attributes:" in doc, f"widedp.{name}: its docstring needs Attributes:"


def test_import_widedp_is_light():
    """`import widedp` loads no torch, Ray or accountant until an API function is used."""
    out = subprocess.run([sys.executable, "-c", "import sys, widedp; print(sorted(m for m in ('torch', 'ray', "
                          "'opacus', 'dp_accounting') if m in sys.modules))"], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
