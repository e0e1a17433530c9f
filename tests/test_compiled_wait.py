"""How a process waits on a compiled graph's channel (trainer/cluster/compiled_wait.py): the backoff
read returns what one look returns, looks again after growing sleeps, and keeps the read's
timeout. The compiled plane with it (and the shard actors' mode) is tested in
tests/test_engine.py::test_ray_matches_in_process."""

import pytest

from widedp.trainer.cluster import compiled_wait as cw


class Timeout(Exception):
    pass


class FakeChannel:
    """A channel whose value arrives after `empty_looks` looks; a fake clock that sleeps advance."""

    def __init__(self, empty_looks, value="v"):
        self.empty_looks, self.value = empty_looks, value
        self.looks, self.timeouts, self.now, self.sleeps = 0, [], 0.0, []

    def read_once(self, timeout):
        self.looks += 1
        self.timeouts.append(timeout)
        if self.looks > self.empty_looks:
            return self.value
        raise Timeout()

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def read(ch, timeout, **kw):
    return cw.backoff_read(ch.read_once, timeout, Timeout, clock=ch.clock, sleep=ch.sleep, **kw)


@pytest.mark.parametrize("timeout", [None, -1, 10.0])
def test_the_backoff_read_returns_the_value_once_there_after_sleeps_that_double_up_to_the_cap(timeout):
    ch = FakeChannel(empty_looks=8)
    assert read(ch, timeout, first_pause_s=1e-5, max_pause_s=1e-4) == "v"
    assert ch.looks == 9 and set(ch.timeouts) == {0}  # every look is Ray's read with a zero timeout
    assert ch.sleeps == pytest.approx([1e-5, 2e-5, 4e-5, 8e-5, 1e-4, 1e-4, 1e-4, 1e-4])


def test_a_long_wait_moves_to_the_idle_pause_and_a_resumed_wait_keeps_its_age():
    """Past long_wait_s the pauses grow to idle_pause_s; a read that continues a wait begun long
    ago (Ray's graph loop reads with a 0.1 s timeout, again and again) starts at the idle pause."""
    kw = dict(first_pause_s=1e-3, max_pause_s=2e-3, long_wait_s=0.01, idle_pause_s=8e-3)
    ch = FakeChannel(empty_looks=10)
    assert read(ch, None, **kw) == "v"
    assert ch.sleeps == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3, 4e-3, 8e-3, 8e-3])
    resumed = FakeChannel(empty_looks=2)
    resumed.now = 5.0
    assert read(resumed, 1.0, waiting_since=4.0, **kw) == "v"
    assert resumed.sleeps == pytest.approx([8e-3, 8e-3])


def test_a_value_already_there_is_read_without_sleeping():
    ch = FakeChannel(empty_looks=0)
    assert read(ch, None) == "v" and ch.sleeps == [] and ch.looks == 1


def test_the_read_timeout_is_kept_a_last_look_made_at_the_deadline_and_ray_s_error_raised():
    ch = FakeChannel(empty_looks=10**9)
    with pytest.raises(Timeout):
        read(ch, 0.01, first_pause_s=1e-3, max_pause_s=4e-3)
    assert ch.now == pytest.approx(0.01)  # slept exactly up to the deadline, never past it
    assert ch.sleeps[-1] <= 4e-3 and sum(ch.sleeps) == pytest.approx(0.01)
    # a value arriving at the last look is still returned
    ch = FakeChannel(empty_looks=3)  # looks at 0, 1, 3 ms empty; the fourth, at the 7 ms deadline, has it
    assert read(ch, 1e-3 + 2e-3 + 4e-3, first_pause_s=1e-3, max_pause_s=1.0) == "v"


def test_a_zero_timeout_is_one_look():
    ch = FakeChannel(empty_looks=1)
    with pytest.raises(Timeout):
        read(ch, 0)
    assert ch.looks == 1 and ch.sleeps == []


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="cluster.compiled_wait must be one of"):
        cw.set_compiled_wait("sleepy")


def test_the_channel_read_follows_the_process_mode_and_spin_is_ray_s_own_read(monkeypatch):
    """The replaced Channel.read calls Ray's read with the caller's timeout under "spin" and
    with zero timeouts under "backoff"; switching back restores Ray's behaviour."""
    pytest.importorskip("ray")
    from ray.exceptions import RayChannelTimeoutError
    from ray.experimental.channel import shared_memory_channel as smc

    before = cw.compiled_wait()
    cw.set_compiled_wait("spin")  # installs the replacement (idempotent)
    replaced = smc.Channel.read
    assert getattr(replaced, "_widedp_wait", False)
    seen = []
    answers = iter([RayChannelTimeoutError("empty"), RayChannelTimeoutError("empty"), "value"])

    def ray_read(self, timeout=None):
        seen.append(timeout)
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    # the replacement closes over Ray's read: rebuild it around the fake one
    monkeypatch.setattr(smc.Channel, "read", ray_read)
    try:
        cw.set_compiled_wait("backoff")  # sees a read that is not ours: wraps the fake
        assert smc.Channel.read is not ray_read
        channel = type("FakeRayChannel", (), {})()
        assert smc.Channel.read(channel, 5.0) == "value" and seen == [0, 0, 0]
        assert channel._widedp_waiting_since is None  # a value came: the next read starts a new wait
        seen.clear()
        answers = iter(["spun"])
        cw.set_compiled_wait("spin")
        assert smc.Channel.read(object(), 5.0) == "spun" and seen == [5.0]
    finally:
        monkeypatch.undo()
        cw.set_compiled_wait(before)
    assert smc.Channel.read is replaced
