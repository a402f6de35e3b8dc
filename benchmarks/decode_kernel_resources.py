"""Registers, spills and shared memory of the decode attention kernel compiled for the H200
(sm_90), on a machine without a GPU: Triton compiles ahead of time for a named target with the
ptxas its package carries, and cuobjdump reads the cubin's resource usage.

    python benchmarks/decode_kernel_resources.py

One line per shape: the launch configurations the engine uses for Qwen2.5-0.5B at 256 requests
(one split), Llama-3.1-8B at batch 1 (64 splits) and at 256 requests (one split), with the
rotation inside the kernel, each with 0, 1 or 2 tiles prefetched and the inputs read before the
PDL wait or after it.
Registers per thread set how many programs fit on an SM (65,536 per SM).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from baton_kernels.triton import decode_attention as da

POINTERS = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i64", "tables_ptr": "*i64", "counter_ptr": "*i32",
    "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
    "slot_block_ptr": "*i64", "slot_offset_ptr": "*i64", "hid_ptr": "*bf16", "qb_ptr": "*bf16",
    "kb_ptr": "*bf16", "vb_ptr": "*bf16", "qk_scale": "fp32", "eps": "fp32",
}  # fmt: skip
UNIT_STRIDES = {"s_qd", "s_od", "s_cd", "s_kd", "s_vd", "s_csd"}  # specialized to 1 at launch
# shape: (head_dim, group, num_heads, tile_n, num_warps, num_stages, num_splits)
# (2 stages at one split since the thirtieth session: decode_attention.ONE_SPLIT_STAGES)
# (Llama 256: one warp on 32-key tiles since the thirty-second session, ONE_SPLIT_WIDE_HEAD;
# "llama 256 old" the launch before)
SHAPES = {
    "qwen 256": (64, 7, 14, 128, 4, 2, 1),
    "llama b1": (128, 4, 32, 64, 2, 3, 64),
    "llama 256": (128, 4, 32, 32, 1, 3, 1),
    "llama 256 old": (128, 4, 32, 64, 2, 2, 1),
}


def compile_decode(
    shape: tuple[int, ...], prefetch_tiles: int = 0, early: bool = False
) -> triton.compiler.CompiledKernel:
    head_dim, group, num_heads, tile_n, num_warps, num_stages, splits = shape
    consts = dict(
        ROPE=True, NORM=True, HAS_BIAS=head_dim == 64,
        BLOCK_HID=triton.next_power_of_2(num_heads * head_dim), NUM_HEADS=num_heads,
        NUM_SPLITS=splits, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=head_dim, BLOCK_SIZE=16, BLOCK_H=16, TILE_N=tile_n, UPCAST=False,
        DOT_PREC="ieee", FUSE_REDUCE=splits > 1, BLOCK_S=splits, UNROLL=min(8, splits),
        PREFETCH=prefetch_tiles * tile_n, ROW_BYTES=head_dim * 2, EARLY=early, PDL=True,
    )  # fmt: skip
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for i, name in enumerate(inspect.signature(da._decode_kernel.fn).parameters):
        if name in consts or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts.get(name, 1)
            continue
        signature[name] = POINTERS.get(name, "i32")
        if name not in ("qk_scale", "eps", "s_tb", "hidden"):  # (s_tb is not specialized)
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=da._decode_kernel, signature=signature, constexprs=constexprs,
                       attrs=attrs)  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip


def main() -> None:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    variants = [(label, shape, p, e) for label, shape in SHAPES.items()
                for p, e in ((0, False), (0, True), (1, True), (2, True))]  # fmt: skip
    for label, shape, prefetch_tiles, early in variants:
        kernel = compile_decode(shape, prefetch_tiles, early)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            cmd = [cuobjdump, "--dump-resource-usage", f.name]
            usage = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
        reg, stack, local = found.groups() if found else ("?", "?", "?")
        shared = kernel.metadata.shared
        label = f"{label}, prefetch {prefetch_tiles}, early {int(early)}"
        print(f"{label:29}: {reg} registers, stack {stack}, local (spills) {local}, "
              f"dynamic shared {shared} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
