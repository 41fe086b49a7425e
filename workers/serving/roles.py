"""A worker's role: which halves of a request it runs. No torch at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.engine.speculative.config import MTP_METHODS

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
    each stage's layers on its ranks); such an engine serves aggregated, as "both". A decode
    worker drafting with the checkpoint's MTP layer is refused: that layer reads the target's
    hidden states of the prompt, which the prefill worker computed and does not hand off
    (`workers.engine.speculative.mtp`)."""
    spec = engine.config.speculative
    if role == "decode" and spec is not None and spec.method in MTP_METHODS:
        raise ValueError(
            f"a worker of role 'decode' cannot draft with speculative_config method "
            f"{spec.method!r}: the multi-token-prediction layer reads the target's hidden "
            f"states of the prompt, which the prefill worker does not hand off; use another "
            f"method there, or serve this worker as 'both'")
    if role == "both" or engine.kv_agent_hosts() is not None:
        return
    from workers.engine.parallel.executor import KVCacheNotShared

    try:
        engine.kv_caches_by_rank()
    except KVCacheNotShared as exc:
        raise ValueError(f"a worker of role {role!r} hands KV off, but {exc}") from None
