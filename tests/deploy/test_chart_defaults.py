"""The chart's copies of Cleave's defaults agree with `cluster.config.CleaveConfig`: the values
its `cleave` block gives, and the fallbacks its templates use for a value left null. The chart
renders the config as the Serve application's args, which `cluster.app.build_app` parses with
`CleaveConfig.parse` like any other config (test_chart_render.py)."""

from __future__ import annotations

import re

import yaml

from tests.deploy.chart import CHART, only, render, serve_config, worker_group

# where the chart means to differ from Cleave's defaults: path (pools as *) -> why
CHART_OVERRIDES = {
    "pools.*.gpus_per_rank": "the chart deploys to GPU clusters; Cleave's default runs on CPU",
    "router.ingress": "the chart's Service sends to the pods whose Serve proxy is healthy",
}


def _cleave_default(path: str):
    from cluster.config import CleaveConfig, PoolSettings

    parts = path.split(".")
    node = CleaveConfig().to_dict()
    if parts[0] == "pools":  # any pool: a pool's own defaults
        node, parts = PoolSettings().model_dump(), parts[2:]
    for p in parts:
        node = node[p]
    return node


def _leaves(node: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _leaves(value, path + ".")
        else:
            out.append((path, value))
    return out


def _generic(path: str) -> str:
    parts = path.split(".")
    return ".".join("*" if i == 1 and parts[0] == "pools" else p for i, p in enumerate(parts))


def test_the_values_cleave_block_gives_cleaves_defaults_unless_it_means_to_differ():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["cleave"]
    differ = {path: (value, _cleave_default(path)) for path, value in _leaves(values)
              if value != _cleave_default(path) and _generic(path) not in CHART_OVERRIDES}
    assert differ == {}, "values.yaml (value, Cleave's default)"


def test_the_templates_fallbacks_are_cleaves_defaults():
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'define "cleave\.defaults".*?\{\{- dict (.*?) \| toJson', text, re.S)
    assert block, "_helpers.tpl defines cleave.defaults as one dict"
    pairs = re.findall(r'"(\w+)" ([\d.]+)', block.group(1))
    where = {"http_port": "router.http_port", "grpc_port": "router.grpc_port",
             "replicas_min": "pools.*.replicas.min", "replicas_max": "pools.*.replicas.max",
             "tp": "pools.*.tp", "pp": "pools.*.pp", "ep": "pools.*.ep",
             "gpus_per_rank": "pools.*.gpus_per_rank", "cpus_per_rank": "pools.*.cpus_per_rank",
             "block_size": "pools.*.engine.block_size"}
    assert {name for name, _ in pairs} == set(where)
    for name, literal in pairs:
        assert float(literal) == _cleave_default(where[name]), name


def test_ports_left_null_take_cleaves_defaults_everywhere_the_chart_uses_them():
    from cluster.config import CleaveConfig

    objects = render({"cleave": {"router": {"http_port": None, "grpc_port": None}}})
    config = serve_config(objects)
    http, grpc = CleaveConfig().router.http_port, CleaveConfig().router.grpc_port
    args = CleaveConfig.parse(config["applications"][0]["args"])
    assert (args.router.http_port, args.router.grpc_port) == (http, grpc)
    assert (config["http_options"]["port"], config["grpc_options"]["port"]) == (http, grpc)
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], worker_group(objects, "decode")]:
        ports = {p["name"]: p["containerPort"] for p in
                 group["template"]["spec"]["containers"][0]["ports"]}
        assert (ports["serve"], ports["grpc"]) == (http, grpc)
    policy = only(objects, "NetworkPolicy")["spec"]["ingress"]
    assert {p["port"] for rule in policy for p in rule.get("ports", [])} >= {http, grpc}
