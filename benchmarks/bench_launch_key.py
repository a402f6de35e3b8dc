"""Host cost of a launch through Baton's Triton launch cache once it holds the kernel
(``baton_kernels.triton.launch.Launcher``): its key alone and the whole call up to the compiled
kernel's launcher, which here is a no-op stand-in (no GPU needed; on a GPU,
``benchmarks/device/launch_cost.py --launches-only`` times real launches).

    python benchmarks/bench_launch_key.py

Two argument lists: the decode attention's size (10 tensors, 40 integers, 20 constexprs) and a
small kernel's (3 tensors, 4 integers, 3 constexprs).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from baton_kernels.triton import launch


@dataclass
class _Param:
    name: str
    is_constexpr: bool
    default: Any = inspect.Parameter.empty


class _Compiled:
    function = packed_metadata = None

    def run(self, *args: Any) -> None:
        pass


class _Kernel:
    def __init__(self, num_runtime: int, num_constexpr: int) -> None:
        self.params = [_Param(f"a{i}", False) for i in range(num_runtime)]
        self.params += [_Param(f"C{i}", True) for i in range(num_constexpr)]

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: _Compiled()


def per_call_us(fn: Any, n: int) -> float:
    for _ in range(n // 10):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def tuple_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key's first form (a tuple an integer), for comparison."""
    return tuple(
        [
            (a.dtype, not a.data_ptr() & 15)
            if isinstance(a, torch.Tensor)
            else (a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF)
            if type(a) is int
            else type(a)
            for a in args
        ]
    )


def measure(tensors: int, ints: int, constexprs: int) -> None:
    launcher = launch.Launcher(_Kernel(tensors + ints, constexprs))
    launcher.enabled = True  # (under TRITON_INTERPRET=1 it would be off)
    args = (*[torch.empty(64) for _ in range(tensors)], *[7 * i + 3 for i in range(ints)])
    kwargs = {f"C{i}": i for i in range(constexprs)}
    for _ in range(2):  # the first calls take Triton's path (here the stand-in)
        launcher((1, 2), *args, **kwargs)
    assert launcher._compiled, launcher.off_because
    call = per_call_us(lambda: launcher((1, 2), *args, **kwargs), 20000)
    key = per_call_us(lambda: launcher.key(args, kwargs), 20000)
    old = per_call_us(lambda: tuple_key(args), 20000)
    print(f"{tensors} tensors, {ints} integers, {constexprs} constexprs: call {call:.2f} us, "
          f"key {key:.2f} us (a tuple an argument: {old:.2f} us)")  # fmt: skip


def main() -> int:
    launch.FAST_LAUNCH = True
    launch._driver_functions = lambda: (lambda: 0, lambda device: 0)  # no GPU: a fixed stream
    for shape in ((10, 40, 20), (3, 4, 3)):
        measure(*shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
