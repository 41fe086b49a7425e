"""GPTQ: integer weights chosen with error compensation instead of round-to-nearest.

For a linear layer y = x W^T with inputs X (calibration activations, [T, K]), the output error
of a quantized W' is ||X (W - W')^T||^2 = tr((W - W') H (W - W')^T) with H = X^T X. GPTQ
quantizes W's input columns one at a time; after column j is rounded, its error e_j is folded
into the columns not yet quantized, in proportion to the rows of the upper Cholesky factor U of
H^-1 (e_j / U[j, j] times U[j, j+1:]), which is the least-squares update of the remaining
weights given that column j is now fixed. Columns are processed in blocks (the update within a
block is immediate, the rest lazily once per block), optionally in act-order (largest H[j, j]
first). A group's scale (and zero point, when asymmetric) is fixed when the pass reaches its
first column, from its columns as updated so far (one group: the whole row, one scale per output
channel; with act-order only that), rounded to the dtype the checkpoint stores it in, so the
integers are exactly the ones that will be read back. Damping: `damp` times H's mean diagonal
is added to the diagonal; inputs that were always zero (H[j, j] = 0) get a unit diagonal and
zero weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from workers.quant.weights import IntWeight


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int = 8, damp: float = 0.01,
                  act_order: bool = False, scale_dtype: torch.dtype = torch.float16,
                  block: int = 128, group_size: int | None = None,
                  symmetric: bool = True) -> IntWeight:
    """w [N, K] float, hessian [K, K] (X^T X up to a factor) -> an IntWeight with one scale
    (and zero point unless `symmetric`) per output channel (`group_size` None) or per group of
    `group_size` input columns, integers chosen by GPTQ."""
    k = w.shape[1]
    if group_size is not None and (group_size < 1 or k % group_size or act_order):
        raise ValueError(f"group_size {group_size} for input size {k} (act_order "
                         f"{act_order}); expected a divisor of {k} and no act-order")
    if hessian.shape != (k, k):
        raise ValueError(f"hessian of shape {list(hessian.shape)} for a weight of input size "
                         f"{k}; expected [{k}, {k}]")
    if not 0.0 < damp < 1.0:
        raise ValueError(f"damp must be in (0, 1); got {damp}")
    hi = (1 << (bits - 1)) - 1
    lo = -hi - 1
    w32 = w.double().clone()
    h = hessian.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w32[:, dead] = 0.0
    size = group_size or k
    group_scales = torch.empty(w32.shape[0], k // size, dtype=torch.float64)
    group_zeros = torch.zeros_like(group_scales)
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    w32, h = w32[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w32)
    for start in range(0, k, block):
        end = min(start + block, k)
        wb, ub = w32[:, start:end].clone(), u[start:end, start:end]
        errors = torch.empty_like(wb)
        for j in range(end - start):
            if (start + j) % size == 0:  # a group's scale from its columns as updated so far
                first = start + j
                cols = torch.cat([wb[:, j:j + size], w32[:, end:first + size]], 1)
                group_scales[:, first // size], group_zeros[:, first // size] = _scales(
                    cols, bits, symmetric, scale_dtype)
            g = (start + j) // size
            scales, zeros = group_scales[:, g], group_zeros[:, g]
            qj = torch.round(wb[:, j] / scales + zeros).clamp(lo, hi)
            q[:, start + j] = qj
            err = (wb[:, j] - (qj - zeros) * scales) / ub[j, j]
            wb[:, j:] -= err[:, None] * ub[j, j:][None, :]
            errors[:, j] = err
        w32[:, end:] -= errors @ u[start:end, end:]
    ints = torch.empty_like(q)
    ints[:, perm] = q
    return IntWeight(ints.to(torch.int8), group_scales.float(), group_zeros.float(), bits)


def _scales(cols: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (rounded to the dtype the checkpoint stores them in) and zero points of rows
    `cols` [N, C], as `weights.quantize_int` chooses them."""
    hi, lo = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    if symmetric:
        scales = (cols.abs().amax(1) / hi).to(scale_dtype).double()
        zeros = torch.zeros_like(scales)
    else:
        wmin, wmax = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        scales = ((wmax - wmin) / (hi - lo)).to(scale_dtype).double()
        zeros = torch.round(lo - wmin / scales.clamp(min=1e-12)).clamp(lo, hi)
    return torch.where(scales > 0, scales, torch.ones_like(scales)), zeros


@torch.no_grad()
def collect_hessians(model: torch.nn.Module, linears: Mapping[str, torch.nn.Linear],
                     calibration: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """H = X^T X (fp64 [K, K], summed over every calibration token) of each named linear's
    input, from `model(ids[None])` run on each calibration sequence. Linears reading the same
    input tensor (q/k/v, gate/up) share one product."""
    sums: dict[str, torch.Tensor] = {}
    # keyed by the input's address; the input itself is held so no later one reuses it
    shared: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):
        def record(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _out) -> None:
            x = inputs[0]
            key = (x.data_ptr(), tuple(x.shape))
            if key not in shared:
                flat = x.reshape(-1, x.shape[-1]).float()  # fp32 product, fp64 sum
                shared[key] = (x, (flat.T @ flat).double())
            product = shared[key][1]
            sums[name] = sums[name] + product if name in sums else product.clone()
        return record

    handles = [mod.register_forward_hook(hook(name)) for name, mod in linears.items()]
    try:
        for ids in calibration:
            shared.clear()
            model(torch.tensor([list(ids)]))
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in linears if name not in sums]
    if missing:
        raise ValueError(f"no calibration input reached {missing[:3]}")
    return sums


# pydoc_data.topics keys, sorted; each at least 256 SmolLM2 tokens; disjoint from the quality
# harness's topics (`benchmarks/quality_corpus.py` TOPICS)
CALIBRATION_TOPICS = ("atom-identifiers", "augassign", "compound", "debugger", "exprlists",
                      "floating", "global", "id-classes", "identifiers", "in", "integers",
                      "numeric-types", "objects", "operator-summary", "power", "sequence-types")


def builtin_calibration() -> list[str]:
    """Calibration text every CPython carries: the reference manual's entries in
    `pydoc_data.topics` named in `CALIBRATION_TOPICS` (none of them in the quality harness's
    corpus, `benchmarks/quality_corpus.py`)."""
    import pydoc_data.topics as topics

    return [topics.topics[key] for key in CALIBRATION_TOPICS if key in topics.topics]


def checkpoint_hessians(src: str, texts: Sequence[str], tokens: int = 256,
                        max_sequences: int = 16) -> dict[str, torch.Tensor]:
    """H of every linear of the decoder layers (and `lm_head`) of the full-precision checkpoint
    `src`, run by transformers in fp32 on `texts` (each tokenized and cut into windows of
    `tokens`), keyed by module name (the checkpoint's weight name less `.weight`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    per_text = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        per_text.append([ids[i:i + tokens] for i in range(0, len(ids), tokens)
                         if len(ids[i:i + tokens]) >= min(tokens, 16)])
    # every text's first window, then every text's second, ...: varied text first
    windows = [w for rank in range(max(map(len, per_text), default=0))
               for text in per_text if rank < len(text) for w in [text[rank]]][:max_sequences]
    if not windows:
        raise ValueError("the calibration text gave no window of 16 tokens or more")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    linears = {name: mod for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and (".layers." in name or name == "lm_head")}
    return collect_hessians(model, linears, windows)
