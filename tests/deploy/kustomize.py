"""A small kustomize renderer for what `k8s/` uses: tests see what `kubectl apply -k` sends.

Supported, in kustomize's order: resources (files, directories), components (a ``kind:
Component`` folder's resources and patches, applied to what the resources gave),
secretGenerator (envs, literals; behavior create/replace/merge; disableNameSuffixHash only),
patches (a file or inline patch:
strategic merge with null deletion, `$patch: delete` and list merge by key; JSON 6902 with a
target), namespace, labels (pairs, includeTemplates; StatefulSet volumeClaimTemplates are left
unlabelled), replicas, images. Anything else raises ``Unsupported`` rather than rendering
something kustomize would not.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "secretGenerator",
    "patches",
    "namespace",
    "labels",
    "replicas",
    "images",
}
# Strategic-merge keys of the pod-spec lists we patch (k8s.io/api patchMergeKey tags).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
}
# Lists whose merge key differs between kinds (container vs. Service ports): not supported.
UNSUPPORTED_LISTS = {"ports"}
# kustomize's namespace transformer treats these specially; none are used here.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PersistentVolume",
    "StorageClass",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet"}


# What a Component (kustomize.config.k8s.io/v1alpha1) may hold here.
COMPONENT_FIELDS = {"apiVersion", "kind", "resources", "patches"}


class Unsupported(ValueError):
    """A kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Resource]:
    """Render the kustomization in ``directory`` (recursively through its resources)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if kust.get("kind") == "Component":
        raise Unsupported(f"{directory}: a Component is applied through components:, not alone")
    unknown = set(kust) - KNOWN_FIELDS
    if unknown:
        raise Unsupported(f"{directory}: kustomization fields {sorted(unknown)}")
    resources = _resources(directory, kust)
    for ref in kust.get("components", []):
        resources = _apply_component(directory / ref, resources)
    for gen in kust.get("secretGenerator", []):
        resources = _generate_secret(directory, gen, resources)
    for entry in kust.get("patches", []):
        resources = _apply_patch_entry(directory, entry, resources)
    if "namespace" in kust:
        for res in resources:
            if res["kind"] in CLUSTER_SCOPED:
                raise Unsupported(f"namespace transformer on the cluster-scoped {res['kind']}")
            res["metadata"]["namespace"] = kust["namespace"]
    for entry in kust.get("labels", []):
        _add_labels(entry, resources)
    for entry in kust.get("replicas", []):
        _set_replicas(entry, resources)
    for entry in kust.get("images", []):
        _set_image(entry, resources)
    _check_unique(resources)
    return resources


def _resources(directory: Path, kust: dict[str, Any]) -> list[Resource]:
    resources: list[Resource] = []
    for ref in kust.get("resources", []):
        path = directory / ref
        resources += render(path) if path.is_dir() else load_documents(path)
    return resources


def _apply_component(directory: Path, resources: list[Resource]) -> list[Resource]:
    """A Component's resources added to ``resources``, then its patches applied to them all."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if kust.get("kind") != "Component":
        raise ValueError(f"{directory}: components: names a folder whose kind is not Component")
    unknown = set(kust) - COMPONENT_FIELDS
    if unknown:
        raise Unsupported(f"{directory}: component fields {sorted(unknown)}")
    resources = resources + _resources(directory, kust)
    for entry in kust.get("patches", []):
        resources = _apply_patch_entry(directory, entry, resources)
    return resources


def load_documents(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_specs(res: Resource) -> list[dict[str, Any]]:
    """The pod spec inside a workload (Deployment, StatefulSet, Job ...), if any."""
    if res["kind"] in WORKLOADS:
        return [res["spec"]["template"]["spec"]]
    return []


def _identity(res: Resource) -> tuple[str, str, str, str | None]:
    meta = res["metadata"]
    return res["apiVersion"], res["kind"], meta["name"], meta.get("namespace")


def _check_unique(resources: list[Resource]) -> None:
    seen = [_identity(r) for r in resources]
    dupes = {i for i in seen if seen.count(i) > 1}
    if dupes:
        raise ValueError(f"duplicate resources: {sorted(map(str, dupes))}")


# --- generators --------------------------------------------------------------------------------


def _read_env_file(path: Path) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: '{line}' is not KEY=VALUE")
            pairs[key] = value
    return pairs


def _generate_secret(
    directory: Path, gen: dict[str, Any], resources: list[Resource]
) -> list[Resource]:
    unknown = set(gen) - {"name", "behavior", "envs", "literals", "options", "type"}
    if unknown or not gen.get("options", {}).get("disableNameSuffixHash"):
        raise Unsupported(
            f"secretGenerator {gen.get('name')}: needs disableNameSuffixHash, no {unknown}"
        )
    pairs: dict[str, str] = {}
    for env_file in gen.get("envs", []):
        pairs.update(_read_env_file(directory / env_file))
    for literal in gen.get("literals", []):
        key, _, value = literal.partition("=")
        pairs[key] = value
    data = {k: base64.b64encode(v.encode()).decode() for k, v in pairs.items()}
    behavior = gen.get("behavior", "create")
    existing = [
        r for r in resources if r["kind"] == "Secret" and r["metadata"]["name"] == gen["name"]
    ]
    if behavior == "create":
        if existing:
            raise ValueError(f"secretGenerator {gen['name']}: the Secret exists (use behavior)")
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": gen["name"]},
            "type": gen.get("type", "Opaque"),
            "data": data,
        }
        return [*resources, secret]
    if len(existing) != 1:
        raise ValueError(f"secretGenerator {gen['name']}: behavior {behavior} needs one Secret")
    secret = existing[0]
    if behavior == "replace":
        secret.pop("stringData", None)
        secret["data"] = data
    elif behavior == "merge":
        secret.setdefault("data", {}).update(data)
    else:
        raise Unsupported(f"secretGenerator behavior {behavior}")
    return resources


