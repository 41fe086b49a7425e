"""The router stays torch-free, and the checked-in gRPC code matches its .proto files."""

from __future__ import annotations

import subprocess
import sys

from router.proto import codegen

ROUTER_MODULES = ["router.app", "router.errors", "router.worker_client",
                  "router.grpc_server", "router.openai.api", "router.policy",
                  "router.prefix_index"]


def test_importing_the_router_does_not_import_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in ROUTER_MODULES)
            + "sys.exit(3 if 'torch' in sys.modules else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=codegen.REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"torch was imported (rc {result.returncode}): " \
                                   f"{result.stderr[-2000:]}"


def test_generated_grpc_code_is_fresh(tmp_path):
    generated = codegen.generate(tmp_path)
    assert {p.name for p in generated} == {"generate_pb2.py", "generate_pb2.pyi",
                                           "generate_pb2_grpc.py"}
    for path in generated:
        checked_in = codegen.REPO_ROOT / codegen.PROTO_DIR / path.name
        assert checked_in.read_bytes() == path.read_bytes(), \
            f"{checked_in} is stale; run `python -m router.proto.codegen`"
