"""The committed gRPC stubs are exactly what ``make protos`` generates from ``protos/``."""

from __future__ import annotations

from pathlib import Path

from baton import protogen


def test_stubs_match_protos(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in protogen.generate(tmp_path)}
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
