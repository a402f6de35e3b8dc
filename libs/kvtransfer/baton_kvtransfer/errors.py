"""Errors of KV transfer: one type per cause, all ``KVTransferError`` subclasses.

The decode side treats each one the same way (recompute the prompt, or fail it under
``--kv-load-failure-policy fail``); the types exist so logs and metrics can tell them apart.
"""

from __future__ import annotations

import grpc


class KVTransferError(Exception):
    """Base of every error this library raises on purpose."""


class IncompatiblePeerError(KVTransferError):
    """The peer's KV is not interchangeable with ours (model, dtype, block size or layout
    differ: the compatibility hashes or block sizes do not match)."""


class LeaseUnavailableError(KVTransferError):
    """The lease is unknown, expired or released (or does not cover the blocks asked for), so
    its blocks may have been freed and reused: their bytes must not be used."""


class TransferFailedError(KVTransferError):
    """The bytes could not be moved: the peer is dead or unreachable, NIXL reported an error,
    the transfer timed out or came back short."""


def error_from_rpc(what: str, error: grpc.aio.AioRpcError) -> KVTransferError:
    """A failed lease or transfer RPC: NOT_FOUND / FAILED_PRECONDITION mean the lease is
    gone; anything else (UNAVAILABLE when the peer is dead, DEADLINE_EXCEEDED, ...) is a
    transfer failure."""
    if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return LeaseUnavailableError(f"{what}: {error.details()}")
    return TransferFailedError(f"{what}: {error.code().name}: {error.details()}")
