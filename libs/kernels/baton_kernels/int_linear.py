"""Integer-weight linear layers (W4A16 / W8A16: compressed-tensors' and AutoAWQ's checkpoints,
vLLM's ``--quantization compressed-tensors`` / ``awq``), the weights kept packed in memory.

A layer's weight ``[N, K]`` is held as unsigned ``bits``-bit values ``u`` (4 or 8 bits) packed
into int32 words, with one float32 scale ``s`` and one zero point ``z`` (uint8, in ``u``'s
range; ``2^(bits - 1)`` where the checkpoint is symmetric) per row and group of ``group_size``
columns: ``w[n, k] = (u[n, k] - z[n, g]) * s[n, g]``, ``g = k // group_size``. The activations
stay in the model's dtype.

The words are laid out by spans (``pack_spans``): each span of ``SPAN_WORDS`` (16) words holds
``32 / bits`` planes of 16 consecutive columns, plane ``j`` in bits ``[bits * j, bits * (j +
1))`` of the span's words (column ``t * span + 16 * j + w`` in slot ``j`` of word ``16 * t +
w``), the last span padded with zeros. A plane is then one shift and mask of the words the
kernel loaded, 16 columns in order: the tensor cores' K, without the register shuffles that
interleaved values (compressed-tensors' ``weight_packed``: value ``j`` of word ``w`` is column
``8 * w + j``) take to bring into order (on an H100 a Llama layer at one row took 206 us
against 228 with interleaved values). Checkpoints are converted on load.

On GPUs (and under Triton's interpreter) the product reads the packed weight itself
(``triton/int_gemm.py``): up to ``GEMV_ROWS`` rows without the tensor cores (``int_gemv``, a
decode step reading a quarter of a bf16 weight's bytes at 4 bits), up to ``DEQUANT_ROWS``
through a GEMM that unpacks each tile in registers, up to ``MM_ROWS`` through ``int_mm``, a
GEMM that unpacks each weight tile once for up to 128 rows, more by unpacking the whole weight
into a scratch matrix in the model's dtype and one cuBLAS GEMM (as vLLM's AWQ layers do from
256 rows). Measured (benchmarks/RESULTS.md): at one row Llama-3.1-8B's projections take 86 us
a layer against 122 in bf16 cuBLAS (H200; Llama-8B decodes one sequence at 272 tok/s against
234 in bf16), at two rows the same as bf16, from four rows more (4 rows 1.5x, 16 rows 2.2x;
H100: 32 rows 1.4x, 64 rows 1.8x, 2,048 rows 1.26x bf16's time).
Elsewhere ``ref_int_linear`` unpacks the weight at every call (the memory of 4-bit weights at a
CPU's cost; the engine dequantizes on load on CPUs instead)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Products of up to this many rows run int_gemm; of more than this and MM_ROWS, the weight is
# unpacked and one cuBLAS GEMM runs: at 64 rows Llama's four projections took 783 us a layer in
# int_gemm against 349 to unpack them and 171 in bf16 cuBLAS (H100, benchmarks/RESULTS.md)
DEQUANT_ROWS = 16
# Products of up to this many rows run without the tensor cores (int_gemv): a Llama layer at 4
# rows 175 us against 237 in int_gemm (H200; bf16 cuBLAS 119); at 8 rows int_gemm is 5x faster
GEMV_ROWS = 4
# Products of more rows than DEQUANT_ROWS and up to this many run through int_mm (a dot a K
# tile of whole spans, the tile unpacked once for up to 128 rows): Llama's four projections
# took 224 us a layer at 32 rows and 287 at 64 against 510 to unpack them and run cuBLAS (bf16
# cuBLAS 161-164); at 128 rows int_mm took 604 against 519, at 16 rows 250 against int_gemm's
# 254 (H100, benchmarks/RESULTS.md). A W4A16 Llama-8B batch of 64 ran 4,270 tok/s against
# 2,922 with unpacking from 17 rows
MM_ROWS = 64
BITS = (4, 8)
SPAN_WORDS = 16  # (a plane's columns: the tensor cores' K for 16-bit operands)


def packed_cols(cols: int, bits: int) -> int:
    """The int32 words a row of ``cols`` ``bits``-bit values takes (densely packed)."""
    return -(cols * bits // -32)


def span_cols(bits: int) -> int:
    """The columns a span of ``SPAN_WORDS`` words holds."""
    return 32 // bits * SPAN_WORDS


def span_words(cols: int, bits: int) -> int:
    """The int32 words a row of ``cols`` values takes in spans (the last one padded)."""
    return -(cols // -span_cols(bits)) * SPAN_WORDS


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words below 2^32 as the int32s of the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_spans(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (``[N, K]``, unsigned, below ``2^bits``) packed by spans (see the module's
    docstring): ``[N, span_words(K, bits)]`` int32."""
    rows, cols = values.shape
    per, span = 32 // bits, span_cols(bits)
    padded = torch.zeros(rows, -(cols // -span) * span, dtype=torch.int64, device=values.device)
    padded[:, :cols] = values.to(torch.int64)
    planes = padded.reshape(rows, -1, per, SPAN_WORDS)  # [row, span, plane, word]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    return _to_int32((planes << shifts.reshape(1, 1, per, 1)).sum(dim=2).reshape(rows, -1))


def unpack_spans(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The first ``cols`` values of each row of span-packed words (``pack_spans``), as int32."""
    rows, per = packed.shape[0], 32 // bits
    words = packed.reshape(rows, -1, 1, SPAN_WORDS)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (words >> shifts.reshape(1, 1, per, 1)) & ((1 << bits) - 1)
    return values.reshape(rows, -1)[:, :cols]


def ref_unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The first ``cols`` unsigned ``bits``-bit values of each row of ``packed`` (int32 words,
    the first value in a word's lowest bits), as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)[:, :cols]


def ref_pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (``[N, K]``, unsigned and below ``2^bits``) packed into int32 words along K,
    the first value in a word's lowest bits (``ref_unpack``'s inverse)."""
    rows, cols = values.shape
    per = 32 // bits
    padded = torch.zeros(rows, packed_cols(cols, bits) * per, dtype=torch.int64,
                         device=values.device)  # fmt: skip
    padded[:, :cols] = values.to(torch.int64)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    return _to_int32((padded.reshape(rows, -1, per) << shifts).sum(dim=-1))


def ref_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    cols: int,
) -> torch.Tensor:
    """The float32 weight ``(u - z) * s`` of a span-packed layer (``[N, cols]``)."""
    u = unpack_spans(packed, bits, cols)
    groups = scale.shape[1]
    s = scale.float().repeat_interleave(group_size, dim=1)[:, :cols] if groups > 1 else scale
    z = zero.to(torch.int32).repeat_interleave(group_size, dim=1)[:, :cols] if groups > 1 else zero
    return (u - z.to(torch.int32)).float() * s.float()


def ref_int_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` with the packed weight dequantized to float32, then rounded to
    ``x``'s dtype (as a model whose weights were dequantized on load computes it)."""
    w = ref_dequantize(packed, scale, zero, bits, group_size, x.shape[-1]).to(x.dtype)
    return F.linear(x, w, bias)


def _triton_runs(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def int_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ ((u - z) * s).T + bias`` for ``x`` ``[..., K]`` in a float dtype, the weight packed
    (see the module's docstring): the output in ``x``'s dtype."""
    if not _triton_runs(x):
        return ref_int_linear(x, packed, scale, zero, bits, group_size, bias)
    from baton_kernels.triton.int_gemm import dequantize, int_gemm, int_gemv, int_mm

    k = x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    if n > max(DEQUANT_ROWS, MM_ROWS):
        w = dequantize(packed, scale, zero, bits, group_size, k, x.dtype)
        return F.linear(x, w, bias)
    kernel = int_gemv if n <= GEMV_ROWS else int_gemm if n <= DEQUANT_ROWS else int_mm
    out = kernel(rows, packed, scale, zero, bits, group_size, bias)
    return out.reshape(*x.shape[:-1], -1)


def ref_quantize(
    weight: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` quantized symmetrically by row and group of ``group_size`` columns
    (``max|w|`` of a group maps to ``2^(bits - 1) - 1``): the values packed by spans, the scales
    ``[N, groups]`` and the zero points (uint8, all ``2^(bits - 1)``)."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, -1, min(group_size, cols))
    top = (1 << (bits - 1)) - 1
    scale = (w.abs().amax(dim=-1) / top).clamp(min=1e-8)
    q = (w / scale.unsqueeze(-1)).round().clamp(-top - 1, top).reshape(rows, cols)
    zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.uint8)
    return pack_spans(q.to(torch.int32) + (1 << (bits - 1)), bits), scale, zero


class IntLinear(nn.Module):
    """A linear layer of packed integer weights (``int_linear``): ``weight_packed`` (int32
    ``[out, span_words(in, bits)]``, by spans), ``weight_scale`` (float32 ``[out, groups]``),
    ``weight_zero`` (uint8 ``[out, groups]``) and a bias in the model's dtype. ``group_size``:
    the columns a scale covers (``in_features``: one an output row; else a multiple of 16, a
    plane's columns)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        bits: int,
        group_size: int | None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        group = group_size or in_features
        if bits not in BITS or in_features % group or (group < in_features and group % 16):
            raise ValueError(
                f"an integer layer of {in_features} inputs takes {bits}-bit values in groups "
                f"of {group} (4 or 8 bits; groups that divide the inputs, of a multiple of 16 "
                "columns or one a row)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group
        groups = in_features // group

        def param(*shape: int, dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        self.weight_packed = param(out_features, span_words(in_features, bits), dt=torch.int32)
        self.weight_scale = param(out_features, groups, dt=torch.float32)
        self.weight_zero = param(out_features, groups, dt=torch.uint8)
        self.bias = param(out_features, dt=dtype) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, bits: int, group_size: int | None) -> IntLinear:
        """An empty integer layer of ``linear``'s shape, on its device, its bias in its dtype."""
        w = linear.weight
        return cls(
            w.shape[1], w.shape[0], linear.bias is not None, w.dtype, bits, group_size, w.device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int_linear(x, self.weight_packed, self.weight_scale, self.weight_zero, self.bits,
                          self.group_size, self.bias)  # fmt: skip

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (``[out, in]``, any float dtype) into the layer
        (``ref_quantize``: symmetric, by row and group)."""
        packed, scale, zero = ref_quantize(weight, self.bits, self.group_size)
        self.weight_packed.copy_(packed)
        self.weight_scale.copy_(scale)
        self.weight_zero.copy_(zero)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}")  # fmt: skip
