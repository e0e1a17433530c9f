"""Deployment artefacts agree with the project: container images install exactly the pinned set
of pyproject.toml (+ the Makefile's torchrec pin); what `kubectl apply -k` applies (rendered by
tests/k8s_manifests.py) validates against the KubeRay CRDs and the Kubernetes API schemas, runs
valid `widedp` commands on a config that exists and fits the cluster it describes, and trains on
the data set its conversion Job writes (whose scripts run here against a local HTTPS server);
the documented `ray job submit` and `kubectl` commands name what exists. No Docker or Kubernetes
needed."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import k8s_manifests as km
import pytest
import yaml

from widedp.trainer.cli import UsageError, build_parser
from widedp.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "cuda": DEPLOY / "Dockerfile.cuda"}


# ---- make setup VARIANT=... ---------------------------------------------------------------------
def _make_plan(tmp_path, *args) -> subprocess.CompletedProcess:
    """`make -n setup ARGS` against a venv path of its own (dry run: the commands make would run)."""
    return subprocess.run(["make", "-n", "-C", str(ROOT), "setup", f"VENV={tmp_path / 'venv'}", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_install_stamp_names_its_variant_so_switching_reinstalls(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu").touch()  # newer than pyproject.toml and the Makefile
    same = _make_plan(tmp_path)
    assert same.returncode == 0 and "pip" not in same.stdout, same.stdout  # the same variant: nothing to do
    cuda = _make_plan(tmp_path, "VARIANT=cuda")
    assert cuda.returncode == 0, cuda.stderr
    plan = cuda.stdout
    assert "uninstall -q -y fbgemm-gpu-cpu" in plan and "'.[test,cuda]'" in plan
    assert f"touch {venv}/.installed-cuda" in plan and f"rm -f {venv}/.installed {venv}/.installed-*" in plan
    (venv / ".installed-cpu").unlink()
    (venv / ".installed-cuda").touch()
    back = _make_plan(tmp_path).stdout
    assert "uninstall -q -y fbgemm-gpu\n" in back + "\n" and "'.[test,cpu]'" in back
    bad = _make_plan(tmp_path, "VARIANT=gpu")
    assert bad.returncode != 0 and "VARIANT must be cpu or cuda, got 'gpu'" in bad.stderr


# ---- the pinned set ------------------------------------------------------------------------------
def _requirement(spec: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", spec)
    return m.group(1).lower().replace("_", "-"), m.group(3).strip()


def _pins() -> dict[str, str]:
    """name -> specifier from pyproject (dependencies + the cpu/cuda extras) and the Makefile."""
    pins = dict(_requirement(d) for d in PROJECT["dependencies"])
    for extra in ("cpu", "cuda"):
        pins.update(_requirement(d) for d in PROJECT["optional-dependencies"][extra])
    makefile = (ROOT / "Makefile").read_text()
    for name, version in re.findall(r"\binstall\b[^\n]*?\b(torch|torchrec)==([0-9][^\s']*)", makefile):
        pins.setdefault(name, f"=={version}")
        assert pins[name] == f"=={version}", f"Makefile pins {name}=={version}, pyproject says {pins[name]}"
    return pins


PINS = _pins()


def _ray_prefix() -> str:
    spec = PINS["ray"]
    m = re.fullmatch(r"==(\d+)\.(\d+)\.\*", spec)
    assert m, f"expected ray pinned to one minor line (==X.Y.*), got {spec}"
    return f"{m.group(1)}.{m.group(2)}."


def test_pyproject_pins_what_the_images_rely_on():
    assert PINS["torch"].startswith("==") and PINS["fbgemm-gpu-cpu"] == PINS["fbgemm-gpu"]
    assert PINS["torchrec"].startswith("==")  # from the Makefile (installed with --no-deps)
    assert _ray_prefix()


# ---- Dockerfiles ----------------------------------------------------------------------------------
def _dockerfile(path: Path) -> str:
    return re.sub(r"\\\n", " ", path.read_text())  # join continuation lines


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_installs_exactly_the_pinned_set(variant):
    text = _dockerfile(DOCKERFILES[variant])
    base = re.search(r"^FROM\s+python:(\d+)\.(\d+)", text, re.M)
    assert base, "base image must be an official python:X.Y image"
    needed = re.search(r">=\s*(\d+)\.(\d+)", PROJECT["requires-python"])
    assert (int(base.group(1)), int(base.group(2))) >= (int(needed.group(1)), int(needed.group(2)))

    installs = [c.strip() for c in re.findall(r"pip install ([^&\n]+)", text)]
    assert installs, "no pip install"
    pinned = {}
    for cmd in installs:
        for name, version in re.findall(r"\b([A-Za-z0-9_\-]+)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.*+]*)", cmd):
            pinned[name.lower().replace("_", "-")] = f"=={version}"
    for name, spec in pinned.items():
        assert name in PINS, f"{DOCKERFILES[variant].name} pins {name}, which pyproject/Makefile do not"
        assert spec == PINS[name], f"{DOCKERFILES[variant].name}: {name}{spec} but the project says {PINS[name]}"
    assert pinned.get("torch") == PINS["torch"] and pinned.get("torchrec") == PINS["torchrec"]
    # torch before the project (as in the Makefile), torchrec last and without its declared deps
    order = [("torch==" in c and "torchrec" not in c, c.startswith('".[') or c.startswith(".["), "torchrec==" in c)
             for c in installs]
    assert [i for i, o in enumerate(order) if o[0]] < [i for i, o in enumerate(order) if o[1]]
    assert any("--no-deps" in c and "torchrec==" in c for c in installs)
    extras = re.findall(r'"?\.\[([a-z,]+)\]"?', " ".join(installs))
    assert extras == [variant], f"installs the project with extras {extras}, expected [{variant}]"
    if variant == "cpu":
        assert any("torch==" in c and "download.pytorch.org/whl/cpu" in c for c in installs)
    # the build checks the Ray line it got against pyproject's
    assert f"startswith('{_ray_prefix()}')" in text
    # the project's sources, its metadata and the configs the manifests inherit from
    copied = {s for line in re.findall(r"^COPY\s+(.+)$", text, re.M) for s in line.split()[:-1]}
    # the one installed package, widedp/, which holds every module (the top-level folders are links into it)
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["widedp", "widedp.*"]
    assert {"trainer", "selection", "accounting"} <= {p.name for p in (ROOT / "widedp").iterdir() if p.is_dir()}
    packages = {"widedp"}
    assert packages | {"pyproject.toml", "README.md", "configs"} <= copied
    assert re.search(r"^WORKDIR /app$", text, re.M)  # configs at /app/configs (the ConfigMap's base)
    ignore = (DOCKERFILES[variant].parent / f"{DOCKERFILES[variant].name}.dockerignore").read_text().split()
    for item in packages | {"pyproject.toml", "README.md", "configs"}:
        assert f"!{item}" in ignore or f"!{item}/" in ignore, f"{item} is excluded from the build context"


def test_both_images_share_the_base():
    bases = {re.search(r"^FROM\s+(\S+)", _dockerfile(p), re.M).group(1) for p in DOCKERFILES.values()}
    assert len(bases) == 1, bases


# ---- Kubernetes manifests: what `kubectl apply -k` applies -----------------------------------------
# Every check below reads the objects as tests/k8s_manifests.py renders them from a top-level
# kustomization (resources + the images[] override, as kubectl's built-in kustomize does), and
# each has a broken variant further down that it must reject.
DATA_LABEL = "app.kubernetes.io/component=data"   # `kubectl apply -k DIR -l ...`: the data step


def _kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def _referenced(directory: Path) -> tuple[set[Path], set[Path]]:
    """(kustomization dirs, manifest files) a build of `directory` reads, itself included."""
    dirs, files = {directory}, set()
    for res in km.load_kustomization(directory).get("resources", []):
        target = (directory / res).resolve()
        if target.is_dir():
            sub_dirs, sub_files = _referenced(target)
            dirs |= sub_dirs
            files |= sub_files
        else:
            files.add(target)
    return dirs, files


def _top_level() -> list[Path]:
    """Kustomizations no other kustomization includes: the ones a user applies."""
    nested = set().union(*(_referenced(d)[0] - {d} for d in _kustomization_dirs()))
    return [d for d in _kustomization_dirs() if d not in nested]


TOP_LEVEL = _top_level()
RENDERS = {d: km.render(d) for d in TOP_LEVEL}
RAY_KINDS = ("RayJob", "RayCluster")
RAY_OBJECTS = [(d, o) for d, objs in RENDERS.items() for o in objs if o["kind"] in RAY_KINDS]
ALL_OBJECTS = [(d, o) for d, objs in RENDERS.items() for o in objs]


def _rel(directory: Path) -> str:
    return directory.relative_to(ROOT).as_posix()


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"the build has no {kind} {name}" if not found else f"{kind} {name} twice"
    return found[0]


def _ray_object(objects: list[dict]) -> dict:
    found = [o for o in objects if o["kind"] in RAY_KINDS]
    assert len(found) == 1, f"expected one RayJob or RayCluster per kustomization, got {len(found)}"
    return found[0]


def _cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def _head_pod(obj: dict) -> dict:
    return _cluster_spec(obj)["headGroupSpec"]["template"]["spec"]


def _pod_specs(spec: dict):
    yield "head", spec["headGroupSpec"], spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group, group["template"]["spec"]


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _mounts(pod: dict, container: dict) -> dict[str, dict]:
    """mountPath -> volume, for one container of a pod spec (no subPath: a path means the same
    directory in every container that mounts the volume at the same place)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        assert "subPath" not in m, f"{container['name']}: subPath mounts are not checked here"
        assert m["name"] in volumes, f"{container['name']} mounts {m['name']}, which the pod does not define"
        out[m["mountPath"]] = volumes[m["name"]]
    return out


