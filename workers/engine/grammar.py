"""Grammar-constrained decoding: one engine's grammars compiled for its tokenizer, a matcher per
constrained sample, and the token mask the sampler applies.

Built on xgrammar, chosen by measuring it against llguidance on Cleave's own tokenizers (the
`small` preset's 8,192-token llama, qwen2 and mistral vocabularies, one JSON schema with nested
objects, bounded arrays, enums and integer ranges): xgrammar filled a token mask in 4.5-9 us at
the median (10-21 us mean), llguidance in 14-57 us (32-161 us mean); xgrammar compiled the
schema in 4-5 ms, llguidance in about 1 ms. A mask is filled for every constrained row of every
step and a schema is compiled once (cached here by its canonical text), so the mask decides.

A matcher's state is a function of the tokens it has accepted: a request handed off or migrated
rebuilds it on the new worker from the tokens already sent (`matcher(spec, sent)`), so its
output stays valid and a greedy one equals an uninterrupted run. JSON is compiled without
free whitespace: a random-weight model would otherwise fill its budget with blanks.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from workers.contract.protocol import InvalidRequestError
from workers.contract.structured_output import StructuredOutput

if TYPE_CHECKING:
    from workers.contract.protocol import SamplingParams

_CACHE_SIZE = 256  # compiled grammars kept per engine
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class Grammars:
    """Compiles and caches one engine's grammars; thread-safe (the async engine compiles off
    the step thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        """`tokenizer`: a `workers.tokenizer.Tokenizer` (None: structured output is refused);
        `vocab_size`: the model's logits width; `stop_token_ids`: the tokens that end a
        request, the only ones a complete grammar allows."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()

    def ready(self, spec: StructuredOutput) -> bool:
        """True when `spec` is compiled already (no compile would run)."""
        with self._lock:
            return spec in self._cache

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`; raises `InvalidRequestError` naming the request's
        field when it does not compile. Takes milliseconds the first time, then is cached."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput, sent_token_ids: Sequence[int] = ()) -> Any:
        """A matcher at the state after `sent_token_ids` (tokens other workers sampled);
        `InvalidRequestError` when they do not follow the grammar."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(spec))
        for token_id in sent_token_ids:
            if not matcher.accept_token(token_id):
                raise InvalidRequestError(
                    f"sent token {token_id} does not follow the request's {spec.param}",
                    param="sent_token_ids")
        return matcher

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError(
                        "structured output needs the model's tokenizer; this model has none",
                        param="response_format")
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._xgrammar_compiler()
        try:
            if spec.reasoning_end:
                import xgrammar as xgr

                return compiler.compile_grammar(xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(reasoning_grammar(spec.reasoning_start,
                                                            spec.reasoning_end)),
                    _grammar(spec)))
            return compiler.compile_grammar(_grammar(spec))
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            message = _XGRAMMAR_LOG_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise InvalidRequestError(f"{spec.param}: {message}", param=spec.param) from None


def _grammar(spec: StructuredOutput) -> Any:
    """The xgrammar `Grammar` of `spec`'s constraint (its reasoning aside)."""
    import xgrammar as xgr

    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(compilable_schema(spec.value), any_whitespace=False)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(spec.choices))
    if spec.kind == "tool_call":
        return _tool_call_grammar(spec.value)
    return xgr.Grammar.from_ebnf(spec.value)


def reasoning_grammar(start: str, end: str) -> str:
    """EBNF of the reasoning a constraint follows: any text without `end`, then `end` and
    blanks; with `start`, an optional block that opens with it (after blanks). Built as the
    automaton that finds `end` (one rule per matched prefix length, KMP's fallbacks)."""
    marks = sorted(set(end))
    other = "[^" + "".join(f"\\u{ord(c):04x}" for c in marks) + "]"

    def after(k: int, c: str) -> int:  # matched prefix length after `c`, from length k
        seen = end[:k] + c
        return max(j for j in range(len(seen) + 1) if end.startswith(seen[len(seen) - j:]))

    rules = []
    for k in range(len(end)):
        moves = [f"{ebnf_literal(c)}" + ("" if after(k, c) == len(end) else
                                          f" think{after(k, c)}") for c in marks]
        head = f"{other}* " if k == 0 else f"{other} think0 | "
        rules.append(f"think{k} ::= " + (f"{head}(" + " | ".join(moves) + ")" if k == 0
                                         else head + " | ".join(moves)))
    body = "think0 [ \\t\\n]*"
    root = (f"root ::= ([ \\t\\n]* {ebnf_literal(start)} {body})?" if start
            else f"root ::= {body}")
    return "\n".join([root, *rules])


