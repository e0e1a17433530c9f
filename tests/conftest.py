"""Shared fixtures of the end-to-end tests."""

import pytest

# The statistical harness tests/privacy_audit.py, bound to its name before any test module puts
# benchmarks/ (which has a privacy_audit.py of its own) first on sys.path: a lazy
# `from privacy_audit import ...` then finds the harness in whatever order the tests run.
import privacy_audit  # noqa: F401

from widedp.trainer.data import synth_ctr


@pytest.fixture(scope="module")
def ctr_dir(tmp_path_factory):
    """A small planted-truth CTR data set (3,000 examples, 26 tables of 500 rows)."""
    path = tmp_path_factory.mktemp("data") / "ctr"
    synth_ctr(path, num_examples=3000, table_sizes=500, seed=3)
    return path


@pytest.fixture(scope="module")
def user_logs_dir(tmp_path_factory):
    """Click logs with users (`widedp synth logs`: 800 users, 3 days, heavy-tailed examples per
    user, list-valued history) converted by their schema, the last day as the test split."""
    from widedp.trainer.data.synthetic.synth_logs import synth_logs
    from widedp.trainer.data.convert.table import convert_table

    root = tmp_path_factory.mktemp("user_logs")
    truth = synth_logs(root / "logs", users=800, days=3, seed=2)
    convert_table([str(root / "logs" / "day=*" / "*.parquet")], root / "data", schema=root / "logs" / "schema.toml",
                  test_after=truth["evaluation_day"]["date"])
    return root / "data"
