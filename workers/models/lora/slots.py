"""A model's adapter slots: LoRA hooks installed on its projections, adapters kept on the host
(`AdapterSlots`, in the process that holds the model or its shard), and which adapter sits in
which of the `max_loras` device slots, the least recently used evicted (`SlotTable`, the
driver's: its host copy stays, so bringing it back is a copy, not a read of its folder).

The driver decides, the model's holders copy: each step carries the (slot, adapter) copies to
make before its forward pass (`StepMessage.lora_writes`), so every tensor-parallel rank's slots
hold the same adapters.

Which projections take LoRA: the attention's fused q/k/v (`q_proj`, `k_proj`, `v_proj`) and
`o_proj`, and a dense MLP's fused gate/up (`gate_proj`, `up_proj`) and `down_proj`, each
sharded as its base projection on a tensor-parallel rank. An MoE's routed experts take PEFT's
`target_parameters` (`workers.models.lora.experts`) where their layout is transformers' own
(`_experts_refused`: Qwen2-MoE's, Qwen3-MoE's, DeepSeek's and Mixtral's, whose
`block_sparse_moe` is transformers 5's `mlp`; not gpt-oss's, nor under expert parallelism).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from torch import nn

from workers.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RowParallelLinear)
from workers.models.moe import FusedExperts
from workers.models.lora.experts import ExpertLora, ExpertShape
from workers.models.lora.peft_folder import (AdapterWeights, LoraAdapterError, TargetShape,
                                             read_adapter)
from workers.models.lora.projection import LoraBatch, LoraProjection, Sub

# our fused projection's name -> the PEFT modules it is made of, in output order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PLAIN = ("o_proj", "down_proj")
SlotWrite = tuple[int, str]  # (device slot, adapter name): copy the adapter into the slot


def _subs(name: str, layer: nn.Module) -> tuple[Sub, ...] | None:
    """The PEFT modules inside the projection `name` (its last dotted part), this rank's part
    of each, or None when it takes no LoRA."""
    if isinstance(layer, QKVParallelLinear) and name == "qkv_proj":
        q, kv, d = layer.q_size, layer.kv_size, layer.head_dim
        kv_rank = layer.tp_rank // layer.num_kv_head_replicas
        full_kv = layer.total_num_kv_heads * d
        return (Sub("q_proj", 0, q, layer.total_num_heads * d, layer.tp_rank * q),
                Sub("k_proj", q, kv, full_kv, kv_rank * kv),
                Sub("v_proj", q + kv, kv, full_kv, kv_rank * kv))
    if isinstance(layer, MergedColumnParallelLinear) and name == "gate_up_proj":
        tp, sizes = layer.tp_size, layer.output_sizes
        return tuple(Sub(n, sum(sizes[:i]) // tp, full // tp, full, layer.tp_rank * full // tp)
                     for i, (n, full) in enumerate(zip(_FUSED[name], sizes, strict=True)))
    if isinstance(layer, ColumnParallelLinear) and name in _PLAIN:
        size = layer.output_size_per_rank
        return (Sub(name, 0, size, layer.output_size, layer.tp_rank * size),)
    if isinstance(layer, RowParallelLinear) and name in _PLAIN:
        return (Sub(name, 0, layer.output_size),)
    return None


def _in_slice(layer: nn.Module) -> tuple[int, int] | None:
    """The input columns a row-parallel projection holds on this rank; None: all."""
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        size = layer.input_size_per_rank
        return layer.tp_rank * size, size
    return None


def _experts_refused(model: nn.Module) -> str | None:
    """Why `model`'s experts take no LoRA (None: they do, or it has none to refuse)."""
    for path, layer in model.named_modules():
        if not isinstance(layer, FusedExperts):
            continue
        kind = type(model).__name__
        if layer.expert_parallel:
            return "experts split over ranks by expert parallelism (use tensor parallelism)"
        if layer.w13_bias is not None or layer.clamped_swiglu is not None:
            return f"{kind}'s experts (biased, clamped SwiGLU, transposed in transformers)"
        if not _hf_experts_path(path).endswith(".mlp.experts"):
            return f"{kind}'s experts at {path} (a layout other than transformers' mlp.experts)"
    return None


