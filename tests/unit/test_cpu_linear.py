"""Packed bf16 linear layers on CPU (``baton_kernels.cpu_linear``) against ``F.linear``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from baton_kernels.cpu_linear import (
    PackedLinear,
    can_pack,
    onednn_bf16_available,
    pack_vnni,
    vnni_ops,
)

needs_vnni = pytest.mark.skipif(vnni_ops() is None, reason="no AVX512-BF16 GEMM on this CPU")
KERNELS = [
    pytest.param("vnni", marks=needs_vnni),
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(
            not onednn_bf16_available(), reason="oneDNN packs no bf16 on this CPU (no AVX512)"
        ),
    ),
]


def ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Float32 product of the bf16 inputs, rounded to bf16 once, as the kernels do."""
    out = x.float() @ w.float().T
    if b is not None:
        out = out + b.float()
    return out.to(torch.bfloat16)


def test_pack_vnni_layout() -> None:
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5).to(torch.bfloat16)
    packed = pack_vnni(w)
    assert packed.shape == (2, 3, 16, 2)
    # block 1, pair 2, column 3 of the block: row 19, K values 4 and the zero padding 5
    assert packed[1, 2, 3].tolist() == [w[19, 4].item(), 0.0]
    assert packed[0, 1, 7].tolist() == [w[7, 2].item(), w[7, 3].item()]
    assert packed[1, :, 4:].abs().sum() == 0  # rows 20..31 are padding


@pytest.fixture(params=[False, pytest.param(True, id="amx")], ids=["avx512", "amx"])
def amx(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The GEMM with its AMX path off, then on (skipped on CPUs without AMX)."""
    ops = vnni_ops()
    if ops is None:
        pytest.skip("no AVX512-BF16 GEMM on this CPU")
    if request.param and not ops.amx_gemm_available():
        pytest.skip("no AMX on this CPU")
    before = ops.use_amx_gemm(request.param)
    yield request.param
    ops.use_amx_gemm(before)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 40, 200])
@pytest.mark.parametrize(("k", "n"), [(96, 160), (577, 50), (64, 33), (3, 17)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_float32", [False, True])
def test_vnni_gemm_matches_reference(
    rows: int, k: int, n: int, bias: bool, out_float32: bool, amx: bool
) -> None:
    """Every tile shape (1-12 rows in one tile, 8-row tiles, 128-row panels), odd K, N that is
    not a multiple of 16, column ranges split across threads; bf16 or float32 output. With AMX
    (K a multiple of 32: 96 and 64), tiles of 16 rows and fewer, a last partial tile of a
    longer x (40, 200 rows), 1-4 column blocks a tile."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    out = vnni_ops().linear_bf16_vnni(x, pack_vnni(w), b, n, out_float32)
    assert out.shape == (rows, n)
    if out_float32:  # the float32 sums themselves, up to the order of additions
        assert out.dtype == torch.float32
        want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    else:
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref_linear(x, w, b).float(), rtol=8e-3, atol=1e-2)


@needs_vnni
def test_vnni_gemm_reads_rows_of_a_strided_view(amx: bool) -> None:
    """The engine passes slices of wider tensors (a fused projection's output) as x."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(21, 200, generator=gen).to(torch.bfloat16)  # (AMX: 16 + a tail of 5)
    x = wide[:, 40:136]  # row stride 200, K 96
    w = torch.randn(48, 96, generator=gen).to(torch.bfloat16)
    out = vnni_ops().linear_bf16_vnni(x, pack_vnni(w), None, 48, False)
    torch.testing.assert_close(out.float(), ref_linear(x, w, None).float(), rtol=8e-3, atol=1e-2)


@needs_vnni
def test_vnni_gemm_rejects_bad_input() -> None:
    ops = vnni_ops()
    w = pack_vnni(torch.randn(32, 64).to(torch.bfloat16))
    x = torch.randn(4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K=65"):
        ops.linear_bf16_vnni(torch.randn(4, 65).to(torch.bfloat16), w, None, 32, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_bf16_vnni(x.float(), w, None, 32, False)
    with pytest.raises(RuntimeError, match="N=40"):
        ops.linear_bf16_vnni(x, w, None, 40, False)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16_vnni(x, w, torch.zeros(31, dtype=torch.bfloat16), 32, False)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(kernel: str, num_tokens: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, num_tokens, 96, dtype=torch.bfloat16)  # leading dims are kept
    packed = PackedLinear(linear, kernel=kernel)
    assert packed.kernel == kernel
    want = F.linear(x, linear.weight, linear.bias)
    torch.testing.assert_close(packed(x), want, rtol=2e-2, atol=2e-2)


def test_default_cpu_engine_packs_every_linear_layer(default_model_dir: object) -> None:
    """bf16 on CPU: every linear layer of the model (LM head included) is packed, for the
    AVX512-BF16 GEMM where the CPU has it."""
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore

    if not can_pack(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("neither kernel is available")
    core = EngineCore(
        EngineConfig(
            model=str(default_model_dir),
            dtype="bfloat16",
            max_model_len=256,
            kv_cache_memory=16 << 20,
        )
    )
    model = core.runner.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    kernels = {m.kernel for m in model.modules() if isinstance(m, PackedLinear)}
    assert kernels == {"vnni" if vnni_ops() is not None else "onednn"}
    # Logits in float32 where the kernel allows: the LM head's outputs only.
    float32_outputs = [m for m in model.modules() if isinstance(m, PackedLinear) and m.out_float32]
    assert float32_outputs == [model.lm_head]
    layers = core.runner.model_config.num_layers
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * layers + 1


def test_auto_dtype_on_cpu_is_bf16_only_where_bf16_is_fast() -> None:
    """``--dtype auto`` keeps a 16-bit model in bf16 on a CPU whose bf16 linear layers are
    fast (AVX512: packed for oneDNN), and runs it in float32 on one without (AVX2 only), where
    bf16 matmuls ran 10x slower; asked for explicitly, bf16 is kept."""
    from types import SimpleNamespace

    from baton_engine.core.engine_core import resolve_dtype

    fast = onednn_bf16_available()
    for native in ("bfloat16", "float16"):
        auto = SimpleNamespace(dtype="auto", device="cpu")
        model = SimpleNamespace(torch_dtype=native)
        want = torch.bfloat16 if fast else torch.float32
        assert resolve_dtype(auto, model) == want  # type: ignore[arg-type]
    explicit = SimpleNamespace(dtype="bfloat16", device="cpu")
    assert resolve_dtype(explicit, model) == torch.bfloat16  # type: ignore[arg-type]
    assert can_pack(torch.zeros(4, 4, dtype=torch.bfloat16)) == (fast or vnni_ops() is not None)
