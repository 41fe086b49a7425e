"""The error every layer raises for a request it refuses; torch-free, imported by the records
(`workers.contract.protocol`, which re-exports it) and by the structured-output constraints."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
