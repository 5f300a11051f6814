"""The committed gRPC stubs are what the documented protoc command makes from session.proto."""

from __future__ import annotations

from pathlib import Path

import pytest

grpc_tools = pytest.importorskip("grpc_tools", reason="needs the serve extra (grpcio-tools)")
from grpc_tools import protoc  # noqa: E402

from kakeya_lab.serve import PROTO_PATH, PROTOC_ARGS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["session_pb2.py", "session_pb2_grpc.py", "session_pb2.pyi"]


def test_regenerated_stubs_equal_the_committed_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the documented command runs from the repository root
    out = str(tmp_path)
    args = [a.replace("_out=.", f"_out={out}") for a in PROTOC_ARGS]
    include = str(Path(protoc.__file__).parent / "_proto")
    assert protoc.main(["grpc_tools.protoc", *args, f"-I{include}"]) == 0
    proto_dir = Path(PROTO_PATH).parent
    for name in GENERATED:
        fresh = (tmp_path / proto_dir / name).read_text()
        committed = (ROOT / proto_dir / name).read_text()
        assert fresh == committed, (
            f"{proto_dir / name} is stale: regenerate it (kakeya_lab/serve/__init__.py)"
        )
