"""benchmarks/quantized_decode.py end to end at a tiny shape: every variant decodes, its weights
take the bytes each format should, and the last line carries the ratios."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.conftest import import_benchmark

TINY = ("hidden_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=256,vocab_size=512")


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("quantized_decode")


def test_a_tiny_run_reports_every_variant_against_fp32(bench, tmp_path, capsys):
    result = bench.main(["--shape", TINY, "--group-size", "32", "--batches", "1,2",
                         "--new-tokens", "3", "--prompt-len", "8", "--cache",
                         str(tmp_path / "cache"), "--out", str(tmp_path / "out.json")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "out.json").read_text()) == result
    runs = result["runs"]
    variants = ("fp32", "bf16", "int8", "int4", "int8_f32", "int4_f32")
    assert set(runs) == {f"{v}_batch{b}" for v in variants for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 and 0 < r["fraction_of_bound"] for r in runs.values())
    # the decoder's projections: int8 reads about a quarter of fp32's bytes, int4 an eighth
    # (plus the int8 output projection and the norms)
    fp32, bf16 = runs["fp32_batch1"]["weight_bytes"], runs["bf16_batch1"]["weight_bytes"]
    assert bf16 == fp32 // 2
    assert runs["int4_batch1"]["weight_bytes"] < runs["int8_batch1"]["weight_bytes"] < bf16
    from workers.kernels import int_gemm as int_kernels

    if int_kernels.available():  # fp32_int_kernels keeps them packed (else: dequantized)
        assert runs["int8_f32_batch1"]["weight_bytes"] < bf16
        assert runs["int4_f32_batch1"]["weight_bytes"] < runs["int8_f32_batch1"]["weight_bytes"]
    ratios = [k for k in result if k.endswith("_ratio")]
    assert len(ratios) == 10 and all(result[k] > 0 for k in ratios)
    assert result["int_variants_lm_head"] == "int8"
