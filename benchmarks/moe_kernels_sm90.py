"""The fused MoE kernels (``baton_kernels.triton.moe``) compiled for the H100/H200 (sm_90) on a
machine without a GPU: Triton compiles ahead of time for a named target with the ptxas its
package carries. It catches what Triton's interpreter (the CPU tests) accepts but its compiler
rejects, and reports each variant's shared memory against the SM's 227 KB.

    python benchmarks/moe_kernels_sm90.py

One line per variant: the router's top-k for 8 of 128 and 2 of 8 experts, the sum of a
token's 8 rows (alone and added to a residual), the pair alignment's kernels for 8, 128 and
512 experts (one program with atomic cursors, one without, and several), the grouped GEMM for
each tile of ``GEMM_CONFIGS`` in bf16 (both projections) and its first tile in float32 (what
the GPU tests run), the GEMV a pair at ``GEMV_CONFIG`` (both projections). Exits non-zero
if any fails or does not fit.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1 (the interpreter's kernels cannot be compiled)")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from baton_kernels.triton import moe

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232_448  # bytes of shared memory a program may take on sm_90
ALIGN = {"ids_ptr": "*i64", "counts_ptr": "*i32", "pairs_ptr": "*i32",
         "block_expert_ptr": "*i32", "block_rows_ptr": "*i32", "num_pairs": "i32",
         "num_blocks": "i32", "per_program": "i32", "blocks_per_program": "i32",
         "cursor_ptr": "*i32"}  # fmt: skip
COUNT = {"ids_ptr": "*i64", "counts_ptr": "*i32", "num_pairs": "i32", "per_program": "i32"}
SUM = {"x_ptr": "*bf16", "res_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32"}
ROUTE = {"logits_ptr": "*bf16", "weights_ptr": "*bf16", "ids_ptr": "*i64",
         "num_experts": "i32", "stride_t": "i32"}  # fmt: skip
GEMM_INTS = ("N", "K", "s_a", "s_we", "s_wn", "s_o")
ALIGNED = set(GEMM_INTS)  # (the counts of pairs and blocks are not specialized)


def build(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: int) -> bool:
    """Compile ``fn`` with each pointer 16-byte aligned and each integer of ``ALIGNED`` a
    multiple of 16, as a launch at Qwen3-30B-A3B's shapes specializes them."""
    name = fn.fn.__name__
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for i, arg in enumerate(inspect.signature(fn.fn).parameters):
        if arg in constexprs:
            sig[arg], consts[(i,)] = "constexpr", constexprs[arg]
            continue
        sig[arg] = signature[arg]
        if sig[arg].startswith("*") or arg in ALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        source = ASTSource(fn, sig, consts, attrs)
        kernel = triton.compile(source, target=TARGET, options=options)
    except Exception as e:  # (the compiler's error, reported per variant)
        print(f"{name} {constexprs} FAILED: {type(e).__name__}: {str(e)[:300]}")
        return False
    shared = kernel.metadata.shared
    print(f"{name} {constexprs} {options} shared {shared} B")
    return bool(shared <= MAX_SHARED)


def main() -> int:
    ok = True
    for top_k, e_p2 in ((8, 128), (2, 8)):
        consts = {"TOP_K": top_k, "K_P2": top_k, "E_P2": e_p2, "RENORMALIZE": True}
        ok &= build(moe._route_kernel, ROUTE, consts, num_warps=1)
    for res in (False, True):
        consts = {"TOP_K": 8, "HAS_RES": res, "BLOCK": 1024}
        ok &= build(moe._sum_pairs_kernel, SUM, consts, num_warps=4)
    for e_p2 in (8, 128, 512):
        chunk = moe.ALIGN_TILE // e_p2 if e_p2 > 8 else 16
        ok &= build(moe._count_kernel, COUNT, {"E_P2": e_p2, "CHUNK": chunk}, num_warps=4)
        for counted in (False, True):
            consts = {"E_P2": e_p2, "BLOCK_M": 16, "CHUNK": chunk, "B_CHUNK": chunk,
                      "G_CHUNK": chunk, "COUNTED": counted}  # fmt: skip
            ok &= build(moe._align_kernel, ALIGN, consts, num_warps=4)
        consts = {"E_P2": e_p2, "BLOCK_M": 16, "CHUNK": moe.ALIGN_CHUNK, "B_CHUNK": chunk}
        ok &= build(moe._align_one_kernel, ALIGN, consts, num_warps=4)
    for dtype in ("bf16", "fp32"):
        tiles = moe.GEMM_CONFIGS if dtype == "bf16" else moe.GEMM_CONFIGS[:1]
        sig = {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
               "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "block_rows_ptr": "*i32",
               "route_ptr": f"*{dtype}"} | dict.fromkeys(GEMM_INTS, "i32")  # fmt: skip
        for _, bm, bn, bk, warps, stages in tiles:
            for gather in (True, False):
                precision = "ieee" if dtype == "fp32" else "tf32"
                consts = {
                    "TOP_K": 8, "GATHER": gather, "ROUTE": not gather, "BLOCK_M": bm,
                    "BLOCK_N": bn, "BLOCK_K": bk, "DOT_PREC": precision, "UPCAST": False,
                }  # fmt: skip
                ok &= build(moe._expert_gemm_kernel, sig, consts, num_warps=warps,
                            num_stages=stages)  # fmt: skip
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
           "route_ptr": "*bf16"} | dict.fromkeys(GEMM_INTS, "i32")  # fmt: skip
    block_n, block_k, warps, stages = moe.GEMV_CONFIG
    for gather in (True, False):
        consts = {"TOP_K": 8, "GATHER": gather, "ROUTE": not gather, "SILU_MUL": not gather,
                  "BLOCK_N": block_n, "BLOCK_K": block_k}  # fmt: skip
        ok &= build(moe._expert_gemv_kernel, sig, consts, num_warps=warps, num_stages=stages)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
