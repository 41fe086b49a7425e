"""Checks that a parallel layout fits the model and the machine, in the user's terms."""

from __future__ import annotations

from workers.engine.config import EngineConfig
from workers.models.model_config import ModelConfig


def check_parallel(config: EngineConfig, model: ModelConfig, num_devices: int | None) -> None:
    """Raises ValueError naming the setting and what the model (or machine) allows.

    `num_devices`: accelerators available to the ranks (None: not counted, on the CPU, where
    ranks are processes, or where each rank brings its own GPU, as a Ray rank actor does)."""
    tp, pp, ep = (config.tensor_parallel_size, config.pipeline_parallel_size,
                  config.expert_parallel_size)
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_attention_heads={heads}; choose a divisor of {heads}")
    if tp > 1 and kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_key_value_heads={kv_heads}; choose a divisor of {kv_heads} "
                         f"(replicated KV heads are not supported across ranks)")
    if model.intermediate_size % tp and model.moe is None:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"intermediate_size={model.intermediate_size}")
    if model.vocab_size < tp:
        raise ValueError(f"tensor_parallel_size={tp} is larger than vocab_size="
                         f"{model.vocab_size}")
    if pp > model.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the model's "
                         f"num_hidden_layers={model.num_hidden_layers}; each stage needs a layer")
    if ep > 1:
        if model.moe is None:
            raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; "
                             f"{model.architecture} has no experts")
        if model.moe.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} does not divide the model's "
                             f"{model.moe.num_experts} experts")
    if model.moe is not None and ep == 1 and tp > 1:
        inter = model.moe.intermediate_size
        if inter % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' "
                             f"intermediate size {inter}; use expert_parallel_size={tp}")
    if num_devices is not None and tp * pp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs "
                         f"{tp * pp} devices; only {num_devices} are visible")
