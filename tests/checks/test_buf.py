"""The wire contract passes `buf lint` (STANDARD) and breaks nothing published.

protos/onnxps_v1.binpb is the committed image of the contract as released; `buf
breaking` compares the .proto against it, so a renamed field, a changed number or a
removed RPC fails here instead of in someone else's client. Update the image only on
purpose (see docs/protocol.md), with `buf build -o protos/onnxps_v1.binpb`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "protos" / "onnxps_v1.binpb"
PROTO = Path("protos") / "onnxps" / "v1" / "parameter_server.proto"


def _buf() -> str:
    beside = Path(sys.executable).parent / "buf"
    found = str(beside) if beside.exists() else shutil.which("buf")
    assert found, "the buf CLI is missing: pip install buf-bin (in the test extra)"
    return found


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_buf(), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_buf_lint_standard_is_clean() -> None:
    proc = _run("lint")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_no_breaking_change_against_the_committed_contract() -> None:
    proc = _run("breaking", "--against", str(BASELINE))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_breaking_check_catches_a_renumbered_field(tmp_path: Path) -> None:
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos" / "onnxps", tmp_path / "protos" / "onnxps")
    proto = tmp_path / PROTO
    text = proto.read_text()
    assert "  uint64 seq = 4;\n" in text
    proto.write_text(text.replace("  uint64 seq = 4;\n", "  uint64 seq = 14;\n"))
    proc = _run("breaking", "--against", str(BASELINE), cwd=tmp_path)
    assert proc.returncode != 0
    assert 'present field "4" with name "seq" on message "PushRequest" was deleted' in (
        proc.stdout
    )


def test_baseline_image_holds_the_service_with_go_package() -> None:
    image = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    (file,) = [f for f in image.file if f.name == "onnxps/v1/parameter_server.proto"]
    assert file.package == "onnxps.v1"
    assert file.options.go_package.endswith("/onnxps/v1;onnxpsv1")
    assert [s.name for s in file.service] == ["ParameterServerService"]
