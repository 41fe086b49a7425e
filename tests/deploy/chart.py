"""Factories for the chart tests: render the chart with a real Helm engine (helm-python-sdk,
offline), and the KubeRay CRD schemas as strict JSON-schema validators."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "cleave"
EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*values*.yaml"))
CRDS_ENV = "CLEAVE_KUBERAY_CRDS"  # a folder holding ray.io_rayservices.yaml, ray.io_rayclusters.yaml
KUBE_VERSION = "1.33"  # kubernetes-validate's schemas for this Kubernetes version
RELEASE = "demo"


@functools.lru_cache(maxsize=1)
def _chart() -> Any:
    import helm_python

    return helm_python.Chart.load(CHART)


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE) -> list[dict[str, Any]]:
    """Every object the chart renders for `values` (over the chart's defaults), NOTES excluded."""
    manifests = _chart().render(values or {}, name=name, namespace="llm")
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def render_notes(values: dict[str, Any] | None = None) -> str:
    return _chart().render(values or {}, name=RELEASE, namespace="llm")["cleave/templates/NOTES.txt"]


def example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def worker_group(objects: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    groups = only(objects, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == pool)


def serve_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])


def crds_dir() -> Path:
    """The KubeRay v1.7.0 CRDs; skips the test when the folder is absent."""
    path = Path(os.environ.get(CRDS_ENV) or REPO.parent / "shared" / "kuberay-crds")
    if not (path / "ray.io_rayservices.yaml").exists():
        pytest.skip(f"KubeRay CRD schemas not found in {path} (set {CRDS_ENV})")
    return path


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields as errors: the API server prunes fields a structural
    schema does not list (unless it preserves unknown fields), so a misspelt field would vanish
    silently on a real cluster."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    """A strict validator for the `v1` schema of the CRD in `filename`."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((crds_dir() / filename).read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))


def schema_errors(validator: jsonschema.Draft7Validator, obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]
