"""The gRPC front end (`cleave.v1.Generation`) over the same `Router` as the HTTP one.

Errors map to status codes through `APIError.grpc_code`: INVALID_ARGUMENT, UNAUTHENTICATED,
NOT_FOUND, RESOURCE_EXHAUSTED (overloaded), UNAVAILABLE (no healthy worker). A cancelled call
or a passed deadline cancels the handler, which aborts the request on its worker.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Collection
from typing import Any, NoReturn, Protocol
from collections.abc import AsyncIterator

import grpc

from router.app import Router
from router.deadline import ttft_deadline_s
from router.embedding_inputs import embed_inputs
from router.errors import INTERNAL_ERROR, APIError, BadRequestError
from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc
from router.streams import Generation
from workers.contract.protocol import InvalidRequestError, SamplingParams, TokenEvent
from workers.contract.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

# SamplingParameters fields copied as they are when set
_PLAIN_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos",
                 "logprobs", "prompt_logprobs", "skip_special_tokens",
                 "include_stop_str_in_output")


def sampling_params(msg: pb.SamplingParameters, max_tokens_default: int) -> SamplingParams:
    """The engine's parameters from the message; raises `BadRequestError` naming the field."""
    kwargs: dict[str, Any] = {f: getattr(msg, f) for f in _PLAIN_FIELDS if msg.HasField(f)}
    kwargs["max_tokens"] = msg.max_tokens if msg.HasField("max_tokens") else max_tokens_default
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    try:
        kwargs["logit_bias"] = dict(msg.logit_bias) or None
        kwargs["structured"] = _constraint(msg)
        # the fields' types are the message's; SamplingParams validates each value
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        raise BadRequestError(exc.message, param=exc.param) from None


def _constraint(msg: pb.SamplingParameters) -> StructuredOutput | None:
    """The output constraint of the message (None: free text)."""
    if not msg.HasField("constraint"):
        return None
    c, param = msg.constraint, "sampling.constraint"
    kind = c.WhichOneof("kind")
    if kind == "json_schema":
        return StructuredOutput.json_schema(c.json_schema, param)
    if kind == "json_object":
        return StructuredOutput("json_object", param=param) if c.json_object else None
    if kind == "choice":
        return StructuredOutput.choice(list(c.choice.choices), param)
    if kind in ("regex", "grammar"):
        return StructuredOutput(kind, getattr(c, kind), param)
    return None


def _response(event: TokenEvent, gen: Generation, request_id: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id, index=event.index, token_ids=event.token_ids,
        text=event.text,
        logprobs=[pb.Logprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)
                  for lp in event.logprobs or ()],
        finish_reason="" if event.finish_reason is None else event.finish_reason.value,
        stop_reason="" if event.stop_reason is None else str(event.stop_reason),
        num_prompt_tokens=event.num_prompt_tokens, num_cached_tokens=event.num_cached_tokens,
        predicted_cached_tokens=gen.predicted_cached_tokens, worker_id=gen.worker_id)


class ServicerContext(Protocol):
    """What the handlers use of a gRPC context: `grpc.aio.ServicerContext`, or Serve's adapted
    by `cluster/ingress.py`."""

    def invocation_metadata(self) -> Collection[tuple[str, str | bytes]] | None: ...

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn: ...


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def _authenticate(self, context: ServicerContext) -> None:
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else None
        self.router.authenticate(token)

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return await self.router.tokenize_async(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        raise BadRequestError("set the prompt: text or token_ids", param="prompt")

    async def Generate(self, request: pb.GenerateRequest,
                       context: ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        router = self.router
        gen: Generation | None = None
        slot = None
        try:
            self._authenticate(context)
            router.check_model(request.model or None)
            router.check_n(request.sampling.n or 1)
            slot = router.admit()  # before any work on the prompt
            ids = await self._prompt(request)
            router.check_prompt(ids)
            params = sampling_params(request.sampling, router.max_model_len - len(ids))
            deadline = ttft_deadline_s({k: v for k, v in context.invocation_metadata() or ()
                                        if isinstance(v, str)})
            gen = await router.generate(ids, params, request.cache_salt or None,
                                        frontend="grpc", ttft_deadline_s=deadline)
            # the client's id labels its responses; the router's own keys its blocks and leases
            label = request.request_id or gen.req.request_id
            async for event in gen.events():
                yield _response(event, gen, label)
        except APIError as exc:
            if gen is None:  # one that streamed was counted by its record
                router.metrics.count_error("grpc", exc)
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            logger.exception("unhandled error serving a gRPC Generate")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)
        finally:
            if gen is not None:
                await gen.aclose()
            if slot is not None:
                slot.release()

    async def Embed(self, request: pb.EmbedRequest,
                    context: ServicerContext) -> pb.EmbedResponse:
        try:
            self._authenticate(context)
            self.router.check_model(request.model or None)
            inputs = [list(x.token_ids.ids) if x.WhichOneof("input") == "token_ids" else x.text
                      for x in request.inputs]
            normalize = request.normalize if request.HasField("normalize") else True
            vectors, num_tokens = await embed_inputs(self.router, inputs,
                                                     request.pooling or None, normalize)
        except APIError as exc:
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v) for v in vectors],
                                num_prompt_tokens=num_tokens)

    async def Models(self, request: pb.ModelsRequest,
                     context: ServicerContext) -> pb.ModelsResponse:
        try:
            self._authenticate(context)
        except APIError as exc:
            await context.abort(grpc.StatusCode[exc.grpc_code], exc.message)
        return pb.ModelsResponse(models=[pb.Model(id=self.router.model_name,
                                                  max_model_len=self.router.max_model_len)])

    async def Health(self, request: pb.HealthRequest,
                     context: ServicerContext) -> pb.HealthResponse:
        """Liveness, open without a key (as HTTP's /health): reads no worker."""
        healthy = self.router.healthy_workers()
        return pb.HealthResponse(healthy=bool(healthy), healthy_workers=healthy)


def create_grpc_server(router: Router, host: str, port: int, *,
                       reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to host:port (0: any free port); returns it and the bound port.
    `reuse_port`: other processes may bind the same port (SO_REUSEPORT). The caller starts and
    stops it."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
    pb_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    try:  # grpc says only that it failed: 0 from older versions, RuntimeError from newer
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}: {_bind_error(host, port)}")
    return server, bound


def _bind_error(host: str, port: int) -> str:
    """Why grpc could not bind (it reports only failure): the reason a plain socket gets."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return "the port was taken and then freed again"
