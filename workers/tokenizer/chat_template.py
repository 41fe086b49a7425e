"""Render Hugging Face chat templates exactly as `transformers`' `apply_chat_template` does.

Templates come from model folders, so they are untrusted code: they run in Jinja's immutable
sandbox, with the same globals and filters transformers provides (`raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape, `namespace` and `dict` that cannot reach
Python internals, loop controls, and a `{% generation %}` block that renders its body).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (`raise_exception` in the template) or failed."""


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render `messages` with `template`; `variables` (special tokens, template kwargs) are
    visible to it.

    Messages are copied into plain JSON types first, and keys whose value is None are dropped, as
    transformers does (templates handle a missing `content` better than a `None` one).
    """
    compiled = compile_chat_template(template)
    plain_messages = [
        _alias_reasoning({key: _plain(value) for key, value in message.items()
                          if value is not None})
        for message in messages
    ]
    try:
        return compiled.render(
            messages=plain_messages,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile `template` once; later calls with the same string return the cached template."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): "
                                f"{exc.message}") from exc


# Names a message's reasoning comes under; templates read the first, gpt-oss templates read
# `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS
                      if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'`; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore-prefixed attributes (a path to CPython
    internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "chat templates cannot store underscore-prefixed attributes on a namespace, got "
                f"{name!r}"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
    just renders."""

    tags = {"generation"}  # noqa: RUF012 -- jinja's `Extension.tags`, read from the class

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [],
                                      body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _plain(value: Any) -> Any:
    """Copy `value` into plain JSON-like types, so the sandbox only ever sees
    str/int/float/list/dict."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name))
                for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
