"""`cleave serve --in-process` runs what the cluster config says, pool by pool (no Ray)."""

from __future__ import annotations

from cluster.config import CleaveConfig
from cluster.local_server import LocalServer
from cluster.settings import in_process_plan
from router.config import Deadlines


def test_each_pool_runs_its_own_engine_and_transfer_settings(tiny_model, monkeypatch):
    from workers.worker import Worker

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
        assert (prefill.worker_id, prefill.role, prefill.num_blocks) == ("prefill-0", "prefill",
                                                                          32)
        assert prefill.engine.config.max_num_seqs == 4
        assert (decode.worker_id, decode.role, decode.num_blocks) == ("decode-0", "decode", 64)
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
