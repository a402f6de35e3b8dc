"""Moving KV-cache blocks from a prefill worker (the source) to a decode worker (the sink).

The pool on each side is one contiguous tensor indexed by block id; a block moves whole.
Transports: ``nixl`` (NIXL READ over UCX, registered memory) and ``grpc`` (a chunked stream,
always available); see ``nixl_agent.py`` for the UCX environment. Leases (``leases.py``) keep
the source's blocks until the sink releases them. DESIGN.md section 4 has the big picture.
"""

from baton_kvtransfer.compat import compat_hash
from baton_kvtransfer.errors import (
    IncompatiblePeerError,
    KVTransferError,
    LeaseUnavailableError,
    TransferFailedError,
)
from baton_kvtransfer.leases import Lease, LeaseTable
from baton_kvtransfer.nixl_agent import BACKENDS, nixl_available, resolve_backend
from baton_kvtransfer.sink import KVTransferSink, PullResult
from baton_kvtransfer.source import KVTransferServicer, KVTransferSource

__all__ = [
    "BACKENDS",
    "IncompatiblePeerError",
    "KVTransferError",
    "KVTransferServicer",
    "KVTransferSink",
    "KVTransferSource",
    "Lease",
    "LeaseTable",
    "LeaseUnavailableError",
    "PullResult",
    "TransferFailedError",
    "compat_hash",
    "nixl_available",
    "resolve_backend",
]
