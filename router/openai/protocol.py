"""OpenAI request bodies (with vLLM's sampling extensions), validated by pydantic.

Only the HTTP edge uses these; `to_sampling_params` turns a body into the engine's
`SamplingParams`. A field the server does not know is refused with a 400 naming it (a client
that sets `logit_bias` or `response_format` must not get output that ignores it); OpenAI's
fields that change nothing here (`user`, `store`, `metadata`, ...) are accepted, and those that
would change the output but are not supported yet are accepted only at their no-op values.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from router.errors import BadRequestError
from workers.protocol import InvalidRequestError, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingBody(BaseModel):
    """Fields the completions and chat bodies share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
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
    parallel_tool_calls: bool | None = None
    # OpenAI fields not supported yet: accepted only when they ask for nothing
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, object] | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: Union[str, dict[str, object], None] = None
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
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except InvalidRequestError as exc:
            raise BadRequestError(exc.message, param=exc.param) from None

    def check_openai_ranges(self) -> None:
        """OpenAI's documented ranges that the engine itself would accept, and the fields
        not supported yet, refused when they ask for something."""
        unsupported = {"logit_bias": bool(self.logit_bias),
                       "response_format": self.response_format not in (None, {"type": "text"}),
                       "tools": bool(self.tools),
                       "tool_choice": self.tool_choice not in (None, "none", "auto")}
        for name, asked in unsupported.items():
            if asked:
                raise BadRequestError(f"{name} is not supported by this server", param=name)
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise BadRequestError(f"temperature must be in [0, 2], got {self.temperature}",
                                  param="temperature")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


# A prompt: text, texts, token ids or lists of token ids. Strict so "1" is not token 1.
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_SamplingBody):
    prompt: Prompt
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token, legacy format
    prompt_logprobs: int | None = None  # vLLM extension
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
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check(self) -> None:
        self.check_openai_ranges()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise BadRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                                  param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
