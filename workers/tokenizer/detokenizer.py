"""Streaming detokenization: turn each step's new token ids into the text they complete, and
one sample's text with its stop strings (`SampleText`). Torch-free: the offline engine uses it on
its step thread, the router (serving) in its own process, where a stop string aborts the request
on its worker.

Decoding token by token is wrong for two reasons: a multi-byte UTF-8 character can be split across
tokens (decoding the first half alone gives U+FFFD), and some decoders change a token's text by
what precedes it (SentencePiece drops the leading space of the first token). So, as in vLLM, we
decode a short window of trailing tokens twice, with and without the new ones, and emit the
difference, holding the new text back while it ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from workers.contract.protocol import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens (enough for any decoder's
# lookback).
_PROMPT_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's output tokens, delivered as deltas while they are generated.

    The concatenation of every `add_tokens` delta plus `flush()` equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level tokenizers, and no delta
    contains U+FFFD unless the final text does at that place. Not thread-safe: one per request.
    """

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends mid-character would let the first output bytes complete a character
        # that is not in the output's own text, so such a prompt gives no context.
        if self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context  # context tokens, then every output token
        self._prefix_offset = 0  # window start: tokens before this are fully emitted
        self._read_offset = len(context)  # tokens before this have had their text emitted
        self._prefix_text = self._decode(context)  # decode(ids[prefix_offset:read_offset])
        self._num_context = len(context)
        self._finished = False

    @property
    def output_token_ids(self) -> list[int]:
        """The output ids added so far (a copy)."""
        return self._ids[self._num_context:]

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids` and return the text they complete ("" while a character is
        incomplete)."""
        if self._finished:
            raise RuntimeError("add_tokens called after flush(); the request's text is already "
                               "final")
        self._ids.extend(new_ids)
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        return self._advance(text)

    def flush(self) -> str:
        """Return the held-back text at the end of the request (U+FFFD for bytes that never
        completed)."""
        self._finished = True
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class SampleText:
    """The text of one sample (one of a request's n). Tokens go in one at a time (`add_token`,
    which reports a completed stop string); `take` returns what may be sent now. Text that could
    still turn out to be the start of a stop string is held back until it can't, so a streamed
    response never shows part of a stop string."""

    __slots__ = ("_detok", "_params", "hold_back", "num_sent_chars", "num_tokens", "text")

    def __init__(self, tokenizer: object | None, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        """`tokenizer` None: no text at all (a model without a tokenizer)."""
        # `tokenizer`: the engine's `Tokenizer`, held as an object by its callers
        self._detok = (IncrementalDetokenizer(
            tokenizer,  # type: ignore[arg-type]  # a `Tokenizer` (above): it has `decode`
            prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
            if tokenizer is not None else None)
        self._params = params
        stops = params.stop
        # characters held back while unfinished: a stop string could start there (0: no stops)
        self.hold_back = max(map(len, stops)) - 1 if stops else 0
        self.text = ""  # all text so far (cut at a stop string once one is found)
        self.num_sent_chars = 0
        self.num_tokens = 0  # output tokens added, primed ones included

    def prime(self, token_ids: Sequence[int]) -> None:
        """Tokens other workers already sent, text and all: taken as sent."""
        if self._detok is not None and token_ids:
            self.text += self._detok.add_tokens(token_ids)
        self.num_tokens += len(token_ids)
        self.num_sent_chars = len(self.text)

    def add_token(self, token_id: int) -> str | None:
        """Detokenize the sample's newest token; return the stop string it completed, if any
        (the text is then cut there, keeping the stop string only when asked to)."""
        old_len = len(self.text)
        self.num_tokens += 1
        if self._detok is not None:
            self.text += self._detok.add_tokens((token_id,))
        params = self._params
        stops = params.stop
        if not stops or self.num_tokens <= params.min_tokens:
            return None
        search_from = max(0, old_len - self.hold_back)
        found: tuple[int, str] | None = None
        for stop in stops:
            at = self.text.find(stop, search_from)
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        self.text = self.text[:at + len(stop) if params.include_stop_str_in_output else at]
        return stop

    def take(self, finished: bool, flush: bool = True) -> str:
        """The text not sent yet that may be sent now: all of it once `finished` (with the
        detokenizer's held-back bytes when `flush`: not after a stop string, nor when the
        sample goes on elsewhere), else all but the stop-string hold-back."""
        if finished:
            if flush and self._detok is not None:
                self.text += self._detok.flush()
            end = len(self.text)
        else:
            end = len(self.text) - self.hold_back
        start = self.num_sent_chars
        end = max(end, start)
        self.num_sent_chars = end
        return self.text[start:end]
