from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from workers.models.checkpoint_shapes import hf_weight_shapes
from workers.models.loader import load_model
from workers.models.make_model import PRESETS, default_model_path, make_model
from workers.models.model_config import ModelConfig
from workers.models.llama import LlamaForCausalLM

transformers = pytest.importorskip("transformers")
pytest.importorskip("workers.tokenizer.build", reason="tokenizer builder not written yet")


def torch_backend():  # type: ignore[no-untyped-def]
    from workers.attention import get_backend

    return get_backend("torch")


def prompt_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits [len, vocab] of one fresh prompt through the real paged torch backend."""
    from workers.attention.backend import AttentionMetadata

    config, n, block_size = model.config, len(ids), 16
    num_blocks = (n + block_size - 1) // block_size
    planes = 1 if config.mla is not None else 2  # a latent cache: one plane
    caches = [torch.zeros(planes, num_blocks, block_size, config.kv_cache_heads,
                          config.kv_cache_head_dim) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], num_decodes=0,
        max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta))


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.suffix in (".safetensors", ".json") and p.name != "config.json"}


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = file_bytes(make_model(tmp_path / "a", seed=5))
    b = file_bytes(make_model(tmp_path / "b", seed=5))
    c = file_bytes(make_model(tmp_path / "c", seed=6))
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= set(a)
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3",
                                  "qwen3_moe", "phi3", "gemma3",
                                  "gpt_oss", "deepseek_v3"])
def test_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path: Path, arch: str) -> None:
    path = make_model(tmp_path, arch=arch)
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                   "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                                   "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                   "qwen3_moe": "Qwen3MoeForCausalLM",
                                   "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                   "gpt_oss": "GptOssForCausalLM",
                                   "deepseek_v3": "DeepseekV3ForCausalLM"}[arch]
    assert (config.moe is not None) == (arch in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss",
                                                 "deepseek_v3"))
    assert (config.mla is not None) == (arch == "deepseek_v3")
    assert config.attention_sinks == (arch == "gpt_oss")
    assert config.qk_norm == (arch.startswith("qwen3") or arch == "gemma3")
    assert config.tie_word_embeddings == (arch in ("qwen2", "gemma3"))
    # Gemma 3: a local layer with a 16-token window, then a global one
    assert config.window_of(0) == (16 if arch in ("gemma3", "gpt_oss") else None)
    assert config.window_of(1) is None
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = load_model(path, config, dtype=torch.float32, device="cpu",
                      attn_backend=torch_backend())
    ids = torch.arange(3, 40)  # longer than Gemma's window
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    logits = prompt_logits(ours, ids)
    assert (logits - expected).abs().max() < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_config_carries_the_tokenizer_ids(tmp_path: Path) -> None:
    path = make_model(tmp_path, arch="llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    config = ModelConfig.from_pretrained(path)
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_ids[0] == tokenizer.eos_token_id
    assert len(tokenizer) <= config.vocab_size
    assert config.torch_dtype == "float32" and config.rope_scaling is not None


def test_large_checkpoints_are_sharded_with_an_index(tmp_path: Path) -> None:
    path = make_model(tmp_path / "sharded", max_shard_bytes=200_000, dtype="bfloat16")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert not (path / "model.safetensors").exists()
    single = make_model(tmp_path / "single", dtype="bfloat16")
    config = ModelConfig.from_pretrained(path)
    assert config.torch_dtype == "bfloat16"
    models = [load_model(p, config, dtype=torch.bfloat16, device="cpu",
                         attn_backend=torch_backend()) for p in (path, single)]
    for (name, a), (_, b) in zip(*(m.state_dict().items() for m in models)):
        assert torch.equal(a, b), name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert hf_model.dtype == torch.bfloat16


def test_overrides_change_the_written_config(tmp_path: Path) -> None:
    path = make_model(tmp_path, arch="mistral", overrides={"num_hidden_layers": 1})
    assert ModelConfig.from_pretrained(path).num_hidden_layers == 1


def test_presets_have_the_advertised_sizes() -> None:
    def num_params(preset: str) -> int:
        p = PRESETS[preset]
        config = ModelConfig.from_dict({
            "architectures": ["LlamaForCausalLM"], **{
                k: getattr(p, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "max_position_embeddings")}})
        return sum(torch.Size(shape).numel() for _, shape in hf_weight_shapes(config))

    assert num_params("llama-3-8b") == 8_030_261_248  # Meta-Llama-3-8B
    assert 10e6 < num_params("small") < 100e6
    assert num_params("tiny") < 1e6


def test_unknown_arch_or_preset_lists_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'gpt2'.*llama.*mistral.*qwen2"):
        make_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="'huge'.*llama-3-8b.*small.*tiny"):
        make_model(tmp_path, preset="huge")


def test_default_model_is_built_once_even_when_processes_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLEAVE_CACHE_DIR", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: default_model_path(), range(3)))
    assert len(set(paths)) == 1
    path = paths[0]
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny-llama-")
    assert os.listdir(path.parent) == [path.name]  # losers cleaned up their temp folders
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert ModelConfig.from_pretrained(path).hidden_size == PRESETS["tiny"].hidden_size


def test_config_only_checkpoint_with_dummy_weights_generates_like_the_written_one(
        tmp_path, tiny_model):
    from workers import LLM, SamplingParams
    from workers.models.make_model import make_model

    bare = make_model(tmp_path / "bare", arch="llama", preset="tiny", weights=False)
    assert not list(bare.glob("*.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = LLM(tiny_model, num_blocks=64).generate(["hello"], params)[0].outputs[0].token_ids
    got = LLM(str(bare), load_format="dummy", num_blocks=64).generate(["hello"], params)
    assert got[0].outputs[0].token_ids == want


@pytest.mark.parametrize("arch,earlier,prompt_end,stops", [
    ("gpt_oss", {"content": "Hello", "thinking": "why"}, "<|end|><|start|>assistant",
     ["<|return|>", "<|call|>", "<|endoftext|>"]),
    ("deepseek_v3", {"content": "<think>why</think>Hello"},
     "<｜User｜>2+2?<｜Assistant｜><think>\n", ["<｜end▁of▁sentence｜>"])])
def test_reasoning_checkpoints_get_their_own_chat_templates(
        tmp_path: Path, arch: str, earlier: dict, prompt_end: str, stops: list[str]) -> None:
    """gpt-oss: Harmony's messages; DeepSeek: R1's turns, the thinking block opened. An earlier
    answer's reasoning is dropped, and transformers renders the template the same way."""
    from workers.tokenizer import Tokenizer

    path = make_model(tmp_path, arch=arch)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", **earlier}, {"role": "user", "content": "2+2?"}]
    ours = Tokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.endswith(prompt_end) and "Be brief." in ours and "why" not in ours
    assert "<|im_start|>" not in ours
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(hf.convert_ids_to_tokens(eos if isinstance(eos, list) else [eos])) == \
        sorted(stops)


