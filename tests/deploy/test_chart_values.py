"""Bad values fail at render time with a message naming the value; the schema and the README
table are in step with Cleave's config and values.yaml."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.deploy.chart import CHART, REPO, render

# (values over the defaults, text the error must contain, whether Cleave's own config rejects the
# same `cleave` block: the chart must not accept what Cleave would refuse)
BAD_VALUES = [
    pytest.param({"cleave": {"pools": {"decode": {"replicas": {"min": -1}}}}},
                 "/cleave/pools/decode/replicas/min", True, id="negative-replicas"),
    pytest.param({"cleave": {"pools": {"decode": {"tp": 0}}}}, "/cleave/pools/decode/tp", True,
                 id="tp-zero"),
    pytest.param({"cleave": {"pools": {"prefill": {"tp": 1.5}}}}, "/cleave/pools/prefill/tp", True,
                 id="tp-not-integer"),
    pytest.param({"cleave": {"pools": {"decoder": {"tp": 1}}}}, "'decoder' not allowed", True,
                 id="unknown-pool-key"),
    pytest.param({"cleave": {"router": {"polcy": "x"}}}, "'polcy' not allowed", True,
                 id="unknown-cleave-field"),
    pytest.param({"cleave": {"kv_transfer": {"transport": "rdma"}}},
                 "/cleave/kv_transfer/transport", True, id="unknown-transport"),
    pytest.param({"cleave": {"pools": {"aggregated": {}}}},
                 "either an aggregated pool or prefill/decode pools", True,
                 id="aggregated-with-prefill-decode"),
    pytest.param({"cleave": {"pools": {"decode": None}}}, "needs a decode pool", True,
                 id="no-decode-pool"),
    pytest.param({"cleave": {"pools": {"decode": {"replicas": {"min": 3, "max": 2}}}}},
                 "cleave.pools.decode.replicas: min=3 is more than max=2", True, id="min-over-max"),
    pytest.param({"cleave": {"pools": {"decode": {"replicas": {"min": 1, "max": 2,
                                                               "initial": 3}}}}},
                 "cleave.pools.decode.replicas: initial=3", True, id="initial-outside"),
    pytest.param({"cleave": {"router": {"grpc_port": 8000}}},
                 "cleave.router: http_port and grpc_port are both 8000", True, id="same-ports"),
    pytest.param({"cleave": {"pools": {"decode": {"tp": 4, "ep": 3}}}},
                 "cleave.pools.decode: ep=3 must be 1 or equal to tp=4", True, id="ep-not-dividing-tp"),
    pytest.param({"cleave": {"pools": {"decode": {"engine": {"block_size": 32}}}}},
                 "same engine.block_size", True, id="block-sizes-differ"),
    pytest.param({"cleave": {"router": {"policy_weights": {"w_foo": 1.0}}}},
                 "cleave.router.policy_weights: unknown weight \"w_foo\"", True,
                 id="unknown-policy-weight"),
    pytest.param({"cleave": {"pools": {"decode": {"tp": 3, "gpus_per_rank": 0.5}}}},
                 "cleave.pools.decode: tp × pp × gpus_per_rank", False, id="fractional-gpus"),
    pytest.param({"cleave": {"pools": {"decode": {"tp": 2, "gpus_per_rank": 0.5}}}},
                 "cleave.pools.decode: gpus_per_rank=0.5 with tp × pp = 2 ranks", False,
                 id="gpu-ranks-sharing-a-gpu"),
    pytest.param({"cleave": {"pools": {"decode": {"cpus_per_rank": 16}}}},
                 "cleave.pools.decode.cpus_per_rank=16 is more than workers.decode.cpuPerRank=8",
                 False, id="cpus-over-pod"),
    pytest.param({"workers": {"aggregated": {"shmSize": "1Gi"}}},
                 "workers.aggregated configures a pool that cleave.pools does not have", False,
                 id="workers-for-absent-pool"),
    pytest.param({"workers": {"encode": {}}}, "'encode' not allowed", False,
                 id="unknown-workers-key"),
    pytest.param({"modelSource": {"type": "pvc"}}, "modelSource.pvc.claimName is required", False,
                 id="pvc-without-claim"),
    pytest.param({"modelSource": {"type": "hostPath", "hostPath": {"path": "/m"}},
                  "cleave": {"model": {"path": "/elsewhere"}}}, "cleave.model.path=\"/elsewhere\"",
                 False, id="model-path-twice"),
    pytest.param({"service": {"type": "Loadbalancer"}}, "/service/type", False,
                 id="bad-service-type"),
    pytest.param({"apiKeys": {"generate": False}}, "no API key is set", True,
                 id="no-api-key"),
]


def test_the_default_install_serves_with_a_generated_key_and_open_needs_an_opt_in():
    from tests.deploy.chart import only, serve_config

    objects = render()
    secret = only(objects, "Secret")
    key = secret["data"]["api-keys"]
    assert len(key) >= 40 and render() and only(render(), "Secret")["data"]["api-keys"] != key
    args = serve_config(objects)["applications"][0]["args"]
    assert args["router"]["api_keys_env"] == "CLEAVE_API_KEYS"
    assert secret["metadata"]["name"] in str(only(objects, "RayService"))
    opened = render({"apiKeys": {"generate": False},
                     "cleave": {"router": {"allow_unauthenticated": True}}})
    assert not [o for o in opened if o["kind"] == "Secret"]
    assert "api_keys_env" not in serve_config(opened)["applications"][0]["args"]["router"]


def _effective_cleave(values: dict) -> dict:
    """The `cleave` block Helm would compose: the chart's defaults with `values` over them."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        all_values = chart.merge_values(values)
    merged = all_values["cleave"]
    merged.setdefault("router", {})["host"] = "0.0.0.0"
    keys = all_values["apiKeys"]
    if keys["existingSecret"] or keys["generate"]:
        merged["router"]["api_keys_env"] = "CLEAVE_API_KEYS"
    return merged


