"""From sampled tokens to token events, with their text
(`workers.tokenizer.detokenizer.SampleText`) unless the engine serves a router, which
detokenizes off the step thread (`detokenize=False`: events carry token ids only, and stop
strings are the router's to find)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.contract.protocol import FinishReason, TokenEvent, TokenLogprob
from workers.engine.request import Request, RequestStatus
from workers.tokenizer.detokenizer import SampleText


@dataclass(slots=True)
class _Sample:
    parent_id: str
    index: int
    text: SampleText | None  # None: no text here
    num_sent_tokens: int = 0
    num_read_tokens: int = 0  # output tokens looked at for stop strings
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: object | None, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self._samples: dict[str, _Sample] = {}

    def add(self, req: Request, parent_id: str, index: int) -> None:
        text = (SampleText(self.tokenizer, req.prompt_token_ids, req.params)
                if self.detokenize else None)
        sample = _Sample(parent_id, index, text)
        self._samples[req.request_id] = sample
        if req.output_token_ids:  # tokens already sent by another worker (KV handoff)
            if text is not None:
                text.prime(req.output_token_ids)
            sample.num_sent_tokens = sample.num_read_tokens = req.num_output_tokens

    def index(self, request_id: str) -> int:
        """A sample's index in its request."""
        return self._samples[request_id].index

    def remove(self, request_id: str) -> None:
        self._samples.pop(request_id, None)

    def find_stop_string(self, req: Request) -> str | None:
        """Detokenize the request's new tokens one at a time (a speculative step appends
        several); return the stop string one completed, if any (the text is then cut there,
        keeping the stop string only when asked to, and the tokens after it are dropped from
        the request's output, as one-at-a-time decoding would never have made them)."""
        sample = self._samples[req.request_id]
        text = sample.text
        if text is None:
            return None
        while sample.num_read_tokens < req.num_output_tokens:
            sample.num_read_tokens += 1
            stop = text.add_token(req.output_token_ids[sample.num_read_tokens - 1])
            if stop is not None:
                req.truncate_output(sample.num_read_tokens)
                return stop
        return None

    def event(self, req: Request, new_logprobs: Sequence[TokenLogprob] = (),
              ) -> TokenEvent | None:
        """The event carrying what this sample has not sent yet; None when there is nothing.
        `new_logprobs`: of the tokens the step added (those of tokens a stop string dropped are
        dropped too)."""
        sample = self._samples[req.request_id]
        sample.pending_logprobs.extend(new_logprobs)
        finished = req.status is RequestStatus.FINISHED
        num_sent_tokens = sample.num_sent_tokens
        if not finished and len(req.output_token_ids) == num_sent_tokens:
            return None
        text = ""
        if sample.text is not None:
            # a prefill-only request cut at its first token goes on elsewhere: keep an
            # incomplete character back, as the decode worker (re-reading that token) will
            continues = req.hold_kv and req.finish_reason is FinishReason.LENGTH
            text = sample.text.take(finished, flush=req.stop_reason is None and not continues)
        new_tokens = req.output_token_ids[num_sent_tokens:]
        sample.num_sent_tokens = len(req.output_token_ids)
        logprobs: list[TokenLogprob] | None = None
        if req.params.logprobs is not None:
            logprobs, sample.pending_logprobs = sample.pending_logprobs[:len(new_tokens)], []
        if finished:
            self.remove(req.request_id)
        return TokenEvent(
            request_id=sample.parent_id, index=sample.index, token_ids=new_tokens, text=text,
            logprobs=logprobs, finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs if num_sent_tokens == 0 else None,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens)
