"""`cleave chat`: an interactive terminal chat against a running server, through its OpenAI
chat API (the `openai` client, streamed), as `vllm chat` offers.

Each line the user types is sent with the whole conversation so far (the system prompt, then
every user and assistant turn) and the answer is printed as it streams. `/clear` forgets the
conversation, `/exit`, end of input (Ctrl-D) and Ctrl-C at the prompt quit with status 0; Ctrl-C
while an answer streams stops that answer and keeps what was shown. A server error (unreachable,
a 4xx or 5xx status, an error in the stream) is one line naming the URL and the server's
message, and the turn that failed is dropped. Without `--model` the server is asked for its
models at start, and a failure there (unreachable, a bad key) ends the chat with status 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TextIO, cast

from cluster.config import RouterSettings

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

DEFAULT_URL = (f"http://{RouterSettings.model_fields['host'].default}:"
               f"{RouterSettings.model_fields['http_port'].default}/v1")
KEY_VARIABLES = ("CLEAVE_API_KEY", "OPENAI_API_KEY")  # read in this order when no --api-key
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # between streamed chunks: a long prompt's first token on a CPU
PROMPT = "> "


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    """Register `cleave chat` and its flags on the `cleave` command's subparsers."""
    chat = sub.add_parser("chat", help=(
        "chat with a running server in the terminal (its OpenAI API, streamed; /clear forgets "
        "the conversation, /exit quits)"))
    chat.add_argument("--url", default=DEFAULT_URL,
                      help=f"the server's OpenAI API base URL (default: {DEFAULT_URL})")
    chat.add_argument("--api-key", default=None, help=(
        f"the server's API key (default: ${KEY_VARIABLES[0]}, else ${KEY_VARIABLES[1]}, "
        "else none)"))
    chat.add_argument("--model", default=None,
                      help="the model to ask (default: the first the server lists)")
    chat.add_argument("--system", default=None,
                      help="a system prompt, sent first in every request")
    chat.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature (default: the server's; 0: greedy)")
    chat.add_argument("--max-tokens", type=int, default=None,
                      help="tokens per answer at most (default: the server's)")
    chat.add_argument("--verbose", action="store_true",
                      help="after each answer, print its token usage (prompt and completion)")
    chat.set_defaults(func=run_chat)


@dataclass(frozen=True)
class ChatOptions:
    """What `cleave chat` was asked for; `api_key` None: the server takes none."""

    url: str = DEFAULT_URL
    api_key: str | None = None
    model: str | None = None  # None: the first of the server's /v1/models
    system: str | None = None
    temperature: float | None = None  # None: the server's default
    max_tokens: int | None = None  # None: the server's default
    verbose: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatOptions:
        key = args.api_key or next((os.environ[v] for v in KEY_VARIABLES if os.environ.get(v)),
                                   None)
        return cls(args.url.rstrip("/"), key, args.model, args.system, args.temperature,
                   args.max_tokens, args.verbose)


class Turn(NamedTuple):
    """One message of the conversation, as the chat API takes it."""

    role: str  # "system", "user" or "assistant"
    content: str


@dataclass
class Conversation:
    """The history sent with every request: the system prompt (kept by `clear`), then the turns."""

    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [Turn("system", self.system)] if self.system else []
        return [t._asdict() for t in head + self.turns]

    def clear(self) -> None:
        self.turns.clear()


class Answer(NamedTuple):
    """A streamed answer: its text, and its token counts when the server reported them."""

    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    interrupted: bool  # Ctrl-C stopped it; `text` is what arrived before


def describe_error(exc: Exception, url: str) -> str:
    """One line for an error of the `openai` client: the URL, the status, the server's message."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return f"{url}: no answer within the timeout ({exc})"
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot reach {url}: {exc.__cause__ or exc}"
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    message = " ".join(str(message or getattr(exc, "message", None) or exc).split())
    if isinstance(exc, openai.APIStatusError):
        return f"{url} answered {exc.status_code}: {message}"
    return f"{url}: {message}"  # an error event inside the stream


def open_client(options: ChatOptions) -> openai.OpenAI:
    """An `openai` client for the server: no retries (an error is shown at once)."""
    import openai

    # the client requires a key; a server without keys ignores the placeholder
    return openai.OpenAI(base_url=options.url, api_key=options.api_key or "none",
                         max_retries=0,
                         timeout=openai.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))


def pick_model(client: openai.OpenAI, options: ChatOptions) -> str:
    """`options.model`, else the first model the server lists. Raises the client's error when
    the server cannot be asked, ValueError when it lists none."""
    if options.model:
        return options.model
    models = client.models.list().data
    if not models:
        raise ValueError(f"{options.url}/models lists no model; pass --model")
    return models[0].id


def stream_answer(client: openai.OpenAI, model: str, conversation: Conversation,
                  options: ChatOptions, out: TextIO) -> Answer:
    """Send the conversation, write the answer to `out` as it streams (flushed per piece).
    Raises the client's errors (`openai.APIError`); Ctrl-C ends the answer early."""
    import openai

    unset = openai.omit  # the server's default
    pieces: list[str] = []
    usage = None
    try:
        stream = client.chat.completions.create(
            model=model, messages=cast("list[ChatCompletionMessageParam]",
                                       conversation.messages()),
            stream=True, stream_options={"include_usage": True},
            temperature=unset if options.temperature is None else options.temperature,
            max_tokens=unset if options.max_tokens is None else options.max_tokens)
        with stream:
            for chunk in stream:
                usage = chunk.usage or usage  # the last chunk's, asked for by include_usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
                        out.write(choice.delta.content)
                        out.flush()
    except KeyboardInterrupt:
        return Answer("".join(pieces), None, None, interrupted=True)
    except Exception:
        if pieces:  # the error's line starts on a line of its own
            out.write("\n")
            out.flush()
        raise
    return Answer("".join(pieces), usage and usage.prompt_tokens,
                  usage and usage.completion_tokens, interrupted=False)


def _say(text: str) -> None:
    print(f"cleave chat: {text}", file=sys.stderr, flush=True)


def ask(client: openai.OpenAI, model: str, conversation: Conversation, options: ChatOptions,
        question: str) -> None:
    """One turn: the question and its answer join the conversation, or nothing does when the
    server fails (the error is one line)."""
    import openai

    conversation.turns.append(Turn("user", question))
    sent = len(conversation.messages())
    try:
        answer = stream_answer(client, model, conversation, options, sys.stdout)
    except openai.APIError as exc:
        conversation.turns.pop()
        _say(describe_error(exc, options.url))
        return
    print(flush=True)
    if answer.interrupted:
        _say("answer interrupted")
    if answer.text or not answer.interrupted:
        conversation.turns.append(Turn("assistant", answer.text))
    else:
        conversation.turns.pop()  # nothing arrived: the question goes too
    if options.verbose and answer.prompt_tokens is not None:
        _say(f"usage: messages={sent} prompt_tokens={answer.prompt_tokens} "
             f"completion_tokens={answer.completion_tokens}")


def chat_loop(client: openai.OpenAI, model: str, options: ChatOptions,
              read: Callable[[str], str] = input) -> int:
    """Read lines with `read(PROMPT)` until `/exit`, end of input or Ctrl-C; 0 when done."""
    conversation = Conversation(options.system)
    while True:
        try:
            line = read(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            print(flush=True)
            return 0
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/clear":
            conversation.clear()
            _say("conversation cleared")
        elif line.startswith("/") and " " not in line:
            _say(f"unknown command {line!r}: /clear forgets the conversation, /exit quits")
        else:
            ask(client, model, conversation, options, line)


def run_chat(args: argparse.Namespace) -> int:
    """`cleave chat`: 0 when the user quits, 1 when the server's models cannot be listed at
    start (without --model)."""
    import openai

    # Ctrl-C is the chat's own key even where SIGINT came ignored (a shell's background job
    # ignores it, and Python leaves an inherited SIG_IGN alone)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # line editing and history at the prompt, where the platform has it
        import readline  # noqa: F401
    except ImportError:
        pass
    options = ChatOptions.from_args(args)
    client = open_client(options)
    try:
        model = pick_model(client, options)
    except openai.APIError as exc:
        _say(describe_error(exc, options.url))
        return 1
    _say(f"{model} at {options.url}; /clear forgets the conversation, /exit quits")
    return chat_loop(client, model, options)
