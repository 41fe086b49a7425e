from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The embedded default's shape (tiny Llama with tokenizer), written fresh for this run."""
    from workers.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", preset="tiny"))
