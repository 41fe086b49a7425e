"""`cleave chat` as a user runs it: a real child process on a pseudo-terminal, typing questions
to a real server (the tiny model, in this test's process) and reading the streamed answers."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.cluster.conftest import free_ports

pytestmark = pytest.mark.timeout(300)

CLEAVE = str(Path(sys.executable).with_name("cleave"))
ROOT = Path(__file__).resolve().parents[2]
KEY = "chat-key"
WAIT_S = 90.0  # one line's deadline: a Python start and an answer on 2 busy cores
# the child's controlling terminal is its stdin, a pty, so Ctrl-C there is a SIGINT
# (subprocess starts it in a new session; pty.fork would fork this threaded process); it starts
# with SIGINT ignored, as a shell's background job does (CI's was): Ctrl-C must still work
CONTROLLING_TTY = ("import fcntl, os, signal, sys, termios; "
                   "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                   "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.argv[1], sys.argv[1:])")
USAGE = (r"cleave chat: usage: messages=(\d+) prompt_tokens=(\d+) "
                   r"completion_tokens=(\d+)")


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = LocalServer(LocalServeConfig(tiny_model, num_workers=1, http_port=0, grpc_port=0,
                                       router={"api_keys": (KEY,)})).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}/v1"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLEAVE_API_KEY", "OPENAI_API_KEY")}
    return dict(env, PYTHONPATH=str(ROOT), TERM="dumb", **extra)


class Terminal:
    """`cleave chat` on a pseudo-terminal: type lines, wait for what it prints (bounded)."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        import pty

        master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-c", CONTROLLING_TTY, CLEAVE, "chat",
                                      *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.fd = master
        self.out = b""
        self.pos = 0  # what `expect` has matched so far

    def text(self) -> str:
        return self.out.decode(errors="replace")

    def _read(self, deadline: float) -> bool:
        """Read what is there before `deadline`; False at the end of the child's output."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.out += data
        return bool(data)

    def expect(self, pattern: str, timeout_s: float = WAIT_S) -> re.Match:
        """The first match of `pattern` in what was printed since the last match."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.compile(pattern, re.DOTALL).search(self.text(), self.pos)
            if found:
                self.pos = found.end()
                return found
            if time.monotonic() > deadline or not self._read(deadline):
                raise AssertionError(f"no {pattern!r} within {timeout_s}s; the terminal "
                                     f"showed:\n{self.text()[self.pos:]}")

    def type(self, keys: str) -> None:
        self.expect(r"> ")  # the prompt
        os.write(self.fd, keys.encode())

    def exit_code(self, timeout_s: float = WAIT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(min(deadline, time.monotonic() + 0.2))
        if self.proc.poll() is None:
            raise AssertionError(f"still running after {timeout_s}s; the terminal showed:\n"
                                 f"{self.text()[self.pos:]!r}")
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.fd)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []

    def open_terminal(*args: str, **env: str) -> Terminal:
        opened.append(Terminal(*args, env=child_env(**env)))
        return opened[-1]

    yield open_terminal
    for term in opened:
        term.close()


def ask(term: Terminal, question: str) -> tuple[str, int, int, int]:
    """Type a question; the streamed answer as shown, and the request's messages, prompt
    tokens and completion tokens (the server's usage, printed by --verbose)."""
    term.type(question + "\n")
    term.expect(re.escape(question) + r"\r?\n")  # the echo of what was typed
    start = term.pos
    usage = term.expect(USAGE)
    answer = term.text()[start:usage.start()]
    return answer, *map(int, usage.groups())


