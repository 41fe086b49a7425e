"""Attention over the paged KV cache, behind a backend interface selected by name."""

from workers.attention.backend import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
