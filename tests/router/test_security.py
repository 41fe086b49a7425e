"""What no one may read or reach without a key, on a real server (HTTP and gRPC, in-process
workers): salted prompts stay with their salt on every worker of a disaggregated deployment,
every route but the liveness probe wants a key on both protocols and under any route prefix,
and an unexpected error tells the client nothing of the server's internals."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from router.errors import INTERNAL_ERROR
from router.openai.api import create_app
from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc
from tests.router.conftest import API_KEY, start_pools, wait_until
from tests.sockets import listening, loopback
from workers.contract.prefix_cache import hash_prompt_blocks

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = " ".join(f"secret{i}" for i in range(60))  # several full blocks, past the threshold


@pytest.fixture(scope="module")
def disagg(tiny_model):
    before = set(listening())  # earlier tests in this process (a Ray driver) may listen too
    srv = start_pools(tiny_model, threshold=24, num_prefill_workers=1, num_decode_workers=1)
    srv.listening_before = before
    yield srv
    srv.stop()


def _complete(base: str, model: str, salt: str | None) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_salted_prompt_is_cached_only_under_its_salt_on_every_worker(disagg):
    base, model = f"http://127.0.0.1:{disagg.http_port}", disagg.router.model_name
    first = _complete(base, model, "tenant-a")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ids = disagg.router.tokenize(PROMPT)
    block = disagg.router.block_size
    unsalted = set(hash_prompt_blocks(ids, block))
    other = set(hash_prompt_blocks(ids, block, "tenant-b"))
    salted = set(hash_prompt_blocks(ids, block, "tenant-a"))
    assert unsalted and not (unsalted & salted)

    def cached() -> list[frozenset[int]]:
        return [disagg.call(c.kv_snapshot()).block_hashes for c in disagg.clients]

    assert wait_until(lambda: all(salted & hashes for hashes in cached()))  # prefill and decode
    for hashes in cached():
        assert not hashes & unsalted and not hashes & other
    for salt in (None, "tenant-b"):  # no usage figure reveals the salted tenant's prompt
        assert _complete(base, model, salt)["usage"]["prompt_tokens_details"][
            "cached_tokens"] == 0
    assert _complete(base, model, "tenant-a")["usage"]["prompt_tokens_details"][
        "cached_tokens"] > 0


def test_every_route_but_the_liveness_probe_wants_a_key(disagg):
    base = f"http://127.0.0.1:{disagg.http_port}"
    app = create_app(disagg.router)
    paths = {r.path: sorted(r.methods - {"HEAD"}) for r in app.routes
             if hasattr(r, "methods") and not r.path.startswith(("/docs", "/openapi", "/redoc"))}
    assert {"/metrics", "/version", "/v1/models", "/v1/completions"} <= set(paths)
    for path, methods in paths.items():
        for method in methods:
            resp = httpx.request(method, f"{base}{path}", json={}, timeout=30)
            want = 200 if path == "/health" else 401
            assert resp.status_code == want, (method, path, resp.text)
    for path in ("/docs", "/openapi.json", "/nowhere"):
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 401


def test_a_route_prefix_does_not_open_a_route(disagg):
    """Under Serve a route prefix is the app's root_path: the key check reads the path after
    it, so /api/metrics is as closed as /metrics."""
    app = create_app(disagg.router)

    async def go() -> tuple[int, int, int]:
        transport = httpx.ASGITransport(app=app, root_path="/api")
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            closed = (await client.get("/api/metrics")).status_code
            keyed = (await client.get("/api/metrics", headers=AUTH)).status_code
            probe = (await client.get("/api/health")).status_code
        return closed, keyed, probe

    assert asyncio.run(go()) == (401, 200, 200)


def test_grpc_wants_a_key_on_every_method_but_health(disagg):
    with grpc.insecure_channel(f"127.0.0.1:{disagg.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(max_tokens=2))
        calls = [lambda md: list(stub.Generate(request, metadata=md, timeout=30)),
                 lambda md: stub.Models(pb.ModelsRequest(), metadata=md, timeout=30)]
        for call in calls:
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call((("authorization", f"Bearer {API_KEY}"),))
        assert stub.Health(pb.HealthRequest(), timeout=30).healthy


def test_an_unexpected_error_tells_the_client_nothing_of_the_internals(disagg, monkeypatch):
    base, model = f"http://127.0.0.1:{disagg.http_port}", disagg.router.model_name
    leak = "Traceback (most recent call last):\n  File \"/srv/cleave/workers/secret.py\""

    async def broken(*args, **kwargs):
        raise RuntimeError(leak)

    monkeypatch.setattr(disagg.router, "generate", broken)
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    for stream in (False, True):
        resp = httpx.post(f"{base}/v1/completions", json={**body, "stream": stream},
                          headers=AUTH, timeout=30)
        assert resp.status_code == 500 and INTERNAL_ERROR in resp.text
        assert "Traceback" not in resp.text and "secret.py" not in resp.text
    with grpc.insecure_channel(f"127.0.0.1:{disagg.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30,
                               metadata=(("authorization", f"Bearer {API_KEY}"),)))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "secret.py" not in err.value.details()


def test_no_listener_on_a_non_loopback_address_by_default(disagg):
    """HTTP, gRPC and the KV transfer servers of a default (in-process) deployment."""
    disagg.call(disagg.clients[0].channel.worker.agents())  # the transfer servers are up
    opened = [addr for addr in listening() if addr not in disagg.listening_before]
    ports = {port for _, port in opened}
    assert {disagg.http_port, disagg.grpc_port} <= ports and len(ports) >= 4, opened
    assert not [(ip, port) for ip, port in opened if not loopback(ip)]
