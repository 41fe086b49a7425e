"""Quantized checkpoints in the hub's formats, written by `cleave quantize` and served.

Faithfulness: in fp32 the engine's logits equal transformers running the checkpoint as dequantized
by an independent reading of each format (`quant_reference`), and 32 greedy tokens are the same;
where transformers loads the format itself (compressed-tensors, FP8 blocks) it is the oracle too.
In bf16 on the CPU the weights stay packed and the int8/int4 kernels agree with a
dequantize-then-matmul reference.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.workers.hf_oracle import greedy_reference, save_hf_model
from tests.workers.quant_reference import dequantized_model, dequantized_state_dict
from workers import LLM, SamplingParams
from workers.models.loader import WeightLoadError
from workers.quant.linear import QuantizedMatmul
from workers.quant.scheme import parse_quantization
from workers.quant.writer import quantize_checkpoint

STEPS = 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(20, 45))]
TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
FORMATS = {  # name: (format, options)
    "gptq-int4-g32": ("gptq", dict(bits=4, group_size=32)),
    "gptq-int8-channel": ("gptq", dict(bits=8, group_size=None)),
    "gptq-int4-act-order": ("gptq", dict(bits=4, group_size=32, act_order=True)),
    "awq-int4-g32": ("awq", dict(bits=4, group_size=32, symmetric=False)),
    "ct-int4-g32": ("compressed-tensors", dict(bits=4, group_size=32)),
    "ct-int4-g32-asym": ("compressed-tensors", dict(bits=4, group_size=32, symmetric=False)),
    "ct-int8-channel": ("compressed-tensors", dict(bits=8, group_size=None)),
    "ct-int8-g32-asym": ("compressed-tensors", dict(bits=8, group_size=32, symmetric=False)),
    "ct-fp8-channel": ("compressed-tensors-fp8", {}),
    "fp8-block32": ("fp8", dict(block=32)),
    "fp8-tensor": ("fp8", dict(block=None)),
    # the output projection quantized too: as the layers (gptq), int8 per channel (ct)
    "gptq-int4-g32-lm-head": ("gptq", dict(bits=4, group_size=32, lm_head=True)),
    "ct-int4-g32-lm-head-int8": ("compressed-tensors", dict(bits=4, group_size=32,
                                                            lm_head=True)),
}
# transformers reads these itself on the CPU (compressed-tensors' asymmetric packed zero points it
# re-initializes with the wrong shape: transformers 5.24, compressed-tensors 0.20)
TRANSFORMERS_LOADS = ("ct-int4-g32", "ct-int8-channel", "ct-fp8-channel", "fp8-block32")


@pytest.fixture(scope="module")
def full_precision(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("fp")
    return path, save_hf_model("llama", path)


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request, full_precision, tmp_path_factory):
    src, _ = full_precision
    fmt, options = FORMATS[request.param]
    out = quantize_checkpoint(src, tmp_path_factory.mktemp(request.param), fmt, **options)
    model = dequantized_model(out, tmp_path_factory.mktemp("dequantized"))
    refs = [greedy_reference(model, p, STEPS) for p in PROMPTS]
    return request.param, out, refs


def test_fp32_logits_and_tokens_match_transformers_on_the_dequantized_weights(quantized):
    name, path, refs = quantized
    llm = LLM(str(path), block_size=4, num_blocks=64)
    for out, ref in zip(llm.generate(PROMPTS, GREEDY), refs):
        sample = out.outputs[0]
        assert sample.token_ids == ref.tokens, name
        got = [lp.logprob for lp in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(got, ref.logprobs)) <= TOL, name
    if name in TRANSFORMERS_LOADS:  # transformers reading the quantized files itself
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        own = greedy_reference(hf, PROMPTS[0], 8)
        assert own.tokens == refs[0].tokens[:8]
        assert max(abs(a - b) for a, b in zip(own.logprobs, refs[0].logprobs)) <= TOL


def modules_with_kernels(llm: LLM) -> dict[str, str]:
    model = llm.engine.runner.executor.model
    return {name: m.matmul.kernel for name, m in model.named_modules()
            if isinstance(getattr(m, "matmul", None), QuantizedMatmul)}


@pytest.mark.parametrize("arch", ["mixtral", "phi3", "deepseek_v3"])
def test_other_families_read_quantized_weights(arch, tmp_path):
    """Experts and latent attention dequantized on load; phi3's fused tensors split."""
    src = tmp_path / "fp"
    save_hf_model(arch, src)
    path = quantize_checkpoint(src, tmp_path / "q", "gptq", bits=4, group_size=16)
    model = dequantized_model(path, tmp_path / "dequantized")
    ref = greedy_reference(model, PROMPTS[0], 16)
    llm = LLM(str(path), block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    sample = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert sample.token_ids == ref.tokens
    assert max(abs(a.logprob - b) for a, b in zip(sample.logprobs, ref.logprobs)) <= TOL


@pytest.mark.parametrize("name", ["gptq-int8-channel", "ct-int4-g32-asym"])
def test_bf16_keeps_weights_packed_and_the_kernels_match_the_reference(name, full_precision,
                                                                     tmp_path):
    src, _ = full_precision
    fmt, options = FORMATS[name]
    path = quantize_checkpoint(src, tmp_path / name, fmt, **options)
    llm = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64)
    kernels = modules_with_kernels(llm)
    want = "int8" if "int8" in name else "int4"
    # every projection of both layers is packed: q/k/v, o, gate/up, down
    assert sorted(set(kernels.values())) == [want] and len(kernels) == 8
    reference = dequantized_state_dict(path)
    model = llm.engine.runner.executor.model
    layer = model.model.layers[0]
    w = reference["model.layers.0.mlp.down_proj.weight"]
    for rows in (5, 16):  # int8: weight-only below 8 rows, int8 activations from 8 rows on
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        got = layer.mlp.down_proj(x).float()
        want_y = x.float() @ w.t()
        assert (got - want_y).abs().max() <= 0.02 * want_y.abs().max()
    packed_bytes = sum(b.numel() * b.element_size() for b in layer.mlp.down_proj.buffers())
    # against bf16: int8 one byte and a scale per row; int4 half a byte and, per 32 columns
    # here, an fp32 scale and offset (a quarter byte more)
    assert packed_bytes < w.numel() * 2 * (0.6 if want == "int8" else 0.4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)


