"""The Triton launch cache's bookkeeping (``baton_kernels.triton.launch.Launcher``) on a CPU.

No compiled Triton kernel runs without a GPU, so a kernel here is a recording stand-in with a
JIT function's interface (``params``, ``kernel[grid](...)`` returning a compiled kernel with
``run``, ``function`` and ``packed_metadata``) and the driver's device and stream are fixed.
What is checked is what the cache adds: which launches go through Triton's path, and that a
cached launch hands the launcher the grid, the stream and every parameter in order (constexpr
defaults included). tests/gpu/test_triton_launch_gpu.py checks it against Triton on a GPU.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from baton_kernels.triton import launch


@dataclass
class Param:
    name: str
    is_constexpr: bool = False
    default: Any = inspect.Parameter.empty


class Compiled:
    packed_metadata = "metadata"

    def __init__(self, calls: list[tuple[Any, ...]], name: str) -> None:
        self.calls, self.function = calls, name

    def run(self, *args: Any) -> None:
        self.calls.append(("launcher", *args))


class Kernel:
    """``kernel(x, n, scale, BLOCK: constexpr, FLAG: constexpr = 7)``; Triton's path records
    the call and returns the compiled kernel of its specialisation (a new one per call, so a
    cached entry shows which call made it)."""

    def __init__(self) -> None:
        self.params = [
            Param("x"), Param("n"), Param("scale"), Param("BLOCK", True), Param("FLAG", True, 7),
        ]  # fmt: skip
        self.calls: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, **kwargs: Any) -> Compiled:
            self.calls.append(("triton", grid, args, kwargs))
            return Compiled(self.calls, f"kernel {len(self.calls)}")

        return run


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Kernel:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(launch, "_driver_functions", lambda: (lambda: 3, lambda dev: 100 + dev))
    return Kernel()


def paths(kernel: Kernel) -> list[str]:
    return [c[0] for c in kernel.calls]


def test_a_known_launch_goes_to_the_launcher_with_every_parameter_in_order(kernel: Kernel) -> None:
    launcher = launch.Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(4):
        launcher((5,), x, 100, 0.5, BLOCK=32, num_warps=4)
    # the first call learns the device, the second keeps the kernel under the full key
    assert paths(kernel) == ["triton", "triton", "launcher", "launcher"]
    assert kernel.calls[-1] == (
        "launcher", 5, 1, 1, 103, "kernel 2", "metadata", None, None, None, x, 100, 0.5, 32, 7,
    )  # fmt: skip
    launcher((5, 2, 3), x, 100, 0.5, BLOCK=32, num_warps=4, FLAG=1)
    launcher((5, 2, 3), x, 100, 0.5, BLOCK=32, num_warps=4, FLAG=1)
    assert kernel.calls[-1][1:4] == (5, 2, 3) and kernel.calls[-1][-2:] == (32, 1)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((100,), (1,)),  # Triton makes an integer equal to 1 a constant
        ((100,), (112,)),  # ... and marks one divisible by 16
        ((100,), (1 << 33,)),  # ... and a 64-bit one another type
        ((16,), (32,)),  # both divisible by 16: the same kernel
    ],
)
def test_integer_specialisations(kernel: Kernel, first: tuple[int], second: tuple[int]) -> None:
    launcher = launch.Launcher(kernel)
    x = torch.zeros(64)
    for n in (first[0], first[0], second[0], second[0]):
        launcher((1,), x, n, 0.5, BLOCK=32)
    same = first[0] % 16 == second[0] % 16 == 0
    assert paths(kernel) == ["triton", "triton"] + (["launcher"] if same else ["triton"]) + [
        "launcher"
    ]


def test_tensor_alignment_dtype_and_constexprs_are_in_the_key(kernel: Kernel) -> None:
    launcher = launch.Launcher(kernel)
    flat = torch.zeros(64)
    variants: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((flat, 100, 0.5), {"BLOCK": 32}),  # twice: the first call learns the device
        ((flat, 100, 0.5), {"BLOCK": 32}),
        ((flat[1:], 100, 0.5), {"BLOCK": 32}),  # 4 bytes off 16-byte alignment
        ((flat.double(), 100, 0.5), {"BLOCK": 32}),
        ((flat, 100, 0.5), {"BLOCK": 64}),
        ((flat, 100, 0.5), {"BLOCK": 32, "num_warps": 8}),
        ((flat[4:], 100, 2.5), {"BLOCK": 32}),  # aligned again, another float: the first's
    ]
    for args, kwargs in variants:
        launcher((1,), *args, **kwargs)
    assert paths(kernel) == ["triton"] * 6 + ["launcher"]
    assert kernel.calls[-1][5] == "kernel 2"  # the kernel the first variant's second call kept


def test_a_registered_hook_sends_launches_through_triton(kernel: Kernel) -> None:
    from triton import knobs

    launcher = launch.Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launcher((1,), x, 100, 0.5, BLOCK=32)
    knobs.runtime.launch_enter_hook.add(print)
    try:
        launcher((1,), x, 100, 0.5, BLOCK=32)
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
    launcher((1,), x, 100, 0.5, BLOCK=32)
    assert paths(kernel) == ["triton", "triton", "triton", "launcher"]


def test_what_the_key_cannot_cover_turns_the_cache_off(kernel: Kernel) -> None:
    x = torch.zeros(64)
    by_keyword = launch.Launcher(kernel)
    for _ in range(3):
        by_keyword((1,), x, 100, scale=0.5, BLOCK=32)
    assert not by_keyword.enabled and "scale" in by_keyword.off_because
    odd = launch.Launcher(kernel)
    for _ in range(3):
        odd((1,), x, [100], 0.5, BLOCK=32)  # a list: Triton would say what it makes of it
    assert not odd.enabled and "list" in odd.off_because
    assert paths(kernel) == ["triton"] * 6


def test_off_when_switched_off_and_under_the_interpreter(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.zeros(64)
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    for _ in range(3):
        launch.Launcher(kernel)((1,), x, 100, 0.5, BLOCK=32)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = launch.Launcher(kernel)
    for _ in range(3):
        interpreted((1,), x, 100, 0.5, BLOCK=32)
    assert not interpreted.enabled
    assert paths(kernel) == ["triton"] * 6