def _volume_at(path: str, mounts: dict[str, dict]) -> tuple[str, dict]:
    """(mountPath, volume) holding `path` (the deepest mount)."""
    holding = [m for m in mounts if PurePosixPath(path).is_relative_to(m)]
    assert holding, f"{path} is on no volume of the container ({sorted(mounts)})"
    mount = max(holding, key=len)
    return mount, mounts[mount]


def _claim(volume: dict) -> str | None:
    return volume.get("persistentVolumeClaim", {}).get("claimName")


def _head_mounts(spec: dict) -> dict[str, dict]:
    """mountPath -> volume (head container)."""
    pod = spec["headGroupSpec"]["template"]["spec"]
    return _mounts(pod, pod["containers"][0])


def _image_tags() -> set[str]:
    return {f"{PROJECT['version']}-{variant}" for variant in DOCKERFILES}


def _image_path(container_path: str) -> Path | None:
    """A path inside the image -> the repository file the Dockerfile copies there (WORKDIR /app)."""
    p = PurePosixPath(container_path)
    if p.is_relative_to("/app"):
        return ROOT / p.relative_to("/app")
    return None


def _parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except (UsageError, SystemExit) as exc:
        raise AssertionError(f"`{shlex.join(argv)}` is not a valid widedp command: {exc}") from None


def _source_file(directory: Path, obj: dict) -> Path:
    """The manifest file of `directory`'s build that defines obj."""
    for path in sorted(_referenced(directory)[1]):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == obj["kind"] and doc["metadata"]["name"] == obj["metadata"]["name"]:
                return path
    raise AssertionError(f"{obj['kind']} {obj['metadata']['name']} is in no file of {directory}")


def _ray_commands(directory: Path, obj: dict) -> list[str]:
    """The widedp commands a Ray object runs: a RayJob's entrypoint, the `ray job submit`
    examples in a RayCluster's header."""
    if obj["kind"] == "RayJob":
        return [obj["spec"]["entrypoint"]]
    commands = _ray_job_submits(_source_file(directory, obj).read_text())
    assert commands, f"{obj['kind']} {obj['metadata']['name']}: no example `ray job submit` in its header"
    return commands


def _check_widedp_command(command: str, spec: dict, objects: list[dict]):
    """A `widedp train` a cluster runs: a valid command whose config exists, whose run dir and data
    set are on a PVC of the same build mounted on the head, and whose shards fit the workers.
    Returns the config."""
    argv = shlex.split(command)
    assert argv[0] == "widedp", command
    args = _parse(argv[1:])
    assert args.command == "train" and args.config and not args.address, command
    mounts = _head_mounts(spec)
    # the config named by the command: a ConfigMap key mounted on the head, or a file in the image
    config_dir, config_name = str(PurePosixPath(args.config).parent), PurePosixPath(args.config).name
    volume = mounts.get(config_dir)
    if volume is not None:
        cm = _named(objects, "ConfigMap", volume["configMap"]["name"])
        assert config_name in cm["data"], f"{command}: no key {config_name} in ConfigMap {cm['metadata']['name']}"
        text = cm["data"][config_name]
    else:
        local = _image_path(args.config)
        assert local is not None and local.is_file(), f"{command}: {args.config} is neither mounted nor in the image"
        text = local.read_text()
    cfg = _load_inline_config(text, args.set)
    run_dir = args.run_dir or cfg.run_dir
    # run dir and data set on a PVC of this build mounted on the head (where the driver runs)
    for what, value in (("run dir", run_dir), ("data.path", cfg.data.path)):
        _, volume = _volume_at(value, mounts)
        assert _claim(volume), f"{what} {value} is not on a PersistentVolumeClaim"
        _named(objects, "PersistentVolumeClaim", _claim(volume))
    # the shards fit the worker groups (the head offers 0 CPUs)
    cpus = sum(g["replicas"] * _cpus(g["rayStartParams"]["num-cpus"]) for g in spec["workerGroupSpecs"])
    assert cfg.cluster.backend == "ray"
    assert cfg.cluster.num_shards * cfg.cluster.cpus_per_shard <= cpus, (
        f"{cfg.cluster.num_shards} shards × {cfg.cluster.cpus_per_shard} CPUs > {cpus} worker CPUs")
    if cfg.cluster.gpus_per_shard:
        gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
                   for g in spec["workerGroupSpecs"])
        assert cfg.cluster.num_shards * cfg.cluster.gpus_per_shard <= gpus
    return cfg


