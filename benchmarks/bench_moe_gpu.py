"""One mixture-of-experts layer at Qwen3-30B-A3B's shape (128 experts, 8 a token, hidden 2048,
an expert's intermediate 768; bf16) by tokens, in each of the engine's forms (issue 5):

- ``fused``: ``baton_kernels.triton.moe.fused_experts`` (its ``GEMM_CONFIGS`` tile, or up to
  ``GEMV_TOKENS`` tokens its GEMVs a pair, then each of ``--gemv-configs``
  (``BN/BK/warps/stages``) and the grouped GEMMs there), and with each tile of ``--tiles``
  (``BM/BN/BK/warps/stages``) for the token counts they fit;
- ``align``: its grouping of the pairs alone (``align_pairs``), and where one program does it
  (up to ``ALIGN_ONE`` pairs) the several programs' form too;
- ``router``: the routing from the router's logits, ``route_top_k``'s one launch, and
  ``route ...`` the engine's torch form (softmax, topk, renormalization: five launches);
- ``gathered`` / ``dense``: the static-shape forms captured decode steps ran before it;
- ``sorted``: the eager form (one GEMM pair an expert; reads the routing on the host).

    python benchmarks/bench_moe_gpu.py [--tokens 1,8,64,256,1024,8192] [--tiles 16/64/128/4/4]
        [--gemv-configs 16/256/4/3]

Times are graph-timed (``do_bench_cudagraph``) but ``sorted``'s (``do_bench``: it cannot be
captured). GB/s: the bytes of the experts chosen (each read once) over the time; the H200's
device-to-device copy runs at ~4.28 TB/s. ``max diff``: against ``sorted`` on the same inputs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton

from baton_engine.models import moe
from baton_kernels.fused import silu_and_mul
from baton_kernels.triton import moe as kmoe

E, K, H, INTER = 128, 8, 2048, 768
Tile = tuple[int, int, int, int, int]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="1,8,64,256,1024,8192")
    p.add_argument("--tiles", default="", help="comma-separated BM/BN/BK/warps/stages")
    p.add_argument("--forms", default="fused,align,router,gathered,dense,sorted")
    p.add_argument("--gemv-configs", default="", help="BN/BK/warps/stages of expert_gemv, ...")
    args = p.parse_args()
    tiles: list[Tile] = []
    for t in filter(None, args.tiles.split(",")):
        bm, bn, bk, warps, stages = (int(v) for v in t.split("/"))
        tiles.append((bm, bn, bk, warps, stages))
    gemv_configs: list[tuple[int, int, int, int]] = []
    for c in filter(None, args.gemv_configs.split(",")):
        bn, bk, warps, stages = (int(v) for v in c.split("/"))
        gemv_configs.append((bn, bk, warps, stages))
    forms = args.forms.split(",")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    gate_up = (torch.randn(E, 2 * INTER, H, device=dev) / H**0.5).bfloat16()
    down = (torch.randn(E, H, INTER, device=dev) / INTER**0.5).bfloat16()
    print(f"{'tokens':>6} {'form':24} {'us':>9} {'GB/s':>6} {'experts':>7} {'max diff':>8}")
    for n in map(int, args.tokens.split(",")):
        bench(n, gate_up, down, forms, tiles, gemv_configs)


def bench(
    n: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    forms: list[str],
    tiles: list[Tile],
    gemv_configs: list[tuple[int, int, int, int]],
) -> None:
    x = torch.randn(n, H, device=gate_up.device).bfloat16()
    logits = torch.randn(n, E, device=gate_up.device).bfloat16()
    weights, ids = moe.route(logits, K, renormalize=True)
    chosen = int(ids.unique().numel())
    nbytes = chosen * 3 * H * INTER * 2
    want = moe.experts_sorted(x, ids, weights, gate_up, down, silu_and_mul)

    def row(name: str, run: Callable[[], object], graph: bool = True) -> None:
        got = run()
        diff = ""
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            diff = f"{(got.float() - want.float()).abs().max().item():8.4f}"
        timer = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
        us = timer(run, rep=200) * 1e3
        print(f"{n:6} {name:24} {us:9.1f} {nbytes / us / 1e3:6.0f} {chosen:7} {diff:>8}",
              flush=True)  # fmt: skip

    def fused() -> torch.Tensor:  # (as the engine calls it: the kernels' SiLU-and-multiply)
        return kmoe.fused_experts(x, ids, weights, gate_up, down, None)

    if "fused" in forms:
        row("fused", fused)
        default, gemv_default, gemv_tokens = kmoe.GEMM_CONFIGS, kmoe.GEMV_CONFIG, kmoe.GEMV_TOKENS
        if n <= gemv_tokens:  # (the GEMVs a pair: each of --gemv-configs, then grouped GEMMs)
            for config in gemv_configs:
                kmoe.GEMV_CONFIG = config
                row("fused gemv " + "/".join(map(str, config)), fused)
            kmoe.GEMV_CONFIG = gemv_default
            kmoe.GEMV_TOKENS = 0
            row("fused (grouped GEMMs)", fused)
        for tile in tiles:
            kmoe.GEMM_CONFIGS = [(float("inf"), *tile)]
            row("fused " + "/".join(map(str, tile)), fused)
        kmoe.GEMM_CONFIGS, kmoe.GEMV_TOKENS = default, gemv_tokens
    if "align" in forms:
        block_m = kmoe.gemm_config(n * K, E)[0]
        row("align", lambda: kmoe.align_pairs(ids, E, block_m))
        one = kmoe.ALIGN_ONE
        if n * K <= one:  # (and the several programs' form the one program replaced there)
            kmoe.ALIGN_ONE = 0
            row("align (programs)", lambda: kmoe.align_pairs(ids, E, block_m))
            kmoe.ALIGN_ONE = one
    if "router" in forms:
        row("router", lambda: kmoe.route_top_k(logits, K, True))
        row("route (torch)", lambda: moe.route(logits, K, True))
    static = {"gathered": moe.experts_gathered, "dense": moe.experts_dense}
    for name, form in static.items():
        # (the gather copies an expert a pair; the dense form computes every expert a token)
        fits = n * K <= 2048 if name == "gathered" else n <= 1024
        if name in forms and fits:
            row(name, lambda f=form: f(x, ids, weights, gate_up, down, silu_and_mul))
    if "sorted" in forms:
        row("sorted", lambda: moe.experts_sorted(x, ids, weights, gate_up, down, silu_and_mul),
            graph=False)  # fmt: skip


if __name__ == "__main__":
    main()
