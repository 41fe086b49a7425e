""""Hand off or run here": whether a request of a deployment with prefill workers is split
between a prefill and a decode worker (disaggregated) or runs whole on a decode-pool worker.
Torch-free.

Policies are registered by name (`get_split_policy("uncached_threshold", threshold_tokens=64)`)
and chosen by `RouterConfig.disagg_policy`. A policy sees the request and what the routing
policy predicted the chosen prefill worker holds, and returns why it should run here (the
reason `RouterCounters.aggregated` counts it under), or None to hand it off. What a handoff
cannot carry (n > 1, prompt logprobs) and the lack of a healthy prefill worker are decided
before any policy is asked (`router.orchestrator`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from router.registry import Registry
from workers.contract.protocol import WorkerRequest


class SplitPolicy(ABC):
    """Decides per request whether to hand it off. Holds no per-request state."""

    name: str

    def __init__(self, threshold_tokens: int = 0) -> None:
        """`threshold_tokens`: `RouterConfig.disagg_threshold_tokens` (for the policies that
        read it; the others keep nothing, so this base constructor ignores it)."""
        return None

    @abstractmethod
    def run_here(self, req: WorkerRequest, predicted_cached_tokens: int) -> str | None:
        """Why `req` should run whole on a decode-pool worker, or None to hand it off.
        `predicted_cached_tokens`: prompt tokens the prefill worker is predicted to hold."""


SPLIT_POLICY_CLASSES: Registry[type[SplitPolicy]] = Registry("disagg policy")
register_split_policy = SPLIT_POLICY_CLASSES.register


def registered_split_policies() -> list[str]:
    return SPLIT_POLICY_CLASSES.names()


def get_split_policy(name: str, *, threshold_tokens: int = 0) -> SplitPolicy:
    """A policy by registered name. `threshold_tokens`: `RouterConfig.disagg_threshold_tokens`
    (read by the policies that use it)."""
    return SPLIT_POLICY_CLASSES.get(name)(threshold_tokens)


@register_split_policy("uncached_threshold")
class UncachedThreshold(SplitPolicy):
    """Hand off when at least `threshold_tokens` of the prompt are not predicted cached: a
    short prefill costs the decode worker less than the handoff would ("short_prompt")."""

    def __init__(self, threshold_tokens: int = 0) -> None:
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {threshold_tokens}")
        self.threshold_tokens = threshold_tokens

    def run_here(self, req: WorkerRequest, predicted_cached_tokens: int) -> str | None:
        uncached = len(req.prompt_token_ids) - predicted_cached_tokens
        return "short_prompt" if uncached < self.threshold_tokens else None


@register_split_policy("always")
class AlwaysHandOff(SplitPolicy):
    """Hand off every request a handoff can carry, however short its prompt."""

    def run_here(self, req: WorkerRequest, predicted_cached_tokens: int) -> str | None:
        return None


@register_split_policy("never")
class NeverHandOff(SplitPolicy):
    """Run every request whole on a decode-pool worker ("policy"): the prefill pool idles."""

    def run_here(self, req: WorkerRequest, predicted_cached_tokens: int) -> str | None:
        return "policy"


__all__ = ["SplitPolicy", "get_split_policy", "register_split_policy",
           "registered_split_policies"]
