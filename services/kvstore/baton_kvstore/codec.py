"""The kvstore's internal types and its only bridge to the ``baton.v1`` protos.

The store, the servicer's logic, the client's callers and ``WorkerRegistration`` speak the frozen
dataclasses below; only this module builds or reads ``*_pb2`` messages (wire requests and
responses, and the bytes the Redis store keeps). Decoding a request validates it and raises
``InvalidRequestError`` with a message meant for the caller; encoding never fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from baton.v1 import common_pb2, kvstore_pb2
from baton_engine.errors import InvalidRequestError

Role = Literal["prefill", "decode"]
EventKind = Literal["stored", "removed", "cleared"]

ROLES: tuple[Role, ...] = ("prefill", "decode")
MAX_WORKER_ID_LEN = 256
MAX_HASH_LEN = 64  # the engine's block hashes are 16-byte blake2b digests

_ROLE_TO_PB: dict[Role, common_pb2.WorkerRole] = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PB: dict[int, Role] = {v: k for k, v in _ROLE_TO_PB.items()}
_KIND_TO_PB: dict[EventKind, kvstore_pb2.KVEventKind] = {
    "stored": kvstore_pb2.KV_EVENT_KIND_STORED,
    "removed": kvstore_pb2.KV_EVENT_KIND_REMOVED,
    "cleared": kvstore_pb2.KV_EVENT_KIND_CLEARED,
}
_KIND_FROM_PB: dict[int, EventKind] = {v: k for k, v in _KIND_TO_PB.items()}


@dataclass(frozen=True)
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    max_num_seqs: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the directory knows it; ``load`` is the last heartbeat's."""

    worker_id: str
    role: Role
    grpc_address: str
    transfer_endpoint: str = ""
    engine_id: str = ""
    epoch: int = 0
    transfer_metadata: bytes = b""
    num_blocks: int = 0
    block_size: int = 0
    model: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)


@dataclass(frozen=True)
class KVEvent:
    """A change to one worker's cache. ``seq`` is per worker and grows by 1 per event."""

    seq: int
    kind: EventKind
    block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class PrefixMatch:
    worker_id: str
    num_blocks: int  # leading blocks of the looked-up prompt the worker caches


# --- validation ---------------------------------------------------------------------------


def check_worker_id(worker_id: str) -> str:
    if not worker_id:
        raise InvalidRequestError("worker_id must not be empty")
    if len(worker_id) > MAX_WORKER_ID_LEN:
        raise InvalidRequestError(f"worker_id is longer than {MAX_WORKER_ID_LEN} characters")
    return worker_id


def check_block_hashes(hashes: Iterable[bytes]) -> tuple[bytes, ...]:
    out = tuple(hashes)
    for h in out:
        if not 0 < len(h) <= MAX_HASH_LEN:
            raise InvalidRequestError(
                f"a block hash must be 1 to {MAX_HASH_LEN} bytes long, got {len(h)}"
            )
    return out


def _role_from_pb(value: int, *, allow_unspecified: bool) -> Role | None:
    if value == common_pb2.WORKER_ROLE_UNSPECIFIED and allow_unspecified:
        return None
    role = _ROLE_FROM_PB.get(value)
    if role is None:
        raise InvalidRequestError(f"role must be PREFILL or DECODE, got {value}")
    return role


def _role_to_pb(role: Role | None) -> common_pb2.WorkerRole:
    return common_pb2.WORKER_ROLE_UNSPECIFIED if role is None else _ROLE_TO_PB[role]


# --- directory ----------------------------------------------------------------------------


def load_to_proto(load: WorkerLoad) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_cache_usage=load.kv_cache_usage,
        max_num_seqs=load.max_num_seqs,
    )


