"""`cleave status` lists the LoRA adapters in each worker's device slots (from the load reports
the router holds), and nothing for a worker holding none."""

from __future__ import annotations

from cluster.status import format_status


def worker(worker_id: str, adapters: list[str]) -> dict:
    return {"worker_id": worker_id, "role": "both", "healthy": True, "draining": False,
            "num_waiting": 0, "num_running": 1, "kv_usage": 0.5, "speculative": None,
            "lora_adapters": adapters}


def test_status_shows_the_adapters_each_worker_holds():
    report = {"application": "RUNNING", "model": "tiny", "deployments": {}, "router": "r0",
              "workers": [worker("gpu0", ["sql", "chat"]), worker("gpu1", [])],
              "num_requests": 3, "num_prompt_tokens": 10, "prefix_hit_rate": None,
              "predicted_prefix_hit_rate": None, "fallbacks": {}}
    lines = format_status(report).splitlines()
    at = [i for i, line in enumerate(lines) if line.strip().startswith("gpu")]
    assert lines[at[0] + 1].strip() == "lora adapters in slots: sql, chat"
    assert lines[at[0] + 2].strip().startswith("gpu1")
    assert lines[at[1] + 1].startswith("requests 3")  # gpu1 holds none: no line
