"""DeepSeek-V3 and -V2: multi-head latent attention (MLA) and a sparse MoE with group-limited
routing (V3: sigmoid scores with a correction bias; V2: softmax) and a shared expert,
following transformers' `modeling_deepseek_v3` and `modeling_deepseek_v2` (whose RoPE, complex
products of interleaved pairs, is the same rotation as V3's interleaved one).

MLA caches one vector per token and layer: the normed KV latent c (kv_lora_rank) and the rotated
key part shared by every head, k_pe (qk_rope_head_dim). Attention runs over that latent with
the up-projections absorbed, as DeepSeek's and vLLM's MLA decode does: each head's no-RoPE query
is multiplied into latent space by its slice of kv_b_proj (W_UK), so

    q . k = q_nope . (W_UK c) + q_pe . k_pe = (q_nope W_UK) . c + q_pe . k_pe,

which is multi-query attention of [q_nope W_UK, q_pe] over the cached [c, k_pe] with head size
kv_lora_rank + qk_rope_head_dim; the softmax-weighted sum of the same vectors, cut to its first
kv_lora_rank entries, is multiplied back out by each head's W_UV. The backends see an ordinary
attention call whose keys are its values (a `[1, ...]` cache). Under tensor parallelism the
heads (q_b_proj, kv_b_proj, o_proj) are split and the latent, the same for every head, is
replicated on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.models.model_config import ModelConfig
from workers.models.moe_config import MoEConfig
from workers.models.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
    _check_divisible,
    default_weight_loader,
)
from workers.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from workers.models.mixtral import MixtralForCausalLM
from workers.models.norm import RMSNorm
from workers.models.moe import FusedExperts
from workers.models.rotary import RotaryEmbedding
from workers.models.vocab import ParallelLMHead

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend,
                 shard: Shard) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture} has no multi-head latent attention settings")
        tp_rank, tp_size = shard.tp_rank, shard.tp_size
        self.mla, self.attn_backend = mla, attn_backend
        self.num_heads = _check_divisible(config.num_attention_heads, tp_size,
                                          "num_attention_heads")
        heads, h, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, False, tp_rank, tp_size)
        else:
            self.q_a_proj = ReplicatedLinear(h, mla.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * qk, False, tp_rank,
                                                 tp_size)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, mla.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False, tp_rank,
            tp_size)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, h, bias=bias, tp_rank=tp_rank,
                                        tp_size=tp_size, comm=shard.comm, site="attn")
        theta, scaling = config.rope_of(layer_idx)
        self.rotary_emb = RotaryEmbedding(mla.qk_rope_head_dim, config.max_position_embeddings,
                                          theta, scaling)
        mscale = 1.0 if scaling is None else scaling.softmax_mscale()
        self.scale = qk ** -0.5 * mscale

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        mla, num_tokens = self.mla, x.shape[0]
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, nope + rope).split([nope, rope], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([rank, rope], -1)
        c = self.kv_a_layernorm(c.contiguous())  # [T, rank]
        q_pe, k_pe = self.rotary_emb(positions, self._pairs_first(q_pe),
                                     self._pairs_first(k_pe[:, None, :]))
        # kv_b_proj's rows, per head: W_UK [nope, rank] then W_UV [v, rank]
        w = self.kv_b_proj.weight.view(self.num_heads, nope + mla.v_head_dim, rank)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w[:, :nope])
        latent = torch.cat([c, k_pe[:, 0]], dim=-1)[:, None, :]  # [T, 1, rank + rope]
        out = self.attn_backend.forward(torch.cat([q_latent, q_pe], dim=-1), latent, latent,
                                        kv_cache, meta, scale=self.scale)  # [T, H, rank + rope]
        o = torch.einsum("thr,hvr->thv", out[..., :rank], w[:, nope:])
        return self.o_proj(o.reshape(num_tokens, self.num_heads * mla.v_head_dim))

    def _pairs_first(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved RoPE dims (x0, x1), (x2, x3)... as halves (x0, x2, ...; x1, x3, ...): the
        rotate-half layout, which transformers' interleaved RoPE also leaves them in."""
        if not self.mla.rope_interleave:
            return x
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = MLAttention


class _SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=shard.tp_rank,
                                   tp_size=shard.tp_size, comm=shard.comm)


class DeepseekMTPLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (one depth; checkpoint keys
    `model.layers.{num_hidden_layers}.*`): from the target's hidden state at position i
    before its final norm, h[i], and the embedding of token i + 1, a decoder layer of its own
    (with its own KV cache) predicts token i + 2:

        x[i] = eh_proj([enorm(embed(t[i + 1])); hnorm(h[i])]),   h'[i] = layer(x[i]) at i,
        logits[i] = shared_head.head(shared_head.norm(h'[i])).

    h'[i] (un-normed) can take h[i]'s place for a further depth: drafting more tokens runs
    this one module again on its own output, as vLLM does past a checkpoint's MTP layers. The
    embedding is the target's, which DeepSeek-V3 shares (the checkpoint's copy is not read)."""

    def __init__(self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend,
                 shard: Shard, mlp_name: str, mlp: nn.Module) -> None:
        super().__init__(config, layer_idx, attn_backend, shard, mlp_name, mlp)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.shared_head = _SharedHead(config, shard)

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embeds: the embeddings of tokens i + 1, previous: h[i] (both [T, hidden]), at
        `positions` i -> h'[i] [T, hidden], writing the layer's K/V at i."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        hidden, residual = self(positions, x, None, kv_cache, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """h' [N, hidden] -> the next-next token's logits [N, vocab_size] float32."""
        return self.shared_head.head.compute_logits(self.shared_head.norm(hidden)).float()


def route_deepseek(logits: torch.Tensor, correction: torch.Tensor | None, moe: MoEConfig,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers, as transformers': logits [T, E] fp32 -> (ids [T, k], weights [T, k]
    fp32). V3: experts chosen by sigmoid score + correction, within the `topk_group` best of
    `n_group` groups (a group's score: its two best), weighed by their sigmoid scores
    (renormalized). V2: softmax scores, greedy or within the best groups (a group's score: its
    best expert; the others' scores zeroed). Both scaled by routed_scaling_factor."""
    v3 = moe.deepseek_scoring == "sigmoid"
    scores = logits.sigmoid() if v3 else logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores + correction if v3 and correction is not None else scores
    if moe.groups is not None:
        n_group, topk_group = moe.groups
        tokens, experts = scores.shape
        grouped = choice.view(tokens, n_group, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if v3 else grouped.max(-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, -1, experts // n_group).reshape(tokens, -1)
        choice = choice.masked_fill(~keep.bool(), float("-inf") if v3 else 0.0)
    if v3:
        ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * moe.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """Router (`gate`, fp32, with its correction bias), routed experts, and a shared expert
    (`shared_experts`, a dense MLP added ungated)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        moe = config.moe
        if moe is None or moe.deepseek_scoring is None:
            raise ValueError("a DeepSeek config needs n_routed_experts and num_experts_per_tok")
        self.moe = moe
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts)
        if moe.deepseek_scoring == "sigmoid":  # V3's
            correction = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                                      requires_grad=False)
            # a parameter carries its loader as an attribute of its own (as vLLM's do)
            correction.weight_loader = (  # type: ignore[attr-defined]  # an attribute of our own
                default_weight_loader)
            self.gate.e_score_correction_bias = correction
        self.experts = FusedExperts(moe.num_experts, config.hidden_size, moe.intermediate_size,
                                    shard, shard.comm)
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            self.shared_experts = LlamaMLP(config, shard, moe.shared_expert_intermediate_size,
                                           site="shared_expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        ids, weights = route_deepseek(
            logits, getattr(self.gate, "e_score_correction_bias", None), self.moe)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(MixtralForCausalLM):
    """The first `first_k_dense_replace` layers have a dense MLP, the rest DeepseekMoE. The
    multi-token-prediction layer a checkpoint may carry (the index past num_hidden_layers) is
    built as `mtp` and loaded where `config.mtp_layers` asks for it (it drafts:
    `workers.engine.speculative.mtp`), else skipped by the loader."""

    # read as matrices, never multiplied as layers (the latent attention's `kv_b_proj`, the
    # router's `gate`, in fp32): a quantized checkpoint's copy is dequantized on load, and an
    # int4 self-draft keeps them dense (workers.quant.linear)
    dense_after_load = ("kv_b_proj", "gate")

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, tp_rank: int = 0,
                 tp_size: int = 1, *, shard: Shard | None = None) -> None:
        super().__init__(config, attn_backend, tp_rank, tp_size, shard=shard)
        self.mtp: DeepseekMTPLayer | None = None
        if not config.mtp_layers:
            return
        if config.mtp_layers != 1 or config.num_nextn_predict_layers < 1:
            raise ValueError(f"one multi-token-prediction layer is built, of the checkpoint's "
                             f"num_nextn_predict_layers={config.num_nextn_predict_layers}; got "
                             f"mtp_layers={config.mtp_layers}")
        if not self.model.is_last:
            raise ValueError("a multi-token-prediction layer needs the decoder stack's last "
                             "layers on this rank (no pipeline parallelism)")
        index = config.num_hidden_layers
        self.mtp = DeepseekMTPLayer(config, index, attn_backend, self.shard,
                                    *self.make_mlp(index))

    def make_model(self, config: ModelConfig, attn_backend: AttentionBackend) -> LlamaModel:
        return LlamaModel(config, attn_backend, self.shard, self.make_mlp,
                          layer_cls=DeepseekV3DecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the Llama loader's, the first multi-token-prediction layer's tensors into `mtp`
        (named `mtp.*`) when it is built; the others past the decoder stack skipped."""
        return super().load_weights(self._mtp_names(weights))

    def _mtp_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        first = self.config.num_hidden_layers
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= first:
                rest = name[layer.end():]
                if (self.mtp is None or int(layer.group(1)) != first
                        or rest == "embed_tokens.weight"):  # the target's, shared
                    continue
                name = "mtp." + rest
            yield name, tensor

    def map_name(self, hf_name: str) -> tuple[str, object]:
        if ".self_attn." in hf_name:  # MLA's projections are not Llama's fused q/k/v
            return hf_name, None
        return super().map_name(hf_name)

    def make_mlp(self, layer_idx: int) -> tuple[str, nn.Module]:
        if not self.config.is_moe_layer(layer_idx):
            return "mlp", LlamaMLP(self.config, self.shard)
        return "mlp", DeepseekMoE(self.config, self.shard)
