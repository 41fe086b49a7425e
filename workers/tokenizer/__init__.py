"""Tokenizer, chat template and incremental detokenizer for Cleave; nothing here imports torch."""

from __future__ import annotations

from workers.tokenizer.build import TokenizerInfo, write_tokenizer_files
from workers.tokenizer.chat_template import ChatTemplateError, render_chat_template
from workers.tokenizer.detokenizer import IncrementalDetokenizer
from workers.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerInfo",
    "render_chat_template",
    "write_tokenizer_files",
]