def test_answers_stream_with_the_history_until_clear_and_exit(terminals, url, server):
    term = terminals("--url", url, "--verbose", "--max-tokens", "8", "--temperature", "0",
                     CLEAVE_API_KEY=KEY)
    term.expect(f"cleave chat: {re.escape(server.router.model_name)} at {re.escape(url)}")
    answer, messages, first_prompt, completion = ask(term, "What is the capital of France?")
    assert messages == 1 and completion > 0
    assert answer.strip("\r\n")  # the tiny model's random text, streamed to the terminal
    _, messages, prompt, _ = ask(term, "And of Italy?")
    assert messages == 3  # the first question and its answer were sent again
    assert prompt > first_prompt + completion // 2
    term.type("/clear\n")
    term.expect("cleave chat: conversation cleared")
    _, messages, prompt, _ = ask(term, "What is the capital of France?")
    assert (messages, prompt) == (1, first_prompt)  # as the first time: history forgotten
    term.type("/exit\n")
    assert term.exit_code() == 0


def test_a_system_prompt_goes_first_in_every_request_and_stays_after_clear(terminals, url):
    term = terminals("--url", url, "--api-key", KEY, "--verbose", "--max-tokens", "2",
                     "--system", "You answer in one sentence.")
    _, messages, with_system, _ = ask(term, "hello")
    assert messages == 2
    term.type("/clear\n")
    _, messages, prompt, _ = ask(term, "hello")
    assert (messages, prompt) == (2, with_system)
    term.type("/exit\n")
    assert term.exit_code() == 0


@pytest.mark.parametrize("keys", ["\x04", "\x03"], ids=["ctrl-d", "ctrl-c"])
def test_end_of_input_and_ctrl_c_at_the_prompt_quit_cleanly(terminals, url, keys):
    term = terminals("--url", url, "--api-key", KEY)
    term.expect("/exit quits")
    term.expect("> ")
    # a person's key comes after the prompt is shown: a SIGINT between the prompt and the
    # read that follows would wait for the next key (CPython checks signals when that read
    # is interrupted, and this one was not)
    time.sleep(0.5)
    os.write(term.fd, keys.encode())
    assert term.exit_code() == 0
    assert "Traceback" not in term.text()


def test_a_bad_key_is_one_line_and_the_chat_goes_on(terminals, url, server):
    term = terminals("--url", url, "--api-key", "wrong", "--model", server.router.model_name)
    term.type("hello\n")
    term.expect(f"cleave chat: {re.escape(url)} answered 401: Incorrect API key")
    term.type("/exit\n")
    assert term.exit_code() == 0
    # without --model the server is asked for its models at start: refused, the chat ends
    start = subprocess.run([CLEAVE, "chat", "--url", url, "--api-key", "wrong"], check=False,
                           capture_output=True, text=True, timeout=WAIT_S, env=child_env(),
                           stdin=subprocess.DEVNULL)
    assert start.returncode == 1
    assert start.stderr.strip().splitlines() == [
        line for line in start.stderr.splitlines() if f"{url} answered 401" in line]


def test_a_server_out_of_reach_at_start_is_one_line_and_status_1():
    url = f"http://127.0.0.1:{free_ports(1)[0]}/v1"  # nothing listens there
    run = subprocess.run([CLEAVE, "chat", "--url", url], check=False, capture_output=True,
                         text=True, timeout=WAIT_S, env=child_env(), stdin=subprocess.DEVNULL)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and f"cannot reach {url}" in run.stderr, run.stderr


def test_ctrl_c_while_an_answer_streams_keeps_the_chat(terminals, url, server):
    term = terminals("--url", url, "--api-key", KEY, "--max-tokens", "1000",
                     "--temperature", "0")
    slow = [c.channel.worker.engine for c in server.clients]
    real_steps = [e.step for e in slow]
    for engine, real in zip(slow, real_steps):
        engine.step = lambda real=real: (time.sleep(0.05), real())[1]
    try:
        term.type("tell me a long story\n")
        term.expect(r"tell me a long story\r?\n.")  # the answer began
        os.kill(term.proc.pid, signal.SIGINT)  # as Ctrl-C does while no prompt is shown
        term.expect("cleave chat: answer interrupted")
    finally:
        for engine, real in zip(slow, real_steps):
            engine.step = real
    term.type("/exit\n")
    assert term.exit_code() == 0
