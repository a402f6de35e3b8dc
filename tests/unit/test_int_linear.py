"""Integer-weight linear layers (``baton_kernels.int_linear``, W4A16 / W8A16, weights kept
packed): the dense packing against compressed-tensors' own and the layers' layout by spans, the
Triton GEMM and dequantization against
the torch reference (the weight dequantized to float32, rounded to the activations' dtype), and
the layer's product against the float layer it quantizes.

Without a GPU the Triton kernels run under Triton's interpreter (its 16-bit dots are computed
in float32 there, and its conversions to bfloat16 truncate); with a GPU the same tests run
compiled."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from baton_kernels import int_linear
from baton_kernels.int_linear import (
    IntLinear,
    pack_spans,
    ref_dequantize,
    ref_int_linear,
    ref_pack,
    ref_unpack,
    span_words,
    unpack_spans,
)
from baton_kernels.triton.int_gemm import dequantize, int_gemm, int_gemv, int_mm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of a product against the reference: float32's sums in another order; a 16-bit
# output's rounding (and under the interpreter bfloat16's truncation)
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (6e-2, 2e-2), torch.float16: (1e-2, 4e-3)}


def _layer(
    n: int, k: int, bits: int, group: int, seed: int = 0, asymmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random weight ``[n, k]`` packed by spans: every value of the range, scales spread over
    two orders of magnitude, and random zero points (``asymmetric``) or the symmetric one."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
    groups = k // group
    scale = torch.rand(n, groups, generator=g).mul_(4).sub_(2).exp_().mul_(0.01)
    if asymmetric:
        zero = torch.randint(0, 1 << bits, (n, groups), generator=g).to(torch.uint8)
    else:
        zero = torch.full((n, groups), 1 << (bits - 1), dtype=torch.uint8)
    return pack_spans(u, bits).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def _rand(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_is_compressed_tensors_layout_and_unpacks_back(bits: int) -> None:
    g = torch.Generator().manual_seed(3)
    half = 1 << (bits - 1)
    signed = torch.randint(-half, half, (5, 64), generator=g, dtype=torch.int8)
    packed = ref_pack(signed.to(torch.int32) + half, bits)
    assert torch.equal(packed, pack_to_int32(signed, bits))
    assert torch.equal(ref_unpack(packed, bits, 64), signed.to(torch.int32) + half)
    # a row that does not fill its last word: the rest of the word is zeros
    part = signed[:, :60].to(torch.int32) + half
    assert torch.equal(ref_unpack(ref_pack(part, bits), bits, 60), part)


@pytest.mark.parametrize("bits", [4, 8])
def test_spans_hold_planes_of_sixteen_columns(bits: int) -> None:
    per, cols = 32 // bits, 200  # (a last span partly padding)
    values = torch.randint(0, 1 << bits, (3, cols), generator=torch.Generator().manual_seed(4))
    packed = pack_spans(values, bits)
    assert packed.shape == (3, span_words(cols, bits)) and packed.shape[1] % 16 == 0
    for k in (0, 1, 15, 16, 17, 16 * per - 1, 16 * per, 199):
        span, plane, word = k // (16 * per), k % (16 * per) // 16, k % 16
        slot = (packed[:, 16 * span + word] >> (bits * plane)) & ((1 << bits) - 1)
        assert torch.equal(slot, values[:, k])
    assert torch.equal(unpack_spans(packed, bits, cols), values)
    assert not unpack_spans(packed, bits, packed.shape[1] * per)[:, cols:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("bits", "group", "k"),
    [
        (4, 32, 128),  # four groups a span
        (4, 128, 256),  # a group a span, two spans a step
        (8, 64, 128),
        (4, 16, 96),  # groups of a plane; a span partly padding
        (8, 48, 144),
        (4, 100, 100),  # one scale a row
    ],
)
@pytest.mark.parametrize("rows", [1, 16, 17, 70])  # (70: two tiles of 64 rows)
def test_the_gemm_is_the_dequantized_weights_product(
    dtype: torch.dtype,
    bits: int,
    group: int,
    k: int,
    rows: int,
    magic: bool = False,
    swap: bool = False,
) -> None:
    n = 72  # (the last program of 32 or 128 columns partly outside)
    packed, scale, zero = _layer(n, k, bits, group, seed=rows)
    x = _rand(rows, k, dtype=dtype)
    bias = _rand(n, dtype=dtype, seed=7) if rows % 2 else None
    want = ref_int_linear(x, packed, scale, zero, bits, group, bias)
    got = int_gemm(x, packed, scale, zero, bits, group, bias, magic=magic, swap=swap)
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)
    # a strided view of the rows (a fused projection's part of a wider buffer) gives the same
    wide = torch.cat([x, x], dim=1)[:, k:]
    torch.testing.assert_close(int_gemm(wide, packed, scale, zero, bits, group, bias,
                                        magic=magic, swap=swap), got, atol=0, rtol=0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 128), (8, 48, 144)])
@pytest.mark.parametrize("rows", [1, 17])
def test_integers_made_floats_by_their_bits_give_the_same_product(
    dtype: torch.dtype, bits: int, group: int, k: int, rows: int
) -> None:
    test_the_gemm_is_the_dequantized_weights_product(dtype, bits, group, k, rows, magic=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 128), (8, 48, 144)])
@pytest.mark.parametrize("rows", [1, 17])
def test_the_transposed_product_is_the_same(
    dtype: torch.dtype, bits: int, group: int, k: int, rows: int
) -> None:
    test_the_gemm_is_the_dequantized_weights_product(dtype, bits, group, k, rows, swap=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group", "k"),
    [
        (4, 32, 128),  # four groups a span: the scale a plane
        (4, 128, 384),  # a group a span: the scale a span
        (8, 128, 256),  # two spans a group
        (4, 16, 96),  # a span partly padding
        (8, 48, 144),
        (4, 100, 100),  # one scale a row
    ],
)
@pytest.mark.parametrize(("rows", "split"), [(1, 1), (1, 3), (3, 2), (8, 0)])
@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_the_gemv_is_the_dequantized_weights_product(
    dtype: torch.dtype, bits: int, group: int, k: int, rows: int, split: int, asm: bool
) -> None:
    n = 72  # (the last program of 64 rows of the weight partly outside)
    packed, scale, zero = _layer(n, k, bits, group, seed=rows)
    x = _rand(rows, k, dtype=dtype)
    bias = _rand(n, dtype=dtype, seed=7) if rows % 2 else None
    want = ref_int_linear(x, packed, scale, zero, bits, group, bias)
    got = int_gemv(x, packed, scale, zero, bits, group, bias, config=(64, split, 4, 2), asm=asm)
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)
    wide = torch.cat([x, x], dim=1)[:, k:]
    torch.testing.assert_close(int_gemv(wide, packed, scale, zero, bits, group, bias,
                                        config=(64, split, 4, 2), asm=asm), got, atol=0,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("bits", "group", "k"),
    [
        (4, 128, 384),  # a scale a tile of one span; K not a multiple of two spans
        (4, 256, 512),  # a scale a tile of two spans
        (8, 64, 320),  # a span a tile (two halved to fit the group)
        (4, 32, 128),  # four groups a span: each value scaled before the dot
        (8, 48, 144),  # a span partly padding
        (4, 100, 100),  # one scale a row, applied at the end
    ],
)
@pytest.mark.parametrize(
    ("rows", "max_m", "swap", "split"),
    [(1, 64, False, 1), (17, 64, True, 2), (70, 32, False, 3), (70, 128, True, 0)],
)
@pytest.mark.parametrize("perm", [0, 1, 2])
def test_the_tiled_gemm_is_the_dequantized_weights_product(
    dtype: torch.dtype, bits: int, group: int, k: int, rows: int, max_m: int, swap: bool,
    split: int, perm: int,
) -> None:  # fmt: skip
    n = 72  # (the last program of 64 rows of the weight partly outside)
    packed, scale, zero = _layer(n, k, bits, group, seed=rows)
    x = _rand(rows, k, dtype=dtype)
    bias = _rand(n, dtype=dtype, seed=7) if rows % 2 else None
    want = ref_int_linear(x, packed, scale, zero, bits, group, bias)
    config = (max_m, 64, 256, 4, 2)
    got = int_mm(x, packed, scale, zero, bits, group, bias, config, swap, split, perm)
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)
    wide = torch.cat([x, x], dim=1)[:, k:]
    torch.testing.assert_close(int_mm(wide, packed, scale, zero, bits, group, bias, config,
                                      swap, split, perm), got, atol=0, rtol=0)  # fmt: skip


def test_the_layer_routes_rows_to_the_tiled_gemm_up_to_mm_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed, scale, zero = _layer(72, 256, 4, 128, seed=6)
    x = _rand(3, 9, 256, dtype=torch.float32)  # (27 rows: past DEQUANT_ROWS)
    bias = _rand(72, dtype=torch.float32, seed=8)
    monkeypatch.setattr(int_linear, "MM_ROWS", 32)
    got = int_linear.int_linear(x, packed, scale, zero, 4, 128, bias)
    assert torch.equal(
        got, int_mm(x.reshape(27, 256), packed, scale, zero, 4, 128, bias).reshape(3, 9, 72)
    )
    want = ref_int_linear(x, packed, scale, zero, 4, 128, bias)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
    few = x[0, :2]  # (GEMV_ROWS and below: still the GEMV)
    assert torch.equal(int_linear.int_linear(few, packed, scale, zero, 4, 128),
                       int_gemv(few, packed, scale, zero, 4, 128))  # fmt: skip
    some = x[0, :8]  # (up to DEQUANT_ROWS: the GEMM that unpacks tiles in registers)
    assert torch.equal(int_linear.int_linear(some, packed, scale, zero, 4, 128),
                       int_gemm(some, packed, scale, zero, 4, 128))  # fmt: skip


def test_the_gemv_in_half_precision_and_by_default() -> None:
    packed, scale, zero = _layer(300, 512, 4, 128, seed=4)
    x = _rand(2, 512, dtype=torch.float16)
    want = ref_int_linear(x, packed, scale, zero, 4, 128)
    atol, rtol = TOL[torch.float16]
    got = int_linear.int_linear(x, packed, scale, zero, 4, 128)  # (GEMV_ROWS: the gemv)
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)
    assert torch.equal(got, int_gemv(x, packed, scale, zero, 4, 128))


@pytest.mark.parametrize("config", [(32, 128, 1, 1), (64, 512, 8, 2)])
def test_launch_configurations_agree(config: tuple[int, int, int, int]) -> None:
    packed, scale, zero = _layer(100, 384, 4, 64, seed=5)  # (three spans: steps of 1 and 4)
    x = _rand(9, 384, dtype=torch.float32)
    want = ref_int_linear(x, packed, scale, zero, 4, 64)
    got = int_gemm(x, packed, scale, zero, 4, 64, config=config)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "group", "k"), [(4, 32, 192), (8, 64, 192), (4, 160, 160)])
def test_dequantization_is_the_reference(dtype: torch.dtype, bits: int, group: int, k: int) -> None:
    packed, scale, zero = _layer(80, k, bits, group, seed=bits)
    got = dequantize(packed, scale, zero, bits, group, k, dtype)
    want = ref_dequantize(packed, scale, zero, bits, group, k)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":  # (the interpreter truncates)
        torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want.to(dtype))


def test_many_rows_run_through_the_dequantized_weight() -> None:
    packed, scale, zero = _layer(48, 64, 4, 32, seed=9)
    rows = int_linear.DEQUANT_ROWS + 3
    x = _rand(2, rows // 2 + 1, 64, dtype=torch.float32)
    bias = _rand(48, dtype=torch.float32, seed=2)
    want = ref_int_linear(x, packed, scale, zero, 4, 32, bias)
    got = int_linear.int_linear(x, packed, scale, zero, 4, 32, bias)
    assert got.shape == (2, rows // 2 + 1, 48)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("bits", "group"), [(4, 16), (8, 64), (4, None)])
def test_a_quantized_layer_approximates_its_float_weights(bits: int, group: int | None) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40, bias=True).to(DEVICE)
    layer = IntLinear.like(linear, bits, group)
    assert layer.weight_scale.shape == (40, 64 // (group or 64)) and layer.bias is not None
    layer.quantize_(linear.weight)
    layer.bias.data.copy_(linear.bias)
    w = ref_dequantize(layer.weight_packed, layer.weight_scale, layer.weight_zero, bits,
                       layer.group_size, 64)  # fmt: skip
    # round to nearest: each weight within half its group's step
    step = layer.weight_scale.repeat_interleave(layer.group_size, dim=1)
    assert bool(((w - linear.weight).abs() <= step / 2 + 1e-6).all())
    x = _rand(3, 64, dtype=torch.float32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, linear.bias),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    error = (layer(x) - linear(x)).abs().max() / linear(x).abs().max()
    assert error < (0.15 if bits == 4 else 0.01)


@pytest.mark.parametrize(
    ("features", "bits", "group"), [((64, 8), 3, 16), ((60, 8), 4, 16), ((64, 8), 4, 8)]
)
def test_shapes_the_layout_cannot_hold_are_refused(
    features: tuple[int, int], bits: int, group: int | None
) -> None:
    with pytest.raises(ValueError, match="integer layer"):
        IntLinear(*features, bias=False, dtype=torch.float32, bits=bits, group_size=group)
