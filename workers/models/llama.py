"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

The architectures differ only in their attention (`workers.models.attention`) and tied
input/output embeddings; the arithmetic, including the order of residual adds and the fp32
RMSNorm, follows transformers' `modeling_llama` so fp32 logits match it to ~1e-5.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.kernels import use_triton
from workers.models.model_config import ModelConfig
from workers.models.attention import LlamaAttention
from workers.models.layers import (MergedColumnParallelLinear, RowParallelLinear, Shard,
                                   WeightShapeError, _comm_for, kv_heads_per_rank)
from workers.models.lora.projection import LoraBatch, lora_active
from workers.models.norm import RMSNorm
from workers.models.vocab import ParallelLMHead, VocabParallelEmbedding

if TYPE_CHECKING:
    from workers.models.fused_layer import FusedDecoderStack
    from workers.kernels.small_gemm import SmallBatchMLP

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
MlpFactory = Callable[[int], tuple[str, nn.Module]]  # layer index -> (name, MLP module)
# (our fused parameter, the HF projection it is made of, shard id)
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_SHARDS_PER_PARAM = {"qkv_proj": 3, "gate_up_proj": 2}


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, intermediate_size: int | None = None,
                 site: str = "mlp") -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        tp_rank, tp_size = shard.tp_rank, shard.tp_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=config.mlp_bias,
            tp_rank=tp_rank, tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size,
            comm=shard.comm, site=site,
        )
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # else silu

    # a few fp32 rows on the CPU by one fused kernel (kernels.small_gemm.SmallBatchMLP), set at
    # load where both projections take it; None: the two projections one by one
    small_batch: SmallBatchMLP | None = None
    lora_batch: LoraBatch | None = None  # the step's adapter rows: they skip `small_batch`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        fused = None if lora_active(self.lora_batch) else self.small_batch
        if fused is not None and x.shape[0] <= fused.max_rows and x.dtype == torch.float32:
            return fused(x)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate / tp_size]
        if use_triton(gate_up):  # one kernel for the activation and the product
            from workers.kernels.act_mul import act_and_mul

            return self.down_proj(act_and_mul(gate_up, self.gelu))
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate / tp_size]
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        # in place, in the projection's own output: no fresh [T, intermediate] buffers (their
        # page faults cost ~10x the arithmetic on CPU)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """`mlp_name`/`mlp`: the feed-forward block under its checkpoint name ("mlp", or Mixtral's
    "block_sparse_moe"). `attention_cls`: the attention block (DeepSeek's is latent)."""

    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(
        self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend, shard: Shard,
        mlp_name: str, mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, attn_backend, shard)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: [T, hidden], the previous layer's MLP output and the residual it
        is to be added to (None on the first layer: hidden is the input) -> the same of this
        layer. HF's LlamaDecoderLayer with each residual add fused into the next norm, as
        vLLM does; the sums land in place in the sublayers' fresh outputs (a + b == b + a)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it: `shard.layers` (global indices) only.

    Every stage holds the embedding and the final norm (NOTE: replicated, a vocab-sized waste
    per stage); the first stage embeds, the last normalizes. `layer_cls`, `norm_cls` and
    `embed_scale` (the embedding's multiplier) are where a family's decoder differs (Gemma 3).
    """

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, shard: Shard,
        make_mlp: MlpFactory, layer_cls: type[nn.Module] = LlamaDecoderLayer,
        norm_cls: type[RMSNorm] = RMSNorm, embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=shard.tp_rank,
            tp_size=shard.tp_size, comm=shard.comm,
        )
        ids = shard.layers if shard.layers is not None else range(config.num_hidden_layers)
        self.layer_ids = list(ids)
        self.is_first = self.layer_ids[0] == 0
        self.is_last = self.layer_ids[-1] == config.num_hidden_layers - 1
        # keyed by the global layer index, so parameter names match the checkpoint's
        self.layers = _LayersByIndex(
            {str(i): layer_cls(config, i, attn_backend, shard, *make_mlp(i))
             for i in self.layer_ids}
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = embed_scale

    # set at load where every layer takes it: a few CPU decode rows in one C call (fused_layer)
    fused_stack: FusedDecoderStack | None = None
    lora_batch: LoraBatch | None = None  # the step's adapter rows: `fused_stack` adds their LoRA
    keep_prenorm = False  # keep the output before the final norm in `prenorm` (an MTP draft)
    prenorm: torch.Tensor | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata, hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`hidden` [T, hidden]: the previous stage's output (None on the first stage)."""
        if hidden is None:
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
            if self.embed_scale is not None:  # rounded to the weights' dtype first, as HF does
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        if self.fused_stack is not None and self.fused_stack.takes(hidden, meta, kv_caches):
            hidden, residual = self.fused_stack(positions, hidden, kv_caches, meta, self.lora_batch)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers.values(), kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if self.is_last:
            normed, summed = self.norm(hidden, residual)
            self.prenorm = summed if self.keep_prenorm else None
            return normed
        return hidden if residual is None else hidden.add_(residual)  # the next stage's input


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2 causal LM for one tensor-parallel rank (and pipeline stage).

    `kv_caches[i]` is the cache of this stage's i-th layer, `[2, num_blocks, block_size,
    num_kv_heads, head_dim]` with `num_kv_heads` this rank's count (the attribute below; less
    than the config's when tp_size > 1). `shard` overrides `tp_rank`/`tp_size` and adds the TP
    group, the stage's layers and expert parallelism. Parameters never require grad.
    """

    cuda_graph_safe = True  # a decode step's forward has no host syncs (workers.engine.cuda_graphs)

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, tp_rank: int = 0,
        tp_size: int = 1, *, shard: Shard | None = None,
    ) -> None:
        super().__init__()
        shard = shard or Shard(tp_rank, tp_size)
        if not 0 <= shard.tp_rank < shard.tp_size:
            raise ValueError(f"tp_rank={shard.tp_rank} must be in [0, tp_size={shard.tp_size})")
        comm = _comm_for(shard.comm, shard.tp_size)
        self.shard = Shard(shard.tp_rank, shard.tp_size, comm, shard.layers,
                           shard.expert_parallel)
        self.config = config
        self.attn_backend = attn_backend
        self.model = self.make_model(config, attn_backend)
        self.num_layers = len(self.model.layer_ids)  # this stage's
        # per rank: the KV cache's head count
        self.num_kv_heads, _ = kv_heads_per_rank(config.num_key_value_heads, shard.tp_size)
        self.head_dim = config.head_dim
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=shard.tp_rank, tp_size=shard.tp_size,
            comm=comm,
        )
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_model(self, config: ModelConfig, attn_backend: AttentionBackend) -> LlamaModel:
        """The decoder stack (a family with other layers overrides this)."""
        return LlamaModel(config, attn_backend, self.shard, self.make_mlp)

    def make_mlp(self, layer_idx: int) -> tuple[str, nn.Module]:
        """(checkpoint name, module) of layer `layer_idx`'s feed-forward block."""
        return "mlp", LlamaMLP(self.config, self.shard)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata, hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden] (on a
        middle pipeline stage: the un-normed hidden states for the next stage). `hidden`: the
        previous stage's output, on every stage but the first."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches, expected one per layer "
                             f"({self.num_layers})")
        return self.model(input_ids, positions, kv_caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab_size] float32 (full vocab on every rank)."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as HF does, then fp32
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def map_name(self, hf_name: str) -> tuple[str, object]:
        """An HF tensor name -> (our parameter name, shard id or None)."""
        return _our_name(hf_name)

    def num_shards(self, name: str) -> int:
        """How many shard ids fill the fused parameter `name`."""
        return _SHARDS_PER_PARAM[name.split(".")[-2]]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the parameters (this rank's shard of each); the names of
        parameters fully loaded (fused ones once every shard came). Other stages' layers are
        skipped; WeightShapeError names the tensor on a shape mismatch, KeyError lists the
        names that match no parameter."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards_seen: dict[str, set[object]] = {}
        unknown: list[str] = []
        stage = set(self.model.layer_ids)
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the output projection
            layer = _LAYER.match(hf_name)
            if layer is not None and int(layer.group(1)) not in stage:
                continue  # another pipeline stage's layer
            name, shard_id = self.map_name(hf_name)
            param = params.get(name)
            if param is None:
                unknown.append(hf_name)
                continue
            try:
                # each parameter carries its loader (`workers.models.layers._make_param`)
                param.weight_loader(  # type: ignore[attr-defined]  # an attribute of our own
                    param, tensor, shard_id)
            except WeightShapeError as e:
                raise WeightShapeError(f"tensor {hf_name!r}: {e}") from None
            if shard_id is None:
                loaded.add(name)
                continue
            shards_seen.setdefault(name, set()).add(shard_id)
            if len(shards_seen[name]) == self.num_shards(name):
                loaded.add(name)
        if unknown:
            raise KeyError(f"checkpoint tensors match no model parameter: {unknown}")
        return loaded


class _LayersByIndex(nn.ModuleDict):
    """A stage's layers keyed by their global index; `layers[i]` takes an int too."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))


def _our_name(hf_name: str) -> tuple[str, object]:
    """Maps an HF tensor name to (our parameter name, shard id or None)."""
    for fused, part, shard_id in _STACKED:
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}."), shard_id
    return hf_name, None
