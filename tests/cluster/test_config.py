"""The cluster config: defaults that run, errors in the user's terms, one source for every
deployment path (flags, YAML, Serve config)."""

from __future__ import annotations

import argparse

import pytest
import yaml

from cluster.autoscaling import PoolPolicy, Targets, desired_replicas
from cluster.config import CleaveConfig, ConfigError
from cluster.flags import add_cluster_flags, config_from_args
from cluster.serve_config import build_serve_config


def parse(**sections):
    return CleaveConfig.parse(sections)


def test_the_default_is_one_prefill_and_one_decode_replica_of_the_embedded_model():
    c = CleaveConfig()
    assert [name for name, _ in c.pools.items()] == ["prefill", "decode"]
    assert c.model.path is None
    assert (c.router.http_port, c.router.grpc_port) == (8000, 50051)
    assert CleaveConfig.parse(c.to_dict()) == c


@pytest.mark.parametrize("sections, message", [
    ({"pools": {"decode": {"tp": 0}}},
     "pools.decode.tp: Input should be greater than or equal to 1 (got 0)"),
    ({"pools": {"decode": {}, "decoder": {}}}, "pools.decoder: unknown field"),
    ({"pools": {"prefill": {}}}, "needs a decode pool"),
    ({"pools": {"aggregated": {}, "decode": {}}}, "either an aggregated pool or prefill/decode"),
    ({"pools": {"decode": {"replicas": {"min": 3, "max": 2}}}}, "min=3 is more than max=2"),
    ({"pools": {"decode": {"replicas": {"min": -1}}}}, "pools.decode.replicas.min"),
    ({"pools": {"decode": {"tp": 4, "ep": 3}}}, "ep=3 must be 1 or equal to tp=4"),
    ({"pools": {"aggregated": {"tp": 2, "gpus_per_rank": 0.5}}},
     "gpus_per_rank=0.5 with tp × pp = 2 ranks: NCCL needs each rank on GPUs of its own"),
    ({"pools": {"prefill": {"pp": 2, "gpus_per_rank": 1}, "decode": {"gpus_per_rank": 1}}},
     "prefill: a GPU pool of pp = 2 pipeline stages keeps each stage's layers"),
    ({"pools": {"prefill": {"engine": {"block_size": 32}}, "decode": {}}},
     "same engine.block_size"),
    ({"pools": {"decode": {"engine": {"block_size": 24}}}}, "pools.decode.engine.block_size"),
    ({"router": {"http_port": 9000, "grpc_port": 9000}}, "http_port and grpc_port are both 9000"),
    ({"router": {"policy": "random"}}, "router.policy"),
    ({"router": {"policy_weights": {"w_hot": 1}}}, "unknown policy_weights ['w_hot']"),
    ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport"),
    ({"model": {"dtype": "float8"}}, "model.dtype"),
])
def test_bad_configs_name_the_field_and_the_reason(sections, message):
    with pytest.raises(ConfigError) as err:
        CleaveConfig.parse(sections)
    assert message in str(err.value)


def test_pool_shapes_are_checked_against_the_model(tiny_model):
    from workers.models.model_config import ModelConfig

    model = ModelConfig.from_pretrained(tiny_model)
    ok = parse(pools={"decode": {"tp": model.num_key_value_heads}})
    ok.check_against_model(model)
    bad = parse(pools={"decode": {"tp": 3, "pp": model.num_hidden_layers + 1, "ep": 1}},
                model={"max_model_len": model.max_position_embeddings + 1})
    with pytest.raises(ConfigError) as err:
        bad.check_against_model(model)
    text = str(err.value)
    heads = model.num_key_value_heads
    assert f"pools.decode.tp=3 does not divide the model's {heads} KV heads" in text
    assert f"pools.decode.pp={model.num_hidden_layers + 1} is more than the model's" in text
    assert "model.max_model_len" in text


