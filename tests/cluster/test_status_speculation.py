"""`cleave status` shows each speculating worker's method, drafted tokens, acceptance rate and
mean accepted length (from the stats the router holds), and nothing for workers that do not
speculate."""

from __future__ import annotations

from cluster.status import format_status, speculation
from workers.contract.protocol import EngineStats


def stats(**counters: object) -> EngineStats:
    return EngineStats(num_waiting=0, num_running=1, kv_usage=0.5, num_free_blocks=8,
                       num_cached_blocks=0, num_blocks=16, **counters)


def worker(worker_id: str, spec: dict | None) -> dict:
    return {"worker_id": worker_id, "role": "decode", "healthy": True, "draining": False,
            "num_waiting": 0, "num_running": 1, "kv_usage": 0.5, "speculative": spec}


def test_status_shows_the_acceptance_rate_of_speculating_workers():
    drafting = speculation(stats(speculative_method="draft_model", num_draft_tokens=200,
                                  num_accepted_tokens=150, num_drafts=50))
    assert drafting is not None and drafting["acceptance_rate"] == 0.75
    assert drafting["mean_accepted_length"] == 4.0  # 150 accepted over 50 drafts, and 1 more
    assert speculation(stats()) is None and speculation(None) is None
    idle = speculation(stats(speculative_method="ngram"))
    report = {"application": "RUNNING", "model": "tiny", "deployments": {}, "router": "r0",
              "workers": [worker("d0", drafting), worker("d1", None), worker("d2", idle)],
              "num_requests": 3, "num_prompt_tokens": 10, "prefix_hit_rate": None,
              "predicted_prefix_hit_rate": None, "fallbacks": {}}
    lines = format_status(report).splitlines()
    at = [i for i, line in enumerate(lines) if line.strip().startswith("d")]
    assert lines[at[0] + 1].strip() == ("speculative draft_model: 200 drafted tokens verified, "
                                        "75.0% accepted, mean accepted length 4.00")
    assert lines[at[1] + 1].strip().startswith("d2")  # d1 does not speculate: no line
    assert lines[at[2] + 1].strip() == ("speculative ngram: 0 drafted tokens verified, - accepted, "
                                        "mean accepted length -")
