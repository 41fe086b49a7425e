"""The `/v1/responses` request body, and what the chat path makes of it: its input items,
instructions and an earlier stored response become chat messages, its flat function tools and
`text.format` become the chat body's `tools` and `response_format`, so a response is generated
by exactly the chat completion path (template, tool-call grammar, structured output).

What a text model cannot do (images, files, audio, built-in and MCP tools, item references)
is refused with a 400 naming the item. The store (`ResponseStore`) is per router replica and
bounded: `previous_response_id` and `GET /v1/responses/{id}` find only what this replica made.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from router.errors import BadRequestError, ResponseNotFoundError
from router.openai.common import validation_error
from router.openai.protocol import ChatCompletionRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# chat body fields named otherwise in a Responses body (in errors, the client's names)
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


class TextField(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseRequest(BaseModel):
    """OpenAI's `POST /v1/responses` body, for what a text model does."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextField | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # OpenAI fields that change nothing here
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (without the instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            _add_item(messages, item, f"input[{i}]")
        if not messages:
            raise BadRequestError("input: no message in it", param="input")
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise BadRequestError(f"tools[{i}]: tools of type {kind!r} are not supported "
                                      f"here, only function tools", param="tools")
            spec = {k: v for k, v in tool.items() if k != "type"}
            out.append({"type": "function", "function": spec})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function" or "name" not in choice:
            raise BadRequestError(f"tool_choice: {choice.get('type')!r} is not supported here; "
                                  "give none, auto, required or {type: function, name}",
                                  param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.get("type") in ("text", "json_object"):
            return fmt
        if fmt.get("type") != "json_schema":
            raise BadRequestError(f"text.format: type {fmt.get('type')!r} is not one of text, "
                                  "json_object, json_schema", param="text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                       if k != "type"}}

    def as_chat(self, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion body that generates this response after the `earlier`
        conversation; raises `BadRequestError` naming this body's field."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields = {"messages": [*system, *earlier, *self.input_messages()],
                  "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p,
                  "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
                  "parallel_tool_calls": self.parallel_tool_calls,
                  "response_format": self.response_format(), "stream": self.stream}
        try:
            chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise renamed(validation_error(exc)) from None
        try:
            chat.check()
        except BadRequestError as exc:
            raise renamed(exc) from None
        return chat


def renamed(exc: BadRequestError) -> BadRequestError:
    """`exc` with the chat body's field names put as a Responses body names them."""
    message, param = exc.message, exc.param
    for chat_name, name in RENAMED.items():
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):
            param = name + param[len(chat_name):]
    return BadRequestError(message, param=param)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise BadRequestError(f"{where}.role: {role!r} is not one of {', '.join(ROLES)}",
                                  param="input")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str)
                         else _text(output, f"{where}.output")})
    elif kind != "reasoning":  # earlier reasoning: templates drop it
        raise BadRequestError(f"{where}: input items of type {kind!r} are not supported here "
                              "(message, function_call, function_call_output, reasoning)",
                              param="input")


def _text(content: Any, where: str) -> str:
    """A message's content as text; parts other than text are refused, named."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError(f"{where}.content: expected text or a list of content parts, got "
                              f"{type(content).__name__}", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequestError(f"{where}.content[{j}]: content of type {kind!r} is not "
                                  "supported by this text model (input_text only)",
                                  param="input")
        texts.append(part["text"])
    return "".join(texts)


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as created
    messages: list[dict[str, Any]]  # its conversation, output included, without instructions


class ResponseStore:
    """The responses this router replica made with `store`, the `capacity` newest kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        found = self._items.get(response_id)
        if found is None:
            raise ResponseNotFoundError(
                f"response {response_id!r} is not in this router replica's store (it keeps the "
                f"{self.capacity} newest responses made here with store set)", param=param)
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
