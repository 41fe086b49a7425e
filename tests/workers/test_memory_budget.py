"""`gpu_memory_utilization` is a fraction of the device's total memory (vLLM's meaning), checked
on the budget arithmetic with fake memory readings; and a `cuda:N` engine runs its steps on
device N."""

from __future__ import annotations

import contextlib

import pytest
import torch

from workers.engine import memory_profile, runner

GIB = 1 << 30


def test_budget_is_a_fraction_of_total_memory_not_of_free(monkeypatch):
    # 80 GiB device; after the profile step: 20 GiB torch peak, 22 GiB reserved by torch,
    # 3 GiB outside torch (context, another process), so 55 GiB free
    readings = {"peak": 20 * GIB, "reserved": 22 * GIB, "free": 55 * GIB, "total": 80 * GIB}
    cuda = torch.cuda
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(cuda, name, lambda *a: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: readings["peak"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a: readings["reserved"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (readings["free"], readings["total"]))
    monkeypatch.setattr(memory_profile, "run_profile_step", lambda *a: None)
    graphs = []  # (graph_batch_size) asked of the graph profile
    monkeypatch.setattr(memory_profile, "graph_profile",
                        lambda *a, graph_batch_size, **k: graphs.append(graph_batch_size) or 0)

    def budget(utilization):
        return memory_profile.gpu_kv_budget(
            None, None, torch.device("cuda"), utilization=utilization, num_tokens=8,
            max_model_len=8, block_size=4, max_num_seqs=1)

    # 0.9 x 80 = 72 GiB for everything: 72 - 20 (peak) - 3 (outside torch) = 49 GiB
    assert budget(0.9) == int(80 * GIB * 0.9) - 20 * GIB - 3 * GIB
    # a fraction of free memory would have given 0.9 x 55 - 20 - 3 = 26.5 GiB
    assert budget(0.5) == 40 * GIB - 23 * GIB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        budget(0.25)  # 20 GiB < 23 GiB already used
    assert graphs == [0, 0, 0]  # no graphs asked for: none measured


def test_budget_takes_off_what_the_largest_graph_holds(monkeypatch):
    cuda = torch.cuda
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(cuda, name, lambda *a: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: 20 * GIB)
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a: 20 * GIB)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(memory_profile, "run_profile_step", lambda *a: None)
    asked = []

    def graph_profile(model, caches_for, device, *, max_seq_len, graph_batch_size):
        asked.append((max_seq_len, graph_batch_size))
        return 2 * GIB

    monkeypatch.setattr(memory_profile, "graph_profile", graph_profile)
    got = memory_profile.gpu_kv_budget(
        None, None, torch.device("cuda"), utilization=0.5, num_tokens=8, max_model_len=64,
        block_size=4, max_num_seqs=8, graph_batch_size=8)
    assert asked == [(64, 8)]
    assert got == 40 * GIB - 20 * GIB - 2 * GIB
    with pytest.raises(ValueError, match="CUDA graphs \\(2.0 GiB\\)"):
        memory_profile.gpu_kv_budget(
            None, None, torch.device("cuda"), utilization=0.26, num_tokens=8,
            max_model_len=64, block_size=4, max_num_seqs=8, graph_batch_size=8)
    with pytest.raises(ValueError, match="graph_bytes must be >= 0, got -1"):
        memory_profile.kv_budget_bytes(80 * GIB, GIB, 0, 0.5, -1)


def test_budget_rejects_a_utilization_outside_0_1():
    with pytest.raises(ValueError, match="utilization must be in \\(0, 1\\], got 1.5"):
        memory_profile.kv_budget_bytes(80 * GIB, GIB, 0, 1.5)


def test_steps_on_cuda_n_make_device_n_current(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    with runner.device_guard(torch.device("cuda:1")):
        pass
    with runner.device_guard(torch.device("cpu")), runner.device_guard(torch.device("cuda")):
        pass
    assert entered == [torch.device("cuda:1")]
