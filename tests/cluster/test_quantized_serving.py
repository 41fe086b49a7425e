"""A quantized checkpoint with an 8-bit KV cache, served as users run it: the cluster config's
`model.dtype` and `pools.*.engine.kv_cache_dtype`, a prefill and a decode pool, the HTTP API."""

from __future__ import annotations

import httpx
import pytest

from cluster.config import CleaveConfig, ConfigError
from cluster.local_server import LocalServer
from cluster.settings import in_process_plan
from tests.cluster.conftest import free_ports
from workers import LLM, SamplingParams
from workers.quant.writer import quantize_checkpoint


def test_a_handed_off_request_serves_the_offline_text(tiny_model, tmp_path):
    model = str(quantize_checkpoint(tiny_model, tmp_path / "awq", "awq", group_size=32))
    http, grpc = free_ports(2)
    pool = {"engine": {"num_blocks": 64, "kv_cache_dtype": "int8"}}
    config = CleaveConfig.parse({
        "model": {"path": model, "served_model_name": "awq", "dtype": "bfloat16"},
        "pools": {"prefill": pool, "decode": pool},
        "router": {"http_port": http, "grpc_port": grpc, "disagg_threshold_tokens": 8}})
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    expected = LLM(model, dtype="bfloat16", kv_cache_dtype="int8").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    server = LocalServer(in_process_plan(config, model)).start()
    try:
        for worker in server.workers:
            assert worker.engine.runner.kv_caches[0].dtype.itemsize == 1  # 8-bit blocks
        out = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=60, json={
            "model": "awq", "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert out["choices"][0]["text"] == expected.outputs[0].text
        assert server.router.counters.num_disaggregated == 1
    finally:
        server.stop()


def test_pools_must_agree_on_the_kv_cache_dtype(tiny_model):
    with pytest.raises(ConfigError, match="same engine.kv_cache_dtype"):
        CleaveConfig.parse({"model": {"path": tiny_model}, "pools": {
            "prefill": {"engine": {"kv_cache_dtype": "int8"}}, "decode": {}}})
