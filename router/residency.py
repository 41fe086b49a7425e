"""Which LoRA adapters each worker holds in its engine's device slots, as the routing policies
read them (`router.loads.LoadTable.lacks`). Torch-free.

A worker reports the adapters in its slots with each load report (`EngineStats.lora_adapters`);
a request routed there under an adapter counts it as held from that moment until the next
report (`note`), so a burst for one adapter follows the first request of it instead of spreading
a load of it over every worker. Kept as one boolean column per adapter over the table's rows, so
"which candidates lack adapter a" is an array operation, not a step per worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class Residency:
    """Adapters held per row (rows as in the `LoadTable` that owns it). Event-loop thread
    only."""

    def __init__(self, num_rows: int = 0) -> None:
        self._held: list[frozenset[str]] = [frozenset()] * num_rows  # row -> its adapters
        self._columns: dict[str, np.ndarray] = {}  # adapter -> held, per row (capacity long)
        self._capacity = max(16, num_rows)

    @classmethod
    def of(cls, held: Iterable[Iterable[str]]) -> Residency:
        """One row per item of `held`, holding those adapters."""
        rows = [tuple(names) for names in held]
        residency = cls(len(rows))
        for row, names in enumerate(rows):
            if names:  # a row holding none is already so (most rows: no adapters served)
                residency.set(row, names)
        return residency

    def add_row(self) -> int:
        """A new row holding nothing."""
        row = len(self._held)
        self._held.append(frozenset())
        if row >= self._capacity:
            self._capacity *= 2
            for name, column in self._columns.items():
                self._columns[name] = np.concatenate(
                    [column, np.zeros(self._capacity - len(column), dtype=bool)])
        return row

    def set(self, row: int, names: Iterable[str]) -> None:
        """Row `row` holds exactly `names` (a report)."""
        held = frozenset(names)
        for name in self._held[row] - held:
            self._columns[name][row] = False
        for name in held - self._held[row]:
            self._column(name)[row] = True
        self._held[row] = held

    def note(self, row: int, name: str) -> None:
        """Row `row` holds `name` too (routed there; its next report says for sure)."""
        if name not in self._held[row]:
            self._held[row] = self._held[row] | {name}
            self._column(name)[row] = True

    def held(self, row: int) -> tuple[str, ...]:
        return tuple(sorted(self._held[row]))

    def lacks(self, rows: np.ndarray, name: str) -> np.ndarray:
        """Per row of `rows`, whether its worker would have to load `name` into a slot."""
        column = self._columns.get(name)
        return np.ones(len(rows), dtype=bool) if column is None else ~column[rows]

    def _column(self, name: str) -> np.ndarray:
        column = self._columns.get(name)
        if column is None:
            column = self._columns[name] = np.zeros(self._capacity, dtype=bool)
        return column
