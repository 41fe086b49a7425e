"""Model implementations by the HF architecture name in `config.json`."""

from __future__ import annotations

from workers.models.deepseek import DeepseekV3ForCausalLM
from workers.models.gemma3 import Gemma3ForCausalLM
from workers.models.gpt_oss import GptOssForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2_moe import Qwen2MoeForCausalLM

# every family derives from Llama's: one interface (forward, compute_logits, load_weights)
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # Llama's, with q/k norm
    "Qwen3MoeForCausalLM": Qwen2MoeForCausalLM,  # Qwen2-MoE's, with q/k norm and no shared expert
    "Phi3ForCausalLM": Phi3ForCausalLM,  # Llama's, from fused qkv and gate_up tensors
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # Llama's, with Gemma's norms and local layers
    "GptOssForCausalLM": GptOssForCausalLM,  # Mixtral's, with sinks, biases, stacked experts
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,  # latent attention, grouped sigmoid routing
    "DeepseekV2ForCausalLM": DeepseekV3ForCausalLM,  # the same, with V2's softmax routing
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing `architecture` (e.g. "LlamaForCausalLM")."""
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]

