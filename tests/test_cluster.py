"""A real two-node Ray cluster on loopback, started by README "### 1. Try it" as written.

The module fixture runs the README's walkthrough block (`<!-- walkthrough: two-node -->`,
tests/readme_blocks.py) through `bash -e -o pipefail`, from this repository and its venv: token
generation, `ray start --head --num-cpus 0` (no shard may land on it, as on KubeRay), a worker
node `ray start --address ... --num-cpus 2 --temp-dir ...`, `ray status`, the quickstart
submitted with `ray job submit`, `python -m json.tool` on its summary. The test changes the block
only by the substitutions in `_walkthrough` (each one says why, and fails loudly when the README
no longer has the text it replaces):
  * isolation: HOME and RAY_TMPDIR point into a fresh directory (the token lands there, the
    head's temp dir is <dir>/ray; nothing touches ~/.ray or /tmp/ray), the worker's
    `--temp-dir` and the run dir move into it, GCS / dashboard / Ray client / dashboard agent
    ports are free ones, and both nodes get a 200 MB object store;
  * time: the quickstart runs 20 steps on 5,000 examples (data in that directory);
  * `make setup &&` is dropped (the tests run in the venv it made) and `ray stop` is not run
    (it would kill every Ray on the machine, e.g. other tests' embedded clusters).
The cluster the block leaves running serves the other tests: the job's summary and that both
shard actors ran on the worker node, and that a too-small cluster, a wrong address and a
missing / wrong token fail fast with a clear message. Ray advertises the host's primary IP for
node-to-node traffic even when given 127.0.0.1
(ray._private.services.resolve_ip_for_localhost); the traffic still stays on this host.

Clean-up stops only what this module started: SIGTERM, then SIGKILL, to every process carrying
this cluster's marker environment variable (every process of the cluster, job drivers and
actors included, inherits it). No `ray stop`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from readme_blocks import Walkthrough, page_with

# make test runs on two xdist workers (--dist loadgroup): the module's one Ray cluster (README's walkthrough)
# stays on one worker.
pytestmark = pytest.mark.xdist_group("test_cluster")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: ray, widedp
RAY = str(BIN / "ray")
WIDEDP = str(BIN / "widedp")
MARKER = "WIDEDP_TEST_CLUSTER"
WALKTHROUGH_TIMEOUT_S = 420  # two `ray start`s and a blocking `ray job submit` (~80 s on a loaded 2-core box)
JOB_TIMEOUT_S = 150
TIMINGS: dict[str, float] = {}


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _marked_pids(marker_value: str) -> list[int]:
    """PIDs of processes whose environment carries MARKER=marker_value."""
    needle = f"{MARKER}={marker_value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _walkthrough(c: "ReadmeCluster") -> Walkthrough:
    """README's two-node block with this test's (only) substitutions."""
    free = "free ports: other Ray clusters may run on this machine"
    return (Walkthrough("two-node")
            .replace("make setup && ", "", 1, "the tests run in the venv `make setup` made; here it could reinstall "
                     "it under the other tests")
            .replace("6379", str(c.gcs_port), 3, free)
            .replace("8265", str(c.dashboard_port), 2, free)
            .append_to_line("ray start --head", f"--ray-client-server-port {c.client_port} --dashboard-agent-listen-port "
                            f"{c.agent_port} --object-store-memory 200000000",
                            f"{free} (the head's defaults 10001, 52365); a small object store")
            .append_to_line("ray start --address", "--object-store-memory 200000000", "a small object store")
            .replace("/tmp/ray-worker", f"{c.tmp}/ray-worker", 1, "the worker's temp dir in this test's directory")
            .replace("/tmp/widedp/", f"{c.tmp}/widedp/", 1, "the run dir in this test's directory")
            .append_to_line("    widedp train", f"--set data.path={c.data} --set train.steps=20 "
                            "--set data.synth_examples=5000", "a smaller quickstart, on data in this test's directory")
            .replace("\nray stop ", "\n: ray stop ", 1, "`ray stop` stops every Ray on the machine; the fixture stops "
                     "this cluster's processes"))


class ReadmeCluster:
    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="wdp", dir="/tmp"))  # short: Unix socket paths
        self.home = self.tmp / "home"
        self.home.mkdir()
        self.gcs_port, self.dashboard_port, self.client_port, self.agent_port = _free_ports(4)
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.data = str(self.tmp / "data")
        self.token = ""
        self.walkthrough = _walkthrough(self)
        self.walkthrough_rc: int | None = None
        self.walkthrough_log = ""

    # Environments ------------------------------------------------------------------------
    def base_env(self) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                            "RAY_API_SERVER_ADDRESS", "RAY_TMPDIR")}
        env.update({"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0",
                    "PYTHONUNBUFFERED": "1", MARKER: str(self.tmp)})
        return env

    def walkthrough_env(self) -> dict:
        """The user's shell, isolated: ~ and Ray's default temp root are this test's directory."""
        return {**self.base_env(), "HOME": str(self.home), "RAY_TMPDIR": str(self.tmp)}

    def client_env(self) -> dict:
        """How a user's shell talks to the cluster: mode explicit, token in the environment."""
        return {**self.base_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    # Lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Runs the walkthrough; it must leave two alive nodes (whether its job succeeded is the
        first test's business)."""
        t0 = time.monotonic()
        log_path = self.tmp / "walkthrough.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["bash", "-c", self.walkthrough.bash()], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=ROOT, env=self.walkthrough_env(), start_new_session=True)
            try:
                self.walkthrough_rc = proc.wait(timeout=WALKTHROUGH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        TIMINGS["readme_walkthrough_s"] = time.monotonic() - t0
        self.walkthrough_log = log_path.read_text(errors="replace")
        token_file = self.home / ".ray" / "auth_token"
        self.token = token_file.read_text().strip() if token_file.exists() else ""
        alive = [n for n in self.nodes() if n["state"] == "ALIVE"] if self.token else []
        if len(alive) != 2:
            raise RuntimeError(f"README walkthrough 'two-node' did not leave a two-node cluster (exit "
                               f"{self.walkthrough_rc}, alive nodes {len(alive)}); changes: {self.walkthrough.changes}"
                               f"\n{self.walkthrough_log[-5000:]}")

    def stop(self) -> None:
        leftovers = _marked_pids(str(self.tmp))
        _signal_all(leftovers, signal.SIGTERM)
        end = time.monotonic() + 5
        while leftovers and time.monotonic() < end:
            time.sleep(0.2)
            leftovers = _marked_pids(str(self.tmp))
        _signal_all(leftovers, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # CLI helpers -------------------------------------------------------------------------
    def ray(self, *args, env=None, timeout=60, check=True) -> subprocess.CompletedProcess:
        out = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=env or self.client_env())
        if check and out.returncode != 0:
            raise AssertionError(f"ray {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def nodes(self) -> list:
        out = self.ray("list", "nodes", "--address", self.dashboard, "--format", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip().startswith("[") else []

    def submit(self, submission_id: str, entrypoint: list[str]) -> None:
        self.ray("job", "submit", "--address", self.dashboard, "--no-wait", "--submission-id", submission_id,
                 "--runtime-env", "deploy/runtime_env.yaml", "--", *entrypoint)

    def wait_job(self, submission_id: str, timeout: float = JOB_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.ray("job", "status", submission_id, "--address", self.dashboard, check=False)
            text = out.stdout + out.stderr
            # ray/dashboard/modules/job/cli.py::_log_job_status: the three terminal wordings.
            for status, wording in (("SUCCEEDED", "succeeded"), ("FAILED", "failed"), ("STOPPED", "was stopped")):
                if f"Job '{submission_id}' {wording}" in text:
                    return status
            time.sleep(1.0)
        self.ray("job", "stop", submission_id, "--address", self.dashboard, check=False)
        raise AssertionError(f"job {submission_id} still running after {timeout:g} s:\n{self.logs(submission_id)}")

    def logs(self, submission_id: str) -> str:
        return self.ray("job", "logs", submission_id, "--address", self.dashboard, check=False).stdout


class _SharedCluster:
    """The one cluster this module's tests share, started by the first of them and stopped after
    the last (counted among the collected, selected items), or at the session's end. Not a
    module-scoped fixture: xdist ran another module between two of these tests, which tears a
    module fixture down, and the two-node cluster was started twice (~70 s each); not left
    running either, since its idle daemons would slow every later test on that worker."""

    def __init__(self):
        self.cluster: ReadmeCluster | None = None
        self.remaining: int | None = None

    def get(self, session) -> ReadmeCluster:
        if self.remaining is None:
            self.remaining = sum(1 for item in session.items
                                 if item.module.__name__ == __name__ and "cluster" in getattr(item, "fixturenames", ()))
        if self.cluster is None:
            for exe in (RAY, WIDEDP):
                assert os.access(exe, os.X_OK), f"{exe} not found: run the tests with the venv's python (make test)"
            assert Path(sys.executable).parent.parent.resolve() == (ROOT / ".venv").resolve(), \
                "the README walkthrough sources .venv/bin/activate: run the tests with the repository's .venv (make test)"
            c = ReadmeCluster()
            try:
                c.start()
            except BaseException:
                c.stop()
                raise
            self.cluster = c
        return self.cluster

    def done_with_one(self) -> None:
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.stop()

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
            if TIMINGS:
                print("\ncluster test timings (s): " + json.dumps({k: round(v, 2) for k, v in TIMINGS.items()}))


_SHARED = _SharedCluster()


@pytest.fixture(scope="session")
def _shared_cluster():
    try:
        yield _SHARED
    finally:
        _SHARED.stop()


@pytest.fixture
def cluster(request, _shared_cluster):
    try:
        yield _shared_cluster.get(request.session)
    finally:
        _shared_cluster.done_with_one()


def _train_args(run_dir: str, data: str, *extra: str) -> list[str]:
    return ["widedp", "train", "--config", "configs/cluster_quickstart.toml", "--no-progress", "--run-dir", run_dir,
            "--set", f"data.path={data}", "--set", "train.steps=20", "--set", "data.synth_examples=5000",
            "--set", "cluster.cpus_per_shard=0.5", *extra]


def test_readme_two_node_walkthrough_runs_as_written(cluster):
    """The block's every command succeeded, its job's summary, and both shards on the worker."""
    log = cluster.walkthrough_log
    assert cluster.walkthrough_rc == 0, f"README walkthrough 'two-node' failed ({cluster.walkthrough_rc}):\n{log[-5000:]}"
    assert re.search(r"Job '[^']+' succeeded", log), log[-5000:]
    runs = sorted((cluster.tmp / "widedp" / "runs").glob("quickstart-*"))
    assert len(runs) == 1, runs
    run_dir = runs[0]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "ray" and summary["num_shards"] == 2 and summary["steps"] == 20
    assert summary["mode"] == "sparse" and summary["selection"] == "threshold" and summary["threshold"] > 0
    assert 0 < summary["epsilon"] <= summary["target_epsilon"] + 1e-9
    assert 0 < summary["test_metrics"]["auc"] <= 1 and summary["privacy_caveats"] and not summary["debug_metrics"]
    for name in ("config.json", "metrics.jsonl", "ledger.json", "checkpoint.pt"):
        assert (run_dir / name).exists(), name
    assert f'"epsilon": {json.dumps(summary["epsilon"])}' in log, "the block's json.tool line printed the summary"

    # Both shard actors ran on the worker node (the head offers 0 CPUs).
    nodes = {n["node_id"]: n for n in cluster.nodes()}
    head = [i for i, n in nodes.items() if n["is_head_node"]]
    actors = json.loads(cluster.ray("list", "actors", "--address", cluster.dashboard, "--detail", "--format", "json",
                                    "--filter", "class_name=EmbeddingShard").stdout)
    assert len(actors) == 2, actors
    assert {a["node_id"] for a in actors}.isdisjoint(head) and all(a["node_id"] in nodes for a in actors)


def test_walkthrough_substitutions_fail_loudly_when_the_block_changes(tmp_path):
    """A README edit that drops or repeats a substituted text stops the test with a message."""
    marker = "<!-- walkthrough: two-node"
    readme = page_with(marker).read_text()
    assert readme.count(marker) == 1, "the docs lack the two-node walkthrough marker"
    changed = tmp_path / "README.md"
    changed.write_text(readme.replace("--temp-dir /tmp/ray-worker", "--temp-dir /var/tmp/rw", 1))
    w = Walkthrough("two-node", changed)
    with pytest.raises(AssertionError, match=r"changed shape: expected 1 × '/tmp/ray-worker', found 0"):
        w.replace("/tmp/ray-worker", "/x", 1, "why")
    with pytest.raises(AssertionError, match="changed shape: expected 1 × line starting 'ray start --nope'"):
        w.append_to_line("ray start --nope", "--x", "why")
    changed.write_text(readme.replace(marker, "<!-- walkthrough: other"))
    with pytest.raises(AssertionError, match="expected one ```bash block after <!-- walkthrough: two-node -->"):
        Walkthrough("two-node", changed)


def test_too_small_cluster_fails_fast_with_the_numbers(cluster):
    t0 = time.monotonic()
    # 2 shards × 1.5 CPU on a cluster with 2 CPUs (head 0 + worker 2, as the README starts them).
    cluster.submit("too-small", _train_args(str(cluster.tmp / "runs" / "too-small"), cluster.data,
                                            "--set", "cluster.cpus_per_shard=1.5"))
    status = cluster.wait_job("too-small", timeout=90)
    TIMINGS["job_too_small_to_failed_s"] = time.monotonic() - t0
    logs = cluster.logs("too-small")
    assert status == "FAILED", logs
    assert "widedp: error: the Ray cluster is too small: 2 shards × (1.5 CPU) need 3 CPU but the cluster has 2" in logs
    assert "Traceback" not in logs


_CHECK = """
import sys, time
from widedp.trainer.cluster.ray_runtime import ensure_ray, ClusterConnectionError

t = time.monotonic()
try:
    ensure_ray(sys.argv[1], timeout_s=float(sys.argv[2]))
    import ray
    print("OK", ray.cluster_resources().get("CPU", 0))
except ClusterConnectionError as exc:
    print("ERR", exc)
print("SECONDS", time.monotonic() - t)
"""


def _ensure(cluster, address: str, env: dict, timeout_s: float = 5.0) -> tuple[str, float, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _CHECK, address, str(timeout_s)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=env)
    wall = time.monotonic() - t0
    lines = out.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("SECONDS"), out.stdout + out.stderr
    return "\n".join(lines[:-1]), float(lines[-1].split()[1]), wall


def _silent_server():
    """A TCP port that accepts connections and never says anything (a black hole)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, held


def test_connection_failures_are_clear_and_fast(cluster):
    (unused,) = _free_ports(1)
    no_token_here = cluster.tmp / "home-without-token"
    no_token_here.mkdir(exist_ok=True)
    plain = cluster.base_env()
    srv, held = _silent_server()
    cases = {
        "ok": (cluster.gcs, cluster.client_env(), "OK 2.0"),
        "wrong_address": (f"127.0.0.1:{unused}", cluster.client_env(), "nothing is listening there"),
        "dashboard_port_as_gcs": (f"127.0.0.1:{cluster.dashboard_port}", cluster.client_env(), "speaks HTTP"),
        "dashboard_url": (cluster.dashboard, cluster.client_env(), "is a dashboard / Jobs API URL"),
        "no_answer": (f"127.0.0.1:{srv.getsockname()[1]}", cluster.client_env(), "no answer within 2 s"),
        "token_auth_off": (cluster.gcs, plain, "requires a token but token authentication is off"),
        "token_missing": (cluster.gcs, {**plain, "RAY_AUTH_MODE": "token", "HOME": str(no_token_here)},
                          "no token was found"),
        "token_wrong": (cluster.gcs, {**plain, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                        "rejected this process's token (read from the RAY_AUTH_TOKEN environment variable)"),
    }
    try:
        for name, (address, env, expected) in cases.items():
            message, seconds, wall = _ensure(cluster, address, env, timeout_s=2.0 if name == "no_answer" else 5.0)
            TIMINGS[f"ensure_ray_{name}_s"] = seconds
            assert expected in message, (name, message)
            if name != "ok":  # reported by our checks, not after Ray's own long connection timeout
                # (a bound on waiting, generous for a loaded 2-core CI box: 4.5 s was seen there)
                assert seconds < (10 if name == "no_answer" else 8), (name, seconds)
            assert wall < 20, (name, wall)
    finally:
        srv.close()
        for conn in held:
            conn.close()


def test_cli_reports_a_wrong_address_in_one_line(cluster):
    (unused,) = _free_ports(1)
    t0 = time.monotonic()
    out = subprocess.run([WIDEDP, *_train_args(str(cluster.tmp / "runs" / "cli"), cluster.data)[1:],
                          "--address", f"127.0.0.1:{unused}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=cluster.client_env())
    TIMINGS["cli_wrong_address_total_s"] = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("widedp: error:")]
    assert errors and "nothing is listening there" in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_job_submit_without_or_with_a_wrong_token_is_refused_fast(cluster):
    """Ray's own client side (documented in the README): the Jobs API answers 401 / 403 at once."""
    for name, env, expected in (
        ("missing", cluster.base_env(), "Authentication required"),
        ("wrong", {**cluster.base_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
         "Authentication failed"),
    ):
        t0 = time.monotonic()
        out = cluster.ray("job", "list", "--address", cluster.dashboard, env=env, check=False, timeout=30)
        TIMINGS[f"job_cli_token_{name}_s"] = time.monotonic() - t0
        assert out.returncode != 0 and expected in out.stdout + out.stderr, (name, out.stdout, out.stderr)


# ---- pure checks (no cluster) ----------------------------------------------------------------------
def test_split_address():
    from widedp.trainer.cluster.ray_runtime import ClusterConnectionError, split_address

    assert split_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert split_address("[::1]:6379") == ("::1", 6379)
    assert split_address(" head.svc:6379 ") == ("head.svc", 6379)
    for bad, words in (("10.0.0.5", "not HOST:PORT"), ("head:port", "not HOST:PORT"), ("head:70000", "not HOST:PORT"),
                       ("http://head:8265", "dashboard / Jobs API URL"), ("grpc://head:6379", "unsupported scheme")):
        with pytest.raises(ClusterConnectionError, match=words):
            split_address(bad)


def test_check_placement_counts_whole_bundles_per_node():
    from widedp.trainer.cluster.ray_shards import ClusterResourceError, check_placement

    def nodes(*cpus, gpus=None):
        return [{"Alive": True, "Resources": {"CPU": c, **({"GPU": gpus[i]} if gpus else {})}}
                for i, c in enumerate(cpus)] + [{"Alive": False, "Resources": {"CPU": 64.0}}]

    check_placement(nodes(0.0, 1.0), {"CPU": 0.5}, 2)                      # the loopback test cluster
    check_placement(nodes(0.0, 0.3, 0.3), {"CPU": 0.1}, 6)                 # 0.3/0.1 is 3 here, not 2.999
    with pytest.raises(ClusterResourceError, match=r"too small: 2 shards × \(1 CPU\) need 2 CPU but the cluster has 1"):
        check_placement(nodes(0.0, 1.0), {"CPU": 1.0}, 2)                  # dead nodes do not count
    with pytest.raises(ClusterResourceError, match="room for 1"):          # 4 CPUs in total, but 3+1 per node
        check_placement(nodes(3.0, 1.0), {"CPU": 2.0}, 2)
    with pytest.raises(ClusterResourceError, match="distinct nodes"):
        check_placement(nodes(4.0, 0.0), {"CPU": 1.0}, 2, "STRICT_SPREAD")
    check_placement(nodes(4.0, 0.0), {"CPU": 1.0}, 2, "STRICT_PACK")
    with pytest.raises(ClusterResourceError, match="need 2 GPU but the cluster has 1"):
        check_placement(nodes(8.0, 8.0, gpus=[1.0, 0.0]), {"CPU": 1.0, "GPU": 1.0}, 2)
