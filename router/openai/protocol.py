"""OpenAI request bodies (with vLLM's sampling extensions), validated by pydantic.

Only the HTTP edge uses these; `sampling_params` turns a body into the engine's
`SamplingParams`. A field the server does not know is refused with a 400 naming it (a client
that sets a field must not get output that ignores it); OpenAI's fields that change nothing here
(`user`, `store`, `metadata`, ...) are accepted, and those that would change the output but are
not supported yet are accepted only at their no-op values. Tools: `tool_calls.py`.

Structured output comes as OpenAI's `response_format` (`json_object`, `json_schema`) or as
vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) or its older
`guided_*` fields: at most one of them per request (`structured_output.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from router.errors import BadRequestError
from router.openai.structured_output import StructuredFields
from router.openai.tool_calls import ToolCallIn, ToolFields
from workers.contract.protocol import InvalidRequestError, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingBody(StructuredFields):
    """Fields the completions and chat bodies share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields that change nothing here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extensions
    ignore_eos: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, description="isolates this request's prefix "
                                   "cache hits to requests with the same salt")
    # Cleave's extension
    speculative: bool = Field(default=True, description="false: decode this request without "
                              "speculation on a server that speculates")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises `BadRequestError` naming the bad field."""
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k,
                min_p=self.min_p or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None
                else self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured=self.structured_output(), logit_bias=self._logit_bias(),
                speculative=self.speculative)
        except InvalidRequestError as exc:
            raise BadRequestError(exc.message, param=exc.param) from None

    def check_openai_ranges(self) -> None:
        """OpenAI's documented ranges that the engine itself would accept."""
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise BadRequestError(f"temperature must be in [0, 2], got {self.temperature}",
                                  param="temperature")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                out[int(key)] = value
            except ValueError:
                raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                      param="logit_bias") from None
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


# A prompt: text, texts, token ids or lists of token ids. Strict so "1" is not token 1.
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_SamplingBody):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token, legacy format
    prompt_logprobs: int | None = None  # vLLM extension
    # vLLM extension: each choice carries its prompt's and its output's token ids
    return_token_ids: bool = False
    suffix: str | None = None

    def check(self) -> None:
        self.check_openai_ranges()
        if self.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_input() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingBody, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check(self) -> None:
        self.check_openai_ranges()
        self.check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise BadRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                                  param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
