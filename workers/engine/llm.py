"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, cast
from collections.abc import Sequence

from workers.engine.config import EngineConfig
from workers.engine.core import Engine
from workers.contract.protocol import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    TokenEvent,
    WorkerRequest,
)

if TYPE_CHECKING:
    from workers.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Runs prompts to completion in one process. `model=None` uses the embedded tiny default;
    other keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        if model is None:
            from workers.models.make_model import default_model_path

            model = str(default_model_path())
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, cache_salt: str | None = None,
                 lora_name: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order. `lora_name`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        # a list of ints is one prompt (the checker cannot narrow by the first element's type)
        prompt_list = ([cast(Prompt, prompts)] if one
                       else list(cast(Sequence[Prompt], prompts)))
        params = sampling_params or SamplingParams()
        params_list = (list(params) if isinstance(params, Sequence)
                       else [params] * len(prompt_list))
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} "
                             "prompts")
        loras = ([lora_name] * len(prompt_list) if lora_name is None or isinstance(lora_name, str)
                 else list(lora_name))
        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, p, lora in zip(prompt_list, params_list, loras, strict=True):
                rid = str(next(self._ids))
                ids = self.engine.tokenize(prompt)
                self.engine.generate(WorkerRequest(rid, tuple(ids), p, cache_salt, lora_name=lora))
                outputs[rid] = RequestOutput(
                    rid, prompt if isinstance(prompt, str) else None, ids,
                    [CompletionOutput(i, "", [], None) for i in range(p.n)], finished=False)
            while self.engine.has_unfinished():
                for event in self.engine.step():
                    _accumulate(outputs[event.request_id], event)
        except BaseException:
            for rid in outputs:
                self.engine.abort(rid)
            raise
        for out in outputs.values():
            out.finished = True
        return list(outputs.values())


    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             **template_kwargs: Any) -> RequestOutput:
        """Render `messages` with the model's chat template (add_generation_prompt) and generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model folder has no tokenizer.json")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, **template_kwargs)
        return self.generate([ids], sampling_params)[0]


def _accumulate(out: RequestOutput, event: TokenEvent) -> None:
    sample = out.outputs[event.index]
    sample.token_ids.extend(event.token_ids)
    sample.text += event.text
    if event.logprobs is not None:
        sample.logprobs = (sample.logprobs or []) + event.logprobs
    if event.finish_reason is not None:
        sample.finish_reason = event.finish_reason
        sample.stop_reason = event.stop_reason
    if event.prompt_logprobs is not None:
        out.prompt_logprobs = event.prompt_logprobs
    out.num_cached_tokens = event.num_cached_tokens
