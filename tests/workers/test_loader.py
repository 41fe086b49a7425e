from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.models.loader import WeightLoadError, load_model, random_weights
from workers.models.model_config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import get_model_class

transformers = pytest.importorskip("transformers")


class PromptOnlyBackend(AttentionBackend):
    """Ignores the cache; causal attention within each sequence. Valid for fresh full prompts."""

    name = "test-prompt-only"

    def forward(self, q, k, v, kv_cache, meta, scale, *, window=None, sinks=None):  # type: ignore[no-untyped-def]
        assert window is None and sinks is None, "full attention only"
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for s, e in zip(starts[:-1], starts[1:]):
            # [H, L, D] per sequence; KV heads repeated for GQA
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            group = q.shape[1] // k.shape[1]
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                      scale=scale).transpose(0, 1)
        return out


def prompt_meta(lengths: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    return AttentionMetadata(
        slot_mapping=torch.arange(total), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.zeros(len(lengths), 1, dtype=torch.int32), num_decodes=0,
        max_query_len=max(lengths), max_seq_len=max(lengths),
        query_start_loc_cpu=starts, seq_lens_cpu=list(lengths),
    )


def run_prompts(model: LlamaForCausalLM, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits [len, vocab] of each prompt, all run as one flat batch."""
    meta = prompt_meta([len(p) for p in prompts])
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    caches = [torch.empty(0)] * model.config.num_hidden_layers
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, caches, meta))
    return list(logits.split([len(p) for p in prompts]))


HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def hf_checkpoint(folder: Path, arch: str) -> Any:
    """A transformers-built fp32 model with weights scaled so logits spread by a few units."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**HF_SHAPE, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "mistral":
        config = transformers.MistralConfig(**HF_SHAPE, sliding_window=None)
    else:
        config = transformers.Qwen2Config(**HF_SHAPE, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # not ones: catches swapped norms
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_logits_match_transformers(tmp_path: Path, arch: str) -> None:
    hf_model = hf_checkpoint(tmp_path, arch)
    config = ModelConfig.from_pretrained(tmp_path)
    model = load_model(tmp_path, config, dtype=torch.float32, device="cpu",
                       attn_backend=PromptOnlyBackend())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 5)]
    ours = run_prompts(model, prompts)
    for prompt, logits in zip(prompts, ours):
        with torch.no_grad():
            expected = hf_model(prompt[None]).logits[0].float()
        assert logits.dtype == torch.float32 and logits.shape == expected.shape
        assert expected.std() > 0.5  # not a degenerate comparison
        assert (logits - expected).abs().max().item() < 1e-4


def tiny_config(**overrides: Any) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **HF_SHAPE,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2}
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


def write_checkpoint(folder: Path, config: ModelConfig, *, drop: str | None = None,
                     replace: dict[str, torch.Tensor] | None = None) -> Path:
    tensors = {n: t for n, t in random_weights(config, seed=0) if n != drop}
    tensors.update(replace or {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def load(path: Path | None, config: ModelConfig, **kwargs: Any) -> LlamaForCausalLM:
    kwargs = {"dtype": torch.float32, "device": "cpu", "attn_backend": PromptOnlyBackend()} | kwargs
    return load_model(path, config, **kwargs)


def no_model_alive() -> bool:
    gc.collect()
    return not any(type(o) is LlamaForCausalLM for o in gc.get_objects())


def test_wrong_shape_names_file_tensor_and_shapes(tmp_path: Path) -> None:
    config = tiny_config()
    bad = "model.layers.0.self_attn.k_proj.weight"
    write_checkpoint(tmp_path, config, replace={bad: torch.zeros(16, 64)})
    with pytest.raises(WeightLoadError) as e:
        load(tmp_path, config)
    message = str(e.value)
    assert "model.safetensors" in message and bad in message
    assert "[32, 64]" in message and "[16, 64]" in message
    del e
    assert no_model_alive()


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, config, drop="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        load(tmp_path, config)


def test_missing_shard_of_fused_projection_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, config, drop="model.layers.0.self_attn.v_proj.weight")
    with pytest.raises(WeightLoadError, match=r"qkv_proj\.weight"):
        load(tmp_path, config)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, config, replace={"model.extra.weight": torch.zeros(3)})
    with pytest.raises(WeightLoadError, match=r"model\.extra\.weight"):
        load(tmp_path, config)


