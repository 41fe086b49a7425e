from __future__ import annotations

import importlib.util

import pytest

HAS_UCXX = importlib.util.find_spec("ucxx") is not None


def transport_param(name: str):
    """A pytest param for a transport, skipped with the reason when it cannot run here."""
    marks = []
    if name == "ucx" and not HAS_UCXX:
        marks.append(pytest.mark.skip(reason="the ucx transport needs the `ucxx` package "
                                             "(pip install ucxx-cu12)"))
    return pytest.param(name, marks=marks, id=name)


TRANSPORTS = [transport_param(t) for t in ("tcp", "ucx", "nccl")]
