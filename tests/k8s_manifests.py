"""What `kubectl apply -k DIR` would send to the API server, and the API server's schemas, without
kubectl or a cluster (used by tests/test_deploy.py).

`render(DIR)`: the objects of a kustomization, as kustomize builds them for the fields the
manifests in deploy/k8s use — `resources` (YAML files, or directories with a kustomization.yaml,
built recursively, in order) and `images` (kustomize's image transformer: every `image` of an
entry in any `containers` or `initContainers` list of any object, CRDs included, whose name
matches, gets newName / newTag / digest; an inner kustomization's `images` first, then the outer
one's). Any other kustomization field is refused: the renderer would silently ignore it, and
what the tests validate would no longer be what kubectl applies. Two objects of one build with
the same kind and name are refused, as kustomize refuses them.

`schema_errors(obj)`: every way `obj` breaks the schema the API server validates it against —
RayJob / RayCluster (ray.io/v1): the `openAPIV3Schema` of KubeRay's CRDs vendored in
tests/data/kuberay-crds (operator v1.6.0); core objects (ConfigMap, PersistentVolumeClaim,
batch/v1 Job, ...): the strict Kubernetes schemas of the `kubernetes-validate` package.
"""

from __future__ import annotations

import copy
import functools
import gzip
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT / "tests" / "data" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz"}
# Core objects are validated against the API of each of these Kubernetes versions ("latest" =
# the newest one the installed kubernetes-validate ships).
K8S_VERSIONS = ("1.30", "latest")
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images"}
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs parse in ~1 s instead of ~7 s


# ---- kustomize -----------------------------------------------------------------------------------
def load_kustomization(directory: Path) -> dict:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kust.get("kind") == "Kustomization", f"{directory}/kustomization.yaml is not a Kustomization"
    unknown = set(kust) - KUSTOMIZATION_FIELDS
    assert not unknown, (f"{directory}/kustomization.yaml uses {sorted(unknown)}, which tests/k8s_manifests.py "
                         f"does not render: teach render() those fields before using them")
    return kust


def render(directory: Path) -> list[dict]:
    """The objects `kubectl apply -k directory` applies (see the module docstring)."""
    kust = load_kustomization(directory)
    objects: list[dict] = []
    for resource in kust.get("resources", []):
        target = (directory / resource).resolve()
        if target.is_dir():
            objects += render(target)
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d]
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in seen, f"{directory}: {key[0]} {key[1]} appears twice in one build (kustomize refuses it)"
        seen.add(key)
    for image in kust.get("images", []):
        for obj in objects:
            for container in containers(obj):
                container["image"] = _set_image(container["image"], image)
    return objects


