"""The `cleave` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import cache_dir

CLEAVE = str(Path(sys.executable).with_name("cleave"))


def run(*args: str, env_dir: Path) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([CLEAVE, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CLEAVE_CACHE_DIR=str(cache_dir(env_dir))))


def test_make_model_then_generate_from_it(tmp_path):
    out = tmp_path / "m"
    made = run("make-model", "--arch", "qwen2", "--preset", "tiny", "--out", str(out),
               env_dir=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    gen = run("generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "5",
              "--ignore-eos", env_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    line = json.loads(gen.stdout.splitlines()[0])
    assert line["prompt"] == "hi" and len(line["token_ids"]) == 5


def test_quantize_then_generate_from_it(tmp_path, tiny_model):
    out = tmp_path / "awq"
    made = run("quantize", "--model", tiny_model, "--out", str(out), "--format", "awq",
               "--group-size", "32", "--asymmetric", env_dir=tmp_path)
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "awq" and config["group_size"] == 32
    assert (out / "tokenizer.json").exists()
    gen = run("generate", "--model", str(out), "--dtype", "bfloat16", "--prompt", "hi",
              "--max-tokens", "5", "--ignore-eos", env_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout.splitlines()[0])["token_ids"]) == 5
    bad = run("quantize", "--model", tiny_model, "--out", str(tmp_path / "x"), "--format",
              "gptq", "--group-size", "100", env_dir=tmp_path)
    assert bad.returncode == 2 and "not a multiple of group_size 100" in bad.stderr


def test_quantize_calibrate_writes_gptq_int8_and_generate_reads_it(tmp_path, tiny_model):
    out = tmp_path / "gptq8"
    made = run("quantize", "--model", tiny_model, "--out", str(out), "--format", "gptq",
               "--bits", "8", "--group-size", "-1", "--calibrate", env_dir=tmp_path)
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["bits"] == 8 and config["group_size"] == -1
    gen = run("generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "5",
              "--ignore-eos", env_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout.splitlines()[0])["token_ids"]) == 5


def test_quantize_lm_head_writes_it_and_generate_reads_it(tmp_path, tiny_model):
    out = tmp_path / "ct"
    made = run("quantize", "--model", tiny_model, "--out", str(out), "--format",
               "compressed-tensors", "--group-size", "32", "--quantize-lm-head", env_dir=tmp_path)
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_1"]["targets"] == ["lm_head"]
    gen = run("generate", "--model", str(out), "--dtype", "bfloat16", "--prompt", "hi",
              "--max-tokens", "5", "--ignore-eos", env_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    bad = run("quantize", "--model", tiny_model, "--out", str(tmp_path / "x"), "--format",
              "awq", "--quantize-lm-head", env_dir=tmp_path)
    assert bad.returncode == 2 and "got format 'awq'" in bad.stderr


def test_generate_defaults_to_the_embedded_model(tmp_path):
    gen = run("generate", "--max-tokens", "3", env_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert len(gen.stdout.splitlines()) == 2
    assert any((tmp_path / "cache" / "models").iterdir())  # made in the cache folder


def test_bad_input_is_one_clear_line(tmp_path):
    bad = run("make-model", "--arch", "gpt9", "--out", str(tmp_path / "x"), env_dir=tmp_path)
    assert bad.returncode == 2
    assert "gpt9" in bad.stderr and "llama" in bad.stderr
    bad = run("generate", "--max-tokens", "0", env_dir=tmp_path)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr
    assert not (tmp_path / "cache" / "models").exists()  # refused before a model was made
    missing = str(tmp_path / "no-such-model")
    for command in ("generate", "serve"):  # serve: before it starts a Ray (it took 30 s)
        bad = run(command, "--model", missing, env_dir=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert missing in bad.stderr and "config.json" in bad.stderr


def test_serve_in_process_answers_the_openai_client_then_stops(tmp_path, tiny_model):
    import os
    import signal
    import socket
    import time

    import openai

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = dict(os.environ, CLEAVE_CACHE_DIR=str(cache_dir(tmp_path)))
    proc = subprocess.Popen([CLEAVE, "serve", "--in-process", "--model", tiny_model,
                             "--port", str(ports[0]),
                             "--grpc-port", str(ports[1]), "--api-key", "k1",
                             "--prefill-workers", "1", "--decode-workers", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key="k1",
                               max_retries=0, timeout=10)
        deadline = time.monotonic() + 120
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        name = models.data[0].id
        assert name == Path(tiny_model).name
        long_prompt = "the quick brown fox jumps over the lazy dog " * 20  # past the threshold
        out = client.completions.create(model=name, prompt=long_prompt, max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "unreachable" not in err, err[-2000:]  # stopping is not a worker going missing


def test_every_flag_has_a_help_line():
    """Flags are generated from the settings' definitions, each with its description."""
    import argparse

    from cluster.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    empty = [f"{name} {'/'.join(action.option_strings)}"
             for name, sub in commands.choices.items() for action in sub._actions
             if action.option_strings and not (action.help or "").strip()]
    assert empty == []
    serve = commands.choices["serve"].format_help()
    assert "--disagg-threshold-tokens" in serve and "uncached tokens" in serve