def test_yaml_files_load_and_unreadable_ones_say_why(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"pools": {"aggregated": {"replicas": {"min": 2, "max": 2}}}}))
    assert CleaveConfig.from_yaml(path).pools.aggregated.replicas.start == 2
    path.write_text("pools: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CleaveConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        CleaveConfig.from_yaml(tmp_path / "missing.yaml")


def _flags(*argv):
    p = argparse.ArgumentParser()
    add_cluster_flags(p)
    return config_from_args(p.parse_args(list(argv)))


def test_kv_offloading_size_gives_every_pool_a_host_tier_in_gib():
    c = _flags("--kv-offloading-size", "0.5", "--device", "cpu")
    assert c.pools.prefill.engine.host_kv_cache_memory_bytes == 2**29
    assert c.pools.decode.engine.host_kv_cache_memory_bytes == 2**29
    with pytest.raises(ConfigError, match="--kv-offloading-size must be >= 0 GiB, got -1"):
        _flags("--kv-offloading-size", "-1")


def test_async_scheduling_reaches_every_pools_engine_and_needs_one_rank(tiny_model):
    from cluster.settings import engine_config

    c = _flags("--async-scheduling", "--device", "cpu")
    assert c.pools.prefill.engine.async_scheduling and c.pools.decode.engine.async_scheduling
    assert engine_config(c, "decode", tiny_model).async_scheduling
    assert not _flags("--device", "cpu").pools.decode.engine.async_scheduling
    tp2 = _flags("--async-scheduling", "--device", "cpu", "--tensor-parallel-size", "2")
    with pytest.raises(ValueError, match="async_scheduling needs one rank"):
        engine_config(tp2, "decode", tiny_model)


def test_fp32_int_kernels_reaches_every_pools_engine_and_needs_one_rank(tiny_model):
    from cluster.settings import engine_config

    c = _flags("--fp32-int-kernels", "--device", "cpu")
    assert engine_config(c, "prefill", tiny_model).fp32_int_kernels
    assert engine_config(c, "decode", tiny_model).fp32_int_kernels
    assert not engine_config(_flags("--device", "cpu"), "decode", tiny_model).fp32_int_kernels
    tp2 = _flags("--fp32-int-kernels", "--device", "cpu", "--tensor-parallel-size", "2")
    with pytest.raises(ValueError, match="fp32_int_kernels needs one rank"):
        engine_config(tp2, "decode", tiny_model)


def test_vllm_flag_names_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "/models/a", "dtype": "float16"},
                                    "pools": {"decode": {"replicas": {"min": 1, "max": 3}}}}))
    c = _flags("--config", str(path), "--served-model-name", "m", "--max-model-len", "512",
               "--tensor-parallel-size", "2", "--block-size", "32", "--max-num-seqs", "8",
               "--api-key", "k", "--port", "9000", "--device", "cpu")
    assert c.model.path == "/models/a" and c.model.dtype == "float16"  # kept from the file
    assert c.model.served_model_name == "m" and c.model.max_model_len == 512
    assert c.pools.decode.tp == 2 and c.pools.decode.engine.block_size == 32
    assert c.pools.decode.replicas.max == 3 and c.pools.prefill is None
    assert c.router.api_keys == ["k"] and c.router.http_port == 9000
    agg = _flags("--num-workers", "2", "--device", "cpu")
    assert [n for n, _ in agg.pools.items()] == ["aggregated"]
    with pytest.raises(ConfigError, match="--num-workers=2"):
        _flags("--num-workers", "2", "--decode-workers", "1")


def test_the_serve_config_is_one_ray_serve_accepts():
    from ray.serve.schema import ServeDeploySchema

    c = parse(router={"host": "0.0.0.0", "http_port": 8080, "grpc_port": 9090,
                      "api_keys": ["k"]})
    serve_config = build_serve_config(c)
    schema = ServeDeploySchema.model_validate(serve_config)
    assert schema.http_options.port == 8080 and schema.grpc_options.port == 9090
    app = serve_config["applications"][0]
    assert CleaveConfig.parse(app["args"]) == c


