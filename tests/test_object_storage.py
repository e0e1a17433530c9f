"""A partitioned data set in object storage (trainer/data/format/remote.py), against moto's S3
server on the loopback address: uploaded with `widedp convert upload`, trained on with data.path
= s3://… (each trainer staging only its own parts, the coordinator only the test split), the
same model as the run on the local copy, and the data set's budget kept beside it in the bucket
with conditional writes — two runs appending at once both land (and a broken store that writes
unconditionally is caught losing one)."""

from __future__ import annotations

import json
import os

import boto3
import moto.server as moto_server
import pytest
import torch

from widedp.trainer.config import load_config
from widedp.trainer.data.errors import DataError
from widedp.trainer.data.format.partitioned import (MANIFEST_FILE, is_partitioned, part_dir, partitioned_identity,
                                                    write_partitioned)
from widedp.trainer.data.format.remote import STAGED_MARK, RemoteDir, local_path, upload
from widedp.trainer.data.partitioned_training import PartitionedTrainSet, TrainerShares
from widedp.trainer.run import budget as dataset_budget
from widedp.trainer.run.train import build_run

from test_train_cli import TINY


BUCKET = "widedp-test"


@pytest.fixture(scope="module")
def s3():
    """(the URI prefix of a fresh bucket on a loopback S3 server, a boto3 client)."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request in a failure's log
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    os.environ.pop("AWS_ENDPOINT_URL", None)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield f"s3://{BUCKET}/{{}}?endpoint_override={host}:{port}&scheme=http", client
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def parts_dir(ctr_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("remote") / "parts"
    write_partitioned(ctr_dir, out, 4, test_fraction=0.2, seed=0)
    return out


@pytest.fixture(scope="module")
def uploaded(s3, parts_dir):
    """The partitioned set uploaded once with `widedp convert upload` (its URI)."""
    from widedp.trainer.cli import main

    uri = s3[0].format("ctr")
    assert main(["convert", "upload", str(parts_dir), uri]) == 0
    return uri


def _keys(client, prefix: str) -> set:
    answer = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix):] for o in answer.get("Contents", [])}


def test_upload_copies_every_part_and_the_manifest_keeps_its_identity(s3, parts_dir, uploaded, tmp_path):
    keys = _keys(s3[1], "ctr/")
    assert MANIFEST_FILE in keys and f"{part_dir(3)}/data.parquet" in keys and "test/data.parquet" in keys
    assert not any(".widedp-cache" in k for k in keys)
    assert is_partitioned(uploaded) and not is_partitioned(s3[0].format("nothing-here"))
    # the identity a run's checkpoint and budget name is the one of the local copy
    assert partitioned_identity(uploaded) == partitioned_identity(parts_dir)
    with pytest.raises(DataError, match="objects are there already"):
        upload(parts_dir, uploaded)


def test_a_trainer_stages_only_its_own_parts_once(uploaded, tmp_path):
    stage = tmp_path / "stage"
    shares = TrainerShares(PartitionedTrainSet(uploaded, stage_dir=str(stage)), 2, 0.5,
                           lambda j, r: __import__("numpy").random.default_rng([j, r]))
    view, _ = shares.share(1).open()
    (local,) = [p for p in stage.iterdir() if p.is_dir()]
    staged = sorted(p.name for p in local.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert staged == [part_dir(1), part_dir(3)] and len(view) == sum(view.part_sizes())
    mark = local / part_dir(1) / STAGED_MARK
    before = mark.stat().st_mtime_ns
    shares.share(1).open()  # the same objects: nothing downloaded again
    assert mark.stat().st_mtime_ns == before


def test_a_staged_part_is_refreshed_when_its_objects_change(s3, parts_dir, tmp_path):
    uri = s3[0].format("refresh")
    upload(parts_dir, uri)
    remote = RemoteDir(uri)
    local, _ = remote.stage([part_dir(0)], tmp_path)
    fs, root = remote.filesystem()
    with fs.open_output_stream(f"{root}/{part_dir(0)}/extra.txt") as out:
        out.write(b"new")
    again, _ = remote.stage([part_dir(0)], tmp_path)
    assert again == local and (local / part_dir(0) / "extra.txt").read_bytes() == b"new"
    assert not [p for p in local.iterdir() if p.name.endswith(".tmp")]


def test_a_part_staged_in_concurrent_ranges_is_the_uploaded_bytes(s3, parts_dir, tmp_path, monkeypatch):
    from widedp.trainer.data.format import remote as remote_mod

    uri = s3[0].format("ranges")
    upload(parts_dir, uri)
    monkeypatch.setattr(remote_mod, "RANGE_BYTES", 4096)  # many ranges, read concurrently
    local, _ = RemoteDir(uri).stage([part_dir(2)], tmp_path)
    for name in ("data.parquet", "dataset.json"):
        assert (local / part_dir(2) / name).read_bytes() == (parts_dir / part_dir(2) / name).read_bytes()
    assert (parts_dir / part_dir(2) / "data.parquet").stat().st_size > 10 * 4096


def _trained(path, stage_dir, *extra) -> tuple:
    cfg = load_config(None, [f"data.path={path}", *TINY, "train.mode=dpsgd", "train.recalibrate=false",
                             "privacy.reproducible=true", "privacy.noise_seed=7", "privacy.noise_multiplier=1.0",
                             "privacy.target_epsilon=1e9", "cluster.num_trainers=2", f"data.stage_dir={stage_dir}",
                             *extra]).validate()
    with build_run(cfg) as run:
        run.run(3)
        engine = run.engine
        model = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
        return model, [s["weights"] for s in engine.shards.broadcast("state_dict")]


def test_a_run_on_the_uri_computes_what_the_run_on_the_local_copy_does(uploaded, parts_dir, tmp_path):
    """One noise seed and the same parts: the sample, the noise and so the model are the same."""
    remote_model, remote_tables = _trained(uploaded, tmp_path / "stage")
    local_model, local_tables = _trained(parts_dir, tmp_path / "unused")
    assert any((tmp_path / "stage").iterdir())
    for name, value in local_model.items():
        torch.testing.assert_close(remote_model[name], value)
    for a, b in zip(remote_tables, local_tables):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b))
    assert not (tmp_path / "unused").exists()  # a local data set is never staged


def test_train_cli_on_the_uri_records_its_spending_in_the_bucket(s3, parts_dir, tmp_path, capsys):
    from widedp.trainer.cli import main

    uri = s3[0].format("cli")
    upload(parts_dir, uri)
    sets = [a for s in [*TINY, "train.recalibrate=false", f"data.stage_dir={tmp_path / 'stage'}",
                        "cluster.num_trainers=2", "train.steps=3", "privacy.target_epsilon=1e9",
                        "privacy.noise_multiplier=1.0", "privacy.selection_epsilon=0.05"] for a in ("--set", s)]
    config = tmp_path / "remote.toml"
    config.write_text(f'[data]\npath = "{uri}"\n')
    assert main(["train", "--config", str(config), "--no-progress", "--run-dir", str(tmp_path / "run"), *sets]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["test_metrics"]["auc"] > 0
    lines = s3[1].get_object(Bucket=BUCKET, Key="cli/privacy_budget.jsonl")["Body"].read().splitlines()
    assert [json.loads(x)["status"] for x in lines] == ["running", "finished"]
    assert main(["budget", uri]) == 0
    budget = json.loads(capsys.readouterr().out)
    assert budget["num_runs"] == 1 and budget["budget_file"].startswith(f"s3://{BUCKET}/cli/")
    assert budget["total_epsilon"] == pytest.approx(summary["epsilon"])
    # the run resumes on the URI (its checkpoint's budget head is the bucket's)
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress", "--set", "train.steps=4"]) == 0
    capsys.readouterr()
    assert len(dataset_budget.read(uri)) == 4
    # a truncated budget in the bucket is refused by name, as on disk
    s3[1].put_object(Bucket=BUCKET, Key="cli/privacy_budget.jsonl", Body=b"\n".join(lines[:1]) + b"\n")
    with pytest.raises(dataset_budget.BudgetError, match="fewer than the 4"):
        dataset_budget.read(uri)


def _record(run_id: str) -> dict:
    return dataset_budget.run_record(run_id=run_id, run_dir=f"/runs/{run_id}", mode="sparse", target_epsilon=1.0,
                                     delta=1e-6, accountant="prv", epsilon=0.5, events_charged=1, steps=1,
                                     started=dataset_budget.now(), status="finished")


class _Racing(dataset_budget._ObjectBudget):
    """Another run appends between this one's read and its write (once)."""

    def __init__(self, remote, rival):
        super().__init__(remote)
        self.rival = rival

    def verified(self):
        answer = super().verified()
        if self.rival is not None:
            rival, self.rival = self.rival, None
            dataset_budget._ObjectBudget(self.remote).append(_record(rival))
        return answer


