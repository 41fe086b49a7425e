"""`cleave serve --in-process` runs what the cluster config says, pool by pool (no Ray)."""

from __future__ import annotations

from cluster.config import CleaveConfig
from cluster.local_server import LocalServer
from cluster.settings import in_process_plan
from router.config import Deadlines


def test_each_pool_runs_its_own_engine_and_transfer_settings(tiny_model, monkeypatch):
    from workers.serving.worker import Worker

    built = {}
    from_config = Worker.from_config

    def record(worker_id, config, role="both", **options):
        built[worker_id] = options
        return from_config(worker_id, config, role, **options)

    monkeypatch.setattr(Worker, "from_config", record)
    config = CleaveConfig.parse({
        "model": {"path": tiny_model},
        "pools": {"prefill": {"engine": {"num_blocks": 32, "max_num_seqs": 4},
                              "step_timeout_s": 9.0},
                  "decode": {"engine": {"num_blocks": 64}}},
        "router": {"http_port": 18000, "grpc_port": 18001, "max_n": 3,
                   "policy_weights": {"w_hit": 2.0}, "prefill_timeout_s": 5.0,
                   "stall_timeout_s": 4.0},
        "kv_transfer": {"lease_s": 7.0, "pull_timeout_s": 3.0}})
    plan = in_process_plan(config, tiny_model)
    server = LocalServer(plan)  # builds the workers; not started: no ports taken
    try:
        prefill, decode = server.workers
        assert (prefill.worker_id, prefill.role, prefill.info.num_blocks) == (
            "prefill-0", "prefill", 32)
        assert prefill.engine.config.max_num_seqs == 4
        assert (decode.worker_id, decode.role, decode.info.num_blocks) == (
            "decode-0", "decode", 64)
        assert decode.engine.config.max_num_seqs == 128
        assert {w: (o["lease_s"], o["pull_timeout_s"]) for w, o in built.items()} == {
            "prefill-0": (7.0, 3.0), "decode-0": (7.0, 3.0)}
        assert server.router.config.max_n == 3
        assert prefill.async_engine.watchdog.timeout_s == 9.0
        assert decode.async_engine.watchdog.timeout_s == 60.0
        assert {c.deadlines for c in server.router.workers.clients.values()} == {
            Deadlines(prefill_s=5.0, stall_s=4.0)}
        assert dict(server.router.config.policy_options) == {"w_hit": 2.0}
    finally:
        for w in server.workers:
            w.engine.close()


def test_process_per_worker_pins_each_worker_and_serves_the_same_greedy_text(tiny_model,
                                                                            tmp_path,
                                                                            monkeypatch):
    """1 prefill + 1 decode worker, each in a process of its own on a core of its own, behind
    the router in this process: a handed-off request gives the offline engine's text, and
    stopping the server ends both processes and frees their cores."""
    import os

    import httpx

    from cluster.cpu_affinity import affinity_of, claim_cores
    from tests.cluster.conftest import free_ports
    from workers import LLM, SamplingParams

    monkeypatch.setenv("CLEAVE_CPU_CLAIM_DIR", str(tmp_path / "claims"))  # the children's too
    cores = sorted(os.sched_getaffinity(0))
    pool = {"engine": {"num_blocks": 64}, "cpu_affinity": cores}
    http, grpc = free_ports(2)
    config = CleaveConfig.parse({
        "model": {"path": tiny_model, "served_model_name": "tiny"},
        "pools": {"prefill": pool, "decode": pool},
        "router": {"http_port": http, "grpc_port": grpc, "disagg_threshold_tokens": 8}})
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    expected = LLM(tiny_model).generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    server = LocalServer(in_process_plan(config, tiny_model), process_per_worker=True).start()
    try:
        channels = [c.channel for c in server.clients]
        pids = [c.pid for c in channels]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        if len(cores) >= 2:  # each claimed a core of its own
            assert sorted(affinity_of(p) for p in pids) == [(cores[0],), (cores[1],)]
        out = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert out["choices"][0]["text"] == expected
        assert server.router.counters.num_disaggregated == 1
        # Nagle off on the router's end: with it on, a call written while another was
        # unanswered (a submit behind a long-polling next_outputs) waited ~40 ms for an ACK
        import socket

        assert all(c._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in channels)
    finally:
        server.stop()
    assert all(not c.process.is_alive() for c in channels)
    claim_cores(cores, len(cores)).release()  # every core is free again


def test_a_killed_worker_process_loses_no_stream(tiny_model):
    """Two aggregated workers in processes of their own: the one streaming a request is
    killed mid-stream; the stream moves to the other and the client gets the whole text."""
    import json
    import os
    import signal

    import httpx

    from tests.cluster.conftest import free_ports
    from workers import LLM, SamplingParams

    http, grpc = free_ports(2)
    config = CleaveConfig.parse({
        "model": {"path": tiny_model, "served_model_name": "tiny"},
        "pools": {"aggregated": {"replicas": {"min": 2, "max": 2, "initial": 2},
                                 "engine": {"num_blocks": 128}}},
        "router": {"http_port": http, "grpc_port": grpc}})
    prompt, max_tokens = "a stream that outlives its worker", 200
    expected = LLM(tiny_model).generate([prompt], SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    server = LocalServer(in_process_plan(config, tiny_model), process_per_worker=True).start()
    try:
        text, killed = "", None
        with httpx.stream("POST", f"http://127.0.0.1:{http}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if killed is None and len(text) > 10:
                    (wid,) = server.router.counters.first_tokens_by_worker
                    killed = next(c.channel for c in server.clients if c.worker_id == wid)
                    os.kill(killed.pid, signal.SIGKILL)
        assert killed is not None and text == expected
        assert server.router.counters.fallbacks.get("decode_worker_failed") == 1
    finally:
        server.stop()


def test_unpinned_worker_processes_share_the_cores_as_torch_threads():
    """One unpinned worker process gets every core (it had one thread: half a 2-core machine);
    several split them, at least one thread each."""
    from cluster.process_worker import share_of_cores

    assert share_of_cores(1, cores=2) == 2
    assert share_of_cores(2, cores=2) == 1
    assert share_of_cores(3, cores=8) == 2
    assert share_of_cores(4, cores=2) == 1
    assert share_of_cores(0, cores=4) == 4  # every worker pinned: unused