def test_the_application_builds_without_ray_running():
    import ray

    from cluster.app import build_app, pool_deployment_options

    assert not ray.is_initialized()
    build_app(CleaveConfig().to_dict())
    c = parse(pools={"aggregated": {"tp": 2, "pp": 2, "gpus_per_rank": 1, "cpus_per_rank": 2,
                                    "resources": {"cleave_pool_aggregated": 1},
                                    "replicas": {"min": 1, "max": 4}}})
    options = pool_deployment_options("aggregated", c.pools.aggregated)
    assert options["placement_group_bundles"] == [
        {"CPU": 2, "GPU": 1, "cleave_pool_aggregated": 1}] * 4
    assert options["placement_group_strategy"] == "STRICT_PACK"
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 4)
    assert scaling["policy"]["policy_function"] == "cluster.autoscaling:PoolPolicy"


@pytest.mark.parametrize("current, total, want", [
    (1, 0.0, 0),  # idle: as few as Serve's min allows
    (1, 3.0, 3),  # 3 replicas' worth of load
    (2, 2.0, 2),  # exactly on target: stay
    (3, 2.2, 3),  # below target, inside the hysteresis band: stay
    (3, 1.5, 2),  # below the band: shrink to what carries it with headroom
])
def test_desired_replicas_follow_load_with_hysteresis(current, total, want):
    assert desired_replicas(current, {"running_seqs": total},
                            Targets({"running_seqs": 1.0}, hysteresis=0.2)) == want


def test_the_decode_policy_takes_the_signal_that_asks_for_more():
    class Ctx:
        current_num_replicas = 1
        capacity_adjusted_min_replicas, capacity_adjusted_max_replicas = 1, 4
        policy_state: dict = {}
        aggregated_metrics = {"kv_usage": {"r1": 0.9}, "running_seqs": {"r1": 1.0}}

    policy = PoolPolicy({"kv_usage": 0.5, "running_seqs": 8.0})
    assert policy(Ctx())[0] == 2  # KV occupancy 0.9 against 0.5 per replica
    with pytest.raises(ValueError, match="unknown autoscaling signals"):
        PoolPolicy({"gpu_temperature": 80.0})


def test_a_replica_still_starting_is_not_stopped_by_the_load_that_asked_for_it():
    """Serve's target is 2 while the second replica starts (1 running): 3.5 sequences against
    4 per replica sit inside the 2-replica hysteresis band, so the pool stays at 2. Sized from
    the running count instead, the policy answered 1 and Serve stopped the starting replica,
    again and again under a steady burst."""
    class Ctx:
        current_num_replicas, target_num_replicas = 1, 2
        capacity_adjusted_min_replicas, capacity_adjusted_max_replicas = 1, 2
        policy_state: dict = {}
        aggregated_metrics = {"kv_usage": {"r1": 0.1}, "running_seqs": {"r1": 3.5}}

    policy = PoolPolicy({"kv_usage": 0.9, "running_seqs": 4.0})
    assert policy(Ctx())[0] == 2
    Ctx.aggregated_metrics = {"kv_usage": {"r1": 0.1}, "running_seqs": {"r1": 1.0}}
    assert policy(Ctx())[0] == 1  # the load really fell: the start is called off


def test_a_pool_refuses_an_autoscaling_target_it_does_not_scale_on():
    with pytest.raises(ConfigError, match="prefill.autoscaling.target_kv_usage=0.5: the prefill "
                                          "pool scales on target_waiting_tokens"):
        parse(pools={"prefill": {"autoscaling": {"target_kv_usage": 0.5}}, "decode": {}})
    with pytest.raises(ConfigError, match="decode.autoscaling.target_waiting_tokens=9"):
        parse(pools={"decode": {"autoscaling": {"target_waiting_tokens": 9}}})


def test_defaults_are_the_inner_records_own():
    from router.config import RouterConfig
    from workers.engine.config import EngineConfig

    c, engine, router = CleaveConfig(), EngineConfig(model="m"), RouterConfig("m")
    assert c.pools.decode.engine.max_num_seqs == engine.max_num_seqs
    assert c.pools.decode.tp == engine.tensor_parallel_size
    assert c.router.max_n == router.max_n and c.router.policy == router.policy


