"""vLLM's JSON-valued flags (``--speculative-config``, ``--profiler-config``,
``--hf-overrides``...): a JSON object on a command line, or a dict offline. Imports no torch
(the gateway reads the profiler's)."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from baton_engine.errors import InvalidRequestError


def json_object(name: str, value: object, keys: Collection[str] | None = None) -> dict[str, Any]:
    """``value`` (a JSON object as text, empty text for none, or a dict) as a dict; with
    ``keys``, each of its keys must be one of them. ``InvalidRequestError`` naming ``name``
    otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(keys)) if keys is not None else []
    if unknown:
        raise InvalidRequestError(
            f"{name} keys {unknown} are not supported (Baton reads {', '.join(keys or ())})"
        )
    return value