def load_from_proto(pb: common_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(pb.num_running, pb.num_waiting, pb.kv_cache_usage, pb.max_num_seqs)


def worker_info_to_proto(info: WorkerInfo) -> kvstore_pb2.WorkerInfo:
    return kvstore_pb2.WorkerInfo(
        worker_id=info.worker_id,
        role=_role_to_pb(info.role),
        grpc_address=info.grpc_address,
        transfer_endpoint=info.transfer_endpoint,
        engine_id=info.engine_id,
        epoch=info.epoch,
        transfer_metadata=info.transfer_metadata,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        model=info.model,
        load=load_to_proto(info.load),
    )


def worker_info_from_proto(pb: kvstore_pb2.WorkerInfo) -> WorkerInfo:
    """Validate and decode; raises ``InvalidRequestError``."""
    if not pb.grpc_address:
        raise InvalidRequestError("grpc_address must not be empty")
    for name in ("num_blocks", "block_size", "epoch"):
        if getattr(pb, name) < 0:
            raise InvalidRequestError(f"{name} must not be negative")
    role = _role_from_pb(pb.role, allow_unspecified=False)
    assert role is not None
    return WorkerInfo(
        worker_id=check_worker_id(pb.worker_id),
        role=role,
        grpc_address=pb.grpc_address,
        transfer_endpoint=pb.transfer_endpoint,
        engine_id=pb.engine_id,
        epoch=pb.epoch,
        transfer_metadata=pb.transfer_metadata,
        num_blocks=pb.num_blocks,
        block_size=pb.block_size,
        model=pb.model,
        load=load_from_proto(pb.load),
    )


def register_request(info: WorkerInfo, ttl_ms: int) -> kvstore_pb2.RegisterWorkerRequest:
    return kvstore_pb2.RegisterWorkerRequest(worker=worker_info_to_proto(info), ttl_ms=ttl_ms)


def register_from_proto(pb: kvstore_pb2.RegisterWorkerRequest) -> tuple[WorkerInfo, int]:
    if pb.ttl_ms <= 0:
        raise InvalidRequestError(f"ttl_ms must be positive, got {pb.ttl_ms}")
    return worker_info_from_proto(pb.worker), pb.ttl_ms


def register_response() -> kvstore_pb2.RegisterWorkerResponse:
    return kvstore_pb2.RegisterWorkerResponse()


def heartbeat_request(worker_id: str, load: WorkerLoad) -> kvstore_pb2.HeartbeatRequest:
    return kvstore_pb2.HeartbeatRequest(worker_id=worker_id, load=load_to_proto(load))


def heartbeat_from_proto(pb: kvstore_pb2.HeartbeatRequest) -> tuple[str, WorkerLoad]:
    return check_worker_id(pb.worker_id), load_from_proto(pb.load)


def heartbeat_response(known: bool) -> kvstore_pb2.HeartbeatResponse:
    return kvstore_pb2.HeartbeatResponse(known=known)


def known_from_proto(pb: kvstore_pb2.HeartbeatResponse) -> bool:
    return pb.known


def list_workers_request(role: Role | None) -> kvstore_pb2.ListWorkersRequest:
    return kvstore_pb2.ListWorkersRequest(role=_role_to_pb(role))


def list_workers_from_proto(pb: kvstore_pb2.ListWorkersRequest) -> Role | None:
    return _role_from_pb(pb.role, allow_unspecified=True)


def list_workers_response(workers: Iterable[WorkerInfo]) -> kvstore_pb2.ListWorkersResponse:
    return kvstore_pb2.ListWorkersResponse(workers=[worker_info_to_proto(w) for w in workers])


def workers_from_proto(pb: kvstore_pb2.ListWorkersResponse) -> list[WorkerInfo]:
    return [worker_info_from_proto(w) for w in pb.workers]


# --- KV events and the prefix index -------------------------------------------------------


def event_to_proto(event: KVEvent) -> kvstore_pb2.KVEvent:
    return kvstore_pb2.KVEvent(
        seq=event.seq, kind=_KIND_TO_PB[event.kind], block_hashes=event.block_hashes
    )


def event_from_proto(pb: kvstore_pb2.KVEvent) -> KVEvent:
    kind = _KIND_FROM_PB.get(pb.kind)
    if kind is None:
        raise InvalidRequestError(f"event kind must be STORED, REMOVED or CLEARED, got {pb.kind}")
    if pb.seq < 0:
        raise InvalidRequestError(f"event seq must not be negative, got {pb.seq}")
    if kind == "cleared" and pb.block_hashes:
        raise InvalidRequestError("a CLEARED event carries no block hashes")
    return KVEvent(pb.seq, kind, check_block_hashes(pb.block_hashes))


def publish_request(
    worker_id: str, events: Sequence[KVEvent]
) -> kvstore_pb2.PublishKVEventsRequest:
    return kvstore_pb2.PublishKVEventsRequest(
        worker_id=worker_id, events=[event_to_proto(e) for e in events]
    )


def publish_from_proto(pb: kvstore_pb2.PublishKVEventsRequest) -> tuple[str, list[KVEvent]]:
    return check_worker_id(pb.worker_id), [event_from_proto(e) for e in pb.events]


def publish_response(resync_required: bool) -> kvstore_pb2.PublishKVEventsResponse:
    return kvstore_pb2.PublishKVEventsResponse(resync_required=resync_required)


def resync_required_from_proto(pb: kvstore_pb2.PublishKVEventsResponse) -> bool:
    return pb.resync_required


def lookup_request(hashes: Sequence[bytes], role: Role | None) -> kvstore_pb2.LookupPrefixRequest:
    return kvstore_pb2.LookupPrefixRequest(block_hashes=hashes, role=_role_to_pb(role))


def lookup_from_proto(pb: kvstore_pb2.LookupPrefixRequest) -> tuple[tuple[bytes, ...], Role | None]:
    return check_block_hashes(pb.block_hashes), _role_from_pb(pb.role, allow_unspecified=True)


def lookup_response(matches: Iterable[PrefixMatch]) -> kvstore_pb2.LookupPrefixResponse:
    pbs = [kvstore_pb2.PrefixMatch(worker_id=m.worker_id, num_blocks=m.num_blocks) for m in matches]
    return kvstore_pb2.LookupPrefixResponse(matches=pbs)


def matches_from_proto(pb: kvstore_pb2.LookupPrefixResponse) -> list[PrefixMatch]:
    return [PrefixMatch(m.worker_id, m.num_blocks) for m in pb.matches]


# --- bytes kept by the Redis store --------------------------------------------------------


def encode_worker_info(info: WorkerInfo) -> bytes:
    data: bytes = worker_info_to_proto(info).SerializeToString()
    return data


def decode_worker_info(data: bytes) -> WorkerInfo:
    pb = kvstore_pb2.WorkerInfo()
    pb.ParseFromString(data)
    return worker_info_from_proto(pb)


def encode_load(load: WorkerLoad) -> bytes:
    data: bytes = load_to_proto(load).SerializeToString()
    return data


def decode_load(data: bytes) -> WorkerLoad:
    pb = common_pb2.WorkerLoad()
    pb.ParseFromString(data)
    return load_from_proto(pb)


def encode_events(worker_id: str, events: Sequence[KVEvent]) -> bytes:
    """One applied batch as it goes into the event log (a ``PublishKVEventsRequest``)."""
    data: bytes = publish_request(worker_id, events).SerializeToString()
    return data


def decode_events(data: bytes) -> tuple[str, list[KVEvent]]:
    pb = kvstore_pb2.PublishKVEventsRequest()
    pb.ParseFromString(data)
    return publish_from_proto(pb)