@pytest.mark.parametrize("values, message, cleave_rejects", BAD_VALUES)
def test_bad_values_fail_at_render_time_naming_the_value(values, message, cleave_rejects):
    import helm_python

    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as err:
        render(values)
    assert message in str(err.value)


@pytest.mark.parametrize("values, message, cleave_rejects", [
    p for p in BAD_VALUES if p.values[2]])
def test_cleaves_own_config_rejects_the_same_values(values, message, cleave_rejects):
    from cluster.config import CleaveConfig, ConfigError

    with pytest.raises(ConfigError):
        CleaveConfig.parse(_effective_cleave(copy.deepcopy(values)))


def test_values_schema_and_readme_table_are_in_step():
    result = subprocess.run([sys.executable, str(CHART / "tools" / "gen_docs.py"), "--check"],
                            check=False, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checked_in_schema_is_the_one_generated_from_the_settings_definitions():
    import json

    sys.path.insert(0, str(CHART / "tools"))
    from gen_docs import values_schema

    checked_in = json.loads((CHART / "values.schema.json").read_text())
    assert checked_in == values_schema(), "stale: run deploy/helm/cleave/tools/gen_docs.py"
    router = checked_in["properties"]["cleave"]["properties"]["router"]["properties"]
    assert router["disagg_threshold_tokens"] == {
        "description": "Prompts with fewer uncached tokens than this prefill on the decode "
                       "worker.", "minimum": 0, "type": "integer"}


def test_every_value_is_documented():
    sys.path.insert(0, str(CHART / "tools"))
    from gen_docs import documented_values

    text = (CHART / "values.yaml").read_text()
    documented = {key for key, _ in documented_values(text)}

    def undocumented(node: dict, prefix: str) -> list[str]:
        missing = []
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in documented:
                continue
            if isinstance(value, dict) and value:
                missing += undocumented(value, path + ".")
            else:
                missing.append(path)
        return missing

    assert undocumented(yaml.safe_load(text), "") == []
