"""`POST /v1/embeddings`: the served model's pooled final hidden states (`router.embedder`).

`input`: a string, strings, token ids or lists of token ids. Pooling: the model folder's
sentence-transformers pooling config (`1_Pooling/config.json`: last-token or mean) when it has
one, else the last token, as vLLM pools a causal LM; `pooling` and `normalize` (vLLM's
extension, default true) override it per request. `encoding_format`: `float` lists or `base64`
(little-endian fp32, what the `openai` client asks for by default). `dimensions` is accepted
only at the model's hidden size (no model here declares truncation)."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.app import Router
from router.embedding_inputs import embed_inputs
from router.errors import BadRequestError
from router.openai.common import parse_body
from router.openai.protocol import Prompt


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extensions
    pooling: Literal["last", "mean"] | None = Field(
        default=None, description="how a prompt's hidden states are pooled; default: the "
        "model's pooling config, else the last token")
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each text or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise BadRequestError("input must not be empty", param="input")
        if all(isinstance(v, int) for v in value):
            return [[v for v in value if isinstance(v, int)]]  # one input of token ids
        return [v for v in value if isinstance(v, (str, list))]


async def create_embeddings(router: Router, request: Request) -> Response:
    body = await parse_body(request, EmbeddingRequest)
    router.check_model(body.model)
    if body.dimensions is not None and body.dimensions < 1:
        raise BadRequestError(f"dimensions must be at least 1, got {body.dimensions}",
                              param="dimensions")
    vectors, num_tokens = await embed_inputs(router, body.inputs(), body.pooling,
                                             body.normalize)
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise BadRequestError(f"dimensions must be this model's hidden size {len(vectors[0])}, "
                              f"got {body.dimensions} (it declares no truncation)",
                              param="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(v) if body.encoding_format == "base64" else list(v)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": router.model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _base64(vector: tuple[float, ...]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
