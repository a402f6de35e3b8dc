"""FP8 linear layers (W8A8, vLLM's ``--quantization fp8``): the weight is stored as
float8_e4m3fn with one float32 scale per output row; at each call the input is quantized per
token (row), ``q[m] = x[m] / s[m]`` with ``s[m] = max|x[m]| / 448``, and ``torch._scaled_mm``
multiplies the two 8-bit matrices, applying both scales to the float32 accumulators:
``out[m, n] = s[m] * w_scale[n] * sum_k q[m, k] w8[n, k]`` (+ bias).

On GPUs of compute capability 8.9 and above (Ada, Hopper: FP8 tensor cores) the product is one
FP8 GEMM (half a bf16 GEMM's weight bytes, twice its peak FLOP/s), or for at most
``GEMV_ROWS`` rows (a few requests' decode step) a Triton GEMV of the FP8 rows on the tensor
cores (``triton/quant.py``: the GEMM's 64-row tiles read the weight far below the memory's
bandwidth), and the quantization one Triton launch. Elsewhere torch's CPU ``_scaled_mm``
computes the same product exactly in float32 (correct, but ~18x slower than a bf16 GEMM on the
development CPU: FP8 on a CPU saves memory, not time).

One scale a row holds an FP8 checkpoint's own quantization exactly, whether it has one scale a
tensor or one an output channel (a fused qkv or gate/up projection gets each part's scale on
its rows), and a row's scale makes quantizing at load time independent of how the rows are
split (tensor parallelism, fused projections)."""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512)  # (vLLM's: a row of zeros still gets a finite 1 / scale)
# The GPU's row-wise scaled GEMM accumulating as the tensor cores do natively (fewer
# promotions to float32 along K; faster, less exact; vLLM's Hopper kernels do so too):
# Llama-3.1-8B's shape at 256 on an H100 12,536 against 11,886 tok/s (benchmarks/RESULTS.md)
FAST_ACCUM = True
# Products of at most this many rows run as a Triton GEMV on GPUs (``triton/quant.py``); 0: never
GEMV_ROWS = 4


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs on its own units (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def ref_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` as FP8 and its float32 scale (``max|row|`` times the float32 of
    1/448): ``x`` times the float32 of ``1 / scale``, saturated, cast (rounded to nearest
    even)."""
    scale = (x.abs().amax(dim=-1).float() * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    inv = 1.0 / scale
    q = (x.float() * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref_quantize_rows`` of ``x`` ``[M, K]``: one Triton launch on a GPU."""
    if x.is_cuda:
        from baton_kernels.triton.quant import quantize_rows as triton_quantize_rows

        return triton_quantize_rows(x if x.stride(1) == 1 else x.contiguous())
    return ref_quantize_rows(x)


def ref_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_linear`` by dequantizing both operands to float32 (the reference, and the path
    for shapes the FP8 GEMM does not take)."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    w = weight.float() * weight_scale.unsqueeze(1)
    out = (q.float() * scale.unsqueeze(1)) @ w.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per row: ``weight``
    ``[N, K]`` FP8, ``weight_scale`` ``[N]`` float32; the output in ``x``'s dtype."""
    n, k = weight.shape
    if x.is_cuda and (n % 16 or k % 16):  # (the FP8 GEMM's dimensions are multiples of 16)
        return ref_fp8_linear(x, weight, weight_scale, bias)
    q, scale = quantize_rows(x.reshape(-1, k))
    if x.is_cuda and q.shape[0] <= GEMV_ROWS:
        from baton_kernels.triton.quant import fp8_gemv

        out = fp8_gemv(q, scale, weight, weight_scale, bias, x.dtype)
    elif x.is_cuda and x.dtype != torch.bfloat16:
        # A GPU's row-wise scaled GEMM writes bfloat16 only: for another dtype the float32
        # accumulators (unit scales), then the scales applied here.
        one = scale.new_ones(())
        acc = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        acc = acc * scale.unsqueeze(1) * weight_scale.unsqueeze(0)
        out = (acc if bias is None else acc + bias).to(x.dtype)
    else:
        out = torch._scaled_mm(
            q,
            weight.t(),
            scale_a=scale.unsqueeze(1),
            scale_b=weight_scale.unsqueeze(0),
            bias=bias,
            out_dtype=x.dtype,
            use_fast_accum=FAST_ACCUM and x.is_cuda,
        )
    return out.reshape(*x.shape[:-1], n)


class Fp8Linear(nn.Module):
    """A linear layer with an FP8 weight ``[out, in]``, one float32 ``weight_scale`` a row,
    and a bias in the model's dtype (``fp8_linear``). ``load_rows_`` quantizes a
    higher-precision weight into it; an FP8 checkpoint's weight and scales are copied in as
    they are."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        empty = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        self.weight = nn.Parameter(empty, requires_grad=False)
        scale = torch.ones(out_features, dtype=torch.float32, device=device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False)
            if bias
            else None
        )

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An empty FP8 layer of ``linear``'s shape, on its device, its bias in its dtype."""
        w = linear.weight
        return cls(w.shape[1], w.shape[0], linear.bias is not None, w.dtype, w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    @torch.no_grad()
    def load_rows_(self, weight: torch.Tensor, start: int = 0) -> None:
        """Quantize ``weight`` (rows ``[start, start + len)`` of this layer's, any float dtype)
        into the layer: each row by its own scale (``ref_quantize_rows``)."""
        q, scale = ref_quantize_rows(weight.to(self.weight.device))
        rows = weight.shape[0]
        self.weight.narrow(0, start, rows).copy_(q)
        self.weight_scale.narrow(0, start, rows).copy_(scale)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight=float8_e4m3fn (a scale a row)"
        )
