"""How a process waits on a compiled Ray graph's channel: Ray's spinning read, or polls with
growing sleeps between them (`cluster.compiled_wait`).

Ray 2.60's shared-memory channel read (`PlasmaObjectHeader::ReadAcquire`) waits for the next
value by spinning on `sched_yield`: an actor waiting on its input channel keeps a core busy
(measured here: 1.01 cores for one idle echo actor; 0.06 with the backoff below, where a
400 kB round trip takes 0.61 ms against 0.35 ms spinning). A step's rounds leave the shards
waiting while the coordinator computes and the coordinator waiting while the shards compute,
so with fewer cores than processes the spinners take the cores the step's compute needs
(docs/RESULTS.md §2d: the compiled plane 21–37% faster with the backoff than spinning, 3
repeats at b = 1,024, 4,096 and 16,384; docs/DESIGN.md §2.2).

"backoff" replaces the channel read in the calling process: it asks with a zero timeout (one
look at the channel, Ray's own code) and, while no value is there, sleeps `FIRST_PAUSE_S`,
doubling up to `MAX_PAUSE_S` (up to `IDLE_PAUSE_S` once the wait has lasted `LONG_WAIT_S`),
until the value arrives or the read's timeout passes (then Ray's `RayChannelTimeoutError`, as
before). What is read is unchanged — the same call returns the same object — so the data
plane's answers are the same bit for bit; only the latency of noticing a value grows, by at
most `MAX_PAUSE_S` while a round is in flight. The cap trades that latency against the CPU of
the wake-ups (26–39 µs each on this machine): chosen on the b = 1,024 step (DESIGN §2.2). "spin" leaves Ray's read as it is
(for machines with a core to spare per waiting process).

The replacement is per process and idempotent; the mode can be switched back. It touches
nothing a privacy guarantee relies on (transport only).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from widedp.trainer.config import COMPILED_WAITS  # cluster.compiled_wait's values (the config checks them)

FIRST_PAUSE_S = 20e-6
MAX_PAUSE_S = 200e-6  # while a wait is short (a round in flight): ≤ 0.2 ms late
LONG_WAIT_S = 0.05
IDLE_PAUSE_S = 2e-3  # after 50 ms of waiting (an idle process): ≤ 2 ms late, little CPU

_mode = "spin"  # this process's mode; the replaced read consults it on every call


def backoff_read(read_once, timeout: Optional[float], timeout_error: type[BaseException], waiting_since: Optional[float] = None,
                 first_pause_s: float = FIRST_PAUSE_S, max_pause_s: float = MAX_PAUSE_S,
                 long_wait_s: float = LONG_WAIT_S, idle_pause_s: float = IDLE_PAUSE_S,
                 clock=time.monotonic, sleep=time.sleep) -> Any:
    """The value `read_once(0)` returns once one is there: look, and while `read_once` raises
    `timeout_error`, sleep first_pause_s, 2·first_pause_s, … up to max_pause_s — up to
    idle_pause_s once the wait has lasted long_wait_s (an idle process) — and look again.
    `waiting_since`: when the wait began (`clock()` time; default now) — a caller that reads
    with a short timeout in a loop, as Ray's graph loop does (0.1 s), keeps its wait's age.
    `timeout` None or -1: wait for ever; 0: one look; else raise `timeout_error` once `timeout`
    seconds have passed (a last look is made at the deadline)."""
    if timeout == 0:
        return read_once(0)
    start = clock()
    since = start if waiting_since is None else waiting_since
    deadline = None if timeout is None or timeout == -1 else start + timeout
    pause = first_pause_s if start - since < long_wait_s else idle_pause_s
    while True:
        try:
            return read_once(0)
        except timeout_error:
            now = clock()
            if deadline is not None:
                left = deadline - now
                if left <= 0:
                    raise
                sleep(min(pause, left))
            else:
                sleep(pause)
            pause = min(pause * 2, max_pause_s if now - since < long_wait_s else idle_pause_s)


def set_compiled_wait(mode: str) -> None:
    """Make this process's compiled-graph channel reads `mode` ("backoff" or "spin"). The first
    call replaces `Channel.read` with one that follows the process's current mode (and keeps,
    per channel, when its current wait began: Ray's graph loop reads with a 0.1 s timeout in a
    loop, and an idle wait must not restart its backoff every 0.1 s)."""
    global _mode
    if mode not in COMPILED_WAITS:
        raise ValueError(f"cluster.compiled_wait must be one of {COMPILED_WAITS}, got {mode!r}")
    from ray.exceptions import RayChannelTimeoutError
    from ray.experimental.channel import shared_memory_channel

    channel = shared_memory_channel.Channel
    if not getattr(channel.read, "_widedp_wait", False):
        ray_read = channel.read

        def read(self, timeout: Optional[float] = None) -> Any:
            if _mode == "spin":
                return ray_read(self, timeout)
            since = getattr(self, "_widedp_waiting_since", None)
            if since is None:
                since = self._widedp_waiting_since = time.monotonic()
            value = backoff_read(lambda t: ray_read(self, t), timeout, RayChannelTimeoutError, since)
            self._widedp_waiting_since = None  # a value came: the next read starts a new wait
            return value

        read._widedp_wait = True  # type: ignore[attr-defined]
        read.__doc__ = ray_read.__doc__
        setattr(channel, "read", read)  # Ray's class, replaced in this process only
    _mode = mode


def compiled_wait() -> str:
    """This process's mode."""
    return _mode


def set_compiled_wait_on_actor(actor_instance: Any, mode: str) -> str:
    """For `actor.__ray_call__.remote(set_compiled_wait_on_actor, mode)`: set the mode in the
    actor's process; returns it."""
    set_compiled_wait(mode)
    return compiled_wait()


def set_compiled_wait_here_and_on(actors, mode: str, ray) -> None:
    """Set `mode` in this process and in every actor's of `actors` (the processes on the two
    ends of a compiled graph's channels); returns once every actor has it."""
    set_compiled_wait(mode)
    ray.get([actor.__ray_call__.remote(set_compiled_wait_on_actor, mode) for actor in actors])


def compiled_wait_of_actor(actor_instance: Any) -> str:
    """For `actor.__ray_call__.remote(compiled_wait_of_actor)`: the mode in the actor's process."""
    return compiled_wait()
