"""A Hugging Face tokenizer folder, loaded without transformers or torch.

`Tokenizer` gives the same ids, text and chat prompts as `transformers.AutoTokenizer` on the same
folder for fast (`tokenizer.json`) tokenizers: encoding and decoding go straight to the `tokenizers`
library, and chat templates are rendered by `workers.tokenizer.chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import tokenizers

from workers.tokenizer.chat_template import render_chat_template
from workers.tokenizer.gguf import gguf_tokenizer
from workers.tokenizer.gguf_file import find_gguf_file

# Named special tokens transformers passes to every chat template (its `special_tokens_map`).
_NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_DIR = "additional_chat_templates"


class Tokenizer:
    """Encode, decode and chat-format text for one model. Never mutated after construction, so one
    instance can be shared by every request and thread."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        extra_eos_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> None:
        """Prefer `from_pretrained`. `special_tokens` maps names like "eos_token" to token strings;
        `chat_templates` maps template names to Jinja sources ("default" is used unless tools pick
        "tool_use"); `extra_eos_token_ids` are stop ids besides `eos_token` (from generation
        config)."""
        self._backend = backend
        self._name = name
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.eos_token_id: int | None = self._special_id("eos_token")
        self.pad_token_id: int | None = self._special_id("pad_token")
        eos = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(
            sorted(i for i, tok in added.items() if tok.special))

    @classmethod
    def found_in(cls, path: Path | str) -> Tokenizer | None:
        """`from_pretrained(path)` where `path` holds a tokenizer (a GGUF file, or a folder with
        `tokenizer.json`); None where it holds none."""
        if find_gguf_file(path) is None and not (Path(path) / "tokenizer.json").exists():
            return None
        return cls.from_pretrained(path)

    @classmethod
    def from_pretrained(cls, path: Path | str) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, chat templates and eos ids from folder
        `path`, or the tokenizer a GGUF file describes (`path` names the file or a folder holding
        it)."""
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            parts = gguf_tokenizer(gguf_file)
            return cls(parts.backend, special_tokens=parts.special_tokens,
                       chat_templates=parts.chat_templates,
                       extra_eos_token_ids=parts.extra_eos_token_ids, name=str(gguf_file))
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(folder)!r}; expected a Hugging Face tokenizer folder "
                "with a fast tokenizer (tokenizer.json)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        special_tokens = {}
        for key in _NAMED_SPECIAL_TOKENS:
            token = _token_content(config.get(key))
            if token is not None:
                special_tokens[key] = token
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            extra_eos.extend(_as_id_list(_read_json(folder / name).get("eos_token_id")))
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_templates=_load_chat_templates(folder, config),
            extra_eos_token_ids=extra_eos,
            name=str(folder),
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object, for libraries that read the whole vocabulary (the grammar
        compiler). Do not mutate it."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added and special tokens included (`len()` of a transformers
        tokenizer)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens ("bos_token", "eos_token", ...) as strings, as the chat template
        sees them."""
        return dict(self._special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a leading
        bos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}: {text!r:.80}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...
    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary strings of `ids` (byte-level tokens look like "Ġthe")."""
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(i) for i in ids]

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = ...,
                            tokenize: Literal[False] = ...,
                            tools: list[dict[str, Any]] | None = ..., **kwargs: Any) -> str: ...
    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = ...,
                            *, tokenize: Literal[True], tools: list[dict[str, Any]] | None = ...,
                            **kwargs: Any) -> list[int]: ...
    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = ...,
                            tokenize: bool = ..., tools: list[dict[str, Any]] | None = ...,
                            **kwargs: Any) -> str | list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Format `messages` (dicts with "role" and "content") as the model's prompt.

        Returns the text, or with `tokenize=True` its ids, encoded without adding special tokens
        again (the template writes bos itself), the same as transformers' `apply_chat_template`.
        Extra `kwargs` (e.g. `documents`, `enable_thinking`) are visible to the template.
        """
        _check_messages(messages)
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise ValueError(f"tools must be a list of JSON-schema dicts, got {tools!r:.200}")
        template = self._pick_chat_template(tools)
        variables = {**self._special_tokens, **kwargs}
        text = render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **variables
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def chat_template_source(self, tools: bool = False) -> str | None:
        """The Jinja source `apply_chat_template` would use (with tools, or without); None
        when the model has none."""
        try:
            return self._pick_chat_template([] if tools else None)
        except ValueError:
            return None

    def _pick_chat_template(self, tools: list[dict[str, Any]] | None) -> str:
        if not self._chat_templates:
            raise ValueError(
                f"the model at {self._name!r} has no chat template (no chat_template.jinja, and no "
                "chat_template in tokenizer_config.json); send a plain completion prompt instead"
            )
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        raise ValueError(
            f"the model at {self._name!r} has chat templates {sorted(self._chat_templates)} "
            "but none named 'default'"
        )

    def _special_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def _id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            raise ValueError(f"token id {token_id} is out of range; expected 0 <= id < "
                             f"{self.vocab_size}")
        return token

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer({self._name!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={sorted(self.eos_token_ids)})")


def _check_messages(messages: object) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of dicts with 'role' and 'content', got "
                         f"{messages!r:.200}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"messages[{index}] must be a dict with 'role' and 'content' keys, got "
                f"{message!r:.200}"
            )
        if not isinstance(message["role"], str):
            raise ValueError(f"messages[{index}]['role'] must be a str, got "
                             f"{message['role']!r:.80}")


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Template files (`chat_template.jinja`, `additional_chat_templates/*.jinja`) win over the
    config."""
    templates: dict[str, str] = {}
    if (folder / _TEMPLATE_FILE).is_file():
        templates["default"] = (folder / _TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / _TEMPLATE_DIR).is_dir():
        for file in sorted((folder / _TEMPLATE_DIR).glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(isinstance(t, Mapping) and {"name", "template"} <= t.keys()
                                       for t in entry):
        return {t["name"]: t["template"] for t in entry}
    raise ValueError(
        f"chat_template in {str(folder / 'tokenizer_config.json')!r} must be a string or a list of "
        f"{{name, template}} dicts, got {entry!r:.200}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config: a string, or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