def test_the_harmony_template_renders_tools_calls_and_results_as_gpt_oss_does(tmp_path: Path):
    """gpt-oss's published template's rendering: the functions namespace (parameters as
    TypeScript types) in the developer message, an earlier call addressed to its function on
    the commentary channel (its reasoning kept while no answer followed), the tool's result
    from that function; transformers renders it the same way."""
    from workers.tokenizer import Tokenizer

    path = make_model(tmp_path, arch="gpt_oss")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather now", "parameters": {
            "type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "description": "A city"},
                "unit": {"enum": ["c", "f"]}, "days": {"type": "array",
                                                     "items": {"type": "integer"}}}}}},
             {"type": "function", "function": {"name": "get_time"}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "thinking": "Look it up.", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ours = Tokenizer.from_pretrained(str(path)).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert ours == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                          tokenize=False)
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in ours
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
            "## functions\n\nnamespace functions {\n\n// Weather now\ntype get_weather = (_: {\n"
            "// A city\ncity: string,\nunit?: \"c\" | \"f\",\ndays?: number[],\n}) => any;\n\n"
            "type get_time = () => any;\n\n} // namespace functions<|end|>") in ours
    assert ours.endswith(
        "<|start|>user<|message|>Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant")
    without = Tokenizer.from_pretrained(str(path)).apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False)
    assert "namespace functions" not in without and "Calls to these tools" not in without
