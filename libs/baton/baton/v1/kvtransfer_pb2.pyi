from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "epoch", "compat_hash", "transfer_metadata")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    compat_hash: bytes
    transfer_metadata: bytes
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., compat_hash: _Optional[bytes] = ..., transfer_metadata: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "epoch", "compat_hash", "transfer_metadata", "block_bytes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    compat_hash: bytes
    transfer_metadata: bytes
    block_bytes: int
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., compat_hash: _Optional[bytes] = ..., transfer_metadata: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "block_ids", "requester_engine_id", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    requester_engine_id: str
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., requester_engine_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "extend_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    extend_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., extend_ms: _Optional[int] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("lease_expiry_unix_ms",)
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expiry_unix_ms: int
    def __init__(self, lease_expiry_unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...
