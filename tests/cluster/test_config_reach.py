"""Every setting reaches what runs from its one definition.

A setting the router, an engine or a worker runs with is defined once, on its record's field
(`workers.contract.setting`). For each such definition, a value other than its default, chosen
from the definition's own type, bounds and choices, is given once in a cluster config, once as
its flag and once in the Helm chart's values; the Ray app (`cluster.ingress`,
`cluster.pool.engine_spec`), `cleave serve --in-process` (`in_process_plan`) and the chart's
rendered Serve application must all run with exactly that value in exactly that field. No Ray
and no model: only the translations run (and Helm's template engine, offline).

The cluster's own settings (replicas, placement, autoscaling, ports) are tested in
test_config_own.py; the chart's schema against its generator in tests/deploy.
"""

from __future__ import annotations

import argparse
import copy
import typing
from typing import Any

import pytest

from cluster.config import CleaveConfig
from cluster.derive import RECORDS, Source, to_record
from cluster.flags import add_cluster_flags, config_from_args
from cluster.ingress import router_config as ray_router_config
from cluster.pool import engine_spec
from cluster.settings import in_process_plan, model_path
from router.config import RouterConfig
from workers.contract.setting import Defined, settings_of
from workers.engine.config import EngineConfig

MODEL = "/models/reach-model"
POOLS = ("prefill", "decode")
# values the generic choice cannot make: setting name -> value (as the cluster config holds it)
VALUES = {"policy_options": {"w_hit": 2.0}, "api_keys": ["test-key"],
          "lora_modules": ["adapter-a=/adapters/a"],
          "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'}
# settings another must come with (lora_modules needs enable_lora): setting -> (key, value)
COMPANIONS = {"lora_modules": ("enable_lora", True), "lora_dir": ("enable_lora", True)}


def _optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_args(kind) and type(None) in typing.get_args(kind) else kind


def other_value(d: Defined) -> Any:
    """A valid value other than the definition's default, from its type, bounds, choices."""
    if d.name in VALUES:
        return VALUES[d.name]
    s, default, kind = d.setting, d.default, _optional(d.type)
    if s.choices is not None:
        return next(c for c in s.choices if c != default)
    if kind is bool:
        return not default
    low = s.ge if s.ge is not None else s.gt if s.gt is not None else 0
    if kind is int:
        return (default if default is not None else int(low)) + 1
    if kind is float:
        if default is None:
            return float(low) + 0.5 if s.le is None else float(s.le)
        value = default * 2 if default else 1.0
        return value if s.le is None or value <= s.le else default / 2
    if kind is str:
        return "other"
    raise AssertionError(f"no value rule for {d.name} ({d.type}); add one to VALUES")


def where(record: type, d: Defined) -> tuple[str, ...] | None:
    """The definition's place in the cluster config, a pool's as `pools.*`."""
    section = RECORDS[record] if d.setting.section == "" else d.setting.section
    if section is None:
        return None
    key = d.setting.key or d.name
    prefix = {"pool": ("pools", "*"), "engine": ("pools", "*", "engine")}.get(section, (section,))
    return (*prefix, key)


def config_with(path: tuple[str, ...], value: Any, base: dict[str, Any]) -> dict[str, Any]:
    """`base` with the setting at `path` set (a pool's in every pool)."""
    data = copy.deepcopy(base)
    for pool in POOLS if path[:2] == ("pools", "*") else (None,):
        node = data
        for name in (path if pool is None else ("pools", pool, *path[2:]))[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
        if path[-1] == "ep":  # ep is 1 or tp
            node["tp"] = value
        if path[-1] in COMPANIONS:
            key, companion = COMPANIONS[path[-1]]
            node[key] = companion
    return data


def ray_records(config: CleaveConfig, record: type) -> list[Any]:
    """The records the Ray app builds: the router's, or each pool's engine or worker options."""
    if record is RouterConfig:
        return [ray_router_config(config, model_path(config))]
    specs = [engine_spec(config, name, "worker") for name, _ in config.pools.items()]
    return [s.engine if record is EngineConfig else s.worker for s in specs]


def in_process_records(config: CleaveConfig, record: type) -> list[Any]:
    plan = in_process_plan(config, model_path(config))
    if record is RouterConfig:
        return [plan.router]
    return [p.engine if record is EngineConfig else p.worker for p in plan.pools]


def _cases() -> list[Any]:
    return [pytest.param(record, d, id=f"{record.__name__}.{d.name}")
            for record in RECORDS for d in settings_of(record) if where(record, d) is not None]


@pytest.fixture(autouse=True)
def _keys_env(monkeypatch):
    monkeypatch.setenv("CLEAVE_API_KEYS", "")  # the flags would add its keys


@pytest.mark.parametrize("record, d", _cases())
def test_a_setting_given_in_the_config_reaches_ray_and_in_process(record, d):
    value = other_value(d)
    config = CleaveConfig.parse(config_with(where(record, d), value,
                                            {"model": {"path": MODEL}}))
    want = to_record(value)
    assert want != d.default, f"{d.name}: the test value is the default"
    for mode, records in (("ray", ray_records(config, record)),
                          ("in process", in_process_records(config, record))):
        got = [getattr(r, d.name) for r in records]
        assert got == [want] * len(records), f"{d.name} in {mode}: {got}, expected {want}"


@pytest.mark.parametrize("record, d", [c for c in _cases() if Source(*c.values).flags])
def test_a_settings_flag_sets_what_it_says(record, d):
    value = other_value(d)
    flag = Source(record, d).flags[0]
    if isinstance(value, bool):
        argv = [flag if value else f"--no-{flag[2:]}"]
    elif isinstance(value, list):
        argv = [a for v in value for a in (flag, str(v))]
    else:
        argv = [flag, str(value)]
    if d.name == "expert_parallel_size":
        argv += ["--tensor-parallel-size", str(value)]
    if d.name in COMPANIONS:
        argv += [f"--{COMPANIONS[d.name][0].replace('_', '-')}"]
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    config = config_from_args(parser.parse_args([*argv, "--device", "cpu", "--model", MODEL]))
    got = {getattr(r, d.name) for r in in_process_records(config, record)}
    assert got == {to_record(value)}, f"{' '.join(argv)} gave {d.name}={got}"


@pytest.mark.parametrize("record, d", _cases())
def test_a_setting_given_in_the_charts_values_reaches_the_rendered_app(record, d, monkeypatch):
    pytest.importorskip("helm_python")
    from tests.deploy.chart import render, serve_config

    monkeypatch.setenv("CLEAVE_API_KEYS", "chart-key")  # the Secret the chart mounts
    value = other_value(d)
    # on CPU: a GPU pool of pp > 1 cannot hand off
    cpu = {"model": {"path": MODEL}, "pools": {p: {"gpus_per_rank": 0} for p in POOLS}}
    args = serve_config(render({"cleave": config_with(where(record, d), value, cpu)})
                        )["applications"][0]["args"]
    config = CleaveConfig.parse(args)
    want = to_record(value)
    if d.name == "api_keys":
        want = (*want, "chart-key")
    got = [getattr(r, d.name) for r in ray_records(config, record)]
    assert got == [want] * len(got), f"{d.name} rendered: {got}, expected {want}"


def test_the_settings_walk_covers_every_definition_the_cluster_holds():
    """Every record field is either a cluster config field or set by the cluster itself."""
    cases = {(c.values[0], c.values[1].name) for c in _cases()}
    set_by_cluster = {(r, d.name) for r in RECORDS for d in settings_of(r)} - cases
    assert {(r.__name__, n) for r, n in set_by_cluster} == {
        ("RouterConfig", "model_path"), ("EngineConfig", "model"), ("EngineConfig", "device")}
    for record, name in cases:
        assert other_value(next(d for d in settings_of(record) if d.name == name)) is not None


def test_a_field_added_to_a_record_reaches_the_config_its_flag_and_the_schema(monkeypatch):
    """Adding a setting is adding its definition: nothing else is written."""
    import dataclasses

    from cluster import derive
    from cluster.config import RouterSettings
    from cluster.flags import flag_kind, flagged_fields
    from workers.contract.setting import setting

    @dataclasses.dataclass(frozen=True)
    class Extended(RouterConfig):
        decode_policy: str = setting("least_loaded", "Which decode worker takes a handoff.",
                                     choices=("least_loaded", "round_robin"))

    monkeypatch.setitem(derive.RECORDS, Extended, "router")
    monkeypatch.delitem(derive.RECORDS, RouterConfig)
    model = derive.derived("router")(RouterSettings.__bases__[0])
    assert model.model_fields["decode_policy"].default == "least_loaded"
    assert model(decode_policy="round_robin").decode_policy == "round_robin"
    schema = model.model_json_schema()["properties"]["decode_policy"]
    assert schema["enum"] == ["least_loaded", "round_robin"]
    assert schema["description"] == "Which decode worker takes a handoff."
    flags = {names[0]: annotation for _, names, annotation, _ in flagged_fields(model)}
    assert flag_kind(flags["--decode-policy"], "--decode-policy")["choices"] == (
        "least_loaded", "round_robin")
    kwargs = derive.record_kwargs(Extended, {"router": model(decode_policy="round_robin"),
                                             "model": CleaveConfig().model})
    assert Extended(**kwargs, model_path=MODEL).decode_policy == "round_robin"
    with pytest.raises(ValueError, match="decode_policy must be one of"):
        Extended(MODEL, decode_policy="random")


def test_a_setting_cannot_be_defined_without_a_description():
    import dataclasses

    from workers.contract.setting import setting

    with pytest.raises(ValueError, match="needs a description"):
        setting(1, " ")

    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        size: int = 1

    with pytest.raises(TypeError, match="Undocumented.size is not defined with setting"):
        settings_of(Undocumented)
