"""Routing policies: which worker a prompt goes to, given the prefix index and the loads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.policy import (
    Decision,
    NoHealthyWorker,
    WorkerLoad,
    get_policy,
    registered_policies,
)
from router.prefix_index import PrefixIndex
from workers.contract.prefix_cache import BlockStored

PROMPT = list(range(1, 11))  # ten block hashes


def index_with(**held: int) -> PrefixIndex:
    """Each worker holds the first `n` blocks of PROMPT."""
    index = PrefixIndex()
    for worker, n in held.items():
        index.apply(worker, [BlockStored("e-" + worker, 0, tuple(PROMPT[:n]), None, (), 16)])
    return index


def load(worker_id: str, waiting: int = 0, running: int = 0, kv: float = 0.0,
         healthy: bool = True) -> WorkerLoad:
    return WorkerLoad(worker_id, waiting, running, kv, healthy)


IDLE = [load("a"), load("b"), load("c")]


def test_prefix_aware_picks_the_longest_cached_prefix() -> None:
    index = index_with(a=3, b=8, c=5)
    assert get_policy("prefix_aware").choose(PROMPT, IDLE, index) == Decision("b", 8)


def test_a_host_tier_hit_counts_what_it_saves_at_the_workers_measured_cost() -> None:
    index = index_with(b=5)  # b: five blocks in its device pool
    index.apply("a", [BlockStored("e-a", 0, tuple(PROMPT[:8]), None, (), 16, medium="host")])
    policy = get_policy("prefix_aware")

    def a_at(cost: float) -> WorkerLoad:  # a's measured cost of a host hit, in its load
        return WorkerLoad("a", 0, 0, 0.0, host_hit_cost=cost)

    # eight host blocks save four blocks of prefill
    assert policy.choose(PROMPT, [a_at(0.5), load("b")], index) == Decision("b", 5)
    # cheap copies: 7.2 blocks saved beat b's 5
    assert policy.choose(PROMPT, [a_at(0.1), load("b")], index) == Decision("a", 8)
    with pytest.raises(ValueError, match="host_hit_cost must be in"):
        a_at(1.5)


def test_prefix_aware_keeps_a_busy_holder_but_leaves_an_overloaded_one() -> None:
    index = index_with(a=10)
    policy = get_policy("prefix_aware")
    busy = [load("a", waiting=6, running=10), load("b", running=8), load("c", running=8)]
    assert policy.choose(PROMPT, busy, index).worker_id == "a"
    overloaded = [load("a", waiting=60, running=16), load("b", running=8),
                  load("c", waiting=1, running=8)]
    assert policy.choose(PROMPT, overloaded, index) == Decision("b", 0)


def test_prefix_aware_weights_are_configurable() -> None:
    index = index_with(a=10)
    loads = [load("a", waiting=3), load("b")]
    assert get_policy("prefix_aware").choose(PROMPT, loads, index).worker_id == "a"
    assert get_policy("prefix_aware", w_hit=0.0).choose(PROMPT, loads, index).worker_id == "b"
    assert get_policy("prefix_aware", queue_scale=1.0, w_queue=2.0).choose(
        PROMPT, loads, index).worker_id == "b"


def test_prefix_aware_prefers_free_kv_then_lighter_load_then_smaller_id() -> None:
    index = index_with(a=4, b=4, c=4)
    policy = get_policy("prefix_aware")
    assert policy.choose(PROMPT, [load("a", kv=0.9), load("b", kv=0.2), load("c", kv=0.5)],
                         index).worker_id == "b"
    assert policy.choose(PROMPT, [load("c"), load("b"), load("a")], index) == Decision("a", 4)
    assert policy.choose([], IDLE, index) == Decision("a", 0)


def test_least_loaded_picks_the_lightest_and_reports_its_hits() -> None:
    index = index_with(a=10, c=2)
    loads = [load("a", waiting=2, running=4), load("b", running=5), load("c", running=3)]
    assert get_policy("least_loaded").choose(PROMPT, loads, index) == Decision("c", 2)
    ties = [load("a", running=2), load("b", waiting=1, running=1), load("c", running=2, kv=0.1)]
    assert get_policy("least_loaded").choose(PROMPT, ties, index) == Decision("a", 10)


def test_round_robin_cycles_over_healthy_workers_in_id_order() -> None:
    index, policy = index_with(), get_policy("round_robin")
    assert [policy.choose(PROMPT, IDLE, index).worker_id for _ in range(4)] == list("abca")
    with_sick_c = [load("a"), load("b"), load("c", healthy=False)]
    assert [policy.choose(PROMPT, with_sick_c, index).worker_id for _ in range(3)] == list("bab")
    grown = [*IDLE, load("d")]
    assert [policy.choose(PROMPT, grown, index).worker_id for _ in range(3)] == list("cda")


@pytest.mark.parametrize("name", ["prefix_aware", "least_loaded", "round_robin"])
def test_unhealthy_workers_are_never_chosen(name: str) -> None:
    index = index_with(a=10)
    loads = [load("a", healthy=False), load("b", waiting=9), load("c", healthy=False)]
    policy = get_policy(name)
    assert {policy.choose(PROMPT, loads, index).worker_id for _ in range(3)} == {"b"}
    with pytest.raises(NoHealthyWorker, match="no healthy worker"):
        policy.choose(PROMPT, [load("a", healthy=False)], index)
    with pytest.raises(ValueError):  # NoHealthyWorker is a ValueError
        policy.choose(PROMPT, [], index)


@given(loads=st.lists(st.builds(WorkerLoad, st.sampled_from("abcdef"), st.integers(0, 50),
                                st.integers(0, 50), st.floats(0, 1), st.booleans()),
                      min_size=1, max_size=6, unique_by=lambda w: w.worker_id),
       held=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 10)),
       name=st.sampled_from(["prefix_aware", "least_loaded", "round_robin"]))
def test_any_decision_names_a_healthy_candidate(loads: list[WorkerLoad], held: dict[str, int],
                                                name: str) -> None:
    index = index_with(**held)
    healthy = {w.worker_id for w in loads if w.healthy}
    policy = get_policy(name)
    if not healthy:
        with pytest.raises(NoHealthyWorker):
            policy.choose(PROMPT, loads, index)
        return
    decision = policy.choose(PROMPT, loads, index)
    assert decision.worker_id in healthy
    assert decision.predicted_hit_blocks == held.get(decision.worker_id, 0)


def test_bad_loads_are_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match="kv_usage must be in \\[0, 1\\], got 1.5"):
        load("a", kv=1.5)
    with pytest.raises(ValueError, match="got -1 and 0"):
        load("a", waiting=-1)


def test_duplicate_workers_in_loads_are_rejected() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        get_policy("least_loaded").choose(PROMPT, [load("a"), load("a")], index_with())


def test_policies_are_registered_by_name() -> None:
    assert registered_policies() == ["least_loaded", "prefix_aware", "round_robin"]
    assert get_policy("prefix_aware").name == "prefix_aware"
    with pytest.raises(ValueError, match="least_loaded, prefix_aware, round_robin"):
        get_policy("random")
    with pytest.raises(ValueError, match="w_bogus"):
        get_policy("prefix_aware", w_bogus=1.0)
    with pytest.raises(ValueError, match="w_queue must be >= 0, got -1"):
        get_policy("prefix_aware", w_queue=-1)
    with pytest.raises(ValueError, match="queue_scale"):
        get_policy("prefix_aware", queue_scale=0)


def _prefix_aware_one_by_one(loads: list[WorkerLoad], hits: dict[str, int]) -> str:
    """The prefix-aware score written out worker by worker, as the policy's docstring states
    it (defaults: w_hit 1, w_queue 0.5, w_kv 0.1, queue_scale 8)."""
    healthy = [w for w in loads if w.healthy]
    depths = [w.queue_depth for w in healthy]
    queue_weight = 0.5 / max(sum(depths) / len(depths), 8.0)
    return min(healthy, key=lambda w: (
        -(1.0 / len(PROMPT) * hits.get(w.worker_id, 0) - queue_weight * w.queue_depth
          - 0.1 * w.kv_usage), w.queue_depth, w.num_waiting, w.kv_usage, w.worker_id)).worker_id


@given(loads=st.lists(st.builds(WorkerLoad, st.sampled_from("abcdefgh"), st.integers(0, 9),
                                st.integers(0, 9), st.sampled_from([0.0, 0.25, 0.5, 1.0]),
                                st.booleans()),
                      min_size=1, max_size=8, unique_by=lambda w: w.worker_id),
       held=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 10)))
def test_the_column_policies_choose_as_the_formula_does_worker_by_worker(
        loads: list[WorkerLoad], held: dict[str, int]) -> None:
    """Ties included (few distinct values): the array form picks the same worker."""
    if not any(w.healthy for w in loads):
        return
    index = index_with(**held)
    assert get_policy("prefix_aware").choose(PROMPT, loads, index).worker_id == \
        _prefix_aware_one_by_one(loads, held)
    lightest = min((w for w in loads if w.healthy),
                   key=lambda w: (w.queue_depth, w.num_waiting, w.kv_usage, w.worker_id))
    assert get_policy("least_loaded").choose(PROMPT, loads, index).worker_id == \
        lightest.worker_id
