"""Regenerate the gRPC stubs from proto/engine.proto (`make proto`).

The stubs are committed so that a gateway pod needs no protoc; a test calls
`generate()` into a temporary folder and fails when the committed ones are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"
STUB_DIR = Path(__file__).resolve().parent
GENERATED = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")


def generate(out_dir: Path = STUB_DIR) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "engine.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/engine.proto")
    # protoc writes a top-level import; the stubs live in a package.
    grpc_file = Path(out_dir) / "engine_pb2_grpc.py"
    text = grpc_file.read_text().replace("import engine_pb2 as", "from . import engine_pb2 as")
    grpc_file.write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_DIR)
