"""A worker's options besides its engine (`workers.serving.worker.Worker`'s keywords), each
defined once (`workers.contract.setting`); the cluster config and flags are derived from them."""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.setting import check_settings, setting

TRANSPORTS = ("tcp", "ucx", "nccl")  # `kvtransfer.TRANSPORTS`


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker's KV moves and how much it takes on."""

    transport: str = setting("tcp", (
        "How KV blocks move from prefill to decode workers (nccl runs on gloo with CPU "
        "caches)."), choices=TRANSPORTS, flag=("--kv-transport",))
    lease_s: float = setting(30.0, (
        "How long prefilled blocks wait for their decode worker at most."), gt=0,
        flag=("--kv-lease-s",))
    pull_timeout_s: float = setting(10.0, "How long a decode waits for its KV.", gt=0,
                                    flag=("--kv-pull-timeout-s",))
    step_timeout_s: float = setting(60.0, (
        "A worker whose engine step runs longer fails its health check and leaves routing "
        "(its streams move to other workers) until the step returns."), gt=0, section="pool")
    max_waiting_requests: int = setting(2048, (
        "Requests a worker queues at most; more are refused as overloaded (the router tries "
        "another worker, or answers 429 when every one is full)."), ge=1, section="pool")

    def __post_init__(self) -> None:
        check_settings(self)
