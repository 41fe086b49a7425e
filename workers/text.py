"""One sample's text as its tokens arrive: incremental detokenization, stop strings, hold-back.
Torch-free: the engine uses it (offline) and so does the router (serving), where it runs off
the engine's step thread and a stop string aborts the request on its worker.

Text that could still turn out to be the start of a stop string is held back until it can't,
so a streamed response never shows part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.protocol import SamplingParams
from workers.tokenizer.detokenizer import IncrementalDetokenizer


class SampleText:
    """The text of one sample (one of a request's n). Tokens go in one at a time (`add_token`,
    which reports a completed stop string); `take` returns what may be sent now."""

    __slots__ = ("_detok", "_params", "hold_back", "text", "num_sent_chars", "num_tokens")

    def __init__(self, tokenizer: object | None, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        """`tokenizer` None: no text at all (a model without a tokenizer)."""
        self._detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids,  # type: ignore[arg-type]
                                              skip_special_tokens=params.skip_special_tokens)
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
