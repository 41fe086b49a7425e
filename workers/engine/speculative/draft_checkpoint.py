"""A draft checkpoint of its own (`{"method": "draft_model", "model": PATH}`): another model
sharing the target's tokenizer (a safetensors folder or a GGUF file: a smaller model of the
family, or the target's own quantized file drafting for its full-precision weights, as
llama.cpp's `-md` does) drafts on a cache of its own (`own_cache.OwnCacheDraft`).

It runs on one rank in the engine's own process, whatever the target's layout: beside a
tensor- or pipeline-parallel target it drafts on the driver, as vLLM's draft models may run
with a tensor-parallel size of 1. A GGUF draft stays packed (its blocks read by the CPU's block
kernels, or the VNNI kernels with `fp32_int_kernels`): a draft is for speed, and verification
decides every token. Its cache holds the target's number of blocks in the draft's shape, beside
the target's KV budget (not carved out of it: on a GPU, loaded after the target's budget was
profiled, the draft's weights and cache need the room `gpu_memory_utilization` leaves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.attention import get_backend
from workers.engine.config import EngineConfig
from workers.models.loader import load_model
from workers.models.model_config import ModelConfig

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM
    from workers.tokenizer import Tokenizer


def load_draft_checkpoint(config: EngineConfig, target: ModelConfig,
                          tokenizer: Tokenizer | None, dtype: torch.dtype, device: torch.device,
                          max_model_len: int) -> LlamaForCausalLM | None:
    """The draft checkpoint `config.speculative` names, loaded on `device` in `dtype` (the
    target's); None when it names none. ValueError naming the path and what does not match
    the target (`target`, `tokenizer`: the target's; `max_model_len`: the longest context the
    draft must place)."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    path = spec.model
    try:
        mc = ModelConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config model {path!r} cannot be read: {exc}") from None
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {path!r} has {mc.vocab_size} token ids, "
                         f"the target {target.vocab_size}: a draft must share the target's "
                         f"tokenizer and vocabulary size")
    check_same_tokenizer(path, tokenizer)
    if mc.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config model {path!r} places {mc.max_position_embeddings} "
                         f"positions, fewer than max_model_len={max_model_len}; lower "
                         f"max_model_len to at most {mc.max_position_embeddings}")
    return load_model(path, mc, dtype=dtype, device=device,
                      attn_backend=get_backend(config.resolved_attention_backend),
                      load_format="auto", seed=config.seed,
                      fp32_int_kernels=config.fp32_int_kernels, gguf_packed=True)


def check_same_tokenizer(path: str, target: Tokenizer | None) -> None:
    """ValueError naming the first token the draft at `path` and the target map differently;
    nothing to compare when either has no tokenizer (its vocabulary size was checked)."""
    from workers.tokenizer import Tokenizer

    draft = Tokenizer.found_in(path) if target is not None else None
    if draft is None or target is None:
        return
    ours = target.backend.get_vocab(with_added_tokens=True)
    theirs = draft.backend.get_vocab(with_added_tokens=True)
    for token, token_id in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != token_id:
            raise ValueError(
                f"speculative_config model {path!r} does not share the target's tokenizer: "
                f"token {token!r} is id {token_id} in the target's, "
                f"{theirs.get(token)} in the draft's")
    if len(theirs) != len(ours):
        raise ValueError(f"speculative_config model {path!r} does not share the target's "
                         f"tokenizer: {len(theirs)} tokens against the target's {len(ours)}")
