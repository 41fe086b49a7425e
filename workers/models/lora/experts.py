"""LoRA on an MoE's routed experts: PEFT's `target_parameters` adapters read (`expert_pairs`)
and the hook a layer's `FusedExperts` carries (`ExpertLora`), which adds each routed row's
adapter products inside its expert (the gate/up one before the activation, the down one after).

PEFT's layout (peft 0.21 `lora.ParamWrapper`, on transformers 5's 3-D expert parameters
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], stored (experts,
out, in) and so with in/out swapped back): one pair per parameter, lora_A [E * r, in] with
expert e's rank rows contiguous (rows e*r .. e*r + r-1), lora_B [out, E * r] with the experts
INTERLEAVED (column j * E + e is expert e's rank j). Expert e's delta weight is
scaling * B[:, e::E] @ A[e*r:(e+1)*r]. Both parameters of one module are nested wrappers in
the module's parameter order, the first innermost: with both targeted, gate_up_proj's tensors
are saved under `mlp.experts.base_layer.lora_{A,B}.weight`, down_proj's under
`mlp.experts.lora_{A,B}.weight`; with one, it has no `base_layer`.

Device stacks, one per layer, allocated by the first adapter that targets experts: for each
local expert, every slot's A side by side (`[E_local, max_loras * max_rank, in]`, slot s in
columns s*R..s*R+R-1, zero-padded to R = max_rank) and its scaled B likewise; a row's product
is (x A^T masked to its slot's columns) B^T: two plain matmuls per expert, base rows and
adapters without expert weights adding exact zeros. Under tensor parallelism each rank keeps
its shard as the base's: gate/up's B its gate rows and its up rows, down's A its input columns
(its product joins the partial sums the all-reduce adds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from workers.models.lora.projection import LoraBatch

PARAMS = ("gate_up_proj", "down_proj")  # transformers' expert parameters, in module order
ExpertPair = tuple[torch.Tensor, torch.Tensor]  # A [E, r, in], B scaled [E, out, r]


class ExpertLoraError(ValueError):
    """An expert adapter that does not fit; `read_adapter` re-raises it naming the adapter."""


@dataclass(frozen=True)
class ExpertShape:
    """One experts module of the base model a LoRA may target: its sizes, all ranks'."""

    num_experts: int
    hidden_size: int
    intermediate_size: int

    def features(self, param: str) -> tuple[int, int]:
        """(in, out) features of `param` as PEFT sees it."""
        h, i = self.hidden_size, self.intermediate_size
        return (h, 2 * i) if param == "gate_up_proj" else (i, h)


def expert_keys(target_parameters: Sequence[str], experts: Mapping[str, ExpertShape]
                ) -> dict[str, tuple[str, str]]:
    """The module path PEFT saves each targeted expert parameter's pair under -> (experts
    module path, parameter). Matching as PEFT's: `module.param` equal to an entry or ending
    with `.entry`. Raises `ExpertLoraError` for an entry that matches nothing here."""
    keys: dict[str, tuple[str, str]] = {}
    used: set[str] = set()
    for module in experts:
        hit = []
        for param in PARAMS:
            key = f"{module}.{param}"
            found = [t for t in target_parameters if key == t or key.endswith(f".{t}")]
            used.update(found)
            if found:
                hit.append(param)
        for depth, param in enumerate(reversed(hit)):  # the last one wraps the others
            keys[module + ".base_layer" * depth] = (module, param)
    unmatched = [t for t in target_parameters if t not in used]
    if unmatched:
        example = next(iter(experts))
        raise ExpertLoraError(f"target_parameters {unmatched} match no expert parameter this "
                              f"model takes LoRA on ({', '.join(PARAMS)} of e.g. {example})")
    return keys


def expert_pair(module: str, param: str, a: torch.Tensor, b: torch.Tensor, shape: ExpertShape,
                rank: int, scaling: float, dtype: torch.dtype) -> ExpertPair:
    """PEFT's (lora_A [E*r, in], lora_B [out, E*r]) of `param` -> per expert (A [E, r, in],
    B scaled [E, out, r]) in `dtype`. Raises `ExpertLoraError` for a shape that does not fit."""
    n_in, n_out = shape.features(param)
    e = shape.num_experts
    for which, got, want in (("lora_A", a, (e * rank, n_in)), ("lora_B", b, (n_out, e * rank))):
        if tuple(got.shape) != want:
            raise ExpertLoraError(
                f"{module}.{param} {which} has shape {list(got.shape)}, the base model's "
                f"{e} experts need {list(want)} (rank {rank}); was it trained on another model?")
    per_a = a.reshape(e, rank, n_in)
    per_b = b.float().reshape(n_out, rank, e).permute(2, 0, 1) * scaling  # experts interleaved
    return per_a.to(dtype).contiguous(), per_b.to(dtype).contiguous()


