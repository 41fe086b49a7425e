"""Streaming detokenization: turn each step's new token ids into the text they complete.

Decoding token by token is wrong for two reasons: a multi-byte UTF-8 character can be split across
tokens (decoding the first half alone gives U+FFFD), and some decoders change a token's text by
what precedes it (SentencePiece drops the leading space of the first token). So, as in vLLM, we
decode a short window of trailing tokens twice, with and without the new ones, and emit the
difference, holding the new text back while it ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens (enough for any decoder's lookback).
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
        """Append `new_ids` and return the text they complete ("" while a character is incomplete)."""
        if self._finished:
            raise RuntimeError("add_tokens called after flush(); the request's text is already final")
        self._ids.extend(new_ids)
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        return self._advance(text)

    def flush(self) -> str:
        """Return the held-back text at the end of the request (U+FFFD for bytes that never completed)."""
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
