"""``KVHandle``: where a prefilled prompt's KV lives and for how long (the proto's plain twin)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandle:
    worker_id: str
    engine_id: str
    epoch: int
    transfer_endpoint: str  # gRPC address of the prefill worker's KV-transfer service
    block_ids: tuple[int, ...]  # the prompt's blocks on the prefill worker, in order
    block_hashes: tuple[bytes, ...]  # chained hashes of the prompt's full blocks
    num_tokens: int  # prompt tokens whose KV the blocks hold
    lease_id: str
    lease_expiry_unix_ms: int
    compat_hash: bytes  # model, dtype, block size and layout