class _Unconditional(_Racing):
    """Broken: writes whatever version is there (no If-Match / If-None-Match)."""

    def _put(self, name, body, etag):
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
        return True


def _fresh(s3, name: str) -> str:
    """A URI under which a (bare) data set's manifest exists, so a budget can be written there."""
    uri = s3[0].format(name)
    bucket, prefix = RemoteDir(uri).bucket_and_prefix()
    s3[1].put_object(Bucket=bucket, Key=f"{prefix}/{MANIFEST_FILE}", Body=b"{}")
    return uri


def test_two_runs_appending_at_once_both_land(s3):
    uri = _fresh(s3, "race")
    dataset_budget.append(uri, _record("first"))
    _Racing(RemoteDir(uri), "rival").append(_record("mine"))
    assert [r["run_id"] for r in dataset_budget.read(uri)] == ["first", "rival", "mine"]
    assert dataset_budget.head(uri)["lines"] == 3


def test_a_store_ignoring_conditional_writes_is_refused_and_would_lose_a_line(s3, monkeypatch):
    uri = _fresh(s3, "unconditional")
    with pytest.raises(dataset_budget.BudgetError, match="did not honour conditional writes.*If-None-Match"):
        _Unconditional(RemoteDir(uri), "rival").append(_record("mine"))
    assert dataset_budget.read(uri) == []  # refused before any line

    class IgnoresIfMatch(dataset_budget._ObjectBudget):  # honours If-None-Match only
        def _put(self, name, body, etag):
            if etag is None:
                return super()._put(name, body, None)
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
            return True

    with pytest.raises(dataset_budget.BudgetError, match="If-Match with another ETag"):
        IgnoresIfMatch(RemoteDir(_fresh(s3, "ignores-if-match"))).append(_record("mine"))
    # why the probe: without it, the rival's line is overwritten and the chain still verifies
    monkeypatch.setattr(dataset_budget._ObjectBudget, "check_conditional_writes", lambda self: None)
    dataset_budget.append(uri, _record("first"))
    _Unconditional(RemoteDir(uri), "rival").append(_record("mine"))
    assert [r["run_id"] for r in dataset_budget.read(uri)] == ["first", "mine"]