def _hf_experts_path(path: str) -> str:
    """transformers 5's path of our experts module `path`, where PEFT saves its pairs: Mixtral's
    MoE block is `block_sparse_moe` in its checkpoints and here, `mlp` in transformers 5 (its
    conversion mapping renames it on load; w1 | w3 become gate_up_proj's halves, our w13's)."""
    block, _, name = path.rpartition(".")
    prefix, _, block_name = block.rpartition(".")
    return f"{prefix}.mlp.{name}" if block_name == "block_sparse_moe" else path


def _expert_hooks(model: nn.Module, batch: LoraBatch, max_loras: int, max_rank: int,
                  dtype: torch.dtype, device: torch.device) -> dict[str, ExpertLora]:
    """HF experts module path (`_hf_experts_path`) -> the hook installed on it (none where
    `_experts_refused`)."""
    if _experts_refused(model) is not None:
        return {}
    hooks: dict[str, ExpertLora] = {}
    for path, layer in model.named_modules():
        if isinstance(layer, FusedExperts):
            shape = ExpertShape(layer.num_experts, layer.hidden_size, layer.intermediate_size)
            hook = ExpertLora(batch, shape, layer.inter_local, layer.tp_rank, max_loras,
                              max_rank, dtype, device)
            layer.lora = hook
            hooks[_hf_experts_path(path)] = hook
    return hooks


