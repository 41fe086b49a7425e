"""Multi-head latent attention settings (DeepSeek-V2/V3) of a Hugging Face `config.json`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), in the HF config's terms."""

    q_lora_rank: int | None  # None: one q_proj (no low-rank query)
    kv_lora_rank: int  # the compressed KV latent's size
    qk_nope_head_dim: int  # per head, the part of q/k without RoPE
    qk_rope_head_dim: int  # per head (and shared by all heads for k), the RoPE part
    v_head_dim: int
    rope_interleave: bool  # the RoPE dims stored in interleaved pairs (transformers' default)

    @property
    def latent_dim(self) -> int:
        """Cached per token and layer: the normed latent and the rotated shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def parse_mla(raw: Mapping[str, Any], model_type: str) -> MLAConfig:
    """DeepSeek-V2's or -V3's latent attention settings from its config.json (V2's RoPE pairs
    are always interleaved)."""
    q_lora = raw.get("q_lora_rank")
    return MLAConfig(q_lora_rank=None if q_lora is None else int(q_lora),
                     kv_lora_rank=int(raw["kv_lora_rank"]),
                     qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                     qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                     v_head_dim=int(raw["v_head_dim"]),
                     rope_interleave=model_type == "deepseek_v2"
                     or bool(raw.get("rope_interleave", True)))