@pytest.mark.parametrize("options", [dict(dtype="bfloat16"),
                                     dict(dtype="float32", fp32_int_kernels=True)])
def test_grouped_int8_runs_dequantized_where_no_kernel_reads_its_groups(options, full_precision,
                                                                        tmp_path):
    """int8 with a scale per 32 columns: no int kernel takes per-group int8 scales, so the
    layers hold the dequantized weight (equal to the format's own reading) in either dtype."""
    src, _ = full_precision
    fmt, quant = FORMATS["ct-int8-g32-asym"]
    path = quantize_checkpoint(src, tmp_path / "g32", fmt, **quant)
    llm = LLM(str(path), block_size=4, num_blocks=64, **options)
    assert modules_with_kernels(llm) == {}
    want = dequantized_state_dict(path)["model.layers.0.mlp.down_proj.weight"]
    got = llm.engine.runner.executor.model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(got.float(), want.to(got.dtype).float())


def test_tensor_parallel_shards_packed_weights_and_scales(full_precision, tmp_path):
    src, _ = full_precision
    path = quantize_checkpoint(src, tmp_path / "ct4", "compressed-tensors", bits=4,
                               group_size=32, symmetric=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    single = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, params)]
    llm = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.close()
    assert got == want


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 fmt 'e5m2'"),
    ({"quant_method": "gptq", "bits": 4, "lm_head": "yes"}, "gptq lm_head 'yes'"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"targets": ["Linear"]}, "b": {"targets": ["re:.*mlp.*"]}}},
     r"targeting \[\['Linear'\], \['re:.\*mlp.\*'\]\]"),
    ({"quant_method": "mxfp4"}, "'mxfp4' is not supported"),
])
def test_unsupported_variants_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization({"quantization_config": config})


def test_a_module_missing_a_part_names_it(full_precision, tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = full_precision
    path = quantize_checkpoint(src, tmp_path / "gptq", "gptq", bits=4, group_size=32)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(file))
    with pytest.raises(WeightLoadError, match=r"'model.layers.1.mlp.up_proj' lacks tensors "
                                              r"\['scales'\]"):
        LLM(str(path), block_size=4, num_blocks=64)


def test_quantize_refuses_a_group_size_that_does_not_divide(full_precision, tmp_path):
    src, _ = full_precision
    with pytest.raises(ValueError, match="input size 64 is not a multiple of group_size 128"):
        quantize_checkpoint(src, tmp_path / "bad", "gptq", bits=4, group_size=128)
    config = json.loads((src / "config.json").read_text())
    assert "quantization_config" not in config


def test_bf16_keeps_a_quantized_lm_head_packed_and_its_logits_match_the_reference(
        full_precision, tmp_path):
    src, _ = full_precision
    path = quantize_checkpoint(src, tmp_path / "ct", "compressed-tensors", bits=4,
                               group_size=32, lm_head=True)
    scheme = parse_quantization(json.loads((path / "config.json").read_text()))
    assert (scheme.bits, scheme.lm_head.bits, scheme.lm_head.group_size) == (4, 8, None)
    llm = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64)
    assert modules_with_kernels(llm)["lm_head"] == "int8"
    lm_head = llm.engine.runner.executor.model.lm_head
    w = dequantized_state_dict(path)["lm_head.weight"]
    x = torch.randn(3, w.shape[1], dtype=torch.bfloat16)
    got, want = lm_head.compute_logits(x).float(), x.float() @ w.t()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    packed_bytes = sum(b.numel() * b.element_size() for b in lm_head.buffers())
    assert packed_bytes < w.numel() * 2 * 0.6  # a byte and a scale per row, against bf16


def test_tensor_parallel_splits_a_quantized_lm_head_by_vocabulary(full_precision, tmp_path):
    src, _ = full_precision
    path = quantize_checkpoint(src, tmp_path / "ct", "compressed-tensors", bits=4,
                               group_size=32, lm_head=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    single = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64)
    want = [o.outputs[0] for o in single.generate(PROMPTS, params)]
    llm = LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64, tensor_parallel_size=2)
    try:
        got = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):  # each rank's rows are the same rows, scaled the same
        assert max(abs(a.logprob - b.logprob) for a, b in zip(g.logprobs, w.logprobs)) <= 0.05


def test_a_tied_lm_head_is_not_quantized(tmp_path):
    src = tmp_path / "qwen2"
    save_hf_model("qwen2", src)  # tie_word_embeddings
    with pytest.raises(ValueError, match="ties lm_head to its input embedding"):
        quantize_checkpoint(src, tmp_path / "q", "gptq", bits=4, group_size=32, lm_head=True)
    path = quantize_checkpoint(src, tmp_path / "q2", "gptq", bits=4, group_size=32)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["lm_head"] = True  # a config that says otherwise
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'lm_head' is tied to the input embedding"):
        LLM(str(path), dtype="bfloat16", block_size=4, num_blocks=64)
