"""From sampled tokens to token events: incremental detokenization and stop strings.

Text that could still turn out to be the start of a stop string is held back until it can't,
so a streamed response never shows part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.protocol import FinishReason, TokenEvent, TokenLogprob
from workers.request import Request, RequestStatus


@dataclass(slots=True)
class _Sample:
    parent_id: str
    index: int
    detok: object | None  # IncrementalDetokenizer, None without a tokenizer
    # characters held back while unfinished: a stop string could start there (0: no stops)
    hold_back: int = 0
    text: str = ""  # all text so far (cut at a stop string once one is found)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        self._samples: dict[str, _Sample] = {}

    def add(self, req: Request, parent_id: str, index: int) -> None:
        detok = None
        if self.tokenizer is not None:
            from workers.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                           skip_special_tokens=req.params.skip_special_tokens)
        stops = req.params.stop
        sample = _Sample(parent_id, index, detok, max(map(len, stops)) - 1 if stops else 0)
        self._samples[req.request_id] = sample
        if req.output_token_ids:  # tokens already sent by another worker (KV handoff)
            self._append_text(sample, req.output_token_ids)
            sample.num_sent_chars = len(sample.text)
            sample.num_sent_tokens = req.num_output_tokens

    def remove(self, request_id: str) -> None:
        self._samples.pop(request_id, None)

    def _append_text(self, sample: _Sample, token_ids: list[int]) -> None:
        if sample.detok is not None:
            sample.text += sample.detok.add_tokens(token_ids)

    def find_stop_string(self, req: Request) -> str | None:
        """Detokenize the request's newest token; return the stop string it completed, if any
        (the text is then cut there, keeping the stop string only when asked to)."""
        sample = self._samples[req.request_id]
        old_len = len(sample.text)
        if sample.detok is not None:
            sample.text += sample.detok.add_tokens(req.output_token_ids[-1:])
        stops = req.params.stop
        if not stops or req.num_output_tokens <= req.params.min_tokens:
            return None
        search_from = max(0, old_len - sample.hold_back)
        found: tuple[int, str] | None = None
        for stop in stops:
            at = sample.text.find(stop, search_from)
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        keep = at + len(stop) if req.params.include_stop_str_in_output else at
        sample.text = sample.text[:keep]
        return stop

    def event(self, req: Request, logprob: TokenLogprob | None) -> TokenEvent | None:
        """The event carrying what this sample has not sent yet; None when there is nothing."""
        sample = self._samples[req.request_id]
        if logprob is not None:
            sample.pending_logprobs.append(logprob)
        finished = req.status is RequestStatus.FINISHED
        num_sent_tokens = sample.num_sent_tokens
        if not finished and len(req.output_token_ids) == num_sent_tokens:
            return None
        if finished:
            # a prefill-only request cut at its first token goes on elsewhere: keep an
            # incomplete character back, as the decode worker (re-reading that token) will
            continues = req.hold_kv and req.finish_reason is FinishReason.LENGTH
            if sample.detok is not None and req.stop_reason is None and not continues:
                sample.text += sample.detok.flush()
            end = len(sample.text)
        else:
            end = len(sample.text) - sample.hold_back  # might be a stop string's start
        start = sample.num_sent_chars
        end = max(end, start)
        new_tokens = req.output_token_ids[num_sent_tokens:]
        text = sample.text[start:end]
        sample.num_sent_chars = end
        sample.num_sent_tokens = len(req.output_token_ids)
        logprobs = None
        if req.params.logprobs is not None:
            logprobs, sample.pending_logprobs = sample.pending_logprobs, []
        if finished:
            self.remove(req.request_id)
        return TokenEvent(
            request_id=sample.parent_id, index=sample.index, token_ids=new_tokens, text=text,
            logprobs=logprobs, finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs if num_sent_tokens == 0 else None)
