"""The fault-injection soak's deterministic subset (`benchmarks/soak.py --quick`): the Ray
application with two prefill and two decode replicas of the tiny model, a mixed workload, each
server fault injected once in a fixed order (prefill and decode replicas killed, a KV pull failed
and one stalled past its timeout, an engine step hung past the watchdog, the router and the
directory replicas killed, a pool scaled down and up), 2 s apart (the script's default is 4 s:
the faults overlap more, each still injected once, and the run takes ~18 s less), hostile input
and client disconnects, cancels and deadlines. What a user and an operator would notice: no
request hangs or gets wrong output, refusals are clear, nothing is left held, and stopping leaves
no Ray process."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benchmarks.conftest import BENCHMARKS


def test_soak_subset_ends_every_request_and_leaves_nothing_behind(tmp_path, tiny_model):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "soak.py"), "--quick", "--duration-s", "60",
         "--fault-interval-s", "2", "--concurrency", "4", "--prompts", "12", "--model", str(tiny_model), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    outcomes = result["by_outcome"]
    assert outcomes.get("ok", 0) > 50, outcomes
    for bad in ("hung", "wrong", "error"):
        assert outcomes.get(bad, 0) == 0, (bad, result["examples_of_failures"])
    assert not result["faults_not_handled"], result["faults_not_handled"]
    server_faults = {"kill_prefill", "kill_decode", "kv_pull_raise", "kv_pull_stall",
                     "step_stall", "kill_router", "kill_directory", "scale_down_up"}
    injected = set(result["faults_by_kind"]) | {f.split(":")[0]
                                                for f in result["faults_skipped"]}
    assert server_faults <= injected, result["faults_by_kind"]
    assert len(result["faults_skipped"]) <= 1, result["faults_skipped"]
    assert result["blocks_leaked"] == 0, result["workers_settled"]
    assert result["leases_outstanding"] == 0
    assert result["engine_actors_alive"] == 4  # killed ones replaced, none left over
    assert result["shm_files_left"] == []
    assert result["ray_processes_left"] == 0
    assert result["router_slots_held_after"] == 0
