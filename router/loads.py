"""Workers' loads as the routing policies read them. Torch-free.

A policy looks at every candidate's load for every request. At hundreds of workers one Python
object per worker per decision is the router's ceiling, so the loads are columns: `LoadTable`
holds numpy arrays (waiting, running, KV usage, pending prompt tokens, healthy, present) over
rows, one row per worker, the LoRA adapters each holds (`router.residency`), and a set of
candidate rows. The router's `WorkerSet` keeps one table
and updates a worker's row when its report arrives; a pool's loads are that table with the
pool's rows as candidates (no copy), so a decision costs a few array operations however many
workers there are.

A table is also a `Sequence[WorkerLoad]`: one record per candidate row on demand, for callers
that look at a few loads by hand. Any sequence of `WorkerLoad`s becomes a table
(`LoadTable.of`), so tests and simulations still pass lists.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from router.residency import Residency

class NoHealthyWorker(ValueError):
    """No candidate worker is healthy (or none was given)."""


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as last reported. `kv_usage` is the fraction of KV blocks in use, 0..1."""

    worker_id: str
    num_waiting: int  # requests queued, not yet scheduled
    num_running: int  # requests in the running batch
    kv_usage: float
    healthy: bool = True
    num_pending_prompt_tokens: int = 0  # prompt tokens queued or mid-prefill there
    # pulling a prefix block from another worker, as a fraction of recomputing it here
    # (measured; None: this worker fetches no prefixes)
    fetch_cost: float | None = None
    # a prefix hit in its host tier, as a fraction of recomputing the block (measured)
    host_hit_cost: float = 0.0
    # what one prefix fetch costs here whatever its size (the export call, reserving, two step
    # boundaries), in blocks of recompute (measured; 0.0 until then)
    fetch_fixed_blocks: float = 0.0
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters in its engine's device slots

    def __post_init__(self) -> None:
        if self.num_waiting < 0 or self.num_running < 0:
            raise ValueError(f"worker {self.worker_id!r}: num_waiting and num_running must be "
                             f">= 0, got {self.num_waiting} and {self.num_running}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id!r}: kv_usage must be in [0, 1], "
                             f"got {self.kv_usage}")
        if self.fetch_fixed_blocks < 0:
            raise ValueError(f"worker {self.worker_id!r}: fetch_fixed_blocks must be >= 0, "
                             f"got {self.fetch_fixed_blocks}")
        if not 0.0 <= self.host_hit_cost <= 1.0:
            raise ValueError(f"worker {self.worker_id!r}: host_hit_cost must be in [0, 1], "
                             f"got {self.host_hit_cost}")

    @property
    def queue_depth(self) -> int:
        return self.num_waiting + self.num_running


