"""The committed gRPC/protobuf stubs are exactly what the pinned generator makes of proto/."""

import shutil
import subprocess
import sys

from conftest import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "proto.py"


def test_committed_stubs_are_current():
    result = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_check_fails_when_a_proto_changed(tmp_path):
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    proto = tmp_path / "proto" / "disttrain" / "v1" / "tensor.proto"
    proto.write_text(
        proto.read_text().replace("bool requires_grad = 4;", "bool requires_grad = 4;\n  int32 extra = 9;")
    )
    result = subprocess.run(
        [sys.executable, str(TOOL), "--check", "--proto-root", str(tmp_path / "proto")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "tensor_pb2.py" in result.stderr
