"""The gRPC front end: generation, cancellation, deadlines and status codes."""

from __future__ import annotations

import grpc
import pytest

from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc
from tests.router.conftest import API_KEY, all_blocks_free, wait_until

AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield pb_grpc.GenerationStub(channel)
    channel.close()


def request(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hello there",
                              sampling=pb.SamplingParameters(**{"max_tokens": 6, **sampling}))


def test_generate_streams_token_events(stub):
    events = list(stub.Generate(request(temperature=0.0, ignore_eos=True, logprobs=2),
                                metadata=AUTH, timeout=30))
    assert sum(len(e.token_ids) for e in events) == 6
    assert events[-1].finish_reason == "length" and events[0].num_prompt_tokens > 0
    assert all(len(lp.top) == 2 for e in events for lp in e.logprobs)


def test_generate_from_token_ids_with_n(stub):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                             sampling=pb.SamplingParameters(max_tokens=3, n=2, ignore_eos=True))
    events = list(stub.Generate(req, metadata=AUTH, timeout=30))
    assert {e.index for e in events if e.finish_reason} == {0, 1}


def test_models_and_health(stub, server):
    (model,) = stub.Models(pb.ModelsRequest(), metadata=AUTH, timeout=10).models
    assert model.id == server.router.model_name and model.max_model_len == 2048
    assert stub.Health(pb.HealthRequest(), timeout=10).healthy


def test_cancelling_the_call_aborts_the_request(stub, server):
    assert wait_until(lambda: all_blocks_free(server))
    call = stub.Generate(request(max_tokens=1400, ignore_eos=True), metadata=AUTH, timeout=60)
    next(call)
    call.cancel()
    engines = [w.engine for w in server.workers]
    assert wait_until(lambda: not any(e.has_unfinished() for e in engines), 3.0)
    assert wait_until(lambda: all_blocks_free(server))


def test_a_passed_deadline_aborts_the_request(stub, server):
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(request(max_tokens=1400, ignore_eos=True), metadata=AUTH,
                               timeout=0.3):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    engines = [w.engine for w in server.workers]
    assert wait_until(lambda: not any(e.has_unfinished() for e in engines), 3.0)
    assert wait_until(lambda: all_blocks_free(server))


BAD = [
    ("no key", request(), (), grpc.StatusCode.UNAUTHENTICATED),
    ("bad key", request(), (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ("no prompt", pb.GenerateRequest(), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
    ("bad top_p", request(top_p=0.0), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
    ("n too large", request(n=17), AUTH, grpc.StatusCode.INVALID_ARGUMENT),
    ("prompt over context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2048)), AUTH,
     grpc.StatusCode.INVALID_ARGUMENT),
    ("token out of vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**6])), AUTH,
     grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown model", pb.GenerateRequest(model="gpt-9", text="x"), AUTH,
     grpc.StatusCode.NOT_FOUND),
]


@pytest.mark.parametrize("name,req,metadata,code", BAD, ids=[b[0] for b in BAD])
def test_bad_calls_get_status_codes(stub, name, req, metadata, code):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, metadata=metadata, timeout=30))
    assert err.value.code() == code and err.value.details()


def test_overload_is_resource_exhausted(stub, server):
    router = server.router
    limit = router.config.max_in_flight
    server.call(_fill(router, limit))
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(), metadata=AUTH, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.call(_fill(router, -limit))
    assert list(stub.Generate(request(), metadata=AUTH, timeout=30))


async def _fill(router, n: int) -> None:
    router.in_flight += n  # pretend n requests are in flight (on the router's loop)


def test_client_request_ids_are_labels_not_keys(stub, server):
    """Concurrent calls reusing one client id, and one shaped like another request's sample
    ("dup/0" against an n=2 "dup"), each get their own output under their own label; aborting
    one (its deadline) touches no other, and every block comes back."""
    from concurrent.futures import ThreadPoolExecutor

    def call(request_id: str, n: int = 1, timeout: float = 60):
        req = pb.GenerateRequest(text="the same prompt", request_id=request_id,
                                 sampling=pb.SamplingParameters(max_tokens=12, n=n,
                                                                temperature=0.0,
                                                                ignore_eos=True))
        return list(stub.Generate(req, metadata=AUTH, timeout=timeout))

    alone = call("solo")
    want = [t for e in alone for t in e.token_ids]
    with ThreadPoolExecutor(4) as pool:
        same = [pool.submit(call, "dup") for _ in range(2)]
        sampled = pool.submit(call, "dup", 2)
        sample_shaped = pool.submit(call, "dup/0")
        for f in [*same, sample_shaped]:
            events = f.result()
            assert {e.request_id for e in events} <= {"dup", "dup/0"}
            assert [t for e in events for t in e.token_ids] == want
        events = sampled.result()
        for i in (0, 1):
            assert [t for e in events if e.index == i for t in e.token_ids] == want
    assert wait_until(lambda: all_blocks_free(server))


def test_a_taken_port_is_named_with_the_reason(server):
    """grpc itself only says it could not bind; the error says why, as HTTP's bind does."""
    import asyncio
    import socket

    from router.grpc_server import create_grpc_server

    async def bind(port: int) -> None:  # grpc.aio servers are made inside a running loop
        create_grpc_server(server.router, "127.0.0.1", port)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}: Address already in use"):
            asyncio.run(bind(port))
