"""Addresses the services print and hand out (torch-free, shared by every service)."""

from __future__ import annotations

import socket


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC dials it (IPv6 hosts bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_host(host: str) -> str:
    """A host a client can dial: wildcard binds are reported under the machine's name."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
