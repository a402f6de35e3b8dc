"""Packed integer layers (W4A16 / W8A16, ``baton_kernels.int_linear``) against bf16 cuBLAS, by
projection of Llama-3.1-8B and Qwen2.5-0.5B and by rows.

    python benchmarks/bench_int_linear_gpu.py            # on the GPU: the table and the sweep
    python benchmarks/bench_int_linear_gpu.py --smoke    # CPU, interpreter: one shape checked

For each projection and row count it times (in CUDA graphs, cycling over enough copies of the
weights that none is read from L2) ``F.linear`` on the bf16 weight, ``int_gemm`` at its default
launch (up to 64 rows), ``int_gemv`` (up to ``GEMV_MAX_ROWS`` rows), ``int_mm`` and its
transposed product, torch's own int4 GEMM (tinygemm, 4 bits) on the same values, the layer as
``int_linear`` routes it, and each launch of a sweep (``--sweep``: ``int_mm``'s or
``int_gemm``'s at ``--sweep-rows``, ``int_gemv``'s at one row). Every result is checked against
the reference. Prints a table (microseconds) and the best launches by row count, summed over
the projections; then the prompts' rows (``--prompt-rows``) through the layer, the
dequantization alone and ``int_mm``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
from bench_linear_gpu import LLAMA, QWEN, graph_time_us
from triton.runtime.errors import OutOfResources

from baton_kernels import int_linear
from baton_kernels.int_linear import ref_int_linear, ref_quantize
from baton_kernels.triton import int_gemm as ig

L2_BYTES = 256 << 20  # (cycled copies of each weight take at least this many bytes)
Launch = tuple[int, int, int, int]
MMLaunch = tuple[int, int, int, int, int]
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sweep(rows: int) -> list[Launch]:
    """``int_gemm``'s launches (columns a program, K a step, warps, stages) to time at ``rows``."""
    if rows <= ig.SMALL_M:
        return list(itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (2, 3, 4)))
    return list(itertools.product((64, 128), (128, 256), (4, 8), (3, 4)))


def gemv_sweep() -> list[tuple[Launch, bool]]:
    """``int_gemv``'s launches (rows of the weight a program, pieces of K, warps, stages), each
    with the planes unpacked by instructions and by byte permutes (``asm``)."""
    out = list(itertools.product((32, 64, 128), (0, 4), (2, 4, 8), (2, 3)))
    out += [(256, 0, 8, 2), (256, 0, 8, 3), (256, 1, 8, 3), (256, 0, 4, 3)]
    return [(c, asm) for c in out for asm in (False, True)]


def mm_sweep() -> list[tuple[MMLaunch, bool, int]]:
    """``int_mm``'s launches (most rows of x a program, rows of the weight a program, K a tile,
    warps, stages), those of 64+ rows of the weight also transposed (``swap``); a few with the
    tile's words loaded once and x's columns or the planes rearranged (``perm`` 1, 2)."""
    out = list(itertools.product((128,), (32, 64, 128), (128, 256), (4, 8), (3,)))
    runs = [(c, False, 0) for c in out] + [(c, True, 0) for c in out if c[1] >= 64]
    runs += [((128, 64, 128, 4, st), s, 0) for st in (1, 2) for s in (False, True)]
    runs += [((128, 64, 128, 8, 3), s, p) for s in (False, True) for p in (1, 2)]
    return [*runs, ((128, 128, 128, 8, 3), True, 2), ((128, 64, 256, 8, 3), True, 2)]


def cycled(
    fn: Callable[..., torch.Tensor], copies: list[Packed], **kw: object
) -> Callable[[], torch.Tensor]:
    """``fn`` on the next copy of the weight at each call (none read twice from L2)."""
    it = itertools.cycle(copies)
    return lambda: fn(*next(it), **kw)


def _cublas(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _gemm(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
          group: int, **kw: object) -> torch.Tensor:  # fmt: skip
    return ig.int_gemm(x, p, s, z, bits, group, **kw)  # type: ignore[arg-type]


def _gemv(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
          group: int, **kw: object) -> torch.Tensor:  # fmt: skip
    return ig.int_gemv(x, p, s, z, bits, group, **kw)  # type: ignore[arg-type]


def _mm(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
        group: int, **kw: object) -> torch.Tensor:  # fmt: skip
    return ig.int_mm(x, p, s, z, bits, group, **kw)  # type: ignore[arg-type]


def _layer(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
           group: int) -> torch.Tensor:  # fmt: skip
    return int_linear.int_linear(x, p, s, z, bits, group)


def _dequantize(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
                group: int) -> torch.Tensor:  # fmt: skip
    return ig.dequantize(p, s, z, bits, group, x.shape[1], x.dtype)


def tinygemm(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int,
             group: int) -> Packed:  # fmt: skip
    """The same 4-bit weight in torch's own int4 GEMM's layout (``_weight_int4pack_mm``,
    "tinygemm": ``w = (u - 8) * s + zero``, so ``zero = (8 - z) * s``), for comparison."""
    u = int_linear.unpack_spans(packed, 4, k)
    pairs = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)
    tiles = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
    s = scale.t().float()
    both = torch.stack([s, (8 - zero.t().float()) * s], dim=-1).to(torch.bfloat16)
    return tiles, both.contiguous(), torch.tensor(group)