def test_the_head_is_never_moved_back_by_a_slower_appender(s3):
    """B appends and advances the head between A's line and A's head: A's head write fails its
    condition, and A leaves B's head (past A's line) as it is."""
    uri = _fresh(s3, "head-race")

    class SlowHead(dataset_budget._ObjectBudget):
        def _advance_head(self, head, etag):
            dataset_budget.append(uri, _record("rival"))  # lines: mine, rival; the head at 2
            super()._advance_head(head, etag)

    SlowHead(RemoteDir(uri)).append(_record("mine"))
    head = dataset_budget.head(uri)
    assert head["lines"] == 2 and [r["run_id"] for r in dataset_budget.read(uri)] == ["mine", "rival"]
    assert "endpoint_override=" in head["path"]  # the recorded location names the store, not only the bucket


def test_a_prefix_with_escapes_keeps_one_budget(s3, parts_dir):
    """pyarrow decodes %-escapes in the path; the budget's client must name the same objects."""
    uri = s3[0].format("with%20space")
    upload(parts_dir, uri)
    dataset_budget.append(uri, _record("after-upload"))
    assert "with space/privacy_budget.jsonl" in _keys(s3[1], "with space/") | {"with space/" + k
                                                                              for k in _keys(s3[1], "with space/")}
    assert [r["run_id"] for r in dataset_budget.read(uri)][-1] == "after-upload"


