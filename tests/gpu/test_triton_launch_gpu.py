# A Triton kernel (untyped decorator, pointer arguments) is exempt; the tests are typed.
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
"""The Triton launch cache (``baton_kernels.triton.launch``) on a CUDA GPU (``pytest -m gpu``):
it must launch the very kernel Triton's own path picks for every specialisation (tensor dtype
and 16-byte alignment, integers equal to 1, divisible by 16 or beyond 32 bits, constexprs and
options), with the arguments in place, and the kernels' results must equal Triton's path.

Baton's kernel modules are imported inside the tests (see test_triton_attention_gpu.py); this
file's own kernel is defined at import (it is not used by the CPU tests).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fast_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On whatever ``BATON_FAST_LAUNCH`` says: these tests are about the cache."""
    from baton_kernels.triton import launch

    monkeypatch.setattr(launch, "FAST_LAUNCH", True)


@triton.jit
def _scale_kernel(x, y, n, stride, factor, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i * stride, mask=i < n).to(tl.float32) * factor
    if ADD_ONE:
        v += 1.0
    tl.store(y + i, v.to(y.dtype.element_ty), mask=i < n)


def _cases(dev: torch.device) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(args, kwargs) of launches that Triton specialises differently, some twice."""
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        # Long enough for the strided reads below (300 elements 16 apart): reading past the end
        # read whatever lay there, NaN at times, and NaN != NaN failed the comparison.
        flat = torch.randn(300 * 16, device=dev).to(dtype)
        y = torch.zeros(4096, device=dev, dtype=dtype)
        for offset in (0, 1, 8):  # 16-byte aligned, not, and (fp32 only) aligned again
            for n in (1, 16, 17, 1000):
                x = flat[offset:]
                out.append(((x, y, n, 1, 0.5), {"BLOCK": 128}))
                out.append(((x, y, n, 1, 2.0), {"BLOCK": 128, "ADD_ONE": True}))
        out.append(((flat, y, 300, 2, 1.5), {"BLOCK": 64, "num_warps": 2}))
        out.append(((flat, y, 300, 16, 1.5), {"BLOCK": 64, "num_warps": 2}))
    return out


def test_launcher_launches_the_kernel_triton_picks_with_its_results() -> None:
    from baton_kernels.triton.launch import Launcher

    dev = torch.device("cuda")
    kernel = _scale_kernel
    launch = Launcher(kernel)
    assert launch.enabled
    cases = _cases(dev)
    for rounds in range(3):  # the first two go through Triton; the third is the cache's
        for args, kwargs in cases:
            grid = (-(args[2] // -kwargs["BLOCK"]),)
            x, y = args[0], args[1]
            y.zero_()
            launch(grid, *args, **kwargs)
            fast = y.clone()
            y.zero_()
            picked = kernel[grid](*args, **kwargs)  # Triton's own path
            torch.testing.assert_close(fast, y, rtol=0, atol=0)
            if rounds < 2:
                continue
            entry = launch._compiled.get(launch.key(args, kwargs))
            assert entry is not None, (args[2:], kwargs)
            assert entry[1] == picked.function, (x.dtype, x.data_ptr() % 16, args[2:], kwargs)
    # every distinct specialisation Triton compiled has one entry or more of the cache's
    assert len(launch._compiled) >= len({id(kernel[(1,)](*a, **k)) for a, k in cases})


def test_engine_kernels_equal_with_and_without_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrappers of the prompt step's kernels, launched through the cache (after a first
    call) and through Triton's path, write the same results."""
    from baton_kernels.triton import fused_ops, launch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(37, 2 * 896, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(5, 151936, device=dev, dtype=torch.bfloat16)
    results = {}
    for fast in (True, False):
        monkeypatch.setattr(launch, "FAST_LAUNCH", fast)
        for _ in range(3):
            got = (fused_ops.silu_and_mul(x), fused_ops.argmax(logits))
        results[fast] = got
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_registered_launch_hook_sees_every_launch() -> None:
    """A profiler's launch hook added after the cache holds a kernel still sees its launches
    (they go through Triton's path while a hook is registered)."""
    from triton import knobs

    from baton_kernels.triton.launch import Launcher

    launch = Launcher(_scale_kernel)
    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        launch((2,), x, y, 256, 1, 2.0, BLOCK=128)
    assert launch._compiled, launch.off_because
    seen: list[object] = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(4):
            launch((2,), x, y, 256, 1, 2.0, BLOCK=128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 4
    torch.testing.assert_close(y, 2.0 * x)
