"""Deployment artefacts agree with the project: container images install exactly the pinned set
of pyproject.toml (+ the Makefile's torchrec pin), the KubeRay manifests run a valid `widedp`
command on a config that exists and fits the cluster they describe, and the documented
`ray job submit` commands parse. No Docker or Kubernetes needed: everything is parsed."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml

from widedp.trainer.cli import build_parser
from widedp.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "cuda": DEPLOY / "Dockerfile.cuda"}


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
    # the one installed package, widedp/, and the top-level folders its links point to
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["widedp", "widedp.*"]
    packages = {"widedp"} | {p.name for p in (ROOT / "widedp").iterdir() if p.is_symlink()}
    assert {"trainer", "selection", "accounting"} <= packages
    assert packages | {"pyproject.toml", "README.md", "configs"} <= copied
    assert re.search(r"^WORKDIR /app$", text, re.M)  # configs at /app/configs (the ConfigMap's base)
    ignore = (DOCKERFILES[variant].parent / f"{DOCKERFILES[variant].name}.dockerignore").read_text().split()
    for item in packages | {"pyproject.toml", "README.md", "configs"}:
        assert f"!{item}" in ignore or f"!{item}/" in ignore, f"{item} is excluded from the build context"


def test_both_images_share_the_base():
    bases = {re.search(r"^FROM\s+(\S+)", _dockerfile(p), re.M).group(1) for p in DOCKERFILES.values()}
    assert len(bases) == 1, bases


# ---- Kubernetes manifests --------------------------------------------------------------------------
def _load_all() -> dict[Path, list]:
    return {p: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.rglob("*.yaml"))}


MANIFESTS = _load_all()
OBJECTS = [(p, d) for p, docs in MANIFESTS.items() for d in docs if d.get("kind") != "Kustomization"]
KUSTOMIZATIONS = {p: docs[0] for p, docs in MANIFESTS.items() if docs and docs[0].get("kind") == "Kustomization"}
RAY_OBJECTS = [(p, d) for p, d in OBJECTS if d.get("kind") in ("RayJob", "RayCluster")]
CONFIGMAPS = {d["metadata"]["name"]: d for _, d in OBJECTS if d.get("kind") == "ConfigMap"}
PVCS = {d["metadata"]["name"]: d for _, d in OBJECTS if d.get("kind") == "PersistentVolumeClaim"}


def _cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def _pod_specs(spec: dict):
    yield "head", spec["headGroupSpec"], spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        yield group["groupName"], group, group["template"]["spec"]


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_manifests_parse_and_name_what_they_need():
    kinds = sorted(d["kind"] for _, d in OBJECTS)
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "RayCluster", "RayJob"], kinds
    assert (K8S / "rayjob.yaml") in {p for p, _ in RAY_OBJECTS}
    for path, kust in KUSTOMIZATIONS.items():
        for res in kust.get("resources", []):
            target = (path.parent / res).resolve()
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: missing resource {res}"
        for image in kust.get("images", []):
            assert image["name"] == "widedp" and image["newTag"] in _image_tags(), (path, image)


def _image_tags() -> set[str]:
    return {f"{PROJECT['version']}-{variant}" for variant in DOCKERFILES}


@pytest.mark.parametrize("path,obj", RAY_OBJECTS, ids=[d["kind"] for _, d in RAY_OBJECTS])
def test_ray_manifest_matches_the_project(path, obj):
    assert obj["apiVersion"] == "ray.io/v1"
    spec = _cluster_spec(obj)
    assert str(spec["rayVersion"]).startswith(_ray_prefix()), f"rayVersion {spec['rayVersion']} vs ray {PINS['ray']}"
    assert spec["authOptions"]["mode"] == "token" and spec["authOptions"].get("secretName")
    pods = list(_pod_specs(spec))
    assert [name for name, _, _ in pods][0] == "head" and len(pods) >= 2, "a head group and a shard worker group"
    for name, group, pod in pods:
        for container in pod["containers"]:
            repo, _, tag = container["image"].rpartition(":")
            assert PurePosixPath(repo).name == "widedp" and tag in _image_tags(), (name, container["image"])
            res = container["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), (name, res)
            if "limits" in res and "cpu" in res["limits"]:
                assert _cpus(res["requests"]["cpu"]) <= _cpus(res["limits"]["cpu"])
            volumes = {v["name"] for v in pod.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
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
        _check_widedp_command(obj["spec"]["entrypoint"], spec)
    else:  # the documented submission against the long-lived cluster
        commands = _ray_job_submits(path.read_text())
        assert commands, f"{path.name}: no example `ray job submit` in its header"
        for command in commands:
            _check_widedp_command(command, spec)


def _head_mounts(spec: dict) -> dict[str, dict]:
    """mountPath -> volume (head container)."""
    pod = spec["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in pod["containers"][0].get("volumeMounts", [])}


def _image_path(container_path: str) -> Path | None:
    """A path inside the image -> the repository file the Dockerfile copies there (WORKDIR /app)."""
    p = PurePosixPath(container_path)
    if p.is_relative_to("/app"):
        return ROOT / p.relative_to("/app")
    return None


def _check_widedp_command(command: str, spec: dict, tmp_dir: Path | None = None) -> None:
    argv = shlex.split(command)
    assert argv[0] == "widedp", command
    args = build_parser().parse_args(argv[1:])
    assert args.command == "train" and args.config and not args.address, command
    mounts = _head_mounts(spec)
    # the config named by the command: a ConfigMap key mounted on the head, or a file in the image
    config_dir, config_name = str(PurePosixPath(args.config).parent), PurePosixPath(args.config).name
    volume = mounts.get(config_dir)
    if volume is not None:
        cm = CONFIGMAPS[volume["configMap"]["name"]]
        assert config_name in cm["data"], f"{command}: no key {config_name} in ConfigMap {cm['metadata']['name']}"
        text = cm["data"][config_name]
    else:
        local = _image_path(args.config)
        assert local is not None and local.is_file(), f"{command}: {args.config} is neither mounted nor in the image"
        text = local.read_text()
    cfg = _load_inline_config(text, args.set)
    run_dir = args.run_dir or cfg.run_dir
    # run dir and data set on the PVC mounted on the head (where the driver runs)
    pvc_mounts = [m for m, v in mounts.items() if "persistentVolumeClaim" in v]
    assert pvc_mounts and all(mounts[m]["persistentVolumeClaim"]["claimName"] in PVCS for m in pvc_mounts)
    for what, value in (("run dir", run_dir), ("data.path", cfg.data.path)):
        assert any(PurePosixPath(value).is_relative_to(m) for m in pvc_mounts), f"{what} {value} is not on the PVC"
    # the shards fit the worker groups (the head offers 0 CPUs)
    cpus = sum(g["replicas"] * _cpus(g["rayStartParams"]["num-cpus"]) for g in spec["workerGroupSpecs"])
    assert cfg.cluster.backend == "ray"
    assert cfg.cluster.num_shards * cfg.cluster.cpus_per_shard <= cpus, (
        f"{cfg.cluster.num_shards} shards × {cfg.cluster.cpus_per_shard} CPUs > {cpus} worker CPUs")
    if cfg.cluster.gpus_per_shard:
        gpus = sum(g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
                   for g in spec["workerGroupSpecs"])
        assert cfg.cluster.num_shards * cfg.cluster.gpus_per_shard <= gpus


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


def test_configmap_config_is_a_valid_override_of_the_repo_config():
    for name, cm in CONFIGMAPS.items():
        for key, text in cm["data"].items():
            raw = tomllib.loads(text)
            cfg = _load_inline_config(text, [])
            assert PurePosixPath(cfg.run_dir).is_absolute() and PurePosixPath(cfg.data.path).is_absolute()
            assert not cfg.cluster.address, "the job's driver must take RAY_ADDRESS from the job"
            assert raw["base"].startswith("/app/configs/"), raw["base"]


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
    text = (ROOT / "README.md").read_text()
    assert "\n## Running on a cluster\n" in text, "README lacks the '## Running on a cluster' section"
    return text.split("\n## Running on a cluster\n", 1)[1].split("\n## ", 1)[0]


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
