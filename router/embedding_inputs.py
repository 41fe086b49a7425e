"""An embedding request as both front ends answer it (`embed_inputs`): its inputs tokenized,
checked and admitted, pooled as the request or the model says, by `Router.embed`. Torch-free."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from router.app import Router
from router.errors import BadRequestError


def model_pooling(model_path: str) -> str:
    """The model folder's sentence-transformers pooling (`1_Pooling/config.json`: `last` or
    `mean`), else `last`, as vLLM pools a causal LM."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return "last"
    modes = json.loads(config.read_text())
    return "mean" if modes.get("pooling_mode_mean_tokens") else "last"


async def embed_inputs(router: Router, inputs: Sequence[str | Sequence[int]],
                       pooling: str | None, normalize: bool
                       ) -> tuple[tuple[tuple[float, ...], ...], int]:
    """The inputs' vectors, in order, and their prompt tokens in all. Raises
    `BadRequestError` naming `input` (empty, too many, too long, ids outside the vocabulary)
    or `pooling`, `OverloadedError`, `NoHealthyWorkerError`."""
    if not inputs:
        raise BadRequestError("input must not be empty", param="input")
    if len(inputs) > router.config.max_prompts_per_request:
        raise BadRequestError(f"at most {router.config.max_prompts_per_request} inputs per "
                              f"request, got {len(inputs)}", param="input")
    with router.admit():
        token_ids = [await router.tokenize_async(x) if isinstance(x, str) else list(x)
                     for x in inputs]
        for ids in token_ids:
            router.check_prompt(ids, param="input")
        found = await router.embed(token_ids, pooling or model_pooling(router.config.model_path),
                                   normalize)
    return found.vectors, sum(len(ids) for ids in token_ids)