def _load_inline_config(text: str, overrides: list[str]):
    """Load a config whose `base` is a path inside the image, resolving it to the repository."""
    import tempfile

    raw = tomllib.loads(text)
    if "base" in raw:
        base = _image_path(raw["base"])
        assert base is not None and base.is_file(), f"base {raw['base']} is not a config in the image"
        text = re.sub(r'^base\s*=\s*"[^"]*"', f'base = "{base.as_posix()}"', text, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text)
        return load_config(str(path), overrides).validate()


def _ray_job_submits(text: str) -> list[str]:
    """The widedp commands after `--` of every `ray job submit` line in `text` (comments too)."""
    out = []
    for line in text.splitlines():
        line = line.lstrip("# ").strip()
        if line.startswith("ray job submit") and " -- " in line:
            out.append(line.split(" -- ", 1)[1])
    return out


def _data_paths(directory: Path, objects: list[dict]) -> set[str]:
    """data.path of every command the build's Ray cluster runs."""
    ray = _ray_object(objects)
    return {_check_widedp_command(c, _cluster_spec(ray), objects).data.path for c in _ray_commands(directory, ray)}


# ---- the checks ----------------------------------------------------------------------------------
def _check_ray_object(directory: Path, objects: list[dict]) -> None:
    """The RayJob / RayCluster matches the project: Ray version, token auth, images, resources,
    a head that takes no shards, worker groups that fit, and valid commands."""
    obj = _ray_object(objects)
    assert obj["apiVersion"] == "ray.io/v1"
    spec = _cluster_spec(obj)
    assert str(spec["rayVersion"]).startswith(_ray_prefix()), f"rayVersion {spec['rayVersion']} vs ray {PINS['ray']}"
    assert spec["authOptions"]["mode"] == "token" and spec["authOptions"].get("secretName")
    pods = list(_pod_specs(spec))
    assert [name for name, _, _ in pods][0] == "head" and len(pods) >= 2, "a head group and a shard worker group"
    for name, group, pod in pods:
        for container in pod.get("initContainers", []) + pod["containers"]:
            repo, _, tag = container["image"].rpartition(":")
            assert PurePosixPath(repo).name == "widedp" and tag in _image_tags(), (name, container["image"])
            res = container["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), (name, res)
            if "limits" in res and "cpu" in res["limits"]:
                assert _cpus(res["requests"]["cpu"]) <= _cpus(res["limits"]["cpu"])
            _mounts(pod, container)  # every mount names a volume of the pod
        assert all(isinstance(v, str) for v in group.get("rayStartParams", {}).values()), "rayStartParams are strings"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0", "shards must not land on the head"
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limit = group["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("cpu")
        if limit is not None:
            assert _cpus(group["rayStartParams"]["num-cpus"]) <= _cpus(limit), "Ray would offer more CPUs than the pod has"
    if obj["kind"] == "RayJob":
        assert obj["spec"]["shutdownAfterJobFinishes"] is True
    for command in _ray_commands(directory, obj):
        _check_widedp_command(command, spec, objects)


def _check_convert_job(directory: Path, objects: list[dict]) -> None:
    """The conversion Job: with the Ray head's image, its init container `download` fetches
    DATA_URL (from a Secret) to RAW on scratch space, refusing a non-empty OUT_DIR; its container
    runs a valid `widedp convert` from RAW to OUT_DIR, and OUT_DIR is data.path of every command
    the cluster runs, on the PVC the head mounts, at the same mount path."""
    jobs = _of_kind(objects, "Job")
    assert len(jobs) == 1, f"{_rel(directory)}: expected one conversion Job, got {len(jobs)}"
    job = jobs[0]
    ray = _ray_object(objects)
    head_pod = _head_pod(ray)
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["spec"].get("backoffLimit") == 0, "a failed conversion is not retried"
    assert not job["spec"].get("ttlSecondsAfterFinished"), "the finished Job stays (kubectl wait / logs, re-apply = no-op)"
    assert pod.get("securityContext") == head_pod.get("securityContext"), "files on the volume: same user as the head"
    head_image = head_pod["containers"][0]["image"]
    for container in pod.get("initContainers", []) + pod["containers"]:
        assert container["image"] == head_image, (
            f"Job {job['metadata']['name']}: {container['name']} runs {container['image']}, the Ray head {head_image}")
    (convert,) = pod["containers"]
    argv = convert["command"] + convert.get("args", [])
    assert argv[0] == "widedp", argv
    args = _parse(argv[1:])
    assert args.command == "convert", argv
    # the output: data.path of the training, on the claim the head mounts at the same place
    assert _data_paths(directory, objects) == {args.out_dir}, (
        f"the Job writes {args.out_dir}, the training reads {sorted(_data_paths(directory, objects))}")
    mount, volume = _volume_at(args.out_dir, _mounts(pod, convert))
    assert _claim(volume), f"{args.out_dir} is not on a PersistentVolumeClaim in the Job"
    head_volume = _head_mounts(_cluster_spec(ray)).get(mount)
    assert head_volume is not None and _claim(head_volume) == _claim(volume), (
        f"the Job writes {args.out_dir} on claim {_claim(volume)} at {mount}; the head mounts "
        f"{_claim(head_volume) if head_volume else 'nothing'} there")
    # the input: what `download` fetched, on a scratch volume both containers mount at one place
    (download,) = [c for c in pod.get("initContainers", []) if c["name"] == "download"]
    env = {e["name"]: e for e in download.get("env", [])}
    assert env["OUT_DIR"].get("value") == args.out_dir, "download's refusal must look at the converter's output dir"
    assert args.input == [env["RAW"].get("value")], f"download writes {env['RAW'].get('value')}, convert reads {args.input}"
    (raw_input,) = args.input
    assert set(env["DATA_URL"]["valueFrom"]["secretKeyRef"]) == {"name", "key"}, "DATA_URL comes from a Secret"
    assert download["command"] == ["python", "-c"] and len(download["args"]) == 1, "download runs its script"
    raw_mount, raw = _volume_at(raw_input, _mounts(pod, convert))
    assert "emptyDir" in raw, f"{raw_input}: the raw download belongs on scratch space, not on {raw}"
    assert _volume_at(raw_input, _mounts(pod, download)) == (raw_mount, raw)
    assert _volume_at(args.out_dir, _mounts(pod, download)) == (mount, volume)


def _check_data_step(directory: Path, objects: list[dict]) -> None:
    """`kubectl apply -k DIR -l app.kubernetes.io/component=data` applies the conversion Job and the
    claim it writes to, and nothing of the Ray cluster."""
    selected = km.select(objects, DATA_LABEL)
    assert sorted(o["kind"] for o in selected) == ["Job", "PersistentVolumeClaim"], (
        f"{_rel(directory)} -l {DATA_LABEL} selects {[(o['kind'], o['metadata']['name']) for o in selected]}")
    job = _of_kind(selected, "Job")[0]
    for volume in job["spec"]["template"]["spec"]["volumes"]:
        if _claim(volume):
            _named(selected, "PersistentVolumeClaim", _claim(volume))


def _check_head_waits_for_data(directory: Path, objects: list[dict]) -> None:
    """A RayJob's head pod (and so the job) does not start before the data set exists: an init
    container polls for DATASET/dataset.json (written last by the converter), DATASET = data.path,
    on the claim the head container mounts at the same place."""
    ray = _ray_object(objects)
    if ray["kind"] != "RayJob":
        return
    pod = _head_pod(ray)
    waits = [c for c in pod.get("initContainers", []) if c["name"] == "wait-for-data"]
    assert waits, f"RayJob {ray['metadata']['name']}: the head has no init container wait-for-data"
    wait = waits[0]
    env = {e["name"]: e.get("value") for e in wait.get("env", [])}
    assert {env.get("DATASET")} == _data_paths(directory, objects), (
        f"wait-for-data waits for {env.get('DATASET')}, the job trains on {sorted(_data_paths(directory, objects))}")
    script = " ".join(wait["command"] + wait.get("args", []))
    assert wait["command"][:2] == ["/bin/sh", "-c"] and 'until [ -f "$DATASET/dataset.json" ]' in script, script
    mount, volume = _volume_at(env["DATASET"], _mounts(pod, wait))
    assert _head_mounts(_cluster_spec(ray)).get(mount) == volume, "wait-for-data must look at the head's volume"


def _check_kustomizations_coexist(renders: dict[Path, list[dict]]) -> None:
    """Both top-level kustomizations can be applied to one namespace: an object both apply is
    identical in both (else the second apply silently changes the first's), and no
    ReadWriteOnce claim is mounted by the pods of two of them (their pods could not run on
    different nodes at once)."""
    seen: dict[tuple[str, str], tuple[Path, dict]] = {}
    users: dict[str, set[Path]] = {}
    for directory, objects in renders.items():
        for obj in objects:
            key = (obj["kind"], obj["metadata"]["name"])
            if key in seen:
                assert seen[key][1] == obj, (f"{key[0]} {key[1]} differs between {_rel(seen[key][0])} and "
                                             f"{_rel(directory)}: applying one changes the other's")
            seen[key] = (directory, obj)
            for volume in _volumes(obj):
                if _claim(volume):
                    users.setdefault(_claim(volume), set()).add(directory)
    for claim, dirs in users.items():
        if len(dirs) > 1:
            pvc = seen[("PersistentVolumeClaim", claim)][1]
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], (
                f"PVC {claim} ({', '.join(pvc['spec']['accessModes'])}) is mounted by pods of "
                f"{', '.join(sorted(_rel(d) for d in dirs))}")


def _volumes(obj):
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "volumes" and isinstance(value, list):
                yield from value
            else:
                yield from _volumes(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _volumes(value)


def _check_conversion_jobs_agree(renders: dict[Path, list[dict]]) -> None:
    """The RayCluster's conversion Job is the RayJob's, but for its name and its claim."""
    def normalized(objects):
        job = copy.deepcopy(_of_kind(objects, "Job")[0])
        job["metadata"]["name"] = "JOB"
        for volume in job["spec"]["template"]["spec"]["volumes"]:
            if _claim(volume):
                volume["persistentVolumeClaim"]["claimName"] = "CLAIM"
        return job
    jobs = {d: normalized(objs) for d, objs in renders.items()}
    first = next(iter(jobs.values()))
    for directory, job in jobs.items():
        assert job == first, f"the conversion Job of {_rel(directory)} differs from the others beyond name and claim"


OBJECT_STORE_SECRET = "widedp-object-store"


def _check_object_storage_reach(directory: Path, objects: list[dict]) -> None:
    """Every Ray container can read a partitioned data set at a URI itself (trainers read their own
    parts on the workers; trainer/data/format/remote.py): the object store's credentials from the
    Secret widedp-object-store (envFrom, optional: a data set on the volume needs none), and
    WIDEDP_STAGE_DIR on a scratch volume (emptyDir) of its own pod, where its parts are staged."""
    spec = _cluster_spec(_ray_object(objects))
    for name, _, pod in _pod_specs(spec):
        for container in pod["containers"]:
            refs = [e.get("secretRef", {}) for e in container.get("envFrom", [])]
            assert any(r.get("name") == OBJECT_STORE_SECRET and r.get("optional") is True for r in refs), (
                f"{name}/{container['name']}: no optional envFrom secretRef {OBJECT_STORE_SECRET}")
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            stage = env.get("WIDEDP_STAGE_DIR")
            assert stage, f"{name}/{container['name']}: no WIDEDP_STAGE_DIR (where its parts are staged)"
            _, volume = _volume_at(stage, _mounts(pod, container))
            assert "emptyDir" in volume and volume["emptyDir"].get("medium") != "Memory", (
                f"{name}/{container['name']}: WIDEDP_STAGE_DIR {stage} is not on a disk scratch volume ({volume})")


def _all_checks(directory: Path, objects: list[dict]) -> None:
    _check_object_storage_reach(directory, objects)
    _check_ray_object(directory, objects)
    _check_convert_job(directory, objects)
    _check_data_step(directory, objects)
    _check_head_waits_for_data(directory, objects)


# ---- the manifests as they are -------------------------------------------------------------------
def test_kustomizations_render_and_cover_every_manifest():
    assert [_rel(d) for d in TOP_LEVEL] == ["deploy/k8s", "deploy/k8s/raycluster"], TOP_LEVEL
    kinds = {_rel(d): sorted(o["kind"] for o in objs) for d, objs in RENDERS.items()}
    assert kinds == {"deploy/k8s": ["ConfigMap", "Job", "PersistentVolumeClaim", "RayJob"],
                     "deploy/k8s/raycluster": ["ConfigMap", "Job", "PersistentVolumeClaim", "RayCluster"]}, kinds
    read = set().union(*(_referenced(d)[1] for d in TOP_LEVEL))
    for path in K8S.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert path in read, f"{path.relative_to(ROOT)} is in no kustomization: kubectl apply -k never applies it"
    for directory in _kustomization_dirs():
        for image in km.load_kustomization(directory).get("images", []):
            assert image["name"] == "widedp" and image["newTag"] in _image_tags(), (directory, image)


@pytest.mark.parametrize("directory", TOP_LEVEL, ids=_rel)
def test_kustomization_runs_widedp_on_converted_data(directory):
    _all_checks(directory, RENDERS[directory])


def test_both_kustomizations_can_be_applied_together():
    _check_kustomizations_coexist(RENDERS)
    _check_conversion_jobs_agree(RENDERS)


@pytest.mark.parametrize("directory,obj", ALL_OBJECTS, ids=[f"{o['kind']}-{o['metadata']['name']}" for _, o in ALL_OBJECTS])
def test_manifest_matches_the_api_schema(directory, obj):
    """Every object `kubectl apply -k` sends validates against the API server's schema: RayJob and
    RayCluster against KubeRay v1.6.0's CRD (tests/data/kuberay-crds), core objects against the
    strict Kubernetes schemas of `kubernetes-validate`.

    Stricter than the API server in one way, on purpose: an object schema with `properties` and
    no `x-kubernetes-preserve-unknown-fields` is closed (additionalProperties: false). The API
    server prunes an unknown field of a structural schema silently unless the client asks for
    strict field validation (recent kubectl does by default; controllers, GitOps tools and client
    libraries often do not): a misspelled field would just not take effect, a bug in a manifest.
    CEL rules (x-kubernetes-validations) are not evaluated: a manifest may not set such a field."""
    errors = km.schema_errors(obj)
    assert not errors, f"{_rel(directory)}: {obj['kind']} {obj['metadata']['name']}:\n" + "\n".join(errors)


def test_configmap_config_is_a_valid_override_of_the_repo_config():
    for directory, objects in RENDERS.items():
        for cm in _of_kind(objects, "ConfigMap"):
            for key, text in cm["data"].items():
                raw = tomllib.loads(text)
                cfg = _load_inline_config(text, [])
                assert PurePosixPath(cfg.run_dir).is_absolute() and PurePosixPath(cfg.data.path).is_absolute()
                assert not cfg.cluster.address, "the job's driver must take RAY_ADDRESS from the job"
                assert raw["base"].startswith("/app/configs/"), raw["base"]
                assert not cfg.data.synth, "the deployment trains on the converted data, never on a generated set"


# ---- broken manifests: each check above rejects its broken variant --------------------------------
def _job(objs):
    return _of_kind(objs, "Job")[0]


def _job_pod(objs):
    return _job(objs)["spec"]["template"]["spec"]


def _env(container, name):
    return next(e for e in container["env"] if e["name"] == name)


def _wait(objs):
    return next(c for c in _head_pod(_ray_object(objs)).get("initContainers", []) if c["name"] == "wait-for-data")


def _set_convert_arg(objs, old, new):
    command = _job_pod(objs)["containers"][0]["command"]
    command[command.index(old)] = new


BROKEN = {
    # name: (kustomization, mutation, the check, what its message must say)
    "convert-writes-elsewhere": ("deploy/k8s", lambda o: _set_convert_arg(o, "/data/datasets/criteo", "/data/datasets/other"),
                                 _check_convert_job, "the training reads"),
    "convert-invalid-option": ("deploy/k8s", lambda o: _set_convert_arg(o, "1048576", "1"),
                               _check_convert_job, "not a valid widedp command"),
    "convert-not-widedp-convert": ("deploy/k8s", lambda o: _set_convert_arg(o, "convert", "synth"),
                                   _check_convert_job, "not a valid widedp command|command == .convert."),
    "job-other-image": ("deploy/k8s", lambda o: _job_pod(o)["containers"][0].update(image="registry.example.com/other:1"),
                        _check_convert_job, "the Ray head"),
    "job-writes-other-claim": ("deploy/k8s/raycluster",
                               lambda o: _job_pod(o)["volumes"][0]["persistentVolumeClaim"].update(claimName="widedp-runs"),
                               _check_convert_job, "the head mounts"),
    "download-checks-other-dir": ("deploy/k8s", lambda o: _env(_job_pod(o)["initContainers"][0], "OUT_DIR").update(value="/data/x"),
                                  _check_convert_job, "refusal"),
    "download-raw-elsewhere": ("deploy/k8s", lambda o: _env(_job_pod(o)["initContainers"][0], "RAW").update(value="/raw/x.tsv"),
                               _check_convert_job, "convert reads"),
    "job-retries": ("deploy/k8s", lambda o: _job(o)["spec"].update(backoffLimit=3), _check_convert_job, "not retried"),
    "pvc-not-in-data-step": ("deploy/k8s", lambda o: _of_kind(o, "PersistentVolumeClaim")[0]["metadata"]["labels"].clear(),
                             _check_data_step, "selects"),
    "head-does-not-wait": ("deploy/k8s", lambda o: _head_pod(_ray_object(o)).pop("initContainers"),
                           _check_head_waits_for_data, "no init container wait-for-data"),
    "head-waits-for-other-data": ("deploy/k8s", lambda o: _env(_wait(o), "DATASET").update(value="/data/datasets/ctr"),
                                  _check_head_waits_for_data, "the job trains on"),
    "training-data-off-the-volume": ("deploy/k8s", lambda o: _of_kind(o, "ConfigMap")[0]["data"].update(
        {"ctr.toml": _of_kind(o, "ConfigMap")[0]["data"]["ctr.toml"].replace('"/data/datasets/criteo"', '"/tmp/criteo"')}),
                                     _check_ray_object, "is on no volume"),
    "worker-without-object-store-credentials": ("deploy/k8s", lambda o: _cluster_spec(_ray_object(o))["workerGroupSpecs"][0][
        "template"]["spec"]["containers"][0].pop("envFrom"), _check_object_storage_reach, "no optional envFrom"),
    "worker-stages-on-no-volume": ("deploy/k8s/raycluster", lambda o: _cluster_spec(_ray_object(o))["workerGroupSpecs"][0][
        "template"]["spec"]["containers"][0]["volumeMounts"].pop(), _check_object_storage_reach, "is on no volume"),
    "shards-do-not-fit": ("deploy/k8s", lambda o: _cluster_spec(_ray_object(o))["workerGroupSpecs"][0].update(replicas=1, minReplicas=1),
                          _check_ray_object, "worker CPUs"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_checks_reject_a_broken_manifest(name):
    directory, mutate, check, message = BROKEN[name]
    directory = ROOT / directory
    objects = copy.deepcopy(RENDERS[directory])
    check(directory, objects)  # the real manifests pass ...
    mutate(objects)
    with pytest.raises(AssertionError, match=message):  # ... the broken variant does not
        check(directory, objects)


def test_coexistence_check_rejects_a_shared_readwriteonce_claim():
    renders = copy.deepcopy(RENDERS)
    _check_kustomizations_coexist(renders)
    cluster = renders[K8S / "raycluster"]
    # the old layout: the RayCluster's head on the RayJob's ReadWriteOnce claim
    for volume in _volumes(cluster):
        if _claim(volume):
            volume["persistentVolumeClaim"]["claimName"] = "widedp-runs"
    cluster[:] = [o for o in cluster if o["kind"] != "PersistentVolumeClaim"]
    cluster.append(copy.deepcopy(_named(renders[K8S], "PersistentVolumeClaim", "widedp-runs")))
    with pytest.raises(AssertionError, match=r"PVC widedp-runs \(ReadWriteOnce\) is mounted by pods of deploy/k8s, "):
        _check_kustomizations_coexist(renders)
    renders = copy.deepcopy(RENDERS)
    _of_kind(renders[K8S / "raycluster"], "ConfigMap")[0]["data"]["ctr.toml"] += "\n"
    with pytest.raises(AssertionError, match="ConfigMap widedp-config differs"):
        _check_kustomizations_coexist(renders)
    renders = copy.deepcopy(RENDERS)
    _set_convert_arg(renders[K8S / "raycluster"], "1048576", "65536")
    with pytest.raises(AssertionError, match="differs from the others"):
        _check_conversion_jobs_agree(renders)


def _ray(kind):
    return copy.deepcopy(next(o for _, o in RAY_OBJECTS if o["kind"] == kind))


def _worker(obj):
    return _cluster_spec(obj)["workerGroupSpecs"][0]


def _head_container(obj):
    return _head_pod(obj)["containers"][0]


SCHEMA_BROKEN = {
    # name: (object, mutation, what the error must say)
    "replicas-as-string": ("RayJob", lambda o: _worker(o).update(replicas="2"), r"replicas: '2' is not of type 'integer'"),
    "misspelled-spec-field": ("RayJob", lambda o: o["spec"].update(shutdownAfterJobFinish=True),
                              r"'shutdownAfterJobFinish' was unexpected"),
    "misspelled-pod-field": ("RayCluster", lambda o: _head_container(o).update(volumeMount=[]),
                             r"containers\.0: .*'volumeMount' was unexpected"),
    "misspelled-metadata": ("RayJob", lambda o: o["metadata"].update(lables={}), r"metadata: .*'lables' was unexpected"),
    "auth-mode-not-in-enum": ("RayCluster", lambda o: _cluster_spec(o)["authOptions"].update(mode="tokens"),
                              r"'tokens' is not one of"),
    "ray-start-param-not-a-string": ("RayJob", lambda o: _worker(o)["rayStartParams"].update({"num-cpus": 4}),
                                     r"num-cpus: 4 is not of type 'string'"),
    "cpu-not-a-quantity": ("RayJob", lambda o: _head_container(o)["resources"]["requests"].update(cpu="two"),
                           r"requests\.cpu: 'two' does not match"),
    "int32-overflow": ("RayJob", lambda o: o["spec"].update(ttlSecondsAfterFinished=2**40), r"is not a 'int32'"),
    "repeated-map-list-key": ("RayCluster", lambda o: _head_container(o)["ports"].append({"containerPort": 6379}),
                              r"ports: list of type map repeats"),
    "cel-field": ("RayJob", lambda o: o["spec"].update(managedBy="ray.io/kuberay-operator"), r"managedBy: .*CEL rules"),
    "job-misspelled": ("Job", lambda o: o["spec"]["template"]["spec"].update(restartPolicyy="Never"),
                       r"Job\) spec\.template\.spec: .*'restartPolicyy' was unexpected"),
    "job-wrong-type": ("Job", lambda o: o["spec"].update(backoffLimit="0"), r"backoffLimit: '0' is not of type"),
    "pvc-misspelled": ("PersistentVolumeClaim", lambda o: o["spec"].update(accessMode=["ReadWriteOnce"]),
                       r"'accessMode' was unexpected"),
    "configmap-misspelled": ("ConfigMap", lambda o: o.update(datas={}), r"'datas' was unexpected"),
}


@pytest.mark.parametrize("name", sorted(SCHEMA_BROKEN))
def test_schema_rejects_a_broken_manifest(name):
    kind, mutate, message = SCHEMA_BROKEN[name]
    obj = copy.deepcopy(next(o for _, o in ALL_OBJECTS if o["kind"] == kind))
    assert not km.schema_errors(obj)
    mutate(obj)
    errors = km.schema_errors(obj)
    assert any(re.search(message, e) for e in errors), errors


# ---- the renderer ----------------------------------------------------------------------------------
def test_render_applies_the_image_override_to_every_container(tmp_path):
    """What the image override of a kustomization does, through the renderer: every container and
    init container named widedp (head, workers, waits, the conversion Job) gets the new image."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [str(K8S)],
        "images": [{"name": "widedp", "newName": "registry.example.com:5000/widedp", "newTag": "0.1.0-cuda"}]}))
    objects = km.render(overlay)
    images = {c["image"] for o in objects for c in km.containers(o)}
    assert images == {"registry.example.com:5000/widedp:0.1.0-cuda"}, images
    assert len(list(km.containers(_of_kind(objects, "Job")[0]))) == 2  # download + convert
    _all_checks(K8S, objects)  # image tags and commands still fit the project
    # an override for another name changes nothing; a field the renderer does not know is refused
    assert km.split_image("registry.example.com:5000/widedp") == ("registry.example.com:5000/widedp", "", "")
    assert km.split_image("widedp:0.1.0-cpu@sha256:ab") == ("widedp", "0.1.0-cpu", "sha256:ab")
    assert km._set_image("other:1", {"name": "widedp", "newTag": "x"}) == "other:1"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [str(K8S)],
        "namePrefix": "dev-"}))
    with pytest.raises(AssertionError, match="namePrefix"):
        km.render(overlay)


# ---- the conversion Job's and the head's scripts, run here ----------------------------------------
def _script(container: dict) -> str:
    return container["args"][0]


def _local(value: str, mounts: dict[str, Path]) -> str:
    """A container path -> the same path under the local directories standing in for its mounts."""
    for mount, local in mounts.items():
        if PurePosixPath(value).is_relative_to(mount):
            return str(local / PurePosixPath(value).relative_to(mount))
    return value


def _criteo_tsv(rows: int) -> bytes:
    lines = []
    for i in range(rows):
        ints = [str(i % 7 + j) if (i + j) % 5 else "" for j in range(13)]
        cats = [f"{(i * 2654435761 + j) % 2**32:08x}" if (i + j) % 4 else "" for j in range(26)]
        lines.append("\t".join([str(i % 2), *ints, *cats]))
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def https_server(tmp_path_factory):
    """An HTTPS server on 127.0.0.1 with a self-signed certificate (trusted through
    SSL_CERT_FILE): serves `routes[path] = (body, headers)`, counts requests."""
    import datetime
    import http.server
    import ipaddress
    import ssl
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tmp = tmp_path_factory.mktemp("https")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    routes: dict[str, tuple[bytes, dict]] = {}
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            body, headers = routes.get(self.path.split("?")[0], (b"", {"status": 404}))
            self.send_response(headers.get("status", 200))
            self.send_header("Content-Length", str(headers.get("Content-Length", len(body))))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"https://127.0.0.1:{server.server_address[1]}", "routes": routes, "requests": requests,
           "cert": tmp / "cert.pem"}
    server.shutdown()
    server.server_close()


def _run_download(server, tmp_path: Path, url: str, out_dir: Path | None = None):
    """The Job's `download` script, with its mounts under tmp_path; (process, RAW, OUT_DIR)."""
    pod = _job_pod(RENDERS[K8S])
    download = pod["initContainers"][0]
    mounts = {m: tmp_path / m.strip("/") for m in _mounts(pod, download)}
    for local in mounts.values():
        local.mkdir(parents=True, exist_ok=True)
    env = {e["name"]: _local(e["value"], mounts) for e in download["env"] if "value" in e}
    if out_dir is not None:
        env["OUT_DIR"] = str(out_dir)
    env.update(DATA_URL=url, SSL_CERT_FILE=str(server["cert"]), PATH=os.environ["PATH"])
    proc = subprocess.run([sys.executable, "-c", _script(download)], env=env, capture_output=True, text=True)
    return proc, Path(env["RAW"]), Path(env["OUT_DIR"])


def test_download_fetches_and_refuses(https_server, tmp_path):
    """The Job's download script, run here against a local HTTPS server: fetches a file (and a
    .gz, decompressed), never keeps a truncated one, refuses non-https URLs and a non-empty
    output directory before fetching anything, and logs the URL without its query (a signature)."""
    data = _criteo_tsv(20)
    srv, routes = https_server, https_server["routes"]
    routes["/d/day.tsv"] = (data, {})
    routes["/d/day.tsv.gz"] = (gzip.compress(data), {})
    routes["/d/short.tsv"] = (data[:100], {"Content-Length": len(data)})
    routes["/d/cut.tsv.gz"] = (gzip.compress(data)[:-20], {})
    for i, path in enumerate(["/d/day.tsv", "/d/day.tsv.gz"]):
        proc, raw, _ = _run_download(srv, tmp_path / str(i), f"{srv['url']}{path}?X-Amz-Signature=secret")
        assert proc.returncode == 0, proc.stderr
        assert raw.read_bytes() == data
        log = json.loads(proc.stdout)
        assert log["url"] == f"{srv['url']}{path}" and "secret" not in proc.stdout + proc.stderr
        assert log["raw_bytes"] == len(data) and len(log["sha256"]) == 64
    for i, path in enumerate(["/d/short.tsv", "/d/cut.tsv.gz", "/d/missing.tsv"]):
        proc, raw, _ = _run_download(srv, tmp_path / f"bad{i}", f"{srv['url']}{path}")
        assert proc.returncode != 0 and not raw.exists(), (path, proc.stdout, proc.stderr)
    before = len(srv["requests"])
    for url, message in (("http://127.0.0.1/day.tsv", "must be an https:// URL"),
                         ("s3://bucket/day.tsv", "aws s3 presign"), ("gs://bucket/day.tsv", "gcloud storage sign-url")):
        proc, raw, _ = _run_download(srv, tmp_path / "scheme", url)
        assert proc.returncode != 0 and message in proc.stderr and not raw.exists(), proc.stderr
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "dataset.json").write_text("{}")
    proc, raw, _ = _run_download(srv, tmp_path / "refused", f"{srv['url']}/d/day.tsv", out_dir=occupied)
    assert proc.returncode != 0 and "refusing" in proc.stderr and not raw.exists(), proc.stderr
    assert len(srv["requests"]) == before, "refused before fetching anything"


def test_conversion_job_pipeline_fills_what_the_head_waits_for(https_server, tmp_path):
    """download -> `widedp convert` exactly as the Job runs them (container paths mapped to local
    directories): the data set appears where the head's wait-for-data looks, the wait then passes,
    and a second conversion into it is refused by both containers."""
    from widedp.trainer.cli import main_result

    srv = https_server
    srv["routes"]["/d/pipeline.tsv.gz"] = (gzip.compress(_criteo_tsv(40)), {})
    proc, raw, out_dir = _run_download(srv, tmp_path, f"{srv['url']}/d/pipeline.tsv.gz")
    assert proc.returncode == 0, proc.stderr
    pod = _job_pod(RENDERS[K8S])
    convert = pod["containers"][0]
    mounts = {m: tmp_path / m.strip("/") for m in _mounts(pod, convert)}
    argv = [_local(a, mounts) for a in convert["command"] + convert.get("args", [])]
    assert Path(argv[argv.index(str(out_dir))]) == out_dir and str(raw) in argv
    result = main_result(argv[1:])
    assert result["num_examples"] == 40 and (out_dir / "dataset.json").is_file()
    # the head's wait, with DATASET mapped the same way: passes at once now
    wait = _wait(RENDERS[K8S])
    dataset = _local(_env(wait, "DATASET")["value"], mounts)
    assert Path(dataset) == out_dir
    done = subprocess.run(wait["command"] + wait["args"], env={"DATASET": dataset, "PATH": os.environ["PATH"]},
                          capture_output=True, text=True)
    assert done.returncode == 0 and "waiting" not in done.stdout, done.stdout + done.stderr
    # never overwritten: download refuses first, the converter refuses too
    again, _, _ = _run_download(srv, tmp_path / "again", f"{srv['url']}/d/pipeline.tsv.gz", out_dir=out_dir)
    assert again.returncode != 0 and "refusing" in again.stderr
    with pytest.raises(ValueError, match="not empty"):
        main_result(argv[1:])


def test_head_waits_until_dataset_json_exists(tmp_path):
    """The head's wait-for-data loops while DATASET/dataset.json is missing and ends once it is
    there (`sleep` is replaced by a stub that creates it, so the loop runs exactly once)."""
    wait = _wait(RENDERS[K8S])
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "data.parquet").write_bytes(b"")  # the converter's data file alone is not enough
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "sleep").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/sleeps"\ntouch "$DATASET/dataset.json"\n')
    (stubs / "sleep").chmod(0o755)
    proc = subprocess.run(wait["command"] + wait["args"], env={"DATASET": str(dataset), "PATH": f"{stubs}:{os.environ['PATH']}"},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sleeps").read_text().count("\n") == 1
    assert f"waiting for {dataset}/dataset.json" in proc.stdout


@pytest.mark.parametrize("layout", ["partitioned", "uri"])
def test_head_does_not_wait_for_a_partitioned_data_set_or_a_uri(tmp_path, layout):
    wait = _wait(RENDERS[K8S])
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "partitions.json").write_text("{}")
    target = str(dataset) if layout == "partitioned" else "s3://bucket/datasets/criteo"
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "sleep").write_text("#!/bin/sh\nkill -9 $PPID\n")  # a wait kills the script
    (stubs / "sleep").chmod(0o755)
    proc = subprocess.run(wait["command"] + wait["args"], env={"DATASET": target, "PATH": f"{stubs}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "waiting" not in proc.stdout, (proc.stdout, proc.stderr)


# ---- README §5 -------------------------------------------------------------------------------------
def _readme_k8s_section() -> str:
    section = _readme_cluster_section()
    assert "\n## 5. Kubernetes (KubeRay)\n" in section, "docs/guide/cluster.md lacks '## 5. Kubernetes (KubeRay)'"
    return section.split("\n## 5. Kubernetes (KubeRay)\n", 1)[1].split("\n## ", 1)[0]


def _check_readme_k8s(section: str, renders: dict[Path, list[dict]]) -> None:
    """The kubectl commands of README §5 name what the manifests define: the Secrets they read
    (name and key), the kustomizations and the data step's selector, the Jobs and the RayJob."""
    text = re.sub(r"\\\n\s*", " ", section)
    secrets = set(re.findall(r"kubectl create secret generic (\S+) --from-literal=([A-Za-z0-9_.-]+)=", text))
    objects = [o for objs in renders.values() for o in objs]
    needed = set()
    for obj in objects:
        for container in km.containers(obj):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    needed.add((ref["name"], ref["key"]))
        if obj["kind"] in RAY_KINDS:
            needed.add((_cluster_spec(obj)["authOptions"]["secretName"], "auth_token"))  # KubeRay's key
    assert needed <= secrets, f"README creates the Secrets {sorted(secrets)}, the manifests read {sorted(needed)}"
    applies = re.findall(r"kubectl apply -k ([\w./-]+)(?: -l ([\w./=,-]+))?", text)
    assert applies, "README shows no `kubectl apply -k`"
    for directory, selector in applies:
        assert ROOT / directory in renders, f"README applies {directory}, which is not a top-level kustomization"
        if selector:
            assert selector == DATA_LABEL, selector
            _check_data_step(ROOT / directory, km.select(renders[ROOT / directory], selector))
    # Jobs: the conversion Jobs, and the submitter Job KubeRay creates for a RayJob (K8sJobMode), named after it
    jobs = {o["metadata"]["name"] for o in objects if o["kind"] == "Job"}
    jobs |= {o["metadata"]["name"] for o in objects
             if o["kind"] == "RayJob" and o["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode"}
    for name in re.findall(r"\bjob/([a-z0-9-]+)", text):
        assert name in jobs, f"README: no Job {name}"
    for name in re.findall(r"\brayjob ([a-z0-9-]+)", text):
        assert any(o["kind"] == "RayJob" and o["metadata"]["name"] == name for o in objects), f"README: no RayJob {name}"


def test_readme_kubernetes_commands_name_what_the_manifests_define():
    section = _readme_k8s_section()
    _check_readme_k8s(section, RENDERS)
    assert "kubectl wait --for=condition=complete job/widedp-convert" in section
    for broken, message in ((section.replace("--from-literal=url=", "--from-literal=uri="), "Secrets"),
                            (section.replace("job/widedp-convert", "job/widedp-conversion"), "no Job widedp-conversion"),
                            (section.replace(f"-l {DATA_LABEL}", "-l app.kubernetes.io/component=dat"), "component=dat")):
        assert broken != section
        with pytest.raises(AssertionError, match=message):
            _check_readme_k8s(broken, RENDERS)


# ---- ray job submit: runtime_env, cluster config, README ------------------------------------------
def test_runtime_env_uploads_only_the_source():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    assert {".git", ".venv", "runs"} <= set(env["excludes"])
    assert set(env) <= {"working_dir", "excludes", "env_vars"}, "dependencies come from the image / the venv"


def test_cluster_quickstart_config():
    cfg = load_config(str(ROOT / "configs" / "cluster_quickstart.toml")).validate()
    assert Path(cfg.run_dir).is_absolute() and Path(cfg.data.path).is_absolute()
    assert cfg.cluster.backend == "ray" and not cfg.cluster.address


def _readme_cluster_section() -> str:
    """The cluster guide (docs/guide/cluster.md), the page a user follows."""
    text = (ROOT / "docs" / "guide" / "cluster.md").read_text()
    assert text.startswith("# Running on a cluster\n"), "docs/guide/cluster.md is not the cluster guide"
    return text


def test_readme_commands_are_valid():
    section = _readme_cluster_section()
    joined = re.sub(r"\\\n\s*", " ", section)
    commands = [c for c in _ray_job_submits(joined)]
    assert len(commands) >= 2, "the README shows `ray job submit` commands"
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["widedp", "train"], command
        args = build_parser().parse_args(argv[1:])
        assert args.config and not args.address, command
        if args.config.startswith("/etc/widedp/") or args.config.startswith("/app/"):
            continue  # container paths: checked against the manifests above
        assert (ROOT / args.config).is_file(), f"README: {args.config} does not exist"
        load_config(str(ROOT / args.config), [s for s in args.set if "$" not in s]).validate()
    for path in re.findall(r"(deploy/[A-Za-z0-9_./-]+)", section):
        assert (ROOT / path.rstrip(".")).exists(), f"README names {path}, which does not exist"
