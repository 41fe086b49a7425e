"""Attention over the paged KV cache, behind a backend interface selected by name."""

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.attention.registry import get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