# --- patches -----------------------------------------------------------------------------------


def _apply_patch_entry(
    directory: Path, entry: dict[str, Any], resources: list[Resource]
) -> list[Resource]:
    if set(entry) - {"path", "patch", "target"}:
        raise Unsupported(f"patch options {sorted(set(entry) - {'path', 'patch', 'target'})}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if len(docs) == 1 and isinstance(docs[0], list):
        if "target" not in entry:
            raise ValueError("a JSON 6902 patch needs a target")
        for res in _select(entry["target"], resources):
            for op in docs[0]:
                _json6902(res, op)
        return resources
    if len(docs) != 1 or "target" in entry:
        # kustomize before v5 reads one strategic-merge patch per entry; keep to that.
        raise Unsupported("one strategic-merge patch per entry, matched by its own kind and name")
    return _strategic_merge_resource(docs[0], resources)


def _select(target: dict[str, Any], resources: list[Resource]) -> list[Resource]:
    if set(target) - {"group", "version", "kind", "name", "namespace"}:
        raise Unsupported(f"patch target fields {sorted(target)}")
    chosen = []
    for res in resources:
        group, _, version = res["apiVersion"].rpartition("/")
        actual = {
            "group": group,
            "version": version,
            "kind": res["kind"],
            "name": res["metadata"]["name"],
            "namespace": res["metadata"].get("namespace", ""),
        }
        # kustomize matches target fields as anchored regular expressions.
        if all(re.fullmatch(str(v), actual[k]) for k, v in target.items()):
            chosen.append(res)
    if not chosen:
        raise ValueError(f"patch target {target} matches nothing")
    return chosen


def _strategic_merge_resource(patch: Resource, resources: list[Resource]) -> list[Resource]:
    key = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
    matches = [r for r in resources if _identity(r)[:3] == key]
    if len(matches) != 1:
        raise ValueError(f"patch for {key} matches {len(matches)} resources")
    if patch.get("$patch") == "delete":
        return [r for r in resources if r is not matches[0]]
    strategic_merge(matches[0], patch)
    return resources


def strategic_merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Merge ``patch`` into ``target`` in place: maps merge, null deletes, keyed lists merge."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value)
        elif isinstance(value, list) and key in UNSUPPORTED_LISTS:
            raise Unsupported(f"patching the list '{key}'")
        elif isinstance(value, list) and key in MERGE_KEYS:
            target[key] = _merge_list(target.get(key, []), value, MERGE_KEYS[key])
        else:
            # Scalars and lists without a merge key (command, args, tolerations ...) replace.
            target[key] = copy.deepcopy(value)


def _merge_list(current: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    merged = copy.deepcopy(current)
    for item in patch:
        found = [m for m in merged if m.get(merge_key) == item[merge_key]]
        if item.get("$patch") == "delete":
            merged = [m for m in merged if m.get(merge_key) != item[merge_key]]
        elif found:
            strategic_merge(found[0], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def _json6902(res: Resource, op: dict[str, Any]) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = res
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op["op"] == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif op["op"] == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[index]
        else:
            raise Unsupported(f"JSON patch op {op['op']}")
        return
    if op["op"] in ("replace", "remove") and last not in parent:
        raise ValueError(f"JSON patch {op['op']} of a missing path {op['path']}")
    if op["op"] in ("add", "replace"):
        parent[last] = copy.deepcopy(op["value"])
    elif op["op"] == "remove":
        del parent[last]
    else:
        raise Unsupported(f"JSON patch op {op['op']}")


# --- transformers ------------------------------------------------------------------------------


def _add_labels(entry: dict[str, Any], resources: list[Resource]) -> None:
    if set(entry) - {"pairs", "includeTemplates"}:
        raise Unsupported(f"labels options {sorted(entry)} (includeSelectors is not implemented)")
    for res in resources:
        res["metadata"].setdefault("labels", {}).update(entry["pairs"])
        if entry.get("includeTemplates") and res["kind"] in WORKLOADS:
            template_meta = res["spec"]["template"].setdefault("metadata", {})
            template_meta.setdefault("labels", {}).update(entry["pairs"])


def _set_replicas(entry: dict[str, Any], resources: list[Resource]) -> None:
    found = [
        r for r in resources if r["kind"] in SCALABLE and r["metadata"]["name"] == entry["name"]
    ]
    if not found:
        raise ValueError(f"replicas: no workload named {entry['name']}")
    for res in found:
        res["spec"]["replicas"] = entry["count"]


def _image_name(image: str) -> str:
    """The name part of an image reference: no digest, no tag (a port's colon is kept)."""
    name = image.split("@", 1)[0]
    head, sep, tail = name.rpartition(":")
    return head if sep and "/" not in tail else name


def _set_image(entry: dict[str, Any], resources: list[Resource]) -> None:
    if set(entry) - {"name", "newName", "newTag"}:
        raise Unsupported(f"images options {sorted(entry)}")
    for res in resources:
        for spec in pod_specs(res):
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                if _image_name(container["image"]) != entry["name"]:
                    continue
                name = entry.get("newName", entry["name"])
                old_tag = container["image"][len(_image_name(container["image"])) :]
                tag = f":{entry['newTag']}" if "newTag" in entry else old_tag
                container["image"] = f"{name}{tag}"
