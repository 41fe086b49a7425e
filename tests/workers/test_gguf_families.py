"""GGUF files of each supported family and tensor type, read by Cleave and by transformers.

The files are written from `make_model` checkpoints the way llama.cpp's converter writes them
(`tests.workers.gguf_files`); transformers' own GGUF loading of the same file is the oracle:
logits within fp32 1e-4, and 32 greedy tokens through the engine identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.gguf_files import WindowedPromptBackend, cleave_logits, write_gguf
from tests.workers.hf_oracle import greedy_reference
from workers import LLM, SamplingParams
from workers.models.loader import WeightLoadError, load_model
from workers.models.make_model import make_model
from workers.models.model_config import ModelConfig
from workers.tokenizer.gguf_file import GGUFError

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TOL = 1e-4
STEPS = 32
# shapes where transformers' GGUF loading reads the file as llama.cpp does: it ignores Llama 3's
# RoPE scaling tensor (tested apart below), Qwen3's and Gemma 3's head size (128 and 256 by
# default) and Gemma 3's attention scale (256; llama.cpp's: the head size); and every sixth
# Gemma 3 layer is global in llama.cpp and transformers' defaults
OVERRIDES = {
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "qwen2": {}, "qwen3": {"head_dim": 128}, "phi3": {},
    "gemma3": {"head_dim": 256, "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
# K-quants need rows of 256 values
K_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64}
CASES = ([("llama", t) for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                 "Q4_K", "Q5_K", "Q6_K")]
         + [("qwen2", "F32"), ("qwen2", "Q8_0"), ("qwen3", "F16"), ("qwen3", "Q4_0"),
            ("gemma3", "F32"), ("gemma3", "Q4_1"), ("phi3", "BF16"), ("phi3", "Q5_1")])
# the engine's greedy decode too (the rest check logits only: the dequantized weights are the
# same path whatever the type)
GREEDY = {("llama", "F32"), ("llama", "Q4_1"), ("llama", "Q6_K"), ("qwen2", "Q8_0"),
          ("qwen3", "Q4_0"), ("gemma3", "Q4_1"), ("phi3", "BF16")}
PROMPTS = [[3, 17, 99, 4, 250, 8, 61, 7, 12, 200, 33, 5, 90, 41, 18, 77, 23, 140, 66, 9,
            101, 55, 2, 180], [42, 7, 300, 11]]


def transformers_gguf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """make_model checkpoints by (family, K-quant shape), written once per module."""
    made: dict[tuple[str, bool], Path] = {}

    def get(arch: str, k_shape: bool) -> Path:
        if (arch, k_shape) not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-hf")
            overrides = {**OVERRIDES[arch], **(K_SHAPE if k_shape else {})}
            made[arch, k_shape] = make_model(folder, arch=arch, preset="tiny",
                                             overrides=overrides)
        return made[arch, k_shape]
    return get


@pytest.mark.parametrize(("arch", "ggml_type"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_logits_and_greedy_tokens_match_transformers_on_the_same_file(
        checkpoints, tmp_path, arch, ggml_type):
    hf_dir = checkpoints(arch, ggml_type.endswith("_K"))
    path = write_gguf(hf_dir, tmp_path / f"{arch}-{ggml_type}.gguf", ggml_type)
    reference = transformers_gguf(path)
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    got = cleave_logits(path, prompt)
    assert expected.std() > 0.3  # not a degenerate comparison
    diff = (got - expected).abs().max().item()
    print(f"GGUF {arch} {ggml_type}: max |logit diff| {diff:.2e}")
    assert diff <= TOL
    if (arch, ggml_type) in GREEDY:
        llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=128)
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
        prompts = PROMPTS[:1]  # 24 tokens and 32 more: past Gemma 3's 16-token window
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            ref = greedy_reference(reference, prompt, STEPS)
            sample = out.outputs[0]
            assert sample.token_ids == ref.tokens
            assert max(abs(lp.logprob - r) for lp, r in
                       zip(sample.logprobs, ref.logprobs)) <= TOL


# llama.cpp's own quantizer, as `benchmarks/peer_llamacpp.py` builds it (cached; not built here:
# that takes most of an hour on two cores)
LLAMA_QUANTIZE = (Path.home() / ".cache/cleave/peer_llamacpp/llama_cpp_python-0.3.36/vendor"
                  / "llama.cpp/build/bin/llama-quantize")
# llama-quantize's mixes: Q4_K_M and Q5_K_M put some tensors in Q6_K, the rest in Q4_K / Q5_K
LLAMA_CPP_TYPES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}


@pytest.mark.skipif(not LLAMA_QUANTIZE.exists(),
                    reason=f"llama.cpp's llama-quantize is not built at {LLAMA_QUANTIZE} "
                           "(python benchmarks/peer_llamacpp.py builds it)")
@pytest.mark.parametrize("mix", sorted(LLAMA_CPP_TYPES))
def test_k_quant_files_made_by_llama_quantize_match_transformers(checkpoints, tmp_path, mix):
    """K-quant files as llama.cpp writes them (its own block search and type mix), not only as
    the gguf package's reference quantizer does: Cleave's logits equal transformers' on the
    same file, and its greedy tokens too."""
    import subprocess

    import gguf

    f32 = write_gguf(checkpoints("llama", True), tmp_path / "f32.gguf", "F32")
    path = tmp_path / f"{mix}.gguf"
    subprocess.run([str(LLAMA_QUANTIZE), str(f32), str(path), mix], check=True,
                   capture_output=True, timeout=120)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert LLAMA_CPP_TYPES[mix] <= types, types  # the file holds the mix's K-quant types
    reference = transformers_gguf(path)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[0]])).logits[0].float()
    assert (cleave_logits(path, PROMPTS[0]) - expected).abs().max().item() <= TOL
    llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[:1], params)
    assert out.outputs[0].token_ids == greedy_reference(reference, PROMPTS[0], STEPS).tokens


def test_llama3_rope_scaling_from_the_rope_freqs_tensor(checkpoints, tmp_path):
    """llama.cpp writes Llama 3's RoPE scaling as per-frequency divisors, which transformers'
    GGUF loading ignores: Cleave reading them gives the logits of the checkpoint the file
    was converted from."""
    hf_dir = make_model(tmp_path / "hf", arch="llama", preset="tiny")  # llama3 scaling
    path = write_gguf(hf_dir, tmp_path / "llama3.gguf", "F32", perturb_norms=False)
    assert ModelConfig.from_pretrained(path).rope_scaling.rope_type == "freq_factors"
    prompt = list(range(1, 120, 2)) * 2  # past the scaled wavelengths
    source = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = source(torch.tensor([prompt])).logits[0].float()
        unscaled = transformers_gguf(path)(torch.tensor([prompt])).logits[0].float()
    assert (unscaled - expected).abs().max().item() > 1e-2  # the scaling matters here
    assert (cleave_logits(path, prompt) - expected).abs().max().item() <= TOL


def test_a_folder_holding_one_gguf_file_is_a_model(checkpoints, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_gguf(checkpoints("qwen2", False), folder / "m.gguf", "Q8_0")
    config = ModelConfig.from_pretrained(folder)
    assert (config.architecture, config.tie_word_embeddings) == ("Qwen2ForCausalLM", True)
    (folder / "other.gguf").write_bytes((folder / "m.gguf").read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        ModelConfig.from_pretrained(folder)


def test_unsupported_files_are_refused_by_name(checkpoints, tmp_path):
    import gguf

    path = write_gguf(checkpoints("llama", False), tmp_path / "m.gguf", "Q8_0")
    config = ModelConfig.from_pretrained(path)
    # another architecture
    other = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        ModelConfig.from_pretrained(tmp_path / "mamba.gguf")
    # a tensor type outside the supported list, found before the model is built
    bad = tmp_path / "iq4.gguf"
    _rewrite(path, bad, lambda name, t: "IQ4_NL" if name == "blk.0.ffn_down.weight" else None)
    with pytest.raises(WeightLoadError, match=r"unsupported types \['blk.0.ffn_down.weight: IQ4_NL'\]"):
        load_model(bad, config, dtype=torch.float32, device="cpu",
                   attn_backend=WindowedPromptBackend())
    # a missing tensor
    short = tmp_path / "short.gguf"
    _rewrite(path, short, lambda name, t: "drop" if name == "blk.1.attn_v.weight" else None)
    with pytest.raises(WeightLoadError, match=r"tensors missing \['blk.1.attn_v.weight'\]"):
        load_model(short, config, dtype=torch.float32, device="cpu",
                   attn_backend=WindowedPromptBackend())
    # a missing metadata key
    nokey = tmp_path / "nokey.gguf"
    _rewrite(path, nokey, lambda name, t: None, drop_key="llama.block_count")
    with pytest.raises(GGUFError, match="lacks the metadata key 'llama.block_count'"):
        ModelConfig.from_pretrained(nokey)


def _rewrite(src: Path, out: Path, change, drop_key: str | None = None) -> None:  # type: ignore[no-untyped-def]
    """`src` copied to `out`: `change(name, tensor)` returns "drop", a GGML type name to store
    the tensor as (random bits of that type's size), or None to keep it."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", drop_key):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for t in reader.tensors:
        action = change(t.name, t)
        if action == "drop":
            continue
        if action is None:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        kind = gguf.GGMLQuantizationType[action]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows, cols = int(t.shape[1]), int(t.shape[0])
        writer.add_tensor(t.name, np.zeros((rows, cols // block * size), dtype=np.uint8),
                          raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
