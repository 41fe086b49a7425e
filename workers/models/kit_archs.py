"""The architectures `cleave make-model` writes, by name. Torch-free, so the command line checks
`--arch` before torch loads (`kit_configs` holds their shapes)."""

from __future__ import annotations

KIT_ARCHS = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
             "gemma3", "gpt_oss", "deepseek_v3")
