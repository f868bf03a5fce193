"""The test renderer agrees with kustomize on the features k8s/ uses, and refuses the rest."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from tests.deploy.kustomize import Unsupported, render

DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web"},
    "spec": {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {
                "nodeSelector": {"gpu": "yes"},
                "tolerations": [{"key": "a", "operator": "Exists"}],
                "containers": [
                    {
                        "name": "web",
                        "image": "registry:5000/web:1",
                        "command": ["a", "b"],
                        "resources": {"limits": {"memory": "1Gi", "nvidia.com/gpu": "1"}},
                    },
                    {"name": "side", "image": "side:2"},
                ],
            },
        },
    },
}
SECRET = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "s"},
    "stringData": {"OLD": "1"},
}


def _write(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        docs = content if isinstance(content, list) else [content]
        text = "---\n".join(yaml.safe_dump(d) for d in docs) if name.endswith(".yaml") else content
        (directory / name).write_text(str(text))
    return directory


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return _write(
        tmp_path / "base",
        {
            "kustomization.yaml": {"resources": ["app.yaml"]},
            "app.yaml": [DEPLOYMENT, SECRET],
        },
    )


def test_strategic_merge_deletes_merges_by_name_and_replaces_plain_lists(
    base: Path, tmp_path: Path
) -> None:
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": None,
                    "tolerations": [{"key": "b", "operator": "Exists"}],
                    "containers": [
                        {"name": "web", "resources": {"limits": {"nvidia.com/gpu": None}}},
                        {"name": "new", "image": "new:1"},
                    ],
                }
            }
        },
    }
    overlay = _write(
        tmp_path / "o",
        {
            "kustomization.yaml": {"resources": ["../base"], "patches": [{"path": "p.yaml"}]},
            "p.yaml": patch,
        },
    )
    spec = render(overlay)[0]["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec
    assert spec["tolerations"] == [{"key": "b", "operator": "Exists"}]
    assert [c["name"] for c in spec["containers"]] == ["web", "side", "new"]
    assert spec["containers"][0]["resources"]["limits"] == {"memory": "1Gi"}
    assert spec["containers"][0]["image"] == "registry:5000/web:1"


def test_delete_patch_json6902_images_replicas_labels_namespace(base: Path, tmp_path: Path) -> None:
    delete = {"$patch": "delete", "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    overlay = _write(
        tmp_path / "o",
        {
            "kustomization.yaml": {
                "resources": ["../base"],
                "namespace": "ns",
                "patches": [
                    {"path": "d.yaml"},
                    {
                        "target": {"kind": "Deploy.*"},
                        "patch": "- op: replace\n  path: /spec/template/spec/containers/1/image\n"
                        "  value: other:3\n",
                    },
                ],
                "labels": [{"pairs": {"team": "x"}, "includeTemplates": True}],
                "replicas": [{"name": "web", "count": 1}],
                "images": [{"name": "registry:5000/web", "newName": "r.io/web", "newTag": "9"}],
            },
            "d.yaml": delete,
        },
    )
    [deployment] = render(overlay)
    spec = deployment["spec"]
    assert deployment["metadata"] == {"name": "web", "namespace": "ns", "labels": {"team": "x"}}
    assert spec["replicas"] == 1 and spec["template"]["metadata"]["labels"]["team"] == "x"
    assert spec["selector"]["matchLabels"] == {"app": "web"}
    assert [c["image"] for c in spec["template"]["spec"]["containers"]] == ["r.io/web:9", "other:3"]


def test_a_component_adds_and_patches_before_the_overlays_own_transformers(
    base: Path, tmp_path: Path
) -> None:
    """kustomize applies components after the resources and before the kustomization's own
    patches and transformers: the component's patch sees the base, the namespace covers what
    the component added."""
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {}}
    _write(
        tmp_path / "comp",
        {
            "kustomization.yaml": {
                "apiVersion": "kustomize.config.k8s.io/v1alpha1",
                "kind": "Component",
                "resources": ["c.yaml"],
                "patches": [{"path": "p.yaml"}],
            },
            "c.yaml": config,
            "p.yaml": {**SECRET, "stringData": {"NEW": "2"}},
        },
    )
    overlay = _write(
        tmp_path / "o",
        {
            "kustomization.yaml": {
                "resources": ["../base"],
                "components": ["../comp"],
                "namespace": "ns",
                "patches": [{"path": "later.yaml"}],
            },
            "later.yaml": {**SECRET, "stringData": {"NEW": "3"}},
        },
    )
    out = {r["kind"]: r for r in render(overlay)}
    assert out["Secret"]["stringData"] == {"OLD": "1", "NEW": "3"}  # the overlay's patch last
    assert out["ConfigMap"]["metadata"] == {"name": "c", "namespace": "ns"}
    assert out["Deployment"]["metadata"]["namespace"] == "ns"
    with pytest.raises(Unsupported, match="Component"):
        render(tmp_path / "comp")  # a component is not a kustomization of its own
    wrong = _write(tmp_path / "w", {"kustomization.yaml": {"components": ["../base"]}})
    with pytest.raises(ValueError, match="not Component"):
        render(wrong)


def test_secret_generator_replaces_the_secret(base: Path, tmp_path: Path) -> None:
    overlay = _write(
        tmp_path / "o",
        {
            "kustomization.yaml": {
                "resources": ["../base"],
                "secretGenerator": [
                    {
                        "name": "s",
                        "behavior": "replace",
                        "envs": ["s.env"],
                        "options": {"disableNameSuffixHash": True},
                    }
                ],
            },
            "s.env": "# comment\nNEW=a=b\n",
        },
    )
    secret = render(overlay)[1]
    assert "stringData" not in secret
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {"NEW": "a=b"}


@pytest.mark.parametrize(
    "kustomization",
    [
        {"resources": ["../base"], "namePrefix": "x-"},
        {"resources": ["../base"], "patches": [{"path": "ports.yaml"}]},
        {"resources": ["../base"], "secretGenerator": [{"name": "t", "literals": ["A=1"]}]},
        {"resources": ["../base"], "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]},
    ],
)
def test_features_it_does_not_implement_are_refused(
    base: Path, tmp_path: Path, kustomization: dict[str, object]
) -> None:
    ports = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "web", "ports": [{"containerPort": 80}]}]}
            }
        },
    }
    overlay = _write(tmp_path / "o", {"kustomization.yaml": kustomization, "ports.yaml": ports})
    with pytest.raises(Unsupported):
        render(overlay)
