"""``baton prefill [MODEL]``: start one prefill worker (the same server as ``baton decode``, in
the prefill role: ``PrefillService`` and ``KVTransferService``)."""

from __future__ import annotations

from typing import Any

from baton_decode.cli import add_worker_parser


def add_parser(subparsers: Any) -> None:
    """Register ``prefill`` on the ``baton`` command's subparsers."""
    add_worker_parser(subparsers, "prefill")