class SlotTable:
    """Which adapter sits in which of `max_loras` device slots, least recently used evicted:
    the driver's (the model's holders only copy, `AdapterSlots.write`). `seq_slots` records the
    copies a step needs; `take_writes` hands them to the step's message."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident, least recent first
        self._writes: list[SlotWrite] = []  # copies not yet sent with a step
        self.num_loads = 0  # adapters copied into a slot since start

    def acquire(self, names: Collection[str]) -> dict[str, int]:
        """The slot of each of `names` (one step's adapters), those not resident given one
        (a write recorded), the least recently used others evicted. ValueError when they are
        more than the slots (the scheduler keeps a step within `max_loras`)."""
        if len(names) > self.max_loras:
            raise ValueError(f"a step with {len(names)} adapters; max_loras={self.max_loras}")
        for name in sorted(names):  # sorted: the same slots whatever the set's order
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            taken = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if not free:  # evict the least recent one not in this step
                victim = next(n for n in self._slot_of if n not in names)
                free = [self._slot_of.pop(victim)]
            self._slot_of[name] = free[0]
            self._writes.append((free[0], name))
            self.num_loads += 1
        return {name: self._slot_of[name] for name in names}

    def seq_slots(self, names: Sequence[str | None]) -> tuple[int, ...]:
        """Each sequence's slot (-1: the base model), its adapters acquired; () when none has
        an adapter."""
        wanted = {n for n in names if n is not None}
        if not wanted:
            return ()
        slots = self.acquire(wanted)
        return tuple(-1 if n is None else slots[n] for n in names)

    def take_writes(self) -> tuple[SlotWrite, ...]:
        """The copies recorded since the last call, in order (for the next step's message)."""
        writes, self._writes = tuple(self._writes), []
        return writes

    def drop(self, name: str) -> None:
        """`name` leaves its slot (unloaded); a pending copy of it is dropped too."""
        self._slot_of.pop(name, None)
        self._writes = [w for w in self._writes if w[1] != name]

    def resident(self) -> list[str]:
        """Adapters in a device slot, least recently used first."""
        return list(self._slot_of)


class AdapterSlots:
    """Hooks `model`'s projections (this rank's shard of them) and keeps its adapters: `add` /
    `remove` on the host, `write` into a device slot. Not thread-safe: the step's thread (or
    the caller between steps) uses it."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} "
                             f"and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = LoraBatch()
        # the activations' dtype: packed weights (int8, a GGUF file's blocks, its embedding's
        # too) are integers, the norms are not
        param = next(p for p in model.parameters() if p.is_floating_point())
        self.dtype, self.device = param.dtype, param.device
        self.projections: dict[str, LoraProjection] = {}  # our module path -> its hook
        self.targets: dict[str, TargetShape] = {}  # HF module path -> its shape, all ranks'
        self._where: dict[str, tuple[str, str]] = {}  # HF module path -> (our path, sub)
        for path, layer in model.named_modules():
            subs = _subs(path.rsplit(".", 1)[-1], layer)
            if subs is None:
                continue
            in_slice = _in_slice(layer)
            hook = LoraProjection(self.batch, subs, layer.input_size if in_slice is None
                                  else in_slice[1], sum(s.size for s in subs), max_loras,
                                  max_rank, self.dtype, self.device, in_slice)
            layer.lora = hook
            self.projections[path] = hook
            prefix = path.rsplit(".", 1)[0]
            for sub in subs:
                self.targets[f"{prefix}.{sub.name}"] = TargetShape(layer.input_size,
                                                                   sub.out_features)
                self._where[f"{prefix}.{sub.name}"] = (path, sub.name)
        if not self.projections:
            raise ValueError(f"{type(model).__name__} has no projection that takes LoRA")
        self.experts = _expert_hooks(model, self.batch, max_loras, max_rank, self.dtype,
                                     self.device)  # HF experts module path -> its hook
        self.experts_refused = _experts_refused(model) or "this model has no experts"
        for module in model.modules():  # the fused fast paths: see the step's adapter rows
            if hasattr(module, "lora_batch"):
                setattr(module, "lora_batch", self.batch)  # noqa: B010 -- any module
            stack = getattr(module, "fused_stack", None)
            if stack is not None:  # the CPU decoder stack adds the products itself
                stack.link()
        # name -> per projection (or experts) path, its host stacks
        self._host: dict[str, dict[str, tuple[torch.Tensor, ...]]] = {}
        self.paths: dict[str, str] = {}  # name -> its folder

    def add(self, name: str, path: str | Path) -> AdapterWeights:
        """Read, check and keep the adapter at `path` as `name` (this rank's shard of it).
        Raises `LoraAdapterError` (nothing kept) for a bad adapter or a name already taken."""
        if name in self._host:
            raise LoraAdapterError(f"adapter {name!r} is already loaded (from "
                                   f"{self.paths[name]}); unload it first")
        weights = read_adapter(name, path, self.targets, self.max_rank, self.dtype,
                               {p: h.shape for p, h in self.experts.items()},
                               self.experts_refused)
        grouped: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in weights.modules.items():
            ours, sub = self._where[module]
            grouped.setdefault(ours, {})[sub] = pair
        host: dict[str, tuple[torch.Tensor, ...]] = {
            p: self.projections[p].host_stacks(w) for p, w in grouped.items()}
        for module, pairs in weights.experts.items():
            host[module] = self.experts[module].host_stacks(pairs)
        if weights.experts:
            self._allocate_experts(name)
        self._host[name] = host
        self.paths[name] = weights.path
        return weights

    def _allocate_experts(self, name: str) -> None:
        """Every layer's expert slots on the device (the first adapter on experts); a device
        out of memory refuses `name`."""
        try:
            for hook in self.experts.values():
                hook.allocate()
        except torch.OutOfMemoryError:
            size = sum(h.nbytes() for h in self.experts.values()) / 2**30
            raise LoraAdapterError(
                f"adapter {name!r}: the experts' adapter slots need {size:.2f} GiB on "
                f"{self.device}, which is out of memory (fewer max_loras or a smaller "
                "max_lora_rank)") from None

    def remove(self, name: str) -> None:
        """Forget `name` (its slot's stale copy is overwritten by the next adapter written
        there). KeyError when it is not loaded."""
        if name not in self._host:
            raise KeyError(f"adapter {name!r} is not loaded")
        del self._host[name], self.paths[name]

    def names(self) -> list[str]:
        return sorted(self._host)

    def write(self, writes: Sequence[SlotWrite]) -> None:
        """Copies each (slot, adapter) of `writes` into the device stacks, in order (a step's
        `lora_writes`, before its forward). KeyError for an adapter not loaded here."""
        for slot, name in writes:
            if name not in self._host:
                raise KeyError(f"adapter {name!r} is not loaded")
            stacks = self._host[name]
            for path, hook in self.projections.items():
                hook.write_slot(slot, stacks.get(path))  # type: ignore[arg-type]
            for path, experts in self.experts.items():
                experts.write_slot(slot, stacks.get(path))