class LoadTable(Sequence[WorkerLoad]):
    """Loads as columns over rows (`ids[row]` is the row's worker; None: a row no longer used)
    and the candidate rows (`rows`, ascending). Tables made by `select`/`without` share the
    columns: they see later updates of the rows."""

    def __init__(self, ids: list[str | None], waiting: np.ndarray, running: np.ndarray,
                 kv_usage: np.ndarray, pending: np.ndarray, healthy: np.ndarray,
                 present: np.ndarray, rows: np.ndarray, index: dict[str, int],
                 fetch_cost: np.ndarray | None = None,
                 host_hit_cost: np.ndarray | None = None,
                 fetch_fixed: np.ndarray | None = None,
                 prefill_rate: np.ndarray | None = None,
                 residency: Residency | None = None,
                 pending_due: np.ndarray | None = None) -> None:
        self.ids = ids
        self.residency = Residency(len(ids)) if residency is None else residency
        # NaN: the row's worker fetches no prefixes
        self.fetch_cost = (np.full(len(waiting), np.nan) if fetch_cost is None
                           else fetch_cost)
        self.host_hit_cost = (np.zeros(len(waiting)) if host_hit_cost is None
                              else host_hit_cost)
        self.fetch_fixed = np.zeros(len(waiting)) if fetch_fixed is None else fetch_fixed
        # measured prefill seconds per prompt token (0.0: not measured yet)
        self.prefill_rate = np.zeros(len(waiting)) if prefill_rate is None else prefill_rate
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self.pending, self.healthy, self.present = pending, healthy, present
        # the prompt tokens a request with a deadline would wait behind there (`pending` when
        # the worker queues in arrival order)
        self.pending_due = pending.copy() if pending_due is None else pending_due
        self.rows = rows
        self.row_of = index  # worker id -> row (not `index`: that is Sequence.index)

    @classmethod
    def of(cls, loads: Sequence[WorkerLoad]) -> LoadTable:
        """`loads` as a table (itself when it is one). Raises `ValueError` on a worker id
        given twice."""
        if isinstance(loads, LoadTable):
            return loads
        ids = [load.worker_id for load in loads]
        index = {wid: row for row, wid in enumerate(ids)}
        if len(index) != len(ids):
            twice = next(w for w in ids if ids.count(w) > 1)
            raise ValueError(f"worker {twice!r} appears twice in loads; expected one WorkerLoad "
                             f"per worker")
        return cls(list(ids), np.array([x.num_waiting for x in loads], dtype=np.int64),
                   np.array([x.num_running for x in loads], dtype=np.int64),
                   np.array([x.kv_usage for x in loads], dtype=np.float64),
                   np.array([x.num_pending_prompt_tokens for x in loads], dtype=np.int64),
                   np.array([x.healthy for x in loads], dtype=bool),
                   np.ones(len(ids), dtype=bool), np.arange(len(ids)), index,
                   np.array([np.nan if x.fetch_cost is None else x.fetch_cost for x in loads],
                            dtype=np.float64),
                   np.array([x.host_hit_cost for x in loads], dtype=np.float64),
                   np.array([x.fetch_fixed_blocks for x in loads], dtype=np.float64),
                   residency=Residency.of(x.lora_adapters for x in loads))

    @classmethod
    def empty(cls) -> LoadTable:
        """A table of no rows, to `add` workers to."""
        return cls([], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                   np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64),
                   np.zeros(0, dtype=bool), np.zeros(0, dtype=bool),
                   np.zeros(0, dtype=np.int64), {})

    # ---- kept by the router's worker set (one table, rows updated in place) -----------------

    _COLUMNS = ("waiting", "running", "kv_usage", "pending", "healthy", "present", "fetch_cost",
                "host_hit_cost", "fetch_fixed", "prefill_rate", "pending_due")

    def add(self, worker_id: str) -> int:
        """A new row for `worker_id` (idle, healthy, present; the columns grow by doubling).
        Rows are never reused. `rows` is left as it is."""
        row = len(self.ids)
        if row == len(self.waiting):
            for name in self._COLUMNS:
                grown = np.zeros(max(16, 2 * row), dtype=getattr(self, name).dtype)
                grown[:row] = getattr(self, name)[:row]
                setattr(self, name, grown)
        self.ids.append(worker_id)
        self.residency.add_row()
        self.row_of[worker_id] = row
        self.healthy[row] = self.present[row] = True
        self.fetch_cost[row] = np.nan
        self.host_hit_cost[row] = self.fetch_fixed[row] = self.prefill_rate[row] = 0.0
        return row

    def remove(self, worker_id: str) -> None:
        """`worker_id`'s row is no longer present (tables read before still name it)."""
        row = self.row_of.pop(worker_id)
        self.ids[row] = None
        self.present[row] = self.healthy[row] = False
        self.residency.set(row, ())

    def report(self, worker_id: str, waiting: int, running: int, kv_usage: float,
               pending: int, healthy: bool, fetch_cost: float | None = None,
               host_hit_cost: float = 0.0, fetch_fixed_blocks: float = 0.0,
               prefill_s_per_token: float = 0.0, lora_adapters: Iterable[str] = (),
               pending_due: int | None = None) -> None:
        """A worker's reported load replaces its row."""
        row = self.row_of.get(worker_id)
        if row is not None:
            self.waiting[row], self.running[row] = waiting, running
            self.kv_usage[row] = min(1.0, max(0.0, kv_usage))
            self.pending[row], self.healthy[row] = pending, healthy
            self.pending_due[row] = pending if pending_due is None else pending_due
            self.fetch_cost[row] = np.nan if fetch_cost is None else fetch_cost
            self.host_hit_cost[row] = min(1.0, max(0.0, host_hit_cost))
            self.fetch_fixed[row] = max(0.0, fetch_fixed_blocks)
            self.prefill_rate[row] = max(0.0, prefill_s_per_token)
            self.residency.set(row, lora_adapters)

    def note_routed(self, worker_id: str, lora_name: str | None = None) -> None:
        """A request (under adapter `lora_name`, None: the base model) was just sent to
        the worker: it counts as waiting there, and the adapter as held, until its report."""
        row = self.row_of.get(worker_id)
        if row is not None:
            self.waiting[row] += 1
            if lora_name is not None:
                self.residency.note(row, lora_name)

    def rows_of(self, worker_ids: Iterable[str]) -> np.ndarray:
        """The rows of those of `worker_ids` that have one, ascending."""
        return np.array(sorted(self.row_of[w] for w in worker_ids if w in self.row_of),
                        dtype=np.int64)

    # ---- as a sequence of records --------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> WorkerLoad: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[WorkerLoad]: ...

    def __getitem__(self, i: int | slice) -> WorkerLoad | Sequence[WorkerLoad]:
        if isinstance(i, slice):
            return [self.load(int(r)) for r in self.rows[i]]
        return self.load(int(self.rows[i]))

    def load(self, row: int) -> WorkerLoad:
        """Row `row` as a record."""
        cost = float(self.fetch_cost[row])
        return WorkerLoad(self.ids[row] or "", int(self.waiting[row]), int(self.running[row]),
                          float(self.kv_usage[row]), bool(self.healthy[row]),
                          int(self.pending[row]), None if np.isnan(cost) else cost,
                          float(self.host_hit_cost[row]), float(self.fetch_fixed[row]),
                          self.residency.held(row))

    @property
    def worker_ids(self) -> list[str]:
        return [self.ids[r] or "" for r in self.rows]

    # ---- narrowing the candidates ---------------------------------------------------------

    def select(self, rows: np.ndarray) -> LoadTable:
        """The same columns with other candidate rows (ascending)."""
        return LoadTable(self.ids, self.waiting, self.running, self.kv_usage, self.pending,
                         self.healthy, self.present, rows, self.row_of, self.fetch_cost,
                         self.host_hit_cost, self.fetch_fixed, self.prefill_rate,
                         self.residency, self.pending_due)

    def with_healthy(self, healthy: np.ndarray) -> LoadTable:
        """The same candidates read against another healthy column."""
        return LoadTable(self.ids, self.waiting, self.running, self.kv_usage, self.pending,
                         healthy, self.present, self.rows, self.row_of, self.fetch_cost,
                         self.host_hit_cost, self.fetch_fixed, self.prefill_rate,
                         self.residency, self.pending_due)

    def without(self, worker_ids: Collection[str]) -> LoadTable:
        """The candidates that are still present (not removed since) and not in
        `worker_ids`."""
        keep = self.present[self.rows]  # a copy (fancy indexing)
        for wid in worker_ids:
            at = self.position(self.rows, wid)
            if at is not None:
                keep[at] = False
        return self.select(self.rows[keep])

    # ---- what policies compute -----------------------------------------------------------

    def healthy_rows(self) -> np.ndarray:
        """The healthy candidates' rows; raises `NoHealthyWorker` when there is none."""
        rows = self.rows[self.healthy[self.rows]]
        if not len(rows):
            raise NoHealthyWorker(f"no healthy worker among "
                                  f"{sorted(self.worker_ids) or 'no workers'}")
        return rows

    def depth(self, rows: np.ndarray) -> np.ndarray:
        """Queue depth (waiting + running) of `rows`, as floats."""
        return (self.waiting[rows] + self.running[rows]).astype(np.float64)

    def lacks(self, rows: np.ndarray, lora_name: str | None) -> np.ndarray:
        """Per row of `rows`, whether its worker would have to load adapter `lora_name` into
        a device slot first (all False for the base model)."""
        if lora_name is None:
            return np.zeros(len(rows), dtype=bool)
        return self.residency.lacks(rows, lora_name)

    def position(self, rows: np.ndarray, worker_id: str) -> int | None:
        """Where `worker_id`'s row is in `rows` (ascending), or None."""
        row = self.row_of.get(worker_id)
        if row is None:
            return None
        at = int(np.searchsorted(rows, row))
        return at if at < len(rows) and rows[at] == row else None

    def any_with_room(self, max_waiting: int, max_pending_tokens: int) -> bool | None:
        """Whether a healthy candidate has fewer than `max_waiting` requests and
        `max_pending_tokens` prompt tokens waiting; None when no candidate is healthy."""
        rows = self.rows[self.healthy[self.rows]]
        if not len(rows):
            return None
        return bool(np.any((self.waiting[rows] < max_waiting)
                           & (self.pending[rows] < max_pending_tokens)))

    def best_by_load(self, rows: np.ndarray) -> int:
        """The row among `rows` with the least (depth, waiting, kv usage, id)."""
        for key in (lambda r: self.waiting[r] + self.running[r], lambda r: self.waiting[r],
                    lambda r: self.kv_usage[r]):
            if len(rows) == 1:
                break
            column = key(rows)
            rows = rows[column == column.min()]
        if len(rows) == 1:
            return int(rows[0])
        return min(rows.tolist(), key=lambda r: self.ids[r] or "")
