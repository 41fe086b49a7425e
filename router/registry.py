"""A name -> class table for the router's pluggable policies (routing, split, ...): one
mechanism for registering, listing and looking up, so each policy family declares only its
classes. A registered class gets its name as the class attribute `name`."""
from __future__ import annotations

from typing import Generic, TypeVar
from collections.abc import Callable

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes by name for one kind of policy; `kind` names it in errors ("routing policy")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A class decorator registering the class under `name`; a second `name` raises."""
        def register(cls: T) -> T:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            cls.name = name  # type: ignore[attr-defined]  # T is any class; the policies declare `name`
            self._classes[name] = cls
            return cls

        return register

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> T:
        """The class registered as `name`; an unknown name raises ValueError listing the known."""
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: "
                             f"{', '.join(self.names())}")
        return cls
