"""Checkpoints written by transformers itself, and transformers as the oracle for greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def save_hf_model(arch: str, out: Path, seed: int = 0, **overrides: int) -> torch.nn.Module:
    """A small random model of `arch` saved with `save_pretrained` in fp32; returns it (eval).
    `overrides`: sizes other than `TINY`'s (e.g. `num_key_value_heads=4`)."""
    import transformers as tf

    tiny = {**TINY, **overrides}

    if arch == "llama":  # GQA with llama3 rope scaling, as Llama 3.1 ships
        config = tf.LlamaConfig(**tiny, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":  # a sliding window shorter than the longer prompts
        config, cls = tf.MistralConfig(**tiny, sliding_window=12), tf.MistralForCausalLM
    elif arch == "qwen2":
        config, cls = tf.Qwen2Config(**tiny, tie_word_embeddings=True), tf.Qwen2ForCausalLM
    elif arch == "mixtral":  # 4 experts, top-2, renormalized
        config = tf.MixtralConfig(**{**tiny, "intermediate_size": 64}, num_local_experts=4,
                                  num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif arch == "qwen2_moe":  # 4 experts, top-2, not renormalized, a gated shared expert
        config = tf.Qwen2MoeConfig(**tiny, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, shared_expert_intermediate_size=64)
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "qwen3":  # q/k norm; a head_dim other than hidden / heads; o_proj bias
        config = tf.Qwen3Config(**{**tiny, "head_dim": 24}, attention_bias=True)
        cls = tf.Qwen3ForCausalLM
    elif arch == "qwen3_moe":  # q/k norm, 4 experts, top-2 renormalized, no shared expert
        config = tf.Qwen3MoeConfig(**tiny, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True)
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "phi3":  # fused qkv and gate_up tensors; GQA
        config = tf.Phi3Config(**tiny, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.Phi3ForCausalLM
    elif arch == "gemma3":  # one local layer (window 8, its own RoPE base), one global layer
        config = tf.Gemma3TextConfig(
            **tiny, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
            query_pre_attn_scalar=20, final_logit_softcapping=30.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
        cls = tf.Gemma3ForCausalLM
    elif arch == "gpt_oss":  # sinks, a window-8 layer then a global one, YaRN, biased experts
        config = tf.GptOssConfig(
            **{**tiny, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=8, head_dim=16,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                             "original_max_position_embeddings": 128})
        cls = tf.GptOssForCausalLM
    elif arch == "deepseek_v2":  # V2-Lite's shape: no low-rank query, softmax routing, groups
        config = tf.DeepseekV2Config(
            **{**tiny, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", routed_scaling_factor=1.5,
            first_k_dense_replace=1, kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=24, q_lora_rank=None)
        cls = tf.DeepseekV2ForCausalLM
    elif arch == "deepseek_v3":
        # MLA (latent 48 + 16), YaRN with DeepSeek's softmax mscale, one dense layer, then 8
        # experts in 2 groups (1 chosen), top-2, a shared expert
        config = tf.DeepseekV3Config(
            **{**tiny, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=24, q_lora_rank=32,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "rope_theta": 10000.0, "original_max_position_embeddings": 128})
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():  # spread the logits so greedy argmax has no near-ties
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):  # large enough to take real weight from the keys
                p.uniform_(-2.0, 2.0)
            elif "norm" not in name:
                p.normal_(0.0, 0.08)
            elif arch == "gemma3":  # stored as offsets from one; not zero: they must be loaded
                p.uniform_(-0.5, 0.5)
            elif "q_norm" in name or "k_norm" in name or "a_layernorm" in name:  # loaded?
                p.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():  # DeepSeek's router correction bias
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    model.save_pretrained(out)
    return model


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # greedy continuation
    logprobs: list[float]  # log p of each continuation token
    prompt_logprobs: list[float]  # log p of prompt tokens 1..n-1 given their prefix


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> Reference:
    """Greedy decoding by full recomputation each step: no cache, no padding, no processors."""
    ids = list(prompt)
    tokens, logprobs = [], []
    first = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    prompt_lp = [first[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    last = first[-1]
    for _ in range(steps):
        token = int(last.argmax())
        tokens.append(token)
        logprobs.append(last[token].item())
        ids.append(token)
        last = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return Reference(tokens, logprobs, prompt_lp)


def peft_adapter(base: torch.nn.Module, folder: Path, targets: list[str], rank: int,
                 alpha: float, rslora: bool, seed: int,
                 parameters: list[str] | None = None) -> torch.nn.Module:
    """A PEFT LoRA (`get_peft_model`) on a copy of `base`, its A and B drawn at random (PEFT
    starts B at zero: the adapter would change nothing), saved by `save_pretrained`; returns
    the PEFT model (the oracle). `parameters`: PEFT's `target_parameters` (an MoE's experts).
    Needs PEFT (the test extras)."""
    import copy

    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or None,
                             target_parameters=parameters, lora_dropout=0.0,
                             use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(folder)
    return model


# PEFT's module names on every family's attention and dense MLP
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# adapter name -> (targets, rank, alpha, rsLoRA[, target_parameters]): attention-only and
# attention + MLP, two ranks
DENSE_ADAPTERS = {"attn": (ATTENTION, 4, 8, False), "full": (ATTENTION + MLP, 8, 16, True)}
# an MoE's experts are 3-D parameters in transformers, which PEFT reaches by target_parameters
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# an MoE's: attention only, and attention + its experts (the families whose experts take LoRA:
# Qwen2/3-MoE's and Mixtral's here, DeepSeek's too but its MLA has none of `ATTENTION`; the
# others' `MOE_ADAPTERS` stay on the attention)
MOE_ADAPTERS = {"attn": (ATTENTION, 4, 8, False),
                "qvo": (["q_proj", "v_proj", "o_proj"], 8, 16, True, EXPERTS)}
EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")


def peft_family(arch: str, root: Path, prompts: list[list[int]], steps: int,
                extra: dict[str, tuple] | None = None
                ) -> tuple[str, dict[str, Path], dict[tuple[str | None, tuple[int, ...]],
                                                      Reference]]:
    """A checkpoint of `arch` under `root`, PEFT adapters on it (`DENSE_ADAPTERS`, or
    `MOE_ADAPTERS` for an MoE, then `extra`'s, specs as theirs), and the greedy references of
    each prompt under each adapter and the base model (None): (checkpoint, adapter folders,
    references)."""
    base = save_hf_model(arch, root / "base")
    specs = {**(MOE_ADAPTERS if arch in MOE_FAMILIES else DENSE_ADAPTERS), **(extra or {})}
    if arch not in EXPERT_FAMILIES:  # an MoE whose experts are refused: its attention only
        specs = {n: spec[:4] for n, spec in specs.items()}
    folders: dict[str, Path] = {}
    refs = {(None, tuple(p)): greedy_reference(base, p, steps) for p in prompts}
    for seed, (name, spec) in enumerate(specs.items()):
        folders[name] = root / name
        model = peft_adapter(base, folders[name], *spec[:4], seed=seed,
                             parameters=spec[4] if len(spec) > 4 else None)
        for prompt in prompts:
            refs[name, tuple(prompt)] = greedy_reference(model, prompt, steps)
    return str(root / "base"), folders, refs
