"""The few-row GEMV with its fused prologue / epilogue (``baton_kernels.triton.gemv``) against
its plain-PyTorch reference and against the separate ops it replaces.

Without a GPU the kernel runs under Triton's interpreter at small shapes; with a GPU the same
tests run compiled, on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from baton_kernels.triton import gemv as gemv_mod
from baton_kernels.triton.gemv import MAX_ROWS, choose_config, choose_launch, gemv, ref_gemv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 exact up to the order of the sums; bf16 within a unit in the last place of the output
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (4e-2, 1.6e-2)}
PROLOGUES = ["none", "norm", "silu"]


def make(rows: int, n: int, k: int, prologue: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    x = rand(rows, 2 * k if prologue == "silu" else k)
    weight = rand(n, k, scale=0.1)
    kwargs = {
        "norm_weight": rand(k, scale=0.2) + 1 if prologue == "norm" else None,
        "silu_mul": prologue == "silu",
    }
    return x, weight, rand(n), rand(rows, n), kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_gemv_matches_the_reference(dtype: torch.dtype, rows: int, prologue: str) -> None:
    # 37 x 100: neither a multiple of the column block nor of the K block
    x, weight, bias, residual, kwargs = make(rows, 37, 100, prologue, dtype)
    for config in ((4, 32, 4, 2), (16, 64, 4, 3), None):
        got = gemv(x, weight, bias, residual=residual, config=config, **kwargs)
        want = ref_gemv(x, weight, bias, residual=residual, **kwargs)
        torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
        plain = gemv(x, weight, config=config, **kwargs)
        torch.testing.assert_close(plain, ref_gemv(x, weight, **kwargs), atol=TOL[dtype][0],
                                   rtol=TOL[dtype][1])  # fmt: skip


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_gemv_with_and_without_the_prefetched_first_slice(prologue: str, prefetch: bool) -> None:
    """The first weight slice read before the wait for the previous kernel (the default under
    programmatic dependent launch, a peeled first iteration) or in the loop: the same sums,
    including a K of one slice (no loop left) and of a slice and a bit."""
    for rows, k, config in ((1, 100, (4, 32, 4, 2)), (3, 100, None), (2, 16, (8, 64, 4, 2))):
        x, weight, bias, residual, kwargs = make(rows, 37, k, prologue, torch.bfloat16, seed=k)
        got = gemv(x, weight, bias, residual=residual, config=config, prefetch=prefetch, **kwargs)
        want = ref_gemv(x, weight, bias, residual=residual, **kwargs)
        atol, rtol = TOL[torch.bfloat16]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_gemv_equals_the_separate_ops(prologue: str) -> None:
    """What the decoder ran before: norm (or SiLU-and-multiply), linear, residual add."""
    x, weight, bias, residual, kwargs = make(2, 48, 64, prologue, torch.float32, seed=1)
    inp = x
    if prologue == "norm":
        inp = torch.nn.functional.rms_norm(x, (64,), kwargs["norm_weight"], 1e-6)
    elif prologue == "silu":
        gate, up = x.chunk(2, dim=-1)
        inp = torch.nn.functional.silu(gate) * up
    want = torch.nn.functional.linear(inp, weight, bias) + residual
    got = gemv(x, weight, bias, residual=residual, **kwargs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_gemv_updates_the_residual_in_place() -> None:
    x, weight, _, residual, kwargs = make(1, 40, 64, "silu", torch.float32)
    want = ref_gemv(x, weight, residual=residual, **kwargs)
    out = gemv(x, weight, residual=residual, out=residual, **kwargs)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, want, atol=2e-5, rtol=1e-5)


def test_gemv_rejects_what_it_cannot_run() -> None:
    x, weight, _, _, _ = make(1, 8, 16, "none", torch.float32)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="one prologue"):
        gemv(x, weight, norm_weight=torch.ones(16, device=DEVICE), silu_mul=True)
    with pytest.raises(ValueError, match="columns"):
        gemv(x, weight, silu_mul=True)  # needs [M, 2K]
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, weight.double())
    with pytest.raises(ValueError, match="residual"):
        gemv(x, weight, residual=torch.zeros(1, 9, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_fixed_grid_gemv_matches_the_reference(
    dtype: torch.dtype, rows: int, prologue: str
) -> None:
    """The fixed-grid kernel (``stream``: programs an SM): programs that loop over several
    column blocks (37 columns in blocks of 4 or 2, on a grid of at most 4 or 8 programs), K in
    slices with a partial last one or in one slice, a single column block, and the residual
    updated in place."""
    atol, rtol = TOL[dtype]
    for n, k, config, stream in (
        (37, 100, (4, 32, 4, 1), 1),
        (37, 100, (2, 64, 4, 1), 2),
        (37, 24, (4, 32, 4, 1), 1),
        (3, 100, (4, 32, 4, 1), 2),
    ):
        x, weight, bias, residual, kwargs = make(rows, n, k, prologue, dtype, seed=n + k)
        want = ref_gemv(x, weight, bias, residual=residual, **kwargs)
        got = gemv(x, weight, bias, residual=residual, config=config, stream=stream, **kwargs)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        plain = gemv(x, weight, config=config, stream=stream, **kwargs)
        torch.testing.assert_close(plain, ref_gemv(x, weight, **kwargs), atol=atol, rtol=rtol)
        gemv(x, weight, bias, residual=residual, out=residual, config=config, stream=stream,
             **kwargs)  # fmt: skip
        torch.testing.assert_close(residual, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stream", [0, 2])
def test_gemv_silu_with_the_folded_norm_matches_silu_and_mul(
    dtype: torch.dtype, stream: int
) -> None:
    """``norm_of``: gate and up scaled by each row's 1/rms of another tensor (the norm folded
    into the gate/up projection) inside the down projection equals
    ``fused_ops.silu_and_mul(norm_of=)`` then the projection, on both kernels; the residual is
    the rows the norm reads (as in a decode layer), the output a new tensor."""
    from baton_kernels.triton.fused_ops import silu_and_mul

    atol, rtol = TOL[dtype]
    for rows, n, k, config in ((1, 37, 100, (4, 32, 4, 1)), (3, 40, 64, (8, 16, 4, 2))):
        x, weight, _, stream_rows, _ = make(rows, n, k, "silu", dtype, seed=rows)
        want = ref_gemv(x, weight, silu_mul=True, norm_of=stream_rows, eps=1e-5,
                        residual=stream_rows)  # fmt: skip
        act = silu_and_mul(x, norm_of=stream_rows, eps=1e-5)
        separate = ref_gemv(act, weight, residual=stream_rows)
        torch.testing.assert_close(want, separate, atol=atol, rtol=rtol)
        got = gemv(x, weight, silu_mul=True, norm_of=stream_rows, eps=1e-5,
                   residual=stream_rows, config=config, stream=stream)  # fmt: skip
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        with pytest.raises(ValueError, match="norm_of"):
            gemv(x, weight, silu_mul=True, norm_of=stream_rows, residual=stream_rows,
                 out=stream_rows)  # fmt: skip
    with pytest.raises(ValueError, match="silu_mul"):
        gemv(stream_rows, torch.zeros(3, n, dtype=dtype, device=DEVICE), norm_of=stream_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", [*PROLOGUES, "silu_norm"])
def test_tensor_core_gemv_matches_the_reference(
    dtype: torch.dtype, rows: int, prologue: str
) -> None:
    """The tensor-core kernel (``dot``): 37 columns in blocks of 16 or 32 (a partial last
    block), K = 100 in slices of 32 or 64 (a partial last slice), in one K range or split over
    2-4 programs a column block whose last sums the partials (the RMSNorm's sums of squares
    too); a single partial column block; the folded norm's 1/rms of another tensor before
    SiLU; the residual updated in place. Each split launch is run twice (its counters are
    left at zero for the next launch)."""
    atol, rtol = TOL[dtype]
    for n, k, dot in (
        (37, 100, (16, 32, 4, 3, 1)),
        (37, 100, (32, 32, 4, 2, 3)),
        (37, 100, (16, 64, 4, 3, 2)),
        (3, 100, (16, 32, 4, 2, 4)),
    ):
        x, weight, bias, residual, kwargs = make(rows, n, k, prologue.split("_")[0], dtype, n + k)
        if prologue == "silu_norm":
            kwargs |= {"norm_of": residual.clone(), "eps": 1e-5}
        want = ref_gemv(x, weight, bias, residual=residual, **kwargs)
        for _ in range(2 if dot[4] > 1 else 1):
            got = gemv(x, weight, bias, residual=residual, dot=dot, **kwargs)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        plain = gemv(x, weight, dot=dot, **kwargs)
        torch.testing.assert_close(plain, ref_gemv(x, weight, **kwargs), atol=atol, rtol=rtol)
        gemv(x, weight, bias, residual=residual, out=residual, dot=dot, **kwargs)
        torch.testing.assert_close(residual, want, atol=atol, rtol=rtol)


def test_dot_launches_route_their_shapes_to_the_tensor_core_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 16-bit weight whose shape is in ``DOT_LAUNCHES`` runs the tensor-core kernel when the
    call names no launch (its split launch leaves a counter of the ``gemv`` owner, at zero);
    a float32 weight of that shape, other shapes, and calls with an explicit ``config`` run
    the CUDA-core kernels."""
    from baton_kernels.triton import common

    def gemv_counters() -> list[torch.Tensor]:
        return [c for (_, owner), c in common._COUNTERS.items() if owner == "gemv"]

    monkeypatch.setattr(gemv_mod, "DOT_LAUNCHES", {(37, 100): (16, 32, 4, 2, 2)})
    monkeypatch.setattr(common, "_COUNTERS", {})
    x, weight, *_ = make(1, 37, 100, "none", torch.bfloat16)
    torch.testing.assert_close(gemv(x, weight), ref_gemv(x, weight), atol=TOL[torch.bfloat16][0],
                               rtol=TOL[torch.bfloat16][1])  # fmt: skip
    counters = gemv_counters()
    assert len(counters) == 1 and not counters[0].any()
    monkeypatch.setattr(common, "_COUNTERS", {})
    gemv(x, weight, config=(4, 32, 4, 1))
    gemv(x[:, :64], weight[:, :64])
    x32, w32, *_ = make(1, 37, 100, "none", torch.float32)
    assert gemv_mod.dot_launch(w32) is None
    torch.testing.assert_close(gemv(x32, w32), ref_gemv(x32, w32), atol=2e-5, rtol=1e-5)
    assert not gemv_counters()


def test_choose_launch_picks_the_fixed_grid_where_it_was_measured_faster() -> None:
    assert choose_launch(4096, 4096)[1] > 0  # Llama-3.1-8B's o_proj
    assert choose_launch(4096, 14336)[1] > 0  # and its down projection
    for n, k in ((6144, 4096), (28672, 4096), (1152, 896), (896, 896), (9728, 896)):
        assert choose_launch(n, k) == (choose_config(n, k), gemv_mod.STREAM)


def test_choose_config_covers_the_measured_shapes() -> None:
    """Every pick is a valid launch (power-of-two blocks) for the shapes it was fitted to."""
    for n, k in ((1152, 896), (896, 896), (9728, 896), (896, 4864), (6144, 4096),
                 (4096, 4096), (28672, 4096), (4096, 14336)):  # fmt: skip
        block_n, block_k, warps, stages = choose_config(n, k)
        for v in (block_n, block_k, warps):
            assert v & (v - 1) == 0
        assert stages >= 2
