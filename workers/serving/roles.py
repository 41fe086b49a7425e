"""A worker's role: which halves of a request it runs. No torch at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.core import Engine

# "both": prefill and decode here (aggregated; may also act as either side of a handoff).
# "prefill": prompts to their first token, then hands the KV off. "decode": continues handoffs.
ROLES = ("both", "prefill", "decode")
PREFILL_ROLES = ("both", "prefill")
DECODE_ROLES = ("both", "decode")


def check_role_fits_engine(role: str, engine: Engine) -> None:
    """Refuses a role that hands KV off ("prefill", "decode") to an engine whose KV cache
    neither this process nor its ranks' agents can serve (a GPU pipeline-parallel group keeps
    each stage's layers on its ranks); such an engine serves aggregated, as "both"."""
    if role == "both" or engine.kv_agent_hosts() is not None:
        return
    from workers.engine.parallel.executor import KVCacheNotShared

    try:
        engine.kv_caches_by_rank()
    except KVCacheNotShared as exc:
        raise ValueError(f"a worker of role {role!r} hands KV off, but {exc}") from None
