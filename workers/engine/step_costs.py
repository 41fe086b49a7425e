"""What an engine's work costs, measured from its own steps: the router weighs a prefix hit in
the host tier, and a prefix pulled from another worker, against recomputing it with these.

Moving averages of: the seconds per prompt token of steps that prefill (their time less their
tier copies, over their batched tokens: prefill dominates such steps), and the seconds per block
of the steps' copies between the KV cache and its host tier. Until a figure is measured it is
None, and what depends on it takes its stated prior.
"""

from __future__ import annotations

from workers.engine.kv_cache.host_tier import BlockCopies

WEIGHT = 0.2  # of each new sample in the moving averages
# prefill steps with fewer prompt tokens than this many blocks' worth do not count: their time
# is mostly per step and per sequence (a prefix fetch's tail of a few tokens measured 2x a
# long prompt's seconds per token)
PREFILL_MIN_BLOCKS = 4


def _mix(old: float | None, sample: float) -> float:
    return sample if old is None else old + WEIGHT * (sample - old)


class StepCosts:
    # a host hit before its copy time is measured: neither free nor a recompute
    HOST_HIT_PRIOR = 0.5

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefill_s_per_token: float | None = None
        self.copy_s_per_block: float | None = None
        self.num_prompt_tokens_computed = 0  # since start: prompt (not decode) tokens run

    def record_step(self, seconds: float, copy_seconds: float, copies: BlockCopies,
                    num_batched_tokens: int, num_decodes: int) -> None:
        """One step: `seconds` in all, `copy_seconds` of it making `copies`. Steps with fewer
        than `PREFILL_MIN_BLOCKS` blocks' worth of prompt tokens do not count toward the
        prefill rate."""
        self.num_prompt_tokens_computed += num_batched_tokens - num_decodes
        num_copied = len(copies.swap_out) + len(copies.swap_in)
        if num_copied:
            self.copy_s_per_block = _mix(self.copy_s_per_block, copy_seconds / num_copied)
        if num_batched_tokens - num_decodes >= PREFILL_MIN_BLOCKS * self.block_size:
            self.prefill_s_per_token = _mix(self.prefill_s_per_token,
                                            max(seconds - copy_seconds, 0.0)
                                            / num_batched_tokens)

    @property
    def host_hit_cost(self) -> float:
        """A host-tier hit as a fraction of recomputing the block, in [0, 1]."""
        if not self.copy_s_per_block or not self.prefill_s_per_token:
            return self.HOST_HIT_PRIOR
        return min(1.0, self.copy_s_per_block / (self.prefill_s_per_token * self.block_size))
