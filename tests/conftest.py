"""Shared fixtures of the end-to-end tests."""

import pytest

from widedp.trainer.data import synth_ctr


@pytest.fixture(scope="module")
def ctr_dir(tmp_path_factory):
    """A small planted-truth CTR data set (3,000 examples, 26 tables of 500 rows)."""
    path = tmp_path_factory.mktemp("data") / "ctr"
    synth_ctr(path, num_examples=3000, table_sizes=500, seed=3)
    return path
