"""Quantized self-drafting: the target's own weights, quantized to int4 in memory at start, draft
for the full-precision target (issue 48's method 3; vLLM has no counterpart: its draft models
are checkpoints of their own).

`quantized_copy` builds a second model of the target's class whose linear layers hold int4
weights in groups of 32 input columns with zero points (`min_max_int4`), packed for the CPU's
VNNI kernels and the fused decoder stack in fp32, and whose output projection (untied from the
input embedding, which stays shared) holds GGUF Q8_0 blocks (int8 in groups of 32, as
llama.cpp keeps a small model's output projection), on the GGUF VNNI kernel where the CPU has
one; every other parameter (norms, embeddings, rotary tables) is the target's own tensor, not a
copy. All layers draft. SmolLM2-135M's fp32 weights (its Q4_1 file's, the output projection
Q8_0) are all held again exactly, and a draft token reads a fifth of the target's bytes (110 of
540 MB).

Why Q8_0 for the output projection (SmolLM2 in fp32, its 4 chat prompts of
`benchmarks/speculative.py` three times, 96 tokens, offline, engines alternating): in int4 it
drafted 1,138 tokens and 69% were accepted, 1.21x the target's tokens/s; in fp32 97%, 1.30x
(the draft then reads the whole table of 113 MB a token); the Q4_1 file as a draft checkpoint
(Q8_0 output projection, activations in int8 as here) 100%, 1.51x.

Its K/V differ from the target's (other weights), so it drafts on a cache of its own
(`workers.engine.speculative.own_cache.OwnCacheDraft`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from workers.models.layers import LINEAR_LAYERS, Shard
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import use_cpu_kernels
from workers.models.vocab import ParallelLMHead
from workers.quant import gguf_packed
from workers.quant.linear import prepare_layers, quantize_layers
from workers.quant.scheme import QuantScheme

GROUP_SIZE = 32
_LINEAR = QuantScheme(method="quantized_self", kind="int", layout="ct-packed", bits=4,
                      group_size=GROUP_SIZE, symmetric=False)
# the output projection in int4 too where the GGUF block kernels are not built: on a small
# model its bytes are a large share of a step's (SmolLM2-135M: 28M of 135M parameters)
INT4 = replace(_LINEAR, lm_head=_LINEAR)


def quantized_copy(target: LlamaForCausalLM) -> LlamaForCausalLM:
    """The target's int4 copy (see the module docstring). ValueError for a target on several
    ranks or one whose linear weights are not held in full precision."""
    if target.shard.tp_size != 1 or not target.model.is_first:
        raise ValueError(f"a quantized self-draft needs the whole target on one rank, got "
                         f"tp_size={target.shard.tp_size}")
    norm = target.model.norm.weight  # in the model's dtype however its linears are held
    device, dtype = norm.device, norm.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = type(target)(target.config, target.attn_backend, shard=Shard(0, 1))
            draft.lm_head = ParallelLMHead(target.config.vocab_size, target.config.hidden_size)
    finally:
        torch.set_default_dtype(previous)
    head_q8_0 = gguf_packed.packable(draft.lm_head, "Q8_0")  # else int4 as the layers
    kept = quantize_layers(draft, _LINEAR if head_q8_0 else INT4, dtype, device,
                           (*LINEAR_LAYERS, ParallelLMHead), fp32=True)
    modules = dict(target.named_modules())
    with torch.no_grad():
        for name, module in draft.named_modules():
            if not hasattr(module, "qweight"):
                continue
            source = getattr(modules[name], "weight", None)
            if source is None or not source.dtype.is_floating_point:
                raise ValueError(f"a quantized self-draft quantizes the target's full-precision "
                                 f"weights; {name} is held packed (a GGUF file's weights: load "
                                 f"it with gguf_packed=False)")
            for part, value in zip(("qweight", "scales", "zeros"), min_max_int4(source.data)):
                getattr(module, part).data.copy_(value)
        _share_the_rest(draft, target)
    if head_q8_0:
        gguf_packed.quantize_layer(draft.lm_head, "Q8_0", dtype)
        gguf_packed.use_int_kernels(draft)
    if kept:
        prepare_layers(draft)
    use_cpu_kernels(draft)
    return draft.eval()


def _share_the_rest(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Every draft parameter and buffer not quantized points at the target's tensor of that
    name; one the target lacks (a dense layer where the target holds a packed one) is refused."""
    params: dict[str, Any] = dict(target.named_parameters(remove_duplicate=False))
    params.update(dict(target.named_buffers(remove_duplicate=False)))
    for name, tensor in [*draft.named_parameters(), *draft.named_buffers()]:
        leaf = name.rpartition(".")[2]
        if leaf in ("qweight", "scales", "zeros"):
            continue
        source = params.get(name)
        if source is None or source.shape != tensor.shape:
            raise ValueError(f"a quantized self-draft needs the target's {name!r} in full "
                             f"precision; the target holds "
                             f"{'none' if source is None else tuple(source.shape)}")
        tensor.data = source.data


def min_max_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in [-8, 7], scales, zeros fp32 [N, K / 32]) with
    w ~ (q - zero) * scale, each group's minimum at q = -8 and maximum at 7, the zero point not
    rounded (as GGUF's Q4_1 keeps a minimum; the VNNI kernels take any zero): a weight that
    came from a Q4_1 file (SmolLM2's, dequantized to fp32) is held again exactly. The
    symmetric-range, integer-zero rounding of `cleave quantize` (`quant.weights.quantize_int`)
    agrees with the fp32 SmolLM2 on the next token about 60% of the time, this one (measured
    in `benchmarks/speculative.py`) far more."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"input size {k} is not a multiple of {GROUP_SIZE}")
    groups = w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = -8.0 - low / scales
    q = torch.round(groups / scales[..., None] + zeros[..., None]).clamp(-8, 7)
    return q.reshape(n, k).to(torch.int8), scales, zeros
