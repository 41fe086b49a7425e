"""Prefix fetch, the router's half: when the routing decision names another worker whose
device pool holds more of the prompt's leading blocks (`router.policy.Decision.fetch_from`),
that worker offers them under a lease (`WorkerClient.export_prefix`) and the chosen worker pulls
them before computing the rest (`workers.serving.prefix_fetch`). Torch-free.

Whether a pull pays is the policy's call, from each worker's measured costs
(`router.workers.fetch_cost`); here it is carried out and counted (`RouterCounters`): the
fetches, the blocks offered, those the request then found, and the prefill seconds predicted
saved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from router.counters import RouterCounters
from router.policy import Decision
from router.workers import WorkerSet
from workers.contract.messages import PrefixFetch
from workers.contract.protocol import WorkerRequest

logger = logging.getLogger(__name__)


async def prefix_to_fetch(workers: WorkerSet, counters: RouterCounters, req: WorkerRequest,
                          hashes: Sequence[int], decision: Decision) -> PrefixFetch | None:
    """The prefix the decision says to pull, offered by its holder; None when there is none,
    or the holder is gone, failing or no longer holds it (the prompt is then computed: nothing
    is lost but the saving)."""
    source = workers.clients.get(decision.fetch_from or "")
    if source is None or decision.fetch_blocks <= decision.predicted_hit_blocks:
        return None
    wanted = tuple(hashes[:decision.fetch_blocks])
    try:
        handoff = await source.export_prefix(req.request_id, wanted,
                                             workers.info(decision.worker_id).tp_size)
    except Exception as exc:  # noqa: BLE001 -- any failure of the holder: compute instead
        logger.warning("prefix export for %s from %s failed: %r", req.request_id,
                       source.worker_id, exc)
        handoff = None
    if handoff is None:
        counters.count_fallback("prefix_fetch_failed")
        return None
    num_blocks = len(handoff.ranks[0].block_ids)
    counters.num_prefix_fetches += 1
    counters.prefix_fetch_blocks += num_blocks
    counters.prefix_fetch_predicted_saved_s += workers.fetch_saving_s(
        decision.worker_id, num_blocks - decision.predicted_hit_blocks)
    return PrefixFetch(handoff, wanted[:num_blocks])
