"""The decode worker's own errors; ``server`` maps each to a gRPC status code."""

from __future__ import annotations

from baton_engine.errors import BatonError, InvalidRequestError


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight on this worker."""


class WorkerFullError(BatonError):
    """The worker already holds ``max_pending`` requests."""


class EngineStepError(BatonError):
    """An engine step failed; the requests in the engine at the time were failed with it."""


class EngineDeadError(BatonError):
    """The engine failed beyond recovery; the worker serves nothing more."""
