"""The chart rendered by a real Helm engine, offline: lint, the KubeRay and Kubernetes schemas,
and Cleave's own config and Serve application, for the default values and every example."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.chart import (
    CHART,
    EXAMPLES,
    KUBE_VERSION,
    crd_validator,
    example,
    only,
    render,
    schema_errors,
    serve_config,
)

CASES = [pytest.param({}, id="defaults")] + [
    pytest.param(example(p), id=p.name) for p in EXAMPLES]
CORE_KINDS = {"Service", "Ingress", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"}


def test_examples_exist_for_dev_8b_and_70b():
    names = {p.name for p in EXAMPLES}
    assert {"dev-single-gpu-values.yaml", "llama-8b-disagg-values.yaml",
            "llama-70b-tp-values.yaml"} <= names


@pytest.mark.parametrize("values", CASES)
def test_helm_lint_is_clean(values):
    import helm_python

    report = helm_python.lint(CHART, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", CASES)
def test_rayservice_validates_against_the_kuberay_crd(values):
    rayservice = only(render(values), "RayService")
    assert schema_errors(crd_validator("ray.io_rayservices.yaml"), rayservice) == []


@pytest.mark.parametrize("values", CASES)
def test_its_ray_cluster_validates_against_the_raycluster_crd(values):
    cluster_spec = only(render(values), "RayService")["spec"]["rayClusterConfig"]
    raycluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                  "metadata": {"name": "demo"}, "spec": cluster_spec}
    assert schema_errors(crd_validator("ray.io_rayclusters.yaml"), raycluster) == []


def test_crd_check_treats_an_unknown_field_as_an_error():
    rayservice = copy.deepcopy(only(render(), "RayService"))
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    errors = schema_errors(crd_validator("ray.io_rayservices.yaml"), rayservice)
    assert any("minReplica" in e for e in errors)


@pytest.mark.parametrize("values", CASES)
def test_core_objects_validate_with_kubernetes_validate(values):
    import kubernetes_validate

    objects = [o for o in render(values) if o["kind"] in CORE_KINDS]
    assert {o["kind"] for o in objects} >= {"Service", "PodDisruptionBudget"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", CASES)
def test_ray_pod_templates_validate_as_pods(values):
    import kubernetes_validate

    cluster = only(render(values), "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = group["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", **template.get("metadata", {})}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def _cluster_app():
    try:
        from cluster import app, serve_config
    except ImportError as e:  # the chart's contract: fail loudly, never skip
        pytest.fail(f"cluster.app / cluster.serve_config cannot be imported ({e}); the chart's "
                    f"serveConfigV2 points at cluster.app:build_app")
    return app, serve_config


@pytest.mark.parametrize("values", CASES)
def test_serve_config_is_what_cleave_builds_from_its_args(values):
    from cluster.config import CleaveConfig

    _, serve_config_module = _cluster_app()
    rendered = serve_config(render(values))
    args = rendered["applications"][0]["args"]
    config = CleaveConfig.parse(args)  # raises ConfigError naming the bad field
    expected = serve_config_module.build_serve_config(config)
    rendered["applications"][0]["args"] = config.to_dict()  # Cleave's defaults filled in
    assert rendered == expected


@pytest.mark.parametrize("values", CASES)
def test_serve_args_build_the_serve_application(values):
    app, _ = _cluster_app()
    args = serve_config(render(values))["applications"][0]["args"]
    assert app.build_app(args) is not None
