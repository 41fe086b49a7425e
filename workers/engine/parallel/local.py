"""The model in this process (`LocalExecutor`) and what every executor is (`ModelExecutor`).

Separate from `workers.engine.parallel.executor` (which re-exports both) so that code a rank runs,
the CUDA-graph executor among it, can build on `LocalExecutor` without importing the driver's
`GroupExecutor`, which imports the rank.
"""

from __future__ import annotations

import abc
import time

from typing import TYPE_CHECKING

import torch

from kvtransfer.remote_messages import AgentHostAddress
from workers.engine.kv_cache.host_caches import HostCaches
from workers.engine.parallel.messages import SampledTokens, StepMessage
from workers.engine.parallel.pipeline import MicroBatch, microbatch_tensors
from workers.engine.step_inputs import TokenFill, fill_input_ids

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM
    from workers.models.lora import AdapterSlots


class ModelExecutor(abc.ABC):
    @abc.abstractmethod
    def execute(self, msg: StepMessage) -> torch.Tensor:
        """Runs the step (writing its K/V into the cache); returns the logits of
        `msg.logit_rows`, [len(logit_rows), vocab_size] float32, on the driver's device or
        the CPU (a group's; the runner moves them)."""

    @abc.abstractmethod
    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        """Per TP rank, per layer (all stages): `[2, num_blocks, block_size, heads, head_dim]`
        with `heads` that rank's KV heads. Shared with the ranks: writes land in their cache.
        Raises `KVCacheNotShared` where this process cannot reach the cache (GPU ranks)."""

    def close(self) -> None:  # noqa: B027 -- a default: an executor may hold nothing to stop
        """Stop whatever runs the model (idempotent)."""

    def agent_hosts(self) -> list[AgentHostAddress] | None:
        """Per TP rank, where that rank's own KV transfer agent is hosted (it serves and pulls
        its shard); None where this process's agents serve the caches
        (`kv_caches_by_rank`)."""
        return None

    @property
    def last_tier_copy_s(self) -> float:
        """Seconds the last step spent copying KV blocks to and from the host tier."""
        return 0.0


class SamplingExecutor(ModelExecutor):
    """An executor that can also sample where the logits are (a group's last rank): the
    runner then sends what to sample and gets token ids back, not the logits."""

    @abc.abstractmethod
    def execute_sampled(self, msg: StepMessage) -> SampledTokens:
        """Runs a step whose `msg.sampling` says what to sample; returns the tokens."""


class LocalExecutor(ModelExecutor):
    """The model in this process. `host_blocks`: the size of the KV cache's host tier.
    `token_fill`, set by the runner for one `execute`: input ids taken on the device."""

    token_fill: TokenFill | None = None
    # the model's LoRA adapters and each step's rows, set where the engine serves adapters
    # (the CUDA-graph executor never does: `workers.engine.assembly.graph_batch_size`)
    lora: AdapterSlots | None = None

    def __init__(self, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, host_blocks: int = 0) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.host = HostCaches(caches, host_blocks) if host_blocks else None
        self._tier_copy_s = 0.0

    @property
    def last_tier_copy_s(self) -> float:
        return self._tier_copy_s

    def copy_tiers(self, msg: StepMessage) -> None:
        """The step's copies between the cache and its host tier, before its forward pass."""
        self._tier_copy_s = 0.0
        if msg.block_copies:
            if self.host is None:
                raise RuntimeError("a step carries KV tier copies, but this executor has no "
                                   "host tier")
            start = time.perf_counter()
            self.host.apply(msg.block_copies)  # on a GPU: a load's launch, a save's wait
            self._tier_copy_s = time.perf_counter() - start

    def execute(self, msg: StepMessage) -> torch.Tensor:
        self.copy_tiers(msg)
        whole = MicroBatch(0, msg.num_seqs, 0, msg.num_tokens)
        ids, positions, meta = microbatch_tensors(msg, whole, self.device)
        fill_input_ids(ids, self.token_fill)
        if self.lora is not None:
            self.lora.write(msg.lora_writes)
            self.lora.batch.begin(msg.query_start_loc, msg.lora_slots, self.device)
        hidden = self.model(ids, positions, self.caches, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[list(msg.logit_rows)])

    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        return [self.caches]

    def load_adapter(self, name: str, path: str) -> None:
        """Keeps the PEFT adapter at `path` as `name` (`AdapterSlots.add`): `LoraAdapterError`
        and nothing kept for a bad one."""
        if self.lora is None:
            raise RuntimeError("this executor's model serves no LoRA adapters")
        self.lora.add(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forgets adapter `name`; KeyError when it is not loaded."""
        if self.lora is None:
            raise KeyError(f"adapter {name!r} is not loaded (no LoRA adapters here)")
        self.lora.remove(name)
