"""Triton launches without ``JITFunction.run``'s work on every call.

A call ``kernel[grid](*args, **kwargs)`` binds the arguments, specialises each one (its type, a
pointer's 16-byte alignment, an integer's equality to 1 and divisibility by 16), builds a cache
key string from that, looks the compiled kernel up, reads several of Triton's settings, and only
then calls the compiled kernel's launcher (Triton 3.6's launch hooks are chains, empty unless a
profiler adds to them, so it also builds launch metadata and calls them every time). On the
H200's hosts a Baton kernel's launch took 25-56 us that way on a faster host and 48-114 us on a
slower one, against 5-15 us through its launcher alone (``python
benchmarks/device/launch_cost.py --launches-only``), and an eager prompt step launches ~100 of
them: on slower hosts a 16,384-token prompt step's launches took as long as its kernels.

``Launcher`` keeps, for one kernel, the compiled kernel of each specialisation it has met, under
a key of its own that is at least as fine as Triton's: each tensor's dtype and 16-byte alignment,
each integer's value where it is below 16 or beyond 32 bits and else its divisibility by 16
(Triton: equality to 1, divisibility by 16, 32 or 64 bits), every other positional argument's
type, the keyword arguments (constexprs and launch options) by value, and the current
device. The first call of a key goes through Triton (which compiles when it must) and keeps what
it returned; later calls go straight to the launcher. Only tensors, integers, floats, bools and
None may be passed positionally and only constexprs and options by keyword: anything else turns
the launcher back to Triton's path for good, as does the interpreter (``TRITON_INTERPRET=1``);
while a launch hook is registered (a profiler's), launches take Triton's path. On unless
``BATON_FAST_LAUNCH=0`` (``FAST_LAUNCH``). A kernel whose source reads a global must not have
that global changed after its first launch (Triton checks; this does not).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

# On unless BATON_FAST_LAUNCH=0. On the H200 every GPU test passed with it on, and it cut a
# launch's host time by a quarter to a half (thirty-fifth session, benchmarks/RESULTS.md).
FAST_LAUNCH = os.environ.get("BATON_FAST_LAUNCH", "1") != "0"
_MAX_KEYS = 1024  # per kernel; more distinct specialisations than this and the cache restarts
_POSITIONAL_TYPES = (torch.Tensor, int, float, bool, type(None))
_Key = tuple[Any, ...]
_Entry = tuple[Any, Any, Any, tuple[tuple[str, Any], ...]]  # run, function, metadata, tail


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Launcher:
    """``launcher(grid, *args, **kwargs)`` launches ``kernel`` as ``kernel[grid](*args,
    **kwargs)`` does (see the module's docstring for what it skips and when it does not)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.enabled = params is not None and not _interpreted()
        self._names = [p.name for p in params or ()]
        self._runtime = {p.name for p in params or () if not p.is_constexpr}
        self._defaults = {
            p.name: p.default
            for p in params or ()
            if getattr(p, "default", inspect.Parameter.empty) is not inspect.Parameter.empty
        }
        self._compiled: dict[_Key, _Entry] = {}
        self._device: Any = None  # the driver's current device and stream, after a first call
        self._stream: Any = None
        self.off_because = "" if self.enabled else "not a compiled Triton kernel"
        self._enter_hooks: list[Any] = []
        self._exit_hooks: list[Any] = []

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not (self.enabled and FAST_LAUNCH) or self._enter_hooks or self._exit_hooks:
            self.kernel[grid](*args, **kwargs)
            return
        key = self.key(args, kwargs)
        try:
            entry = self._compiled.get(key)
        except TypeError:  # an unhashable keyword argument: Triton's path from now on
            self._turn_off("an unhashable keyword argument")
            self.kernel[grid](*args, **kwargs)
            return
        if entry is None:
            self._first(key, grid, args, kwargs)
            return
        run, function, metadata, tail = entry
        n = len(grid)
        run(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            self._stream(key[0]),
            function,
            metadata,
            None,
            None,
            None,
            *args,
            *[kwargs.get(name, default) for name, default in tail],
        )

    def _turn_off(self, reason: str) -> None:
        self.enabled = False
        self.off_because = reason

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Key:
        """The cache key of a launch with ``args`` and ``kwargs`` (see the module docstring)."""
        device = self._device
        return (
            device() if device is not None else None,
            tuple(kwargs.items()),
            # an integer: its value below 16 (1 among them) or beyond 32 bits, else 16 or 17
            # by its divisibility by 16 (cheaper than a tuple each: 3.9 against 7.6 us for 40
            # integers and 10 tensors on the dev CPU); a tensor: dtype and alignment
            *[
                (a if a < 16 or a > 0x7FFFFFFF else 16 + (not a & 15))
                if type(a) is int
                else (a.dtype, not a.data_ptr() & 15)
                if isinstance(a, torch.Tensor)
                else type(a)
                for a in args
            ],
        )

    def _first(
        self, key: _Key, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Launch through Triton and keep the compiled kernel under ``key`` (or give up on the
        fast path where its key could not be trusted)."""
        compiled = self.kernel[grid](*args, **kwargs)
        from triton import knobs

        if self._runtime.intersection(kwargs):
            self._turn_off(f"runtime arguments by keyword: {self._runtime.intersection(kwargs)}")
            return
        if not all(isinstance(a, _POSITIONAL_TYPES) for a in args):
            self._turn_off(f"positional arguments of types {[type(a) for a in args]}")
            return
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
        if not all(isinstance(getattr(h, "calls", None), list) for h in hooks):
            self._turn_off(f"Triton's launch hooks are not chains: {hooks}")
            return
        try:
            run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        except AttributeError as e:  # another Triton: keep its own path
            self._turn_off(f"this Triton's compiled kernel: {e}")
            return
        if self._device is None:
            # the key so far had no device: start again with it
            self._device, self._stream = _driver_functions()
            # the hook chains' lists of hooks (a profiler adds to them): Triton's path while
            # either holds one
            self._enter_hooks, self._exit_hooks = hooks[0].calls, hooks[1].calls
            return
        if len(self._compiled) >= _MAX_KEYS:
            self._compiled.clear()
        tail = tuple((name, self._defaults.get(name)) for name in self._names[len(args) :])
        self._compiled[key] = (run, function, metadata, tail)


def _driver_functions() -> tuple[Any, Any]:
    """The active Triton driver's current device and a device's current stream."""
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream


_LAUNCHERS: dict[int, Launcher] = {}


def launcher(kernel: Any) -> Launcher:
    """The ``Launcher`` of ``kernel`` (one a kernel, made at its first use)."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found
