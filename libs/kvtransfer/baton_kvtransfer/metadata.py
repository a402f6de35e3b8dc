"""What a NIXL peer needs to read a source's pool, as carried in ``HandshakeResponse.
transfer_metadata`` (and in the worker directory): a fixed little-endian header followed by the
opaque NIXL agent metadata.

    offset  size  field
    0       4     magic b"BKVN"
    4       2     version (1)
    6       1     memory kind (0 DRAM, 1 VRAM)
    7       1     reserved (0)
    8       4     device id (int32; 0 for DRAM)
    12      8     base address of the pool
    20      8     num_blocks
    28      8     block_bytes
    36      -     NIXL agent metadata (``nixl_agent.get_agent_metadata()``)

Empty metadata means the peer serves only the gRPC stream. Descriptors are plain numbers
computed from this header, never NIXL's pickled descriptor lists.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

MemKind = Literal["DRAM", "VRAM"]

_MAGIC = b"BKVN"
_VERSION = 1
_HEADER = struct.Struct("<4sHBBiQQQ")
_MEM_KINDS: tuple[MemKind, MemKind] = ("DRAM", "VRAM")


@dataclass(frozen=True)
class PoolMetadata:
    mem_kind: MemKind
    device_id: int
    base_address: int
    num_blocks: int
    block_bytes: int
    agent_metadata: bytes  # opaque NIXL agent blob

    def encode(self) -> bytes:
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            _MEM_KINDS.index(self.mem_kind),
            0,
            self.device_id,
            self.base_address,
            self.num_blocks,
            self.block_bytes,
        )
        return header + self.agent_metadata

    @classmethod
    def decode(cls, data: bytes) -> PoolMetadata | None:
        """None for empty metadata (a gRPC-only peer); ValueError for anything malformed."""
        if not data:
            return None
        if len(data) < _HEADER.size:
            raise ValueError(f"transfer metadata too short: {len(data)} bytes")
        magic, version, kind, _, device_id, base, num_blocks, block_bytes = _HEADER.unpack_from(
            data
        )
        if magic != _MAGIC:
            raise ValueError(f"transfer metadata has an unknown magic {magic!r}")
        if version != _VERSION:
            raise ValueError(f"transfer metadata version {version} is not supported")
        if kind >= len(_MEM_KINDS):
            raise ValueError(f"transfer metadata has an unknown memory kind {kind}")
        agent_metadata = data[_HEADER.size :]
        if not agent_metadata:
            raise ValueError("transfer metadata carries no NIXL agent metadata")
        return cls(_MEM_KINDS[kind], device_id, base, num_blocks, block_bytes, agent_metadata)
