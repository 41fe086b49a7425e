"""The directory of workers: a draining worker stays draining through its heartbeats (with the
way its streams move), until it is put back in rotation or removed."""

from __future__ import annotations

from cluster.directory import Directory, WorkerEntry


def _entry(wid: str = "decode-a") -> WorkerEntry:
    return WorkerEntry(wid, "decode", "decode", actor=None, node_id="n1")


def test_a_drain_survives_heartbeats_until_the_worker_is_put_back():
    d = Directory()
    d.register(_entry())
    d.set_draining("decode-a", with_kv=False)
    d.register(_entry())  # the replica's next heartbeat says nothing of draining
    (entry,) = d.entries()
    assert entry.draining and not entry.drain_with_kv
    d.undrain("decode-a")
    d.register(_entry())
    (entry,) = d.entries()
    assert not entry.draining and entry.drain_with_kv


def test_draining_or_undraining_an_unknown_worker_changes_nothing():
    d = Directory()
    d.set_draining("nope")
    d.undrain("nope")
    assert d.entries() == []


def test_a_switched_workers_role_survives_its_heartbeats():
    d = Directory()
    d.register(WorkerEntry("agg-a", "aggregated", "both", actor=None, node_id="n1"))
    d.assign_role("agg-a", "prefill")
    d.register(WorkerEntry("agg-a", "aggregated", "both", actor=None, node_id="n1"))
    (entry,) = d.entries()
    assert entry.assigned_role == "prefill"
    d.assign_role("nope", "prefill")
    assert [e.worker_id for e in d.entries()] == ["agg-a"]
