from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_CLEARED: _ClassVar[KVEventKind]
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_STORED: KVEventKind
KV_EVENT_KIND_REMOVED: KVEventKind
KV_EVENT_KIND_CLEARED: KVEventKind

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "transfer_endpoint", "engine_id", "epoch", "transfer_metadata", "num_blocks", "block_size", "model", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    grpc_address: str
    transfer_endpoint: str
    engine_id: str
    epoch: int
    transfer_metadata: bytes
    num_blocks: int
    block_size: int
    model: str
    load: _common_pb2.WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., grpc_address: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., transfer_metadata: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker", "ttl_ms")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    ttl_ms: int
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: bool = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "kind", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: KVEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[KVEventKind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PublishKVEventsRequest(_message.Message):
    __slots__ = ("worker_id", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class PublishKVEventsResponse(_message.Message):
    __slots__ = ("resync_required",)
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    resync_required: bool
    def __init__(self, resync_required: bool = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("block_hashes", "role")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    role: _common_pb2.WorkerRole
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class PrefixMatch(_message.Message):
    __slots__ = ("worker_id", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[PrefixMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[PrefixMatch, _Mapping]]] = ...) -> None: ...
