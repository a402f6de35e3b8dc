"""The down projection with SiLU-and-multiply in front and the residual add behind
(``silu_linear.silu_and_mul_linear``), against its plain-PyTorch reference and against the
unfused kernels it replaces.

Without a GPU the kernel runs under Triton's interpreter at small shapes; TRITON_INTERPRET is set
before any kernel module is imported. With a GPU the same tests run compiled, plus one at the
shapes of Qwen2.5-0.5B's decode step.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_kernels.triton.fused_ops import silu_and_mul
from baton_kernels.triton.silu_linear import (
    SiluLinearConfig,
    default_config,
    ref_silu_and_mul_linear,
    silu_and_mul_linear,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) against the reference, which rounds SiLU-and-multiply's output to the dtype as
# the kernel does; the sums differ in order, and the interpreter truncates fp32 to 16 bits
# where the reference rounds (each of the K products then errs the same way: a few units in
# the last place of bf16 outputs of ~1-4).
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 3e-2), torch.float16: (1e-2, 5e-3)}
POISON = float("nan")
EPS = 1e-5
# small tiles (the interpreter); K slices of uneven length: 88 inputs in 16-wide steps
SMALL = SiluLinearConfig(block_m=16, block_n=32, block_k=16, split_k=1)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def inputs(
    m: int, k: int, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = [gate | up], the weight, a residual stream and the rows whose 1/rms scales x (each
    row's scale different)."""
    x = randn(m, 2 * k, dtype=dtype)
    weight = randn(n, k, dtype=dtype) * 0.1
    residual = randn(m, n, dtype=dtype) * 2
    norm_of = randn(m, 24, dtype=dtype) * torch.arange(1, m + 1, device=DEVICE)[:, None].to(dtype)
    return x, weight, residual, norm_of


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m", [1, 21])
@pytest.mark.parametrize("k", [88, 96])
def test_silu_and_mul_linear(dtype: torch.dtype, split_k: int, m: int, k: int) -> None:
    """With and without the residual and the folded norm, one K slice or three (the last
    program of each tile sums the partials), K a multiple of the tile or not, a row tile
    partly past the rows; ``out`` poisoned beforehand."""
    torch.manual_seed(1)
    x, weight, residual, norm_of = inputs(m, k, 40, dtype)
    cfg = SMALL._replace(split_k=split_k)
    for res, norm in ((None, None), (residual, None), (None, norm_of), (residual, norm_of)):
        out = torch.full((m, 40), POISON, dtype=dtype, device=DEVICE)
        got = silu_and_mul_linear(
            x, weight, residual=res, norm_of=norm, eps=EPS, out=out, config=cfg
        )
        assert got is out
        assert_close(got, ref_silu_and_mul_linear(x, weight, res, norm, EPS), dtype)
        if res is None and norm is None:  # the unfused kernels
            act = silu_and_mul(x)
            assert_close(got, act @ weight.t(), dtype)


def test_the_sum_of_the_k_slices_is_the_same_at_every_launch() -> None:
    """The partials are added in slice order, whichever program is last; the per-tile counters
    are left at zero for the next launch (a replayed CUDA graph relies on it)."""
    torch.manual_seed(2)
    x, weight, residual, norm_of = inputs(33, 96, 72, torch.float32)
    cfg = SMALL._replace(split_k=4)
    first = silu_and_mul_linear(x, weight, residual=residual, norm_of=norm_of, eps=EPS, config=cfg)
    for _ in range(3):
        again = silu_and_mul_linear(
            x, weight, residual=residual, norm_of=norm_of, eps=EPS, config=cfg
        )
        assert torch.equal(again, first)
    one_slice = silu_and_mul_linear(
        x, weight, residual=residual, norm_of=norm_of, eps=EPS, config=SMALL
    )
    assert_close(first, one_slice, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_linear_reads_strided_inputs(dtype: torch.dtype) -> None:
    """``x`` and the residual views into wider tensors (rows dense, apart) are read through
    their row strides."""
    torch.manual_seed(3)
    wide = randn(9, 2 * 48 + 5, dtype=dtype)
    x = wide[:, 2 : 2 + 2 * 48]
    assert not x.is_contiguous()
    weight = randn(40, 48, dtype=dtype) * 0.2
    residual = randn(9, 50, dtype=dtype)[:, 3:43]
    got = silu_and_mul_linear(x, weight, residual=residual, config=SMALL._replace(split_k=2))
    assert_close(got, ref_silu_and_mul_linear(x, weight, residual), dtype)


def test_default_config_splits_k_until_the_tiles_cover_the_sms() -> None:
    qwen_256 = default_config(256, 896, 4864)  # 28 tiles of 64 x 128
    assert qwen_256.split_k == 4
    assert default_config(8192, 896, 4864).split_k == 1  # 896 tiles
    assert default_config(256, 896, 300).split_k == 1  # no slice under MIN_SPLIT_K
    for m in (1, 5, 64, 256):
        assert default_config(m, 896, 4864).block_m >= min(16, m)


def test_empty_inputs() -> None:
    x, weight, residual, _ = inputs(3, 16, 8, torch.float32)
    assert silu_and_mul_linear(x[:0], weight, residual=residual[:0]).shape == (0, 8)
    empty_k = silu_and_mul_linear(x[:, :0], weight[:, :0], residual=residual)
    assert torch.equal(empty_k, residual)


def test_silu_and_mul_linear_rejects_misuse() -> None:
    x, weight, residual, norm_of = inputs(3, 16, 8, torch.float16)
    bad_calls = [
        dict(x=x[:, :7], weight=weight),  # odd width
        dict(x=x.flatten(), weight=weight),
        dict(x=x.long(), weight=weight.long()),
        dict(x=x, weight=weight[:, :15]),  # K mismatch
        dict(x=x, weight=weight.float()),
        dict(x=x, weight=weight, residual=residual[:2]),
        dict(x=x, weight=weight, residual=residual.float()),
        dict(x=x, weight=weight, norm_of=norm_of[:2]),
        dict(x=x, weight=weight, norm_of=norm_of.t().contiguous().t()),
        dict(x=x, weight=weight, out=torch.empty(3, 9, dtype=torch.float16, device=DEVICE)),
        dict(x=x, weight=weight, residual=residual, out=residual),  # in place: a race
        # rows not dense
        dict(x=x.t().contiguous().t(), weight=weight),
        dict(x=x, weight=weight.t().contiguous().t()),
        dict(x=x, weight=weight, residual=residual.t().contiguous().t()),
    ]
    for kwargs in bad_calls:
        with pytest.raises(ValueError):
            silu_and_mul_linear(**kwargs)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 64, 256, 2048])
def test_silu_and_mul_linear_at_qwen_shapes(m: int) -> None:
    """Qwen2.5-0.5B's down projection (4,864 -> 896), bf16, with the engine's default tiles,
    against the unfused kernels and cuBLAS (``addmm``)."""
    torch.manual_seed(4)
    x = randn(m, 2 * 4864, dtype=torch.bfloat16)
    weight = randn(896, 4864, dtype=torch.bfloat16) * 0.02
    stream = randn(m, 896, dtype=torch.bfloat16)
    got = silu_and_mul_linear(x, weight, residual=stream, norm_of=stream, eps=EPS)
    act = silu_and_mul(x, norm_of=stream, eps=EPS)
    want = stream.clone().addmm_(act, weight.t())
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
