"""The committed generated stubs are what the .proto generates (no drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_do_not_drift_from_the_proto() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "drift" not in proc.stdout


def test_stubs_serve_the_package_named_in_the_proto() -> None:
    from onnxps.v1 import parameter_server_pb2 as pb

    assert pb.DESCRIPTOR.package == "onnxps.v1"
    assert pb.DESCRIPTOR.name == "onnxps/v1/parameter_server.proto"
    service = pb.DESCRIPTOR.services_by_name["ParameterServerService"]
    assert [m.name for m in service.methods] == [
        "CreateGroup",
        "CreateGroupStream",
        "DescribeGroup",
        "ListGroups",
        "DeleteGroup",
        "SetLearningRate",
        "Push",
        "PushStream",
        "Pull",
        "PullStream",
        "Apply",
        "ApplyStream",
        "JoinGroup",
        "Heartbeat",
        "LeaveGroup",
        "Save",
    ]
