"""The suite's own scheduling: `make test` deals tests to two xdist workers with --dist loadgroup,
and the modules that share an expensive runtime (a Ray runtime, the two-node cluster, trained
runs) keep their tests on one worker by an `xdist_group` mark. A pytest / pytest-xdist pair that
ignores the mark runs those runtimes once per worker, silently (pytest 9.2 with xdist 3.8 did:
pyproject.toml pins pytest < 9); this test fails instead."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite_scheduling_probe")


def test_an_xdist_group_mark_reaches_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup (make test runs one)")
    # xdist's loadgroup scheduler reads the group from the node id's "@group" suffix
    assert request.node.nodeid.endswith("@suite_scheduling_probe"), request.node.nodeid
