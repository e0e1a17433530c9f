"""A failed run leaves no empty run directory, and a run's Ray actors end with its driver
(issue 28, "vocabulary and cleanup").

Run directories (trainer/run/train.py `train`, trainer/run/outputs.py `remove_unrecorded_run_dir`):
a new run that fails removes the directory it created (and the parents it created) unless the
directory holds a record — a ledger, a checkpoint, a summary, a metrics line, or any file the
run's scaffold (config.json, an empty metrics.jsonl) does not explain. A directory with a ledger
is never removed: the ledger only grows (docs/DESIGN.md §1).

Actors (trainer/cluster/ray_runtime.py `ACTOR_OPTIONS`): a real `widedp train` is killed with SIGKILL, on
an embedded Ray and on a `ray start --head` cluster this test starts (2 shard and 2 trainer
actors: with the trainers made detached, two outlived the driver there and this test failed);
its actors must be gone within a generous bound. The measured time is printed (`pytest -s`), not
asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from widedp.trainer.run import budget as dataset_budget
from widedp.trainer.cli import main
from widedp.trainer.config import load_config
from widedp.trainer.engine import Engine
from widedp.trainer.run.outputs import holds_a_record, remove_unrecorded_run_dir
from widedp.trainer.run.train import train

TINY = ["model.embedding_dim=4", "model.bottom_mlp=[8]", "model.top_mlp=[8]", "train.batch_size=64",
        "train.log_every=2", "train.checkpoint_every=100", "privacy.k=50", "cluster.backend=local",
        "cluster.num_shards=2", "train.steps=6"]


def _sets(*items):
    return [x for item in items for x in ("--set", item)]


def _config(ctr_dir, *sets):
    return load_config(None, [f"data.path={ctr_dir}", *TINY, *sets])


class Boom(RuntimeError):
    pass


def _fail_at_step(monkeypatch, n: int, exc: type[BaseException] = Boom):
    """Engine.step raises `exc` when called for the n-th time (1-based); steps before it run."""
    real, calls = Engine.step, [0]

    def step(self):
        calls[0] += 1
        if calls[0] == n:
            raise exc("injected failure")
        return real(self)

    monkeypatch.setattr(Engine, "step", step)


def _budget_statuses(ctr_dir, run_dir):
    return [r["status"] for r in dataset_budget.read(ctr_dir) if r["run_dir"] == str(Path(run_dir).absolute())]


# ---- run directories ---------------------------------------------------------------------------

def test_unreachable_target_leaves_no_directory(capsys, tmp_path, ctr_dir):
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    run_dir = tmp_path / "runs" / "r"
    code = main(["train", "--config", str(config), "--no-progress", "--run-dir", str(run_dir),
                 *_sets(*TINY, "train.selection=threshold", "train.steps=300", "train.batch_size=24",
                        "privacy.accountant=rdp", "privacy.target_epsilon=0.001")])  # RDP's floor ≈ 0.1
    err = capsys.readouterr().err
    assert code == 2 and "privacy.target_epsilon = 0.001 is unreachable" in err
    assert not (tmp_path / "runs").exists()  # neither the run dir nor the parent it would have made


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failure_before_anything_is_charged_removes_the_run_dir(monkeypatch, tmp_path, ctr_dir, exc):
    # The run got as far as its scaffold (config.json, an empty metrics.jsonl, its "running"
    # line in the data set's budget), then its first step failed before charging anything.
    _fail_at_step(monkeypatch, 1, exc)
    run_dir = tmp_path / "runs" / "r"
    with pytest.raises(exc):
        train(_config(ctr_dir), run_dir, progress=False)
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
    statuses = _budget_statuses(ctr_dir, run_dir)  # the data set's record is append-only: it stays
    assert statuses[0] == "running" and statuses[-1] in ("failed", "interrupted")
    # the same --run-dir is free again
    monkeypatch.undo()
    assert train(_config(ctr_dir), run_dir, progress=False)["steps"] == 6


def test_failure_after_charging_keeps_the_ledger(monkeypatch, tmp_path, ctr_dir):
    _fail_at_step(monkeypatch, 3)  # steps 1 and 2 were charged (and released)
    run_dir = tmp_path / "r"
    with pytest.raises(Boom):
        train(_config(ctr_dir), run_dir, progress=False)
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert sum(entry["count"] for entry in ledger["history"]) == 2
    assert (run_dir / "config.json").exists()
    # and a new run refuses it: the directory holds a run
    monkeypatch.undo()
    with pytest.raises(ValueError, match="holds a run"):
        train(_config(ctr_dir), run_dir, progress=False)


def test_a_directory_the_run_did_not_create_is_left_alone(monkeypatch, tmp_path, ctr_dir):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    _fail_at_step(monkeypatch, 1)
    with pytest.raises(Boom):
        train(_config(ctr_dir), run_dir, progress=False)
    assert run_dir.is_dir()


def test_what_counts_as_a_record(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    assert not holds_a_record(run_dir)
    for name, content in [("ledger.json", "{}"), ("checkpoint.pt", ""), ("summary.json", "{}"),
                          ("metrics.jsonl", '{"step": 1}\n'), ("notes.txt", "someone's file")]:
        path = run_dir / name
        before = path.read_text() if path.exists() else None
        path.write_text(content)
        assert holds_a_record(run_dir), name
        assert remove_unrecorded_run_dir(run_dir) is False and path.exists()
        if before is None:
            path.unlink()
        else:
            path.write_text(before)
    created_parent = tmp_path / "made"
    nested = created_parent / "r"
    created_parent.mkdir()
    run_dir.rename(nested)
    assert remove_unrecorded_run_dir(nested, (created_parent,)) is True
    assert not created_parent.exists() and tmp_path.is_dir()


# ---- actors end with their driver ---------------------------------------------------------------

START_DEADLINE_S = 300  # Ray's start, imports, first steps (generous: CI machines are shared and loaded)
DEATH_DEADLINE_S = 20  # after SIGKILL of the driver, its actors must be gone within this
ACTOR_TITLES = ("ray::EmbeddingShard", "ray::_TrainerActor")
RAY = str(Path(sys.executable).parent / "ray")


def _session_processes(sid: int) -> dict[int, str]:
    """{pid: command line} of the live (non-zombie) processes of session `sid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _actors(sid: int) -> dict[int, str]:
    return {pid: cmd for pid, cmd in _session_processes(sid).items() if cmd.startswith(ACTOR_TITLES)}


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of a session this test started (by pid, nothing else)."""
    for pid in _session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray_env(tmp_path: Path, token: bool) -> dict:
    """No RAY_* settings of this process (no RAY_ADDRESS: the driver gets an embedded Ray unless
    --address); with `token`, token auth with a token of this test's own, as a `ray start`
    cluster a user runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if token:
        path = tmp_path / "token"
        path.write_text(os.urandom(32).hex())
        path.chmod(0o600)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    return env


def _train_and_kill(tmp_path: Path, ctr_dir, env: dict, actor_sid, num_actors: int, *extra: str) -> float:
    """Start `widedp train` (its own session), wait until it trains with `num_actors` actors
    (found in session `actor_sid(driver_pid)`), SIGKILL it, and return how long its actors lived
    on (at most DEATH_DEADLINE_S; the test fails if they outlive it)."""
    config = tmp_path / "ray.toml"
    config.write_text(f'[data]\npath = "{ctr_dir}"\n')
    run_dir = tmp_path / "run"
    sets = [*TINY, "train.steps=1000000", "train.log_every=1000000", "privacy.target_epsilon=1000",
            "privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.05",  # explicit: no calibration
            "cluster.backend=ray", "cluster.cpus_per_shard=0.25", "cluster.cpus_per_trainer=0.25"]
    stderr = tmp_path / "driver.err"
    with open(stderr, "wb") as err:
        driver = subprocess.Popen([sys.executable, "-m", "widedp.trainer.cli", "train", "--config", str(config),
                                   "--no-progress", "--run-dir", str(run_dir), *_sets(*sets), *extra],
                                  stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    sid = actor_sid(driver.pid)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while not ((run_dir / "ledger.json").exists() and len(_actors(sid)) == num_actors):
            assert driver.poll() is None, f"the driver exited ({driver.returncode}): {stderr.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not training with {num_actors} actors after {START_DEADLINE_S} s"
            time.sleep(0.2)
        actors = _actors(sid)
        os.kill(driver.pid, signal.SIGKILL)
        killed = time.monotonic()
        driver.wait()
        while set(actors) & set(_actors(sid)) and time.monotonic() - killed < DEATH_DEADLINE_S:
            time.sleep(0.05)
        seconds = time.monotonic() - killed
        alive = {pid: cmd for pid, cmd in _actors(sid).items() if pid in actors}
        assert not alive, f"still alive {DEATH_DEADLINE_S} s after the driver's SIGKILL: {alive}"
        return seconds
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        # an embedded Ray's own agents linger ~60 s after their raylet (trainer/cluster/ray_runtime.py)
        _kill_session(driver.pid)


# An embedded Ray (the default) ends with its driver whatever the actors' lifetime (measured: actors
# gone 2.1–2.9 s after SIGKILL), so only a cluster that outlives the driver can tell a detached
# actor apart: that is the test.


def test_actors_die_with_a_killed_driver_on_a_running_cluster(tmp_path, ctr_dir):
    """A `ray start --head` cluster that outlives the driver: only here would an actor that is
    not the driver's (detached) survive it. 2 shard and 2 trainer actors."""
    env = _ray_env(tmp_path, token=True)
    gcs, *ports = _free_ports(8)
    ray_tmp = Path(tempfile.mkdtemp(prefix="wdr", dir="/tmp"))  # short: Unix socket paths (≤ 107 bytes)
    log = tmp_path / "head.log"
    with open(log, "wb") as out:
        head = subprocess.Popen(
            [RAY, "start", "--block", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
             "--include-dashboard=false", f"--ray-client-server-port={ports[0]}",
             f"--dashboard-agent-listen-port={ports[1]}", f"--dashboard-agent-grpc-port={ports[2]}",
             f"--runtime-env-agent-port={ports[3]}", f"--metrics-export-port={ports[4]}",
             f"--node-manager-port={ports[5]}", f"--object-manager-port={ports[6]}",
             "--min-worker-port=0", "--max-worker-port=0", "--num-cpus=2", "--num-gpus=0",
             "--object-store-memory=100000000", f"--temp-dir={ray_tmp}", "--disable-usage-stats"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert head.poll() is None, f"ray start failed: {log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, "ray start --head did not come up"
            time.sleep(0.2)
        # the actors are the cluster's worker processes: in the head's session, not the driver's
        seconds = _train_and_kill(tmp_path, ctr_dir, env, lambda driver: head.pid, 4,
                                  "--address", f"127.0.0.1:{gcs}", *_sets("cluster.num_trainers=2"))
        print(f"\n`ray start` cluster: actors gone {seconds:.2f} s after SIGKILL of the driver")
        assert head.poll() is None  # the cluster itself lived on
    finally:
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it launched
            try:
                head.wait(timeout=30)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()
        _kill_session(head.pid)
        shutil.rmtree(ray_tmp, ignore_errors=True)