def test_in_process_each_pool_runs_its_own_engine_with_the_cluster_settings(monkeypatch):
    from cluster.settings import in_process_plan, router_config

    monkeypatch.setenv("KEYS", "k2")
    c = parse(model={"path": "/models/m"},
              pools={"prefill": {"engine": {"max_num_batched_tokens": 4096}},
                     "decode": {"tp": 2, "replicas": {"min": 2, "max": 3}}},
              router={"policy_weights": {"w_hit": 3.0}, "max_n": 4, "api_keys": ["k1"],
                      "api_keys_env": "KEYS"},
              kv_transfer={"lease_s": 5.0, "pull_timeout_s": 2.0})
    plan = in_process_plan(c, "/models/m")
    prefill, decode = plan.pools
    assert (prefill.replicas, decode.replicas) == (1, 2)  # min: in process nothing autoscales
    assert prefill.engine.max_num_batched_tokens == 4096
    assert prefill.engine.tensor_parallel_size == 1
    assert decode.engine.max_num_batched_tokens == 2048 and decode.engine.tensor_parallel_size == 2
    assert (decode.worker.lease_s, decode.worker.pull_timeout_s) == (5.0, 2.0)
    r = plan.router
    assert r.policy_options == (("w_hit", 3.0),) and r.max_n == 4 and r.api_keys == ("k1", "k2")
    assert r.migration_wait_s == 0.0  # nothing replaces a dead worker in process
    assert router_config(c, "/models/m").migration_wait_s == 120.0  # Serve replaces it on Ray


def test_in_process_a_deployment_that_starts_without_a_decoder_is_refused():
    from cluster.settings import in_process_plan

    c = parse(pools={"prefill": {}, "decode": {"replicas": {"min": 0, "max": 2}}})
    with pytest.raises(ValueError, match="none of {'prefill': 1, 'decode': 0} decodes"):
        in_process_plan(c, "/models/m")


def test_the_local_shorthand_gives_every_pool_one_engine():
    from cluster.local_server import LocalServeConfig

    plan = LocalServeConfig("/models/m", num_prefill_workers=1, num_decode_workers=2,
                            router={"max_body_bytes": 1024}, engine={"num_blocks": 96},
                            worker={"lease_s": 10.0}).plan()
    assert [(p.name, p.role, p.replicas) for p in plan.pools] == [("prefill", "prefill", 1),
                                                                   ("decode", "decode", 2)]
    assert {p.engine.num_blocks for p in plan.pools} == {96}
    assert plan.pools[0].worker.lease_s == 10.0 and plan.router.max_body_bytes == 1024


def test_a_non_loopback_router_needs_keys_or_an_explicit_opt_in(monkeypatch):
    from cluster.settings import router_config

    with pytest.raises(ConfigError, match="host='0.0.0.0' serves beyond this machine"):
        parse(router={"host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="10.1.2.3"):
        _flags("--host", "10.1.2.3")
    assert _flags("--host", "10.1.2.3", "--allow-unauthenticated").router.allow_unauthenticated
    assert _flags("--host", "10.1.2.3", "--api-key", "k").router.api_keys == ["k"]
    for loopback in ("127.0.0.1", "localhost", "::1"):
        assert parse(router={"host": loopback}).router.host == loopback
    # a key variable that resolves to nothing where the router starts is an error, not an open
    # server
    c = parse(router={"host": "0.0.0.0", "api_keys_env": "CLEAVE_TEST_KEYS"})
    monkeypatch.delenv("CLEAVE_TEST_KEYS", raising=False)
    with pytest.raises(ConfigError, match="CLEAVE_TEST_KEYS.*unset or holds no key"):
        router_config(c, "/m")
    monkeypatch.setenv("CLEAVE_TEST_KEYS", "a,b")
    assert router_config(c, "/m").api_keys == ("a", "b")