# one JSON-string character, by UTF-8 length class (ranges within one class compile to exact
# byte automata): printable ASCII but '"' and '\\', then 2-, 3- (no surrogates) and 4-byte
_STRING_CHAR = (r'(?:[ !#-\[\]-~]|[\u0080-\u07ff]|[\u0800-\ud7ff]|[\ue000-\uffff]'
                r'|[\u{10000}-\u{10ffff}])')


class CompileQueue:
    """The async engine's grammar compiles: a request whose grammar is new is compiled on a
    thread of its own, then started, so neither the step nor the event loop waits on it."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cleave-grammar")
        self._tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its compile

    def needed(self, params: SamplingParams) -> bool:
        return params.structured is not None and not self.grammars.ready(params.structured)

    async def compile(self, params: SamplingParams) -> None:
        """Compile (and cache) the grammar `params` asks for; raises `InvalidRequestError`
        when it does not compile. Nothing to do without one, or when it is cached."""
        spec = params.structured
        if spec is not None and self.needed(params):
            await asyncio.get_running_loop().run_in_executor(
                self._pool, self.grammars.compile, spec)

    def start_after(self, request_id: str, params: SamplingParams,
                    failed: Callable[[Exception], None], start: Callable[[], None]) -> None:
        """`start()` once the grammar is compiled, or `failed(error)`; `cancel` meanwhile
        (an abort) calls neither."""
        async def run() -> None:
            try:
                await self.compile(params)
            except asyncio.CancelledError:
                return
            # a grammar that does not compile: a bad request
            except Exception as exc:  # noqa: BLE001
                failed(exc)
                return
            finally:
                self._tasks.pop(request_id, None)
            start()

        self._tasks[request_id] = asyncio.get_running_loop().create_task(run())

    def cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)


def compilable_schema(schema_json: str) -> str:
    """The schema as handed to xgrammar, each length-bounded string given as a pattern of
    `_STRING_CHAR`s. xgrammar 0.2.8 compiles `minLength`/`maxLength` to `[^"\\\r\n]{m,n}`,
    which admits raw control characters, and compiles a negated class inside a pattern to
    bytes that admit overlong UTF-8 (`E0 89 89`): both seen in a random-weight model's output,
    text that is not JSON, or longer than its bound once decoded. Such strings hold no '"' or
    '\\' (so no escapes)."""
    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in ("enum", "const", "default", "examples") else rewrite(v)
               for k, v in node.items()}
        if (out.get("type") == "string" and "pattern" not in out and "format" not in out
                and ("minLength" in out or "maxLength" in out)):
            low = int(out.pop("minLength", 0))
            high = out.pop("maxLength", None)
            out["pattern"] = f"^{_STRING_CHAR}{{{low},{'' if high is None else int(high)}}}$"
        return out
    return json.dumps(rewrite(json.loads(schema_json)))


def _tool_call_grammar(value: str) -> Any:
    """A fixed prefix, JSON of the call's schema, a fixed suffix."""
    import xgrammar as xgr

    spec = json.loads(value)
    parts = [xgr.Grammar.from_json_schema(compilable_schema(json.dumps(spec["schema"])),
                                          any_whitespace=False)]
    if spec["prefix"]:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(spec['prefix'])}"))
    if spec["suffix"]:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(spec['suffix'])}"))
    return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: BMP characters other than letters, digits and blanks
    escaped as a \\u and four hex digits, the rest as they are."""
    return '"' + "".join(c if c.isalnum() or c == " " else f"\\u{ord(c):04x}"
                         if ord(c) <= 0xFFFF else c for c in text) + '"'


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


class MaskBuffer:
    """The sampler's token-mask buffer, grown as batches need and reused across steps."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """Set to -inf, in place, every logit of `rows` that its matcher does not allow."""
        import xgrammar as xgr

        n, vocab_size = logits.shape
        if (self._bitmask is None or self._bitmask.shape[0] < n
                or self._bitmask.shape[1] * 32 < vocab_size):
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), vocab_size)
        bitmask = self._bitmask[:n]
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=vocab_size, indices=list(rows))
