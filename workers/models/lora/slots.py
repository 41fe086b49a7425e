"""A model's adapter slots: LoRA hooks installed on its projections, adapters kept on the host,
and at most `max_loras` of them in the device stacks at once, the least recently used evicted
(its host copy stays: bringing it back is a copy, not a read of its folder).

Which projections take LoRA: the attention's fused q/k/v (`q_proj`, `k_proj`, `v_proj`) and
`o_proj`, and a dense MLP's fused gate/up (`gate_proj`, `up_proj`) and `down_proj`, on one
tensor-parallel rank (a sharded adapter is not supported yet). An MoE's experts take none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from torch import nn

from workers.models.layers import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RowParallelLinear)
from workers.models.lora.peft_folder import (AdapterWeights, LoraAdapterError, TargetShape,
                                             read_adapter)
from workers.models.lora.projection import LoraBatch, LoraProjection, Sub

# our fused projection's name -> the PEFT modules it is made of, in output order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PLAIN = ("o_proj", "down_proj")


def _subs(name: str, layer: nn.Module) -> tuple[Sub, ...] | None:
    """The PEFT modules inside the projection `name` (its last dotted part), or None when it
    takes no LoRA."""
    if isinstance(layer, QKVParallelLinear) and name == "qkv_proj":
        q, kv = layer.q_size, layer.kv_size
        return (Sub("q_proj", 0, q), Sub("k_proj", q, kv), Sub("v_proj", q + kv, kv))
    if isinstance(layer, MergedColumnParallelLinear) and name == "gate_up_proj":
        sizes, offsets = layer.output_sizes, [0, layer.output_sizes[0]]
        return tuple(Sub(n, o, s) for n, o, s in zip(_FUSED[name], offsets, sizes, strict=True))
    if isinstance(layer, RowParallelLinear | ColumnParallelLinear) and name in _PLAIN:
        out = getattr(layer, "output_size_per_rank", layer.output_size)
        return (Sub(name, 0, out),)
    return None


class AdapterSlots:
    """Hooks `model`'s projections (`install`) and keeps its adapters: `add`/`remove` on the
    host, `acquire` into the device slots for a step. Not thread-safe: the step's thread (or
    the caller between steps) uses it."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} "
                             f"and {max_rank}")
        shard = getattr(model, "shard", None)
        if shard is not None and shard.tp_size > 1:
            raise ValueError(f"LoRA adapters run on one tensor-parallel rank; tp_size="
                             f"{shard.tp_size}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = LoraBatch()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.projections: dict[str, LoraProjection] = {}  # our module path -> its hook
        self.targets: dict[str, TargetShape] = {}  # HF module path -> its shape
        self._where: dict[str, tuple[str, str]] = {}  # HF module path -> (our path, sub)
        for path, layer in model.named_modules():
            subs = _subs(path.rsplit(".", 1)[-1], layer)
            if subs is None:
                continue
            hook = LoraProjection(self.batch, subs, layer.input_size, sum(s.size for s in subs),
                                  max_loras, max_rank, self.dtype, self.device)
            layer.lora = hook
            self.projections[path] = hook
            prefix = path.rsplit(".", 1)[0]
            for sub in subs:
                self.targets[f"{prefix}.{sub.name}"] = TargetShape(layer.input_size, sub.size)
                self._where[f"{prefix}.{sub.name}"] = (path, sub.name)
        if not self.projections:
            raise ValueError(f"{type(model).__name__} has no projection that takes LoRA")
        for module in model.modules():  # the fused fast paths: see the step's adapter rows
            if hasattr(module, "lora_batch"):
                setattr(module, "lora_batch", self.batch)  # noqa: B010 -- any module
            stack = getattr(module, "fused_stack", None)
            if stack is not None:  # the CPU decoder stack adds the products itself
                stack.link()
        # name -> per projection path, its host (A, B) stacks
        self._host: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.paths: dict[str, str] = {}  # name -> its folder
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident, least recent first
        self.num_loads = 0  # adapters copied into a slot since start

    # ---- the host side ---------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> AdapterWeights:
        """Read, check and keep the adapter at `path` as `name`. Raises `LoraAdapterError`
        (nothing kept) for a bad adapter or a name already taken."""
        if name in self._host:
            raise LoraAdapterError(f"adapter {name!r} is already loaded (from "
                                   f"{self.paths[name]}); unload it first")
        weights = read_adapter(name, path, self.targets, self.max_rank, self.dtype)
        grouped: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in weights.modules.items():
            ours, sub = self._where[module]
            grouped.setdefault(ours, {})[sub] = pair
        self._host[name] = {p: self.projections[p].host_stacks(w) for p, w in grouped.items()}
        self.paths[name] = weights.path
        return weights

    def remove(self, name: str) -> None:
        """Forget `name` (its slot freed). KeyError when it is not loaded."""
        if name not in self._host:
            raise KeyError(f"adapter {name!r} is not loaded")
        del self._host[name], self.paths[name]
        self._slot_of.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._host)

    def resident(self) -> list[str]:
        """Adapters in a device slot, least recently used first."""
        return list(self._slot_of)

    # ---- the device side -------------------------------------------------------------------

    def acquire(self, names: Collection[str]) -> dict[str, int]:
        """The slot of each of `names` (one step's adapters), copying in those not resident
        and evicting the least recently used others. ValueError when they are more than the
        slots (the scheduler keeps a step within `max_loras`), KeyError for an unknown name."""
        if len(names) > self.max_loras:
            raise ValueError(f"a step with {len(names)} adapters; max_loras={self.max_loras}")
        for name in names:
            if name not in self._host:
                raise KeyError(f"adapter {name!r} is not loaded")
        for name in names:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            taken = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if not free:  # evict the least recent one not in this step
                victim = next(n for n in self._slot_of if n not in names)
                free = [self._slot_of.pop(victim)]
            self._write(name, free[0])
            self._slot_of[name] = free[0]
        return {name: self._slot_of[name] for name in names}

    def seq_slots(self, names: Sequence[str | None]) -> tuple[int, ...]:
        """Each sequence's slot (-1: the base model), its adapters acquired; () when none has
        an adapter."""
        wanted = {n for n in names if n is not None}
        if not wanted:
            return ()
        slots = self.acquire(wanted)
        return tuple(-1 if n is None else slots[n] for n in names)

    def _write(self, name: str, slot: int) -> None:
        stacks = self._host[name]
        for path, hook in self.projections.items():
            hook.write_slot(slot, stacks.get(path))
        self.num_loads += 1
