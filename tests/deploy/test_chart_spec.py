"""What the chart renders, one behaviour each."""

from __future__ import annotations

import helm_python
import pytest

from tests.deploy.chart import (
    EXAMPLES,
    example,
    only,
    render,
    render_notes,
    serve_config,
    worker_group,
)


def _pod_spec(group: dict) -> dict:
    return group["template"]["spec"]


def _container(group: dict) -> dict:
    return _pod_spec(group)["containers"][0]


def _env(group: dict) -> dict:
    return {e["name"]: e for e in _container(group).get("env", [])}


def _disagg(decode: dict | None = None, **values) -> dict:
    return {"cleave": {"pools": {"decode": decode or {}}}, **values}


def _aggregated(pool: dict, **values) -> dict:
    return {"cleave": {"pools": {"prefill": None, "decode": None, "aggregated": pool}}, **values}


def test_sets_nvidia_gpu_to_tp_times_pp_for_the_worker_group():
    objects = render(_aggregated({"tp": 4, "pp": 2, "gpus_per_rank": 1}))
    limits = _container(worker_group(objects, "aggregated"))["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"


def test_refuses_a_gpu_pipeline_parallel_pool_that_would_hand_kv_off():
    with pytest.raises(helm_python.HelmRenderError, match="cleave.pools.decode: a GPU pool of pp = 2 "
                                        "pipeline stages keeps each stage's layers"):
        render(_disagg({"pp": 2, "gpus_per_rank": 1}))


def test_a_gpu_tensor_parallel_pool_hands_kv_off_from_every_rank():
    objects = render(_disagg({"tp": 4, "gpus_per_rank": 1}))
    limits = _container(worker_group(objects, "decode"))["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4"


def test_scales_cpu_and_memory_with_the_ranks_of_a_pod():
    objects = render(_aggregated({"tp": 2},
                                 workerDefaults={"cpuPerRank": 6, "memoryPerRankGi": 40}))
    resources = _container(worker_group(objects, "aggregated"))["resources"]
    assert resources["limits"]["cpu"] == "12" and resources["limits"]["memory"] == "80Gi"
    assert resources["requests"] == resources["limits"]


def test_asks_no_gpu_for_a_cpu_pool():
    objects = render(_disagg({"gpus_per_rank": 0}))
    assert "nvidia.com/gpu" not in _container(worker_group(objects, "decode"))["resources"]["limits"]


def test_renders_one_worker_group_per_pool():
    groups = only(render(), "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["prefill", "decode"]
    dev = only(render(example(EXAMPLES[0])), "RayService")
    assert [g["groupName"] for g in dev["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == [
        "aggregated"]


def test_worker_group_replicas_are_the_pool_replicas_for_rays_autoscaler():
    objects = render(_disagg({"replicas": {"min": 1, "max": 5, "initial": 2}}))
    group = worker_group(objects, "decode")
    assert (group["minReplicas"], group["maxReplicas"], group["replicas"]) == (1, 5, 2)
    assert only(objects, "RayService")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]


def test_each_pod_offers_its_pool_resource_and_each_rank_asks_for_one_unit():
    objects = render(_disagg({"tp": 4, "gpus_per_rank": 0}))
    params = worker_group(objects, "decode")["rayStartParams"]
    assert params["resources"] == '"{\\"cleave_pool_decode\\": 4}"'
    pools = serve_config(objects)["applications"][0]["args"]["pools"]
    assert pools["decode"]["resources"] == {"cleave_pool_decode": 1}
    assert pools["prefill"]["resources"] == {"cleave_pool_prefill": 1}


def test_keeps_a_pool_resource_the_values_give():
    objects = render(_disagg({"resources": {"cleave_pool_decode": 0.5}}))
    pools = serve_config(objects)["applications"][0]["args"]["pools"]
    assert pools["decode"]["resources"] == {"cleave_pool_decode": 0.5}


def test_pool_fields_left_out_take_cleaves_defaults():
    from cluster.config import PoolSettings

    objects = render({"cleave": {"pools": {"prefill": None, "decode": None, "aggregated": {}}}})
    group = worker_group(objects, "aggregated")
    default = PoolSettings()
    assert (group["minReplicas"], group["maxReplicas"]) == (default.replicas.min,
                                                            default.replicas.max)
    assert default.gpus_per_rank == 0
    assert "nvidia.com/gpu" not in _container(group)["resources"]["limits"]


def test_mounts_dev_shm_in_memory_with_the_pools_size():
    objects = render(_disagg(workers={"decode": {"shmSize": "32Gi"}}))
    spec = _pod_spec(worker_group(objects, "decode"))
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in _container(
        worker_group(objects, "decode"))["volumeMounts"]


def test_per_pool_settings_override_the_defaults():
    objects = render(_disagg(workers={"decode": {"nodeSelector": {"gpu": "h100"},
                                                 "priorityClassName": "high"}}))
    decode, prefill = worker_group(objects, "decode"), worker_group(objects, "prefill")
    assert _pod_spec(decode)["nodeSelector"] == {"gpu": "h100"}
    assert _pod_spec(decode)["priorityClassName"] == "high"
    assert "nodeSelector" not in _pod_spec(prefill)
    assert _pod_spec(prefill)["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_sets_nccl_and_ucx_environment_from_values():
    objects = render(_disagg(network={"ncclSocketIfname": "eth0", "ncclIbHca": "mlx5_0",
                                      "ucxTls": "rc,cuda_copy", "extraEnv": {"NCCL_DEBUG": "INFO"}}))
    env = _env(worker_group(objects, "decode"))
    assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"
    assert env["NCCL_IB_HCA"]["value"] == "mlx5_0"
    assert env["UCX_TLS"]["value"] == "rc,cuda_copy"
    assert env["NCCL_DEBUG"]["value"] == "INFO"


def test_points_the_router_and_every_worker_at_the_trace_collector_when_set():
    collector = "http://otel-collector.observability:4318"
    objects = render(_disagg(monitoring={"tracing": {"otlpEndpoint": collector}}))
    head = only(objects, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    for group in (head, worker_group(objects, "prefill"), worker_group(objects, "decode")):
        env = _env(group)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == collector
        assert env["OTEL_SERVICE_NAME"]["value"] == "cleave"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _env(worker_group(render(_disagg()), "decode"))


def test_mounts_the_pvc_read_only_where_the_model_path_points():
    objects = render({"modelSource": {"type": "pvc", "pvc": {"claimName": "models"},
                                      "subPath": "llama"}})
    for group in [worker_group(objects, "decode"),
                  only(objects, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]]:
        volume = next(v for v in _pod_spec(group)["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        mount = next(m for m in _container(group)["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert serve_config(objects)["applications"][0]["args"]["model"]["path"] == "/models/llama"


def test_mounts_a_host_path_model_read_only():
    objects = render({"modelSource": {"type": "hostPath", "hostPath": {"path": "/data/llama"}}})
    group = worker_group(objects, "decode")
    volume = next(v for v in _pod_spec(group)["volumes"] if v["name"] == "model")
    assert volume["hostPath"]["path"] == "/data/llama"
    assert next(m for m in _container(group)["volumeMounts"] if m["name"] == "model")["readOnly"]


def test_download_init_container_fills_the_volume_with_the_secrets_token():
    objects = render({"modelSource": {"type": "download", "subPath": "m", "download": {
        "repoId": "org/model", "secretName": "hf", "secretKey": "token"}}})
    spec = _pod_spec(worker_group(objects, "decode"))
    init = spec["initContainers"][0]
    env = {e["name"]: e for e in init["env"]}
    assert env["CLEAVE_REPO_ID"]["value"] == "org/model"
    assert env["CLEAVE_MODEL_DIR"]["value"] == "/models/m"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]  # writable here
    assert next(m for m in spec["containers"][0]["volumeMounts"]
                if m["name"] == "model")["readOnly"]


def test_router_service_has_http_and_grpc_ports_and_is_a_load_balancer_by_default():
    service = next(o for o in render() if o["kind"] == "Service"
                   and o["metadata"]["labels"]["app.kubernetes.io/component"] == "router")
    assert service["spec"]["type"] == "LoadBalancer"
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {
        ("http", 8000), ("grpc", 50051)}
    assert service["spec"]["selector"]["ray.io/serve"] == "true"


def test_binds_the_router_on_all_interfaces():
    config = serve_config(render())
    assert config["http_options"]["host"] == "0.0.0.0"
    assert config["applications"][0]["args"]["router"]["host"] == "0.0.0.0"


def test_api_keys_come_from_the_existing_secret():
    objects = render({"apiKeys": {"existingSecret": "keys", "secretKey": "k"}})
    env = _env(worker_group(objects, "decode"))
    assert env["CLEAVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "k"}
    args = serve_config(objects)["applications"][0]["args"]
    assert args["router"]["api_keys_env"] == "CLEAVE_API_KEYS"


def test_ingress_is_rendered_only_when_enabled():
    assert not [o for o in render() if o["kind"] == "Ingress"]
    ingress = only(render({"ingress": {"enabled": True, "hosts": ["llm.example.com"]}}), "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["port"] == {"name": "http"}


def test_omits_the_service_monitor_when_disabled():
    objects = render({"monitoring": {"serviceMonitor": {"enabled": False}}})
    assert not [o for o in objects if o["kind"] == "ServiceMonitor"]


def test_omits_the_service_monitor_on_auto_when_the_cluster_lacks_its_crd():
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]  # offline: no such API


def test_renders_the_service_monitor_when_enabled():
    monitor = only(render({"monitoring": {"serviceMonitor": {"enabled": True}}}),
                   "ServiceMonitor")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"ray-metrics", "http"}


def test_ships_the_grafana_dashboard_labelled_for_the_sidecar():
    import json

    config_map = only(render(), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["cleave-dashboard.json"])["title"]


def test_renders_a_pod_disruption_budget_per_pool():
    budgets = [o for o in render() if o["kind"] == "PodDisruptionBudget"]
    assert sorted(b["spec"]["selector"]["matchLabels"]["cleave.io/pool"] for b in budgets) == [
        "decode", "prefill"]


def _rules_admitting(policy: dict, port: int) -> list[dict]:
    return [r for r in policy["spec"]["ingress"]
            if "ports" not in r or any(p["port"] == port for p in r["ports"])]


@pytest.mark.parametrize("port", [6379, 10001, 40123], ids=["gcs", "ray-client", "kv-transfer"])
def test_network_policy_admits_ray_and_kv_ports_only_from_release_pods(port):
    objects = render()
    policy = only(objects, "NetworkPolicy")
    release = {"app.kubernetes.io/name": "cleave", "app.kubernetes.io/instance": "demo"}
    rules = _rules_admitting(policy, port)
    assert rules and all(r["from"] == [{"podSelector": {"matchLabels": release}}] for r in rules)
    pod_labels = worker_group(objects, "decode")["template"]["metadata"]["labels"]
    assert release.items() <= pod_labels.items()


def test_network_policy_admits_the_router_ports_from_the_values_peers():
    peers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    policy = only(render({"networkPolicy": {"routerFrom": peers}}), "NetworkPolicy")
    assert all(r["from"] == peers or "podSelector" in r["from"][0]
               for r in _rules_admitting(policy, 8000))


def test_notes_say_how_to_send_a_first_request():
    notes = render_notes({"service": {"type": "ClusterIP"}})
    assert "port-forward svc/demo-cleave" in notes
    assert "/v1/chat/completions" in notes
