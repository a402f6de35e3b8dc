"""FP8 linear layers (``baton_kernels.fp8_linear``, W8A8): the per-token quantization kernel
against its torch reference bit for bit, the quantization's error bounds and saturation, and
the layer's product against a float32 product of the dequantized operands.

Without a GPU the Triton kernel runs under Triton's interpreter and the product is torch's CPU
``_scaled_mm``; with a GPU the same tests run compiled, and through the GPU's FP8 GEMM.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_kernels.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Linear,
    fp8_linear,
    ref_fp8_linear,
    ref_quantize_rows,
)
from baton_kernels.triton.quant import fp8_gemv, quantize_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 100, 5000])  # (5000: two passes of the kernel's block)
def test_the_quantization_kernel_equals_the_reference_bit_for_bit(
    dtype: torch.dtype, cols: int
) -> None:
    x = _rand(5, cols, dtype=dtype)
    x[1] *= 1000.0  # (a wide row)
    x[2] = 0.0  # (a row of zeros: the smallest scale)
    x[3, :7] = torch.tensor([0.49, -0.49, 1e-3, 3.0, -448.0, 7e-5, 2.25], dtype=dtype)
    q, scale = quantize_rows(x)
    want_q, want_scale = ref_quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert scale[2].item() == pytest.approx(MIN_SCALE) and not q[2].float().any()
    # a strided view of the rows (a fused projection's part) gives the same
    wide = torch.cat([x, x], dim=1)
    q2, scale2 = quantize_rows(wide[:, cols:])
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


def test_a_rows_largest_value_is_the_formats_largest_and_the_error_is_a_rounding() -> None:
    x = _rand(16, 256) * torch.logspace(-3, 3, 16, device=DEVICE).unsqueeze(1)
    q, scale = ref_quantize_rows(x)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((16,), FP8_MAX, device=DEVICE))
    torch.testing.assert_close(scale, x.abs().amax(dim=1) / FP8_MAX, atol=0, rtol=2e-7)
    back = q.float() * scale.unsqueeze(1)
    # e4m3: 3 mantissa bits, a relative error of at most 2^-4 for normal values, and an
    # absolute one of half the subnormal step (2^-10) times the scale below them
    bound = torch.maximum(x.abs() * 2**-4, scale.unsqueeze(1) * 2**-10)
    assert bool(((back - x).abs() <= bound * 1.0001).all())
    assert not torch.isnan(back).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(2, 3), (3,)])  # (on a GPU: the FP8 GEMM, the few-row kernel)
def test_the_fp8_product_is_the_dequantized_operands_product(
    dtype: torch.dtype, bias: bool, lead: tuple[int, ...]
) -> None:
    x = _rand(*lead, 64, dtype=dtype)  # (leading dims kept)
    rows = x.numel() // 64
    layer = Fp8Linear(64, 48, bias, dtype, DEVICE)
    layer.load_rows_(_rand(48, 64, seed=1) * 0.05)
    if layer.bias is not None:
        layer.bias.data.copy_(_rand(48, seed=2).to(dtype))
    got = layer(x)
    assert got.shape == (*lead, 48) and got.dtype == dtype
    # the reference: both operands dequantized, multiplied in float32
    q, scale = ref_quantize_rows(x.reshape(rows, 64))
    w = layer.weight.float() * layer.weight_scale.unsqueeze(1)
    want = (q.float() * scale.unsqueeze(1)) @ w.t()
    if layer.bias is not None:
        want += layer.bias.float()
    # float32 sums in another order (CPU), or a bfloat16 output (GPU)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 and not x.is_cuda else (2e-2, 1e-2)
    torch.testing.assert_close(got.float().reshape(rows, 48), want, atol=atol, rtol=rtol)
    ref = ref_fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    # against the unquantized product: within FP8's rounding of both operands
    exact = x.float() @ (_rand(48, 64, seed=1) * 0.05).t()
    if layer.bias is not None:
        exact += layer.bias.float()
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_shape_the_fp8_gemm_does_not_take_falls_back_to_the_reference() -> None:
    x = _rand(3, 40)  # (K = 40, N = 20: not multiples of 16)
    layer = Fp8Linear(40, 20, True, torch.float32, DEVICE)
    layer.load_rows_(_rand(20, 40, seed=1))
    layer.bias.data.fill_(0.5)  # type: ignore[union-attr]
    torch.testing.assert_close(
        fp8_linear(x, layer.weight, layer.weight_scale, layer.bias),
        ref_fp8_linear(x, layer.weight, layer.weight_scale, layer.bias),
        atol=1e-5,
        rtol=1e-5,
    )


def test_rows_quantized_in_pieces_equal_the_whole() -> None:
    """Each row has its own scale: a fused projection loaded part by part (q, k, v), or a
    rank's rows of it, holds what the whole weight quantized at once holds."""
    w = _rand(96, 32) * torch.linspace(0.01, 10, 96, device=DEVICE).unsqueeze(1)
    whole = Fp8Linear(32, 96, False, torch.float32, DEVICE)
    whole.load_rows_(w)
    parts = Fp8Linear(32, 96, False, torch.float32, DEVICE)
    for start, rows in ((0, 64), (64, 16), (80, 16)):
        parts.load_rows_(w[start : start + rows], start)
    assert torch.equal(parts.weight.view(torch.uint8), whole.weight.view(torch.uint8))
    assert torch.equal(parts.weight_scale, whole.weight_scale)
    assert "float8_e4m3fn" in repr(whole)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bias"), [(37, 100, True), (48, 600, False)])
@pytest.mark.parametrize("dot", [None, (16, 64, 4, 2), (32, 128, 4, 3), "default"])
def test_the_few_rows_kernel_is_the_dequantized_operands_product(
    rows: int, dtype: torch.dtype, n: int, k: int, bias: bool, dot: tuple[int, ...] | str | None
) -> None:
    """The GEMV of a few FP8 rows (a decode step's) by an FP8 weight, on the CUDA cores or
    the tensor cores (``dot``): the dequantized operands' float32 product, within the order of
    the sums (neither N nor K a multiple of the kernel's blocks in the first shape)."""
    layer = Fp8Linear(k, n, bias, dtype, DEVICE)
    layer.load_rows_(_rand(n, k, seed=1) * 0.05)
    if layer.bias is not None:
        layer.bias.data.copy_(_rand(n, seed=2).to(dtype))
    q, scale = quantize_rows(_rand(rows, k, dtype=dtype))
    got = fp8_gemv(q, scale, layer.weight, layer.weight_scale, layer.bias, dtype, dot)  # type: ignore[arg-type]
    w = layer.weight.float() * layer.weight_scale.unsqueeze(1)
    want = (q.float() * scale.unsqueeze(1)) @ w.t()
    if layer.bias is not None:
        want += layer.bias.float()
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
