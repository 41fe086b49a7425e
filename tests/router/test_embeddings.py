"""`/v1/embeddings` with the `openai` client against a served model: the vectors are
transformers' `last_hidden_state` of the same checkpoint, pooled the same way, within fp32
1e-4 (the tiny random model with a prefill and a decode worker, where the prefill worker
answers; SmolLM2-135M-Instruct: `tests/workers/test_gguf_smollm2.py`); batches, token-id
inputs and both encodings agree; bad requests are 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from cluster.local_server import LocalServeConfig, LocalServer
from tests.router.conftest import API_KEY
from workers.contract.calls import Embed
from workers.serving import dispatch

transformers = pytest.importorskip("transformers")

TOL = 1e-4
TEXTS = ["The capital of France is Paris.", "a", "Embeddings pool the final hidden states "
         "of every token of a prompt into one vector per prompt, " * 3]


def serve(model: str, **pools: int) -> LocalServer:
    return LocalServer(LocalServeConfig(
        model, http_port=0, grpc_port=0, router={"api_keys": (API_KEY,),
                                                 "served_model_name": "m"},
        engine={"num_blocks": 64, "max_num_batched_tokens": 64}, **pools)).start()


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=120, max_retries=0)


@torch.no_grad()
def expected(reference, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    hidden = reference.model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, hidden]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert (got_t - want).abs().max().item() <= TOL
    assert torch.nn.functional.cosine_similarity(got_t, want, dim=0).item() >= 0.9999


@pytest.fixture(scope="module")
def tiny(tiny_model):
    srv = serve(tiny_model, num_prefill_workers=1, num_decode_workers=1)
    srv.reference = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32).eval()
    yield srv
    srv.stop()


def test_embeddings_are_transformers_pooled_hidden_states(tiny, monkeypatch):
    answered = []
    real = dispatch.HANDLERS[Embed]
    monkeypatch.setitem(dispatch.HANDLERS, Embed,
                        lambda w, c: answered.append(w.worker_id) or real(w, c))
    client, tok = client_of(tiny), tiny.router.tokenizer
    out = client.embeddings.create(model="m", input=TEXTS)  # base64, as the client asks
    ids = [tok.encode(t) for t in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, prompt in zip(out.data, ids):
        assert_close(d.embedding, expected(tiny.reference, prompt, "last"))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    assert answered == ["prefill-0"]  # the prefill pool embeds
    mean = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float",
                                    extra_body={"pooling": "mean", "normalize": False})
    assert_close(mean.data[0].embedding, expected(tiny.reference, ids[0], "mean", False))


def test_token_ids_and_both_encodings_give_the_same_vectors(tiny):
    client, tok = client_of(tiny), tiny.router.tokenizer
    as_text = client.embeddings.create(model="m", input=TEXTS[:2], encoding_format="float")
    as_ids = client.embeddings.create(model="m", input=[tok.encode(t) for t in TEXTS[:2]])
    one = client.embeddings.create(model="m", input=tok.encode(TEXTS[0]))
    for a, b in zip(as_text.data, as_ids.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    assert one.data[0].embedding == pytest.approx(as_text.data[0].embedding, abs=1e-7)


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [[10 ** 9]]}, "input"),
    ({"input": "hi", "dimensions": 3}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "pooling": "cls"}, "pooling"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(tiny, body, param):
    resp = httpx.post(f"http://127.0.0.1:{tiny.http_port}/v1/embeddings",
                      json={"model": "m", **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_grpc_embed_gives_the_http_vectors(tiny):
    import grpc

    from router.proto.cleave.v1 import generate_pb2 as pb
    from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc

    tok = tiny.router.tokenizer
    http = client_of(tiny).embeddings.create(model="m", input=TEXTS[:2], encoding_format="float")
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{tiny.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        out = stub.Embed(pb.EmbedRequest(model="m", inputs=[
            pb.EmbedInput(text=TEXTS[0]),
            pb.EmbedInput(token_ids=pb.TokenIds(ids=tok.encode(TEXTS[1])))]),
            metadata=auth, timeout=60)
        for got, want in zip(out.embeddings, http.data):
            assert list(got.values) == pytest.approx(want.embedding, abs=1e-6)  # fp32 on the wire
        assert out.num_prompt_tokens == http.usage.prompt_tokens
        with pytest.raises(grpc.RpcError) as caught:
            stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text="x")], pooling="cls"),
                       metadata=auth, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
