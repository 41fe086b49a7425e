"""Generates the Python modules of `router/proto/cleave/v1/*.proto` with grpcio-tools.

`generate(out_root)` writes `router/proto/cleave/v1/*_pb2*.py` under `out_root`; with the
repository root as `out_root` it refreshes the checked-in code (the tests regenerate into a
temporary folder and compare). Needs grpcio-tools (a test dependency), imported on call.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("router/proto/cleave/v1")


def proto_files() -> list[Path]:
    return sorted((REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc with the repository root on the include path, so the generated imports read
    `from router.proto.cleave.v1 import ...`. Returns the files written."""
    from grpc_tools import protoc

    (out_root / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(REPO_ROOT)) for p in proto_files()]
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{include}",
                      f"--python_out={out_root}", f"--pyi_out={out_root}",
                      f"--grpc_python_out={out_root}", *files])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit status {rc} on {files}")
    return sorted(p for p in (out_root / PROTO_DIR).glob("*_pb2*.py*"))


def main() -> int:
    for path in generate(REPO_ROOT):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