def test_a_staged_copy_or_a_replaced_data_set_is_never_trained_on(uploaded, tmp_path):
    stage = tmp_path / "stage"
    train_set = PartitionedTrainSet(uploaded, stage_dir=str(stage))
    shares = TrainerShares(train_set, 1, 0.5, lambda j, r: __import__("numpy").random.default_rng([j, r]))
    shares.share(0).open()
    (local,) = [p for p in stage.iterdir() if p.is_dir()]
    with pytest.raises(DataError, match="a staged copy of s3://"):
        PartitionedTrainSet(local)
    with pytest.raises(DataError, match="a staged copy"):
        dataset_budget.append(local, _record("x"))
    share = shares.share(0)
    share.manifest_sha256 = "0" * 64
    with pytest.raises(DataError, match="not the manifest this run started with"):
        share.open()


def test_upload_refuses_a_used_prefix_and_a_store_without_conditional_writes(s3, parts_dir):
    uri = _fresh(s3, "used")
    with pytest.raises(DataError, match="objects are there already"):
        upload(parts_dir, uri)
    with pytest.raises(DataError, match="s3:// .* only"):
        upload(parts_dir, "gs://bucket/data")


def test_bad_locations_are_refused_by_name(s3, parts_dir, tmp_path):
    with pytest.raises(DataError, match="credentials") as refused:
        RemoteDir(f"s3://key:hunter2@{BUCKET}/x")
    assert "hunter2" not in str(refused.value)
    with pytest.raises(DataError, match="secret_key") as refused:
        RemoteDir(f"s3://{BUCKET}/x?secret_key=hunter2")
    assert "hunter2" not in str(refused.value)
    cfg = load_config(None, [f"data.path={s3[0].format('nothing-here')}", *TINY]).validate()
    with pytest.raises(DataError, match="must be a partitioned one"):
        build_run(cfg)
    with pytest.raises(dataset_budget.BudgetError, match="conditional writes"):
        dataset_budget.append("gs://bucket/data", _record("x"))
    # file:// names a local directory
    assert local_path(f"file://{parts_dir}") == parts_dir and is_partitioned(f"file://{parts_dir}")
    with pytest.raises(DataError, match="not on host"):
        local_path("file://elsewhere/data")


_DRIVER_STAGES_THE_TEST_SPLIT_ONLY = """
from widedp.trainer.data.format import remote

real_stage = remote.RemoteDir.stage

def _test_split_only(self, rel_dirs, stage_root=None, **kwargs):  # the coordinator stages no training part
    if list(rel_dirs) != ["test"]:
        raise AssertionError(f"the coordinator staged {rel_dirs}")
    return real_stage(self, rel_dirs, stage_root, **kwargs)

remote.RemoteDir.stage = _test_split_only
"""


def test_trainer_actors_on_ray_stage_their_own_parts_from_the_bucket(uploaded, tmp_path):
    """A Ray cluster started by the driver: its trainer actors stage their parts from S3 (with the
    driver's environment's credentials); the driver stages the test split and decodes nothing else."""
    import subprocess
    import sys

    from test_partitioned_data import _DRIVER_NEVER_OPENS_A_PART

    sets = [*TINY, "train.recalibrate=false", "cluster.backend=ray", "cluster.num_trainers=2",
            "cluster.cpus_per_trainer=0.25", "cluster.cpus_per_shard=0.25", "train.steps=3",
            "privacy.target_epsilon=8", f"data.stage_dir={tmp_path / 'stage'}"]
    config = tmp_path / "remote.toml"
    config.write_text(f'[data]\npath = "{uploaded}"\n')
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = _DRIVER_STAGES_THE_TEST_SPLIT_ONLY + _DRIVER_NEVER_OPENS_A_PART
    done = subprocess.run([sys.executable, "-c", driver, "train", "--config", str(config), "--no-progress",
                           "--run-dir", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["trainer_actors"] and summary["steps"] == 3
    assert summary["partitions"]["trainer_parts"] == [[0, 2], [1, 3]]
    (local,) = [p for p in (tmp_path / "stage").iterdir() if p.is_dir()]
    assert sorted(p.name for p in local.iterdir() if p.is_dir()) == [part_dir(j) for j in range(4)] + ["test"]
