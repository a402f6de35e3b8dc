"""Errors the engine raises for bad input: one type per cause, all ``ValueError`` subclasses."""

from __future__ import annotations


class BatonError(Exception):
    """Base of every error Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """A request the engine cannot serve as given (empty prompt, too long, bad parameters)."""


class NotFoundError(InvalidRequestError):
    """A request names something the engine does not have (a LoRA adapter to unload)."""


class ModelLoadError(BatonError, ValueError):
    """The model could not be found or read (missing path, corrupt or unsupported file)."""


class EngineSleepingError(BatonError):
    """The engine is asleep (sleep mode): nothing runs until it is woken."""


class EngineBusyError(InvalidRequestError):
    """What was asked needs an idle engine (sleep mode, reloading the weights) and requests
    are running or hold KV blocks."""
