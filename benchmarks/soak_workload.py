"""The soak's requests: a seeded mix of what users send, each checked against a reference answer
taken from the same server before any fault.

A `Spec` is what decides the output (API, prompt, sampling); a `Variant` is how it is sent
(streamed or not, a tenant's `cache_salt`, a client that disconnects or cancels on purpose, a
gRPC deadline, a request id shared with another request). Greedy and seeded specs must give
their reference text whatever the variant and whatever path served them (aggregated,
disaggregated, migrated): a difference means tokens were lost, duplicated or mixed up.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, replace

import grpc
import httpx

from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches near old stone bridges under grey autumn skies").split()


@dataclass(frozen=True)
class Spec:
    api: str  # "completions", "chat" or "grpc"
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    @property
    def key(self) -> str:
        return json.dumps([self.api, self.prompt, self.max_tokens, self.temperature, self.seed,
                           self.n, self.stop, self.logprobs])


@dataclass(frozen=True)
class Variant:
    stream: bool = False
    salt: str | None = None
    disconnect: str | None = None  # "before_first" or "mid_stream": the client goes away
    grpc_cancel: bool = False  # a gRPC call cancelled after its first event
    grpc_deadline_s: float | None = None  # a deadline too short for the request
    request_id: str | None = None  # gRPC: an id another request in flight also uses

    @property
    def on_purpose(self) -> bool:
        """Whether the client itself ends the request early (no output is expected)."""
        return bool(self.disconnect or self.grpc_cancel or self.grpc_deadline_s)


def make_specs(rng: random.Random, num_prompts: int) -> list[Spec]:
    """Greedy and seeded specs over short and long prompts (long ones are disaggregated)."""
    specs = []
    for i in range(num_prompts):
        length = rng.choice((6, 12, 90, 160))  # words; the tiny tokenizer gives about as many
        prompt = " ".join(rng.choice(WORDS) for _ in range(length))
        api = ("completions", "chat", "grpc")[i % 3]
        specs.append(Spec(api, prompt, rng.randint(6, 24)))
        if i % 4 == 1:
            specs.append(Spec(api, prompt, 12, temperature=0.8, seed=rng.randrange(2**31)))
        if i % 6 == 2 and api != "grpc":
            specs.append(Spec(api, prompt, 8, temperature=0.9, seed=rng.randrange(2**31), n=2))
        if i % 5 == 3 and api == "completions":
            specs.append(Spec(api, prompt, 10, logprobs=2))
    return specs


def with_stop(spec: Spec, reference: list[str]) -> Spec | None:
    """The spec again with a stop string taken from the middle of its reference text (so it
    does stop there), or None when the text is too short."""
    text = reference[0]
    if len(text) < 12:
        return None
    return replace(spec, stop=(text[len(text) // 2:len(text) // 2 + 3],))


@dataclass
class Outcome:
    spec: Spec
    variant: Variant
    status: str = "error"  # ok, refused, unavailable, cancelled, error, hung
    texts: list[str] | None = None
    detail: str = ""
    seconds: float = 0.0


class Clients:
    """One HTTP client and one gRPC channel to a router, with its API key."""

    def __init__(self, http_url: str, grpc_target: str, model: str, api_key: str) -> None:
        self.model = model
        self.auth = {"Authorization": f"Bearer {api_key}"}
        self.metadata = (("authorization", f"Bearer {api_key}"),)
        self.http = httpx.AsyncClient(base_url=http_url, headers=self.auth,
                                      timeout=httpx.Timeout(120.0, connect=5.0),
                                      limits=httpx.Limits(max_connections=256))
        self.channel = grpc.aio.insecure_channel(grpc_target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()


def http_body(spec: Spec, variant: Variant, model: str) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                  "n": spec.n, "stream": variant.stream, "ignore_eos": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.logprobs is not None:
        body["logprobs"] = spec.logprobs
    if variant.salt is not None:
        body["cache_salt"] = variant.salt
    if spec.api == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


def _texts_of(spec: Spec, choices: list[dict], chunks: dict[int, list[str]] | None) -> list[str]:
    if chunks is not None:
        return ["".join(chunks.get(i, [])) for i in range(spec.n)]
    ordered = sorted(choices, key=lambda c: c["index"])
    if spec.api == "chat":
        return [c["message"]["content"] or "" for c in ordered]
    return [c["text"] for c in ordered]


async def send_http(clients: Clients, spec: Spec, variant: Variant) -> Outcome:
    out = Outcome(spec, variant)
    path, body = http_body(spec, variant, clients.model)
    if not variant.stream:
        r = await clients.http.post(path, json=body)
        if r.status_code != 200:
            return _refusal(out, r.status_code, r.text)
        out.texts, out.status = _texts_of(spec, r.json()["choices"], None), "ok"
        return out
    chunks: dict[int, list[str]] = {}
    async with clients.http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return _refusal(out, r.status_code, (await r.aread()).decode())
        if variant.disconnect == "before_first":
            out.status = "cancelled"
            return out  # leaving the block closes the connection before any chunk is read
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return _refusal(out, 500, line)
            for c in data["choices"]:
                piece = c["delta"].get("content") if spec.api == "chat" else c["text"]
                chunks.setdefault(c["index"], []).append(piece or "")
            if variant.disconnect == "mid_stream" and chunks:
                out.status = "cancelled"
                return out
    out.texts, out.status = _texts_of(spec, [], chunks), "ok"
    return out


def _refusal(out: Outcome, status: int, text: str) -> Outcome:
    """A refusal must be OpenAI-shaped, say why, and carry no traceback."""
    out.detail = f"{status}: {text[:200]}"
    shaped = '"error"' in text and "Traceback" not in text
    out.status = ("refused" if status in (429, 503) else "error") if shaped else "error"
    return out


async def send_grpc(clients: Clients, spec: Spec, variant: Variant) -> Outcome:
    out = Outcome(spec, variant)
    sampling = pb.SamplingParameters(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                     n=spec.n, ignore_eos=True,
                                     stop=list(spec.stop))
    if spec.seed is not None:
        sampling.seed = spec.seed
    req = pb.GenerateRequest(text=spec.prompt, sampling=sampling,
                             request_id=variant.request_id or "")
    if variant.salt is not None:
        req.cache_salt = variant.salt
    call = clients.stub.Generate(req, metadata=clients.metadata,
                                 timeout=variant.grpc_deadline_s or 120.0)
    pieces: dict[int, list[str]] = {}
    try:
        async for event in call:
            pieces.setdefault(event.index, []).append(event.text)
            if variant.grpc_cancel:
                call.cancel()
                out.status = "cancelled"
                return out
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if variant.on_purpose and code in (grpc.StatusCode.CANCELLED,
                                           grpc.StatusCode.DEADLINE_EXCEEDED):
            out.status = "cancelled"
        elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            out.status, out.detail = "refused", f"{code.name}: {exc.details()}"
        else:
            out.status, out.detail = "error", f"{code.name}: {exc.details()}"
        return out
    out.texts = ["".join(pieces.get(i, [])) for i in range(spec.n)]
    out.status = "ok"
    return out


async def send(clients: Clients, spec: Spec, variant: Variant, deadline_s: float) -> Outcome:
    """Send one request; `hung` when it did not end within `deadline_s`; connection failures
    (a router replica restarting) are `unavailable`."""
    start = time.monotonic()
    sender = send_grpc if spec.api == "grpc" else send_http
    # not `wait_for`: it would wait for the cancelled call to finish unwinding, and a call
    # that never ends must be counted as hung, not hang the soak
    task = asyncio.get_running_loop().create_task(sender(clients, spec, variant))
    done, _ = await asyncio.wait({task}, timeout=deadline_s)
    if not done:
        task.cancel()
        out = Outcome(spec, variant, "hung", detail=f"no end within {deadline_s} s")
    elif isinstance(task.exception(), (httpx.TransportError, grpc.aio.AioRpcError)):
        out = Outcome(spec, variant, "unavailable", detail=repr(task.exception())[:200])
    else:
        out = task.result()
    out.seconds = time.monotonic() - start
    return out
