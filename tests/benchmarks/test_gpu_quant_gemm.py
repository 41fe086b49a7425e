"""benchmarks/gpu_quant_gemm.py on one small shape in Triton's interpreter (no GPU here): every
figure is written, and each kernel's product is x times its dequantized weight."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("gpu_quant_gemm")


def test_a_small_run_reports_both_kernels_against_bf16(bench, tmp_path, capsys):
    result = bench.main(["--shapes", "32x128", "--rows", "1,3", "--out",
                         str(tmp_path / "out.json")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "out.json").read_text()) == result
    assert {k for k in result if k.startswith("n")} == {"n32_k128_m1", "n32_k128_m3"}
    for figures in (result["n32_k128_m1"], result["n32_k128_m3"]):
        assert figures["fp8_vs_bf16_ratio"] > 0 and figures["int4_vs_bf16_ratio"] > 0
        assert figures["fp8_rel_err"] < 1e-5 and figures["int4_rel_err"] < 1e-5
