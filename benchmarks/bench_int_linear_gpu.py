"""Packed integer layers (W4A16 / W8A16, ``baton_kernels.int_linear``) against bf16 cuBLAS, by
projection of Llama-3.1-8B and Qwen2.5-0.5B and by rows.

    python benchmarks/bench_int_linear_gpu.py            # on the GPU: the table and the sweep
    python benchmarks/bench_int_linear_gpu.py --smoke    # CPU, interpreter: one shape checked

For each projection and row count it times (in CUDA graphs, cycling over enough copies of the
weights that none is read from L2) ``F.linear`` on the bf16 weight, ``int_gemm`` at its default
launch, with the integers made floats by their bits (``MAGIC``) and as the transposed product
(``SWAP``), ``int_gemv`` (up to ``GEMV_MAX_ROWS`` rows), and at each launch of a sweep
(``--sweep``: the GEMM's, those of 64+ columns transposed too; the GEMV's at 1 row); from
``DEQUANT_ROWS`` rows the dequantize-then-cuBLAS path. Every result is checked against the
reference. Prints a table (microseconds; GB/s: the packed weight's bytes
over the time) and the best launches by row count, summed over the projections.
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

from baton_kernels import int_linear
from baton_kernels.int_linear import ref_int_linear, ref_quantize
from baton_kernels.triton import int_gemm as ig

L2_BYTES = 256 << 20  # (cycled copies of each weight take at least this many bytes)
Launch = tuple[int, int, int, int]
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sweep(rows: int) -> list[Launch]:
    """Launches (columns a program, K a step, warps, stages) to time at ``rows``."""
    if rows <= ig.SMALL_M:
        return list(itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (2, 3, 4)))
    return list(itertools.product((64, 128), (128, 256), (4, 8), (3, 4)))


def gemv_sweep() -> list[tuple[Launch, bool]]:
    """``int_gemv``'s launches (rows of the weight a program, pieces of K, warps, stages), each
    with the planes unpacked by instructions and by byte permutes (``asm``)."""
    out = list(itertools.product((32, 64, 128), (0, 4), (2, 4, 8), (2, 3)))
    out += [(256, 0, 8, 2), (256, 0, 8, 3), (256, 1, 8, 3), (256, 0, 4, 3)]
    return [(c, asm) for c in out for asm in (False, True)]


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


def _layer(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
           group: int) -> torch.Tensor:  # fmt: skip
    return int_linear.int_linear(x, p, s, z, bits, group)


def _dequantize(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor, x: torch.Tensor, bits: int,
                group: int) -> torch.Tensor:  # fmt: skip
    return ig.dequantize(p, s, z, bits, group, x.shape[1], x.dtype)


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
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows_list = [1, 20] if args.smoke else [int(r) for r in args.rows.split(",") if r]
    for rows in rows_list:
        x = torch.randn(rows, k, device=device).to(dtype)
        want = ref_int_linear(x, packed, scale, zero, bits, group)
        tol = 1e-3 if args.smoke else 2e-2
        on = {"x": x, "bits": bits, "group": group}
        launches = sweep(rows) if "gemm" in args.sweep else []
        swapped = [c for c in launches if c[0] >= 64]  # (warpgroup MMAs: 64 rows of the weight)
        gemv = rows <= ig.GEMV_MAX_ROWS
        vlaunches = gemv_sweep() if gemv and rows == 1 and "gemv" in args.sweep else []
        asm = not args.smoke  # (byte permutes: compiled only)
        runs: list[tuple[Callable[..., torch.Tensor], dict[str, object]]] = [
            (_gemm, kw) for kw in [{}, {"magic": True}, {"swap": True}]
        ] + [(_gemm, {"config": c}) for c in launches]
        runs += [(_gemv, {"asm": a}) for a in {False, asm} if gemv]
        runs += [(_gemv, {"config": c, "asm": a and asm}) for c, a in vlaunches]
        for i, (fn, kw) in enumerate(runs):
            if args.smoke and i > 5 and fn is _gemm:
                continue
            got = fn(packed, scale, zero, **on, **kw)
            torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                                       atol=tol * want.abs().max().item())  # fmt: skip
        if args.smoke:
            print(f"{shape} {proj} {rows}: checked {len(runs)} launches")
            continue
        t_bf = graph_time_us(cycled(_cublas, bf16, x=x))
        t_int = graph_time_us(cycled(_gemm, packs, **on))
        t_bits = graph_time_us(cycled(_gemm, packs, **on, magic=True))
        t_swap = graph_time_us(cycled(_gemm, packs, **on, swap=True))
        nan = float("nan")
        t_gemv = graph_time_us(cycled(_gemv, packs, **on, asm=False)) if gemv else nan
        t_asm = graph_time_us(cycled(_gemv, packs, **on, asm=True)) if gemv else nan
        t_gemv = min(t_gemv, t_asm) if gemv else nan
        top, top_launch = min(t_int, t_gemv) if gemv else t_int, "-"
        timed = [(_gemm, c, False) for c in launches] + [(_gemm, c, True) for c in swapped]
        for fn, launch, flag in timed + [(_gemv, c, a) for c, a in vlaunches]:
            extra = {"swap": flag} if fn is _gemm else {"asm": flag}
            t = graph_time_us(cycled(fn, packs, **on, config=launch, **extra))
            named = " asm" if fn is _gemv else " swap"
            key = f"{'gemv ' if fn is _gemv else ''}{launch}{named if flag else ''}"
            best.setdefault(rows, {})
            best[rows][key] = best[rows].get(key, 0.0) + t
            if t < top:
                top, top_launch = t, key
        fast = min(t_int, t_gemv) if gemv else t_int
        print(f"{shape:6} {proj:8} {rows:5d} {t_bf:8.1f} {t_int:8.1f} {t_bits:8.1f} {t_swap:8.1f} "
              f"{t_asm if gemv else nan:8.1f} {t_gemv:8.1f} {nbytes / fast / 1e3:6.0f} "
              f"{top:8.1f} {top_launch:>28} "
              f"{fast / t_bf:8.2f}")  # fmt: skip
    if args.smoke:
        return
    for rows in (int(r) for r in args.prompt_rows.split(",") if r):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        on = {"x": x, "bits": bits, "group": group}
        t_bf = graph_time_us(cycled(_cublas, bf16, x=x), reps=5)
        t_int = graph_time_us(cycled(_layer, packs, **on), reps=5)
        t_deq = graph_time_us(cycled(_dequantize, packs, **on), reps=5)
        print(f"{shape:6} {proj:8} {rows:5d} {t_bf:8.1f} {t_int:8.1f} (dequantize {t_deq:.1f}, "
              f"{nbytes * 5 / t_deq / 1e3:.0f} GB/s)  int/bf16 {t_int / t_bf:.2f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--prompt-rows", default="512,2048,8192")
    p.add_argument("--shapes", default="qwen,llama")
    p.add_argument(
        "--sweep",
        default="gemv",
        help="launches to sweep, comma-separated: gemm, gemv (none: empty)",
    )
    args = p.parse_args()
    shapes = {"qwen": QWEN, "llama": LLAMA}
    chosen = {"tiny": {"qkv": (256, 96)}} if args.smoke else {
        s: shapes[s] for s in args.shapes.split(",")
    }  # fmt: skip
    print(f"{args.bits}-bit weights, groups of {args.group}; times in us (GB/s: packed bytes / "
          "time of the faster of int and gemv; bits: the integers made floats by their bits; "
          "swap: the transposed product; asm: the gemv, planes unpacked by byte permutes; gemv: "
          "the faster of the gemv without and with them; fast/bf16: the faster default's time "
          "over bf16's)")  # fmt: skip
    print(f"{'shape':6} {'proj':8} {'rows':>5} {'bf16':>8} {'int':>8} {'bits':>8} {'swap':>8} "
          f"{'asm':>8} {'gemv':>8} {'GB/s':>6} {'best':>8} {'launch':>28} "
          f"{'fast/bf16':>8}")  # fmt: skip
    best: dict[int, dict[str, float]] = {}
    for shape, projs in chosen.items():
        for proj, (k, n) in projs.items():
            run_shape(shape, proj, k, n, args, best)
    for rows, times in sorted(best.items()):
        ranked = sorted(times.items(), key=lambda item: item[1])[:3]
        default = ig.GEMM_SMALL if rows <= ig.SMALL_M else ig.GEMM_LARGE
        print(f"rows {rows}: best launches (sum over projections, us) "
              + ", ".join(f"{c} {t:.1f}" for c, t in ranked)
              + f"; default {default} {times.get(str(default), float('nan')):.1f}"
              + f", gemv {ig.GEMV} {times.get(f'gemv {ig.GEMV}', float('nan')):.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