def _tiny(t: torch.Tensor, sz: torch.Tensor, size: int, x: torch.Tensor, bits: int,
          **kw: object) -> torch.Tensor:  # fmt: skip
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm(x, t, int(size), sz)
    return out


def run_shape(
    shape: str, proj: str, k: int, n: int, args: argparse.Namespace,
    best: dict[int, dict[str, float]],
) -> None:  # fmt: skip
    device = torch.device("cpu" if args.smoke else "cuda")
    bits, group = args.bits, args.group
    w = torch.randn(n, k, device=device) * 0.02
    packed, scale, zero = (t.to(device) for t in ref_quantize(w, bits, group))
    nbytes = packed.numel() * 4 + scale.numel() * 5
    copies = 1 if args.smoke else max(1, -(L2_BYTES // -nbytes))
    packs = [(packed.clone(), scale.clone(), zero.clone()) for _ in range(copies)]
    bf16 = [(w.to(torch.bfloat16), scale, zero) for _ in range(max(1, copies // 4))]
    tiny: list[Packed] = []
    if not args.smoke and bits == 4:
        try:
            tiny = [tinygemm(*pk, k, group) for pk in packs]
        except RuntimeError as e:  # (torch without the kernel for this GPU or shape)
            print(f"tinygemm: {str(e).splitlines()[0]}")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows_list = [1, 20] if args.smoke else [int(r) for r in args.rows.split(",") if r]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    nan = float("nan")
    for rows in rows_list:
        x = torch.randn(rows, k, device=device).to(dtype)
        want = ref_int_linear(x, packed, scale, zero, bits, group)
        tol = 1e-3 if args.smoke else 2e-2
        on = {"x": x, "bits": bits, "group": group}
        swept = rows in sweep_rows or args.smoke
        launches = sweep(rows) if "gemm" in args.sweep and swept else []
        gemv = rows <= ig.GEMV_MAX_ROWS
        vlaunches = gemv_sweep() if gemv and rows == 1 and "gemv" in args.sweep else []
        mlaunches = mm_sweep() if "mm" in args.sweep and swept else []
        asm = not args.smoke  # (byte permutes: compiled only)
        runs: list[tuple[Callable[..., torch.Tensor], dict[str, object]]] = [(_gemm, {})]
        runs += [(_gemm, {"config": c}) for c in launches]
        runs += [(_gemv, {"asm": a}) for a in {False, asm} if gemv]
        runs += [(_gemv, {"config": c, "asm": a and asm}) for c, a in vlaunches]
        runs += [(_mm, {"swap": False}), (_mm, {"swap": True})]
        runs += [(_mm, {"config": c, "swap": a, "perm": b}) for c, a, b in mlaunches]
        for i, (fn, kw) in enumerate(runs):
            if args.smoke and i > 5 and fn is not _mm:
                continue
            try:
                got = fn(packed, scale, zero, **on, **kw)
            except OutOfResources as e:  # (a launch too large for this GPU: not timed)
                print(f"{fn.__name__} {kw} at {rows} rows: {e}")
                mlaunches = [m for m in mlaunches if m != (kw.get("config"), kw.get("swap"),
                                                           kw.get("perm"))]  # fmt: skip
                continue
            torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                                       atol=tol * want.abs().max().item())  # fmt: skip
        if tiny:
            try:
                got = _tiny(*tiny[0], **on)
                torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                                           atol=tol * want.abs().max().item())  # fmt: skip
            except (RuntimeError, AssertionError) as e:
                print(f"tinygemm at {rows} rows: {str(e).splitlines()[0]}")
                tiny = []
        if args.smoke:
            print(f"{shape} {proj} {rows}: checked {len(runs)} launches")
            continue
        t_bf = graph_time_us(cycled(_cublas, bf16, x=x))
        t_int = graph_time_us(cycled(_gemm, packs, **on)) if rows <= 64 else nan
        t_gemv = graph_time_us(cycled(_gemv, packs, **on, asm=True)) if gemv else nan
        t_mm = graph_time_us(cycled(_mm, packs, **on, swap=False))
        t_mms = graph_time_us(cycled(_mm, packs, **on, swap=True))
        t_tiny = graph_time_us(cycled(_tiny, tiny, **on)) if tiny else nan
        t_layer = graph_time_us(cycled(_layer, packs, **on))
        top, top_launch = nan, "-"
        timed: list[tuple[Callable[..., torch.Tensor], tuple[int, ...], dict[str, int]]]
        timed = [(_gemm, c, {}) for c in launches]
        timed += [(_mm, c, {"swap": a, "perm": b}) for c, a, b in mlaunches]
        timed += [(_gemv, c, {"asm": a}) for c, a in vlaunches]
        for fn, launch, extra in timed:
            t = graph_time_us(cycled(fn, packs, **on, config=launch, **extra))
            name = {_gemv: "gemv ", _gemm: "gemm ", _mm: "mm "}[fn]
            key = name + str(launch) + "".join(f" {f}{int(v)}" for f, v in extra.items() if v)
            best.setdefault(rows, {})
            best[rows][key] = best[rows].get(key, 0.0) + t
            if not t >= top:
                top, top_launch = t, key
        print(f"{shape:6} {proj:8} {rows:5d} {t_bf:8.1f} {t_int:8.1f} {t_gemv:8.1f} {t_mm:8.1f} "
              f"{t_mms:8.1f} {t_tiny:8.1f} {t_layer:8.1f} {nbytes / t_layer / 1e3:6.0f} "
              f"{top:8.1f} {top_launch:>36} {t_layer / t_bf:8.2f}")  # fmt: skip
    if args.smoke:
        return
    for rows in (int(r) for r in args.prompt_rows.split(",") if r):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        on = {"x": x, "bits": bits, "group": group}
        t_bf = graph_time_us(cycled(_cublas, bf16, x=x), reps=5)
        t_int = graph_time_us(cycled(_layer, packs, **on), reps=5)
        t_deq = graph_time_us(cycled(_dequantize, packs, **on), reps=5)
        t_mm = graph_time_us(cycled(_mm, packs, **on), reps=5)
        print(f"{shape:6} {proj:8} {rows:5d} {t_bf:8.1f} {t_int:8.1f} (dequantize {t_deq:.1f}, "
              f"{nbytes * 5 / t_deq / 1e3:.0f} GB/s; mm {t_mm:.1f})  int/bf16 "
              f"{t_int / t_bf:.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--sweep-rows", default="16,64,256", help="rows at which to sweep launches")
    p.add_argument("--prompt-rows", default="512,2048,8192")
    p.add_argument("--shapes", default="qwen,llama")
    p.add_argument(
        "--sweep",
        default="mm",
        help="launches to sweep, comma-separated: gemm, gemv (at one row), mm (none: empty)",
    )
    args = p.parse_args()
    shapes = {"qwen": QWEN, "llama": LLAMA}
    chosen = {"tiny": {"qkv": (256, 96)}} if args.smoke else {
        s: shapes[s] for s in args.shapes.split(",")
    }  # fmt: skip
    print(
        f"{args.bits}-bit weights, groups of {args.group}; times in us (gemm: int_gemm; gemv: "
        "int_gemv, byte permutes; mm: int_mm (mms: transposed); tiny: torch's int4 GEMM "
        "(tinygemm); layer: int_linear as routed; GB/s: packed bytes / layer's time; best: "
        "the sweep's fastest launch; layer/bf16: the routed layer's time over bf16's)"
    )
    print(f"{'shape':6} {'proj':8} {'rows':>5} {'bf16':>8} {'gemm':>8} {'gemv':>8} {'mm':>8} "
          f"{'mms':>8} {'tiny':>8} {'layer':>8} {'GB/s':>6} {'best':>8} {'launch':>36} "
          f"{'layer/bf16':>8}")  # fmt: skip
    best: dict[int, dict[str, float]] = {}
    for shape, projs in chosen.items():
        for proj, (k, n) in projs.items():
            run_shape(shape, proj, k, n, args, best)
    for rows, times in sorted(best.items()):
        ranked = sorted(times.items(), key=lambda item: item[1])[:3]
        mine = f"mm {ig.mm_config(rows)}{' swap1' if ig.MM_SWAP else ''}"
        mine += f" perm{ig.MM_PERM}" if ig.MM_PERM else ""
        print(
            f"rows {rows}: best launches (sum over projections, us) "
            + ", ".join(f"{c} {t:.1f}" for c, t in ranked)
            + f"; default {mine} {times.get(mine, float('nan')):.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
