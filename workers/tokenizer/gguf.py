"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built as a `tokenizers` tokenizer
that gives the same ids as transformers' GGUF loading of the same file.

Two vocabularies are read, by `tokenizer.ggml.model`:
- "gpt2": byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) from the tokens and merges; the split
  before BPE is the one `tokenizer.ggml.pre` names where transformers knows it (Llama 3's,
  Qwen2's, GPT-4o's ...), else GPT-2's.
- "llama": SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3) from the
  tokens and their scores (merges are rebuilt from the scores when the file has none).
Tokens the file marks as control become special added tokens, user-defined ones plain added
tokens; bos is added to a prompt when `tokenizer.ggml.add_bos_token` says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from workers.tokenizer.gguf_file import GGUFError, GGUFMetadata, read_metadata

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPACE = "\u2581"  # SentencePiece's word-start mark
_NAMED_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
              "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> the split its merges were learned after (as transformers maps them)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O),
    "tekken": _TEKKEN,
}
_GEMMA = ("gemma", "gemma2", "gemma3")


class GGUFTokenizer(NamedTuple):
    """What `Tokenizer` is built from (`Tokenizer.from_pretrained` on a GGUF file)."""

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]  # "bos_token" ... -> the token's text
    chat_templates: dict[str, str]  # "default" (and named ones) -> Jinja source
    extra_eos_token_ids: list[int]  # end-of-turn / end-of-message ids besides eos


def gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer, special tokens, stop ids and chat template(s) of the GGUF file at `path`.
    Raises GGUFError for a vocabulary kind other than "gpt2" and "llama", or missing keys."""
    meta = read_metadata(path)
    kind = meta.require("tokenizer.ggml.model")
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")]
    if kind == "gpt2":
        backend, tokens = _byte_level(meta, tokens)
    elif kind == "llama":
        backend, tokens = _sentencepiece(meta, tokens)
    else:
        raise GGUFError(f"GGUF file {str(path)!r}: tokenizer model {kind!r} is not supported; "
                        "expected 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)")
    named = {name: tokens[i] for name, key in _NAMED_IDS.items()
             if (i := meta.get(f"tokenizer.ggml.{key}")) is not None and 0 <= i < len(tokens)}
    _add_special_tokens(backend, meta, tokens, byte_level=kind == "gpt2", named=named)
    backend.post_processor = _post_processor(meta, named, backend, kind)
    extra_eos = [int(i) for key in ("eot_token_id", "eom_token_id")
                 if (i := meta.get(f"tokenizer.ggml.{key}")) is not None]
    return GGUFTokenizer(backend, named, _chat_templates(meta), extra_eos)


def _byte_level(meta: GGUFMetadata, tokens: list[str]) -> tuple[tokenizers.Tokenizer, list[str]]:
    """GPT-2-style BPE over bytes spelled as printable characters."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token with characters outside the byte alphabet is spelled byte by byte
    tokens = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
              for t in tokens]
    merges = [tuple(m.split(" ")) for m in meta.require("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(models.BPE(
        {t: i for i, t in enumerate(tokens)}, merges, dropout=None, unk_token=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
        byte_fallback=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                         trim_offsets=True, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()  # its settings are fixed (the arguments did nothing)
    return backend, tokens


def _sentencepiece(meta: GGUFMetadata, tokens: list[str]
                   ) -> tuple[tokenizers.Tokenizer, list[str]]:
    """SentencePiece-style BPE: words marked by U+2581, unknown bytes as <0xXX> tokens."""
    gemma = meta.architecture in _GEMMA
    if gemma:  # Gemma stores runs of spaces as spaces, and merges in token order
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores: Mapping[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, (float(s) for s in meta.require("tokenizer.ggml.scores"))))
    vocab = {t: i for i, t in enumerate(tokens)}
    written = meta.get("tokenizer.ggml.merges")
    merges = ([tuple(m.split(" ")) for m in written] if written
              else _merges_from_scores(vocab, scores))
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)] if gemma else None
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=unk,
                                              fuse_unk=True, byte_fallback=True))
    pieces = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif meta.architecture == "phi3":  # the prefix space from a normalizer, as Phi-3's own
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE),
                                                   normalizers.Replace(" ", _SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE,
                                                         prepend_scheme="first", split=False)
    if not gemma:
        pieces.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(pieces)
    return backend, tokens


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]
                        ) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best-scored merged token first (ties:
    longer left, then longer right pieces first; then vocabulary order)."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(backend: tokenizers.Tokenizer, meta: GGUFMetadata, tokens: list[str],
                        *, byte_level: bool, named: Mapping[str, str]) -> None:
    """Control tokens (and bos/eos/unk/pad) matched whole as special tokens; user-defined ones
    (like `<think>`) whole but not special. In a byte-level vocabulary a control token spelled
    outside the byte alphabet is a mislabel of llama.cpp's and stays an ordinary token."""
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    vocab = backend.get_vocab()
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL
               and (alphabet is None or set(t) <= alphabet)]
    control += [t for t in named.values() if t in vocab and t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(meta: GGUFMetadata, named: Mapping[str, str],
                    backend: tokenizers.Tokenizer, kind: str) -> processors.TemplateProcessing:
    """bos before (and eos after) a prompt where the file asks for them."""
    before, after = [], []
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and "bos_token" in named:
        before.append(named["bos_token"])
    if meta.get("tokenizer.ggml.add_eos_token", False) and "eos_token" in named:
        after.append(named["eos_token"])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(before + after)]
    return processors.TemplateProcessing(
        single=[*before, "$A", *after], pair=[*before, "$A", *after, *before, "$B:1", *after],
        special_tokens=specials)


def _chat_templates(meta: GGUFMetadata) -> dict[str, str]:
    templates = {}
    if meta.get("tokenizer.chat_template") is not None:
        templates["default"] = str(meta.get("tokenizer.chat_template"))
    for name in meta.get("tokenizer.chat_templates") or ():
        template = meta.get(f"tokenizer.chat_template.{name}")
        if template is not None:
            templates[str(name)] = str(template)
    return templates


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes: printable ones as themselves, the rest from U+0100 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


__all__ = ["GGUFTokenizer", "gguf_tokenizer"]
