"""Regenerate the committed protobuf and gRPC modules from protos/onnxps/v1/*.proto.

Run from anywhere: ``python scripts/gen_protos.py``. With ``--check`` it generates into
a temporary directory and exits 1 when the committed files differ (the drift test).

The modules come from grpcio-tools (``*_pb2.py``, ``*_pb2_grpc.py``); their typed
stubs from mypy-protobuf (``protoc-gen-mypy`` writes ``*_pb2.pyi``,
``protoc-gen-mypy_grpc`` writes ``*_pb2_grpc.pyi``), so mypy sees typed messages,
enums and service stubs. Both tools are pinned in the test extra.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PACKAGE = PROTO_ROOT / "onnxps" / "v1"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    """A protoc plugin installed beside this Python (a venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install mypy-protobuf")
    return found


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # test dependency: grpcio-tools

    protos = sorted(PACKAGE.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    produced = []
    for proto in protos:
        for suffix in GENERATED:
            produced.append(Path("onnxps") / "v1" / f"{proto.stem}{suffix}")
    return produced


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail on drift")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        files = generate(out)
        drift = [
            f
            for f in files
            if not (PROTO_ROOT / f).exists() or not filecmp.cmp(out / f, PROTO_ROOT / f)
        ]
        if args.check:
            for f in drift:
                print(f"drift: {f} differs from what the .proto generates")
            return 1 if drift else 0
        for f in files:
            shutil.copyfile(out / f, PROTO_ROOT / f)
            print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