def containers(obj: Any) -> Iterator[dict]:
    """Every entry of a `containers` or `initContainers` list anywhere in obj (kustomize's
    image transformer walks objects the same way, api/filters/imagetag/legacy.go)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict) and "image" in c)
            else:
                yield from containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from containers(value)


def split_image(image: str) -> tuple[str, str, str]:
    """name, tag, digest of an image reference ("" when absent)."""
    rest, _, digest = image.partition("@")
    name, colon, tag = rest.rpartition(":")
    if not colon or "/" in tag:  # no tag: the colon (if any) belongs to a registry port
        name, tag = rest, ""
    return name, tag, digest


def _set_image(image: str, rule: dict) -> str:
    name, tag, digest = split_image(image)
    if name != rule["name"]:
        return image
    name = rule.get("newName", name)
    if "digest" in rule:
        return f"{name}@{rule['digest']}"
    tag = rule.get("newTag", tag)
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest and "newTag" not in rule else "")


def select(objects: list[dict], selector: str) -> list[dict]:
    """`kubectl apply -l k=v[,k=v]`: the objects whose labels match (equality selectors only)."""
    wanted = dict(term.split("=", 1) for term in selector.split(","))
    return [o for o in objects if all(o["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]


# ---- schemas -------------------------------------------------------------------------------------
def schema_errors(obj: dict) -> list[str]:
    """'path: message' for every violation (empty: valid)."""
    if obj.get("apiVersion", "").startswith("ray.io/"):
        assert obj["apiVersion"] == "ray.io/v1" and obj.get("kind") in CRD_FILES, (
            f"no vendored CRD schema for {obj.get('apiVersion')} {obj.get('kind')}")
        body = {k: v for k, v in obj.items() if k != "metadata"}
        errors = [_format(e) for e in _crd_validator(obj["kind"]).iter_errors(body)]
        # the root metadata of a custom resource is an ObjectMeta, validated by the API server
        # itself (the CRD says only `type: object`): check it as a core object's metadata
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata")}
        return errors + _core_errors(meta, what=f"{obj['kind']}'s ObjectMeta")
    return _core_errors(obj, what=obj.get("kind"))


def _format(error: jsonschema.ValidationError) -> str:
    return f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"


def _core_errors(obj: dict, what) -> list[str]:
    from kubernetes_validate import utils as kv

    errors = []
    for version in K8S_VERSIONS:
        version = kv.latest_version() if version == "latest" else version
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            errors.append(f"(Kubernetes {exc.version}, {what}) {_format(exc)}")
        except kv.SchemaNotFoundError as exc:
            errors.append(exc.message)
    return errors


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    """The v1 openAPIV3Schema of the vendored CRD for `kind`."""
    with gzip.open(CRD_DIR / CRD_FILES[kind], "rt", encoding="utf-8") as fh:
        crd = next(d for d in yaml.load_all(fh, Loader=_Loader) if d)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@functools.lru_cache(maxsize=None)
def _crd_validator(kind: str):
    schema = closed(crd_schema(kind))
    return _VALIDATOR(schema, format_checker=_FORMATS)


def closed(schema: dict) -> dict:
    """A CRD's structural OpenAPI schema as a JSON schema that rejects what Kubernetes would drop.

    - An object schema with `properties`, no `additionalProperties` and no
      `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`. The API server
      does not reject an unknown field there: it prunes it silently — a misspelled field would
      simply not take effect, which in a manifest is a bug.
    - `nullable: true` admits null.
    - A field with `x-kubernetes-validations` (CEL rules, which this validator cannot evaluate)
      may not be set at all: nothing the API server would check goes unchecked here.
    - `x-kubernetes-list-type: map / set` lists may not repeat a key / an item (the API server
      rejects that).
    """
    out = copy.deepcopy(schema)
    _close(out, root=True)
    return out


def _close(node: dict, root: bool = False) -> None:
    if "x-kubernetes-validations" in node and not root:
        node["x-widedp-cel"] = [r["rule"] for r in node["x-kubernetes-validations"]]
    for name in ("items", "not"):
        if isinstance(node.get(name), dict):
            _close(node[name])
    if isinstance(node.get("additionalProperties"), dict):
        _close(node["additionalProperties"])
    for name in ("anyOf", "allOf", "oneOf"):
        for sub in node.get(name, []):
            _close(sub)
    for sub in node.get("properties", {}).values():
        _close(sub)
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
    if node.get("nullable") and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]


def _cel(validator, rules, instance, schema):
    yield jsonschema.ValidationError(
        f"sets a field that carries CEL rules ({'; '.join(rules)}), which this test cannot evaluate: "
        "leave it out of the manifests or teach tests/k8s_manifests.py to check it")


def _list_type(validator, list_type, instance, schema):
    if not isinstance(instance, list):
        return
    if list_type == "set":
        keys = [repr(i) for i in instance]
    elif list_type == "map":
        fields = schema.get("x-kubernetes-list-map-keys", [])
        keys = [repr(tuple(i.get(f) for f in fields)) if isinstance(i, dict) else repr(i) for i in instance]
    else:
        return
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        yield jsonschema.ValidationError(f"list of type {list_type} repeats {', '.join(repeated)}")


_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-widedp-cel": _cel, "x-kubernetes-list-type": _list_type})
_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63
