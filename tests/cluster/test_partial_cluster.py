"""A partial cluster serves: on a local Ray with room for one of two decode replicas, `deploy`
(as `cleave serve` runs it) returns once the application serves and says what it waits for;
killing the running decode engine then takes nothing down: the router stays up, a replacement
is started, and requests are answered again."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from tests.cluster.conftest import RAY_CPUS, app_config, directory_entries, wait_for

pytestmark = pytest.mark.timeout(600)


def test_a_replica_lost_while_another_is_pending_leaves_the_cluster_serving(local_ray,
                                                                            tiny_model):
    from ray import serve

    from cluster.app_state import app_status, describe
    from cluster.config import CleaveConfig
    from cluster.launch import deploy

    wide = RAY_CPUS * 0.6  # one decode replica fits, a second waits for CPUs
    config = CleaveConfig.parse(app_config(tiny_model, pools={
        "prefill": {"cpus_per_rank": 0.25, "engine": {"num_blocks": 256}},
        "decode": {"cpus_per_rank": wide, "replicas": {"min": 2, "max": 2},
                   "engine": {"num_blocks": 256}}}))
    said: list[str] = []
    started = time.monotonic()
    deploy(config, progress=said.append, until="serving")
    assert time.monotonic() - started < 240
    line = describe(app_status())
    assert "pool-decode 1/2" in line, line
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.router.http_port}/v1",
                           api_key="unused", max_retries=0, timeout=60)

    def answered() -> bool:
        try:
            out = client.completions.create(model="tiny", prompt="Hello, my name is",
                                            max_tokens=4, extra_body={"ignore_eos": True})
        except openai.APIError:
            return False
        return out.usage.completion_tokens == 4

    assert answered()
    import ray

    (running,) = [e for e in directory_entries() if e.pool == "decode"]
    ray.kill(running.actor, no_restart=True)
    # Serve sees the replica fail and places a new one; the router and the prefill pool stay
    wait_for(answered, 240, "a completion after the decode engine was killed", interval_s=2.0)
    assert serve.status().applications["cleave"].deployments["router"].replica_states
    replacement = [e for e in directory_entries() if e.pool == "decode"]
    assert replacement and running.worker_id not in {e.worker_id for e in replacement}


def test_a_router_that_cannot_start_fails_the_deploy_naming_why(local_ray, tiny_model):
    """Before it ever served, a hard failure still ends `deploy`, with the reason from the
    failed constructor's traceback (Serve's own message only names the deployment)."""
    from ray import serve

    from cluster.config import CleaveConfig
    from cluster.launch import deploy

    try:
        serve.delete("cleave")  # the test before leaves its application serving
    except serve.exceptions.RayServeException:  # run alone: no Serve yet
        pass
    config = CleaveConfig.parse(app_config(tiny_model))
    # both of the router's ports held by someone else: whichever it binds first fails (holding
    # one left the other to a race with whatever took that free port in the meantime)
    with socket.socket() as http, socket.socket() as grpc:
        for taken, port in ((http, config.router.http_port), (grpc, config.router.grpc_port)):
            taken.bind(("127.0.0.1", port))
            taken.listen()
        with pytest.raises(RuntimeError, match="failed to deploy") as failed:
            deploy(config, until="serving")
    assert "router: OSError: " in str(failed.value)
    assert "Address already in use" in str(failed.value)
    assert local_ray.is_initialized()  # not this call's Ray: left running
