"""LoRA adapters over HTTP as vLLM serves them: `GET /v1/models` lists the base model and each
adapter (its `parent` the base), and `POST /v1/load_lora_adapter` {lora_name, lora_path} and
`POST /v1/unload_lora_adapter` {lora_name} load and unload one on every worker at run time
(`router.adapters`). A request's `model` naming a loaded adapter selects it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from router.app import Router
from router.openai.common import parse_body


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str  # a PEFT adapter folder, as the workers' file system sees it


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and unused (adapters go by name)


def model_list(router: Router) -> dict[str, Any]:
    """The base model, then its adapters by name."""
    base = {"id": router.model_name, "object": "model", "created": router.created,
            "owned_by": "cleave", "root": router.config.model_path, "parent": None,
            "max_model_len": router.max_model_len}
    adapters = [{**base, "id": name, "root": name, "parent": router.model_name}
                for name in router.adapters.names]
    return {"object": "list", "data": [base, *adapters]}


async def load_lora_adapter(router: Router, request: Request) -> Response:
    """200 with vLLM's text once every worker serves it; 400 naming what is wrong."""
    body = await parse_body(request, LoadLoraAdapterRequest)
    await router.adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(router: Router, request: Request) -> Response:
    """200 with vLLM's text once no worker serves it; 404 when none did."""
    body = await parse_body(request, UnloadLoraAdapterRequest)
    await router.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
