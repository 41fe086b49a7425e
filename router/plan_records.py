"""The SLO planner's records: the targets, the traffic as request classes, the pools' bounds,
what one planning tick knows (`PlanInput`) and what it decides (`Plan`). Torch-free; the model
that turns one into the other is `router.planner`'s."""

from __future__ import annotations

from dataclasses import dataclass

from router.profiles import StepProfile


@dataclass(frozen=True)
class SloTargets:
    """The latency targets: `ttft_s` and `itl_s` at `percentile` (0..1)."""

    ttft_s: float
    itl_s: float
    percentile: float = 0.9
    # the slowest inter-token gap a stream tolerates (another prompt prefilled on its worker),
    # in ITL targets
    max_gap_itl: float = 5.0
    # the mean ITL the planner plans for, as a fraction of the target: requests' own means
    # spread around the pool's (their workers' loads differ), and the target bounds a
    # percentile of them
    itl_headroom: float = 0.85

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft_s={self.ttft_s}, "
                             f"itl_s={self.itl_s}")
        if not 0 < self.percentile < 1:
            raise ValueError(f"percentile must be in (0, 1), got {self.percentile}")
        if self.max_gap_itl < 1:
            raise ValueError(f"max_gap_itl must be >= 1, got {self.max_gap_itl}")
        if not 0 < self.itl_headroom <= 1:
            raise ValueError(f"itl_headroom must be in (0, 1], got {self.itl_headroom}")


@dataclass(frozen=True)
class RequestClass:
    """Requests alike: `rate` per second, `prompt_tokens` uncached, `output_tokens`."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a request class needs rate >= 0 and prompt and output tokens "
                             f">= 1, got {self}")


@dataclass(frozen=True)
class PoolBounds:
    min_prefill: int = 0
    max_prefill: int = 1 << 20
    min_decode: int = 1
    max_decode: int = 1 << 20
    max_workers: int = 1 << 21  # both pools together

    def __post_init__(self) -> None:
        if self.max_workers < self.min_prefill + self.min_decode:
            raise ValueError(f"max_workers must be >= min_prefill + min_decode, got "
                             f"{self.max_workers}")
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"need 0 <= min_prefill <= max_prefill, got {self.min_prefill} "
                             f"and {self.max_prefill}")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"need 1 <= min_decode <= max_decode, got {self.min_decode} and "
                             f"{self.max_decode}")


@dataclass(frozen=True)
class PlanInput:
    """What one planning tick knows."""

    classes: tuple[RequestClass, ...]
    profile: StepProfile
    targets: SloTargets
    bounds: PoolBounds = PoolBounds()
    # prompt tokens queued now (as the workers pushed them): work to clear within the TTFT
    # target on top of the arrivals, by the pool that prefills the longest prompts
    backlog_tokens: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Workers per pool and the router's threshold (`RouterConfig.disagg_threshold_tokens`),
    with what the model predicts for them and why."""

    prefill: int
    decode: int  # decode-pool workers (they also run the prompts under the threshold)
    threshold_tokens: int  # AGGREGATED: no prompt is handed off
    feasible: bool  # False: the bounds do not allow meeting the targets; the plan is the max
    ttft_s: float  # predicted, at the percentile, for the worst class
    itl_s: float  # predicted mean inter-token latency
    reason: str
    gap_s: float = 0.0  # predicted slowest gap: a decode step with a prompt run whole in it

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


__all__ = ["Plan", "PlanInput", "PoolBounds", "RequestClass", "SloTargets"]
