"""The committed gRPC stubs are exactly what ``make protos`` generates from ``protos/``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from baton import protogen


def test_stubs_match_protos(tmp_path: Path) -> None:
    # In a fresh process: protoc's C++ protobuf aborts in one that has loaded NIXL (its bundled
    # protobuf registers the same descriptors), which other test modules do.
    script = (
        "import sys, pathlib; from baton import protogen; "
        "protogen.generate(pathlib.Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*_pb2*.py*")}
    committed_dir = protogen.OUT_DIR / "baton" / "v1"
    committed = {
        p.relative_to(protogen.OUT_DIR): p.read_bytes() for p in committed_dir.glob("*_pb2*.py*")
    }
    assert fresh.keys() == committed.keys(), "stubs added or removed: run `make protos`"
    stale = sorted(str(name) for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_every_service_has_its_stub() -> None:
    from baton.v1 import engine_pb2_grpc, kvstore_pb2_grpc, kvtransfer_pb2_grpc

    for name in ("DecodeServiceStub", "PrefillServiceStub"):
        assert hasattr(engine_pb2_grpc, name)
    assert hasattr(kvtransfer_pb2_grpc, "KVTransferServiceStub")
    assert hasattr(kvstore_pb2_grpc, "KVStoreServiceStub")