class ExpertLora:
    """One layer's experts' adapter stacks (this rank's experts and shard) and their products.
    `a13`..`b2` stay None until an adapter on experts is written into a slot."""

    def __init__(self, batch: LoraBatch, shape: ExpertShape, inter_local: int, tp_rank: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.batch, self.shape, self.inter_local = batch, shape, inter_local
        self.first = tp_rank * inter_local  # this rank's first intermediate column
        self.max_loras, self.max_rank, self.dtype, self.device = max_loras, max_rank, dtype, device
        self.a13: torch.Tensor | None = None  # [E, L * R, H]
        self.b13: torch.Tensor | None = None  # [E, 2 * I_local, L * R]
        self.a2: torch.Tensor | None = None  # [E, L * R, I_local]
        self.b2: torch.Tensor | None = None  # [E, H, L * R]
        self.filled: set[int] = set()  # the slots holding an adapter with expert weights

    @property
    def active(self) -> bool:
        """Whether this step has rows of an adapter with expert products to add (else the
        experts run their usual paths)."""
        return self.batch.active and any(s in self.filled for s, _, _ in self.batch.segments)

    def host_stacks(self, pairs: Mapping[str, ExpertPair]) -> tuple[torch.Tensor, ...]:
        """One adapter's (A13, B13, A2, B2) for a slot, this rank's shard, padded to max_rank;
        a parameter it does not target stays zero."""
        a13, b13, a2, b2 = self._zeros(self.max_rank, torch.device("cpu"))
        i, lo, full = self.inter_local, self.first, self.shape.intermediate_size
        if "gate_up_proj" in pairs:
            a, b = pairs["gate_up_proj"]
            r = a.shape[1]
            a13[:, :r] = a
            b13[:, :i, :r] = b[:, lo:lo + i]  # this rank's gate rows, then its up rows
            b13[:, i:, :r] = b[:, full + lo:full + lo + i]
        if "down_proj" in pairs:
            a, b = pairs["down_proj"]
            r = a.shape[1]
            a2[:, :r] = a[:, :, lo:lo + i]
            b2[:, :, :r] = b
        return a13, b13, a2, b2

    def _zeros(self, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Zero (A13, B13, A2, B2) of `width` rank columns."""
        e, h, i = self.shape.num_experts, self.shape.hidden_size, self.inter_local
        return tuple(torch.zeros(shape, dtype=self.dtype, device=device) for shape in (
            (e, width, h), (e, 2 * i, width), (e, width, i), (e, h, width)))

    def allocate(self) -> None:
        """The device stacks, once (the first adapter on experts: `AdapterSlots.add`, which
        turns a device out of memory into a refusal)."""
        if self.a13 is None:
            self.a13, self.b13, self.a2, self.b2 = self._zeros(
                self.max_loras * self.max_rank, self.device)

    def nbytes(self) -> int:
        """What `allocate` takes on the device."""
        e, h, i = self.shape.num_experts, self.shape.hidden_size, self.inter_local
        width = self.max_loras * self.max_rank
        return e * width * (2 * h + 3 * i) * self.dtype.itemsize

    def write_slot(self, slot: int, stacks: Sequence[torch.Tensor] | None) -> None:
        """Puts an adapter's host stacks into `slot` (None: zeros, it has no expert weights)."""
        if self.a13 is None:
            if stacks is None:
                return  # nothing allocated, nothing to clear
            self.allocate()
        if stacks is None:
            self.filled.discard(slot)
        else:
            self.filled.add(slot)
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        views = (self.a13[:, cols], self.b13[:, :, cols],  # type: ignore[index]
                 self.a2[:, cols], self.b2[:, :, cols])  # type: ignore[index]
        for view, host in zip(views, stacks or (None,) * 4, strict=True):
            if host is None:
                view.zero_()
            else:
                view.copy_(host, non_blocking=True)

    def row_mask(self) -> torch.Tensor:
        """[T, L * R] of the step's token rows: 1 in its slot's columns, 0 elsewhere (a base
        model row: 0 everywhere)."""
        slots = self.batch.token_slots
        onehot = slots[:, None] == torch.arange(self.max_loras, device=slots.device)[None, :]
        return onehot.repeat_interleave(self.max_rank, dim=1).to(self.dtype)

    def gate_up(self, x: torch.Tensor, mask: torch.Tensor, expert: int) -> torch.Tensor:
        """Local expert `expert`'s gate|up product of rows x [N, H] (mask [N, L*R])."""
        shrunk = torch.mm(x, self.a13[expert].t()) * mask  # type: ignore[index]
        return torch.mm(shrunk, self.b13[expert].t())  # type: ignore[index]

    def down(self, hidden: torch.Tensor, mask: torch.Tensor, expert: int) -> torch.Tensor:
        """Its down product of rows hidden [N, I_local] (this rank's partial sum under TP)."""
        shrunk = torch.mm(hidden, self.a2[expert].t()) * mask  # type: ignore[index]
        return torch.mm(shrunk, self.b2[expert].t())  # type: ignore[index]