def test_missing_files_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match=rf"{tmp_path}.*model\.safetensors"):
        load(tmp_path, tiny_config())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(WeightLoadError, match="model-00001-of-00002.safetensors"):
        load(tmp_path, tiny_config())


def test_unknown_load_format_lists_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'pt'.*auto.*safetensors.*dummy"):
        load(tmp_path, tiny_config(), load_format="pt")


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    config = tiny_config()
    single = load(write_checkpoint(tmp_path / "single", config), config)
    tensors = dict(random_weights(config, seed=0))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / file))
    index = {"weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load(folder, config)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_dummy_weights_are_reproducible_and_match_the_written_checkpoint(tmp_path: Path) -> None:
    config = tiny_config()
    a = load(None, config, load_format="dummy", seed=3)
    b = load(None, config, load_format="dummy", seed=3)
    c = load(None, config, load_format="dummy", seed=4)
    from_disk = load(write_checkpoint(tmp_path, config), config)
    seed0 = load(None, config, load_format="dummy", seed=0)
    prompt = [torch.arange(10)]
    assert torch.equal(run_prompts(a, prompt)[0], run_prompts(b, prompt)[0])
    assert not torch.equal(run_prompts(a, prompt)[0], run_prompts(c, prompt)[0])
    assert torch.equal(run_prompts(seed0, prompt)[0], run_prompts(from_disk, prompt)[0])
    norm = a.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    logits = run_prompts(a, [torch.arange(32)])[0]
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 1.0 and (top2[:, 0] - top2[:, 1]).mean() > 0.3  # well spread


def test_bf16_load_shares_a_bf16_rope_cache_and_returns_fp32_logits(tmp_path: Path) -> None:
    config = tiny_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                         tie_word_embeddings=True)
    model = load(write_checkpoint(tmp_path, config), config, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # one cos/sin cache in the model's dtype for every layer (transformers rounds it so too)
    caches = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in model.model.layers.values()}
    assert len(caches) == 1
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    reference = load(tmp_path, config)
    prompt = [torch.arange(12)]
    logits, expected = run_prompts(model, prompt)[0], run_prompts(reference, prompt)[0]
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert torch.get_default_dtype() == torch.float32  # restored after building


def test_registry_names_unsupported_architecture() -> None:
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


_TP_WORKER = r"""
import json, sys
import torch
import torch.distributed as dist
from workers.attention import AttentionMetadata, get_backend
from workers.models.loader import load_model
from workers.models.model_config import ModelConfig

rank, world, port, out, raw = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
config = ModelConfig.from_dict(json.loads(raw))
model = load_model(None, config, dtype=torch.float32, device="cpu", attn_backend=get_backend("torch"),
                   load_format="dummy", seed=7, tp_rank=rank, tp_size=world)
n = 24
caches = [torch.zeros(2, 2, 16, model.num_kv_heads, model.head_dim) for _ in model.model.layers]
meta = AttentionMetadata(
    slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
    num_decodes=0, max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
with torch.no_grad():
    logits = model.compute_logits(model(torch.arange(n) * 7 % config.vocab_size, torch.arange(n), caches, meta))
if rank == 0:
    torch.save(logits, out)
dist.destroy_process_group()
"""


def test_tensor_parallel_ranks_reproduce_single_rank_logits(tmp_path: Path) -> None:
    """Two gloo ranks: query heads split, the single KV head replicated, last vocab shard padded."""
    import socket
    import subprocess
    import sys

    tp_size = 2
    raw = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **HF_SHAPE,
           "num_key_value_heads": 1, "vocab_size": 251, "rope_theta": 10000.0}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "logits.pt"
    procs = [subprocess.Popen([sys.executable, "-c", _TP_WORKER, str(rank), str(tp_size), str(port),
                               str(out), json.dumps(raw)]) for rank in range(tp_size)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    config = ModelConfig.from_dict(raw)
    reference = load(None, config, load_format="dummy", seed=7)
    n = 24
    expected = run_prompts(reference, [torch.arange(n) * 7 % config.vocab_size])[0]
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-5, atol=1e-5)
