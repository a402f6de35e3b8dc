"""The decode attention's key loop, variant by variant, as the engine launches it (issue 5).

    python benchmarks/device/decode_loop.py [--points qwen:256,qwen:1,llama:1]

Nsight Compute (``ncu_kernels.sh``, twenty-seventh session) saw the kernel at Qwen2.5-0.5B's
256-request decode step read 2.9 TB/s with 16 warps an SM and 0.34 eligible a scheduler: each
program waits on one memory round trip after another (its inputs, the rotation, its block ids,
each key tile, then the partial last tile's block ids and keys after the loop). This times one
CUDA graph of every layer's launch in turn (each layer's KV read once, as in a decode step),
with the rotation, the new K/V's write and the folded RMSNorm inside (``DecodeRope`` with
``DecodeNorm``, the engine's decode path), lengths spread over 64 tokens, blocks scattered at
random in a block-major pool of all layers. Variants: the key tile, warps and pipeline stages,
the split count. (The twenty-seventh session's run also had the partial last tile inside the
pipelined loop, an option of commit 09f87ce since removed: slower everywhere. The twenty-eighth
session's had the key loop pipelined by hand, each tile's block ids and keys requested into
registers before the previous tile's arithmetic, commit fd1fde9, since removed: 6-83% slower at
Qwen 256 and Qwen 1, up to 11x at Llama batch 1; 4-10% faster at Qwen 64 with 64-key tiles.
The thirtieth session's: each tile's iteration starting the next tile's blocks into the L2,
``prefetch_next`` of commit 587d63b, since removed: +17% at Qwen 256, +20% at Llama batch 1.)
Each variant's output is compared with the default launch's (same inputs).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_pools import scattered_pool

from baton_kernels.attention import KVCacheView
from baton_kernels.triton.decode_attention import (
    DecodeNorm,
    DecodeRope,
    choose_num_splits,
    decode_attention,
)

MODELS = {
    "qwen": (14, 2, 64, 24, True),
    "llama": (32, 8, 128, 32, False),
    "tiny": (4, 2, 64, 2, True),
}  # + layers, qkv bias
# name -> decode_attention keywords (on top of the engine's defaults)
VARIANTS = {
    "qwen": {
        "default": {},
        "128/4/5": {"num_stages": 5},
        "64/4/3": {"tile_n": 64, "num_stages": 3},
        "64/4/5": {"tile_n": 64, "num_stages": 5},
        "2 splits": {"splits": 2},
    },
    "llama": {  # (the 32nd session's wider sweep at llama:256 also had 64/4/2-3, 128/4/2-3,
        # 128/8/2, 32/2/4, 2 splits: 7-31% slower than the default)
        "default": {},
        "64/2/5": {"num_stages": 5},
        "64/2/3": {"num_stages": 3},
        "32/2/3": {"tile_n": 32},
        "32/2/2": {"tile_n": 32, "num_stages": 2},
        "32/1/2": {"tile_n": 32, "num_warps": 1, "num_stages": 2},
        "32/1/3": {"tile_n": 32, "num_warps": 1, "num_stages": 3},
        "32/1/4": {"tile_n": 32, "num_warps": 1, "num_stages": 4},
        "16/1/3": {"tile_n": 16, "num_warps": 1, "num_stages": 3},
        "16/1/4": {"tile_n": 16, "num_warps": 1, "num_stages": 4},
    },
    "tiny": {"default": {}, "2 splits": {"splits": 2}},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--points", default="qwen:256,qwen:64,qwen:1,llama:1")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{'point':10} {'variant (splits)':24} {'us/layer':>8} {'GB/s':>6} {'vs default':>10} "
          f"{'max diff':>8}")  # fmt: skip
    for point in args.points.split(","):
        model, batch = point.split(":")
        bench_point(model, int(batch), args.context, torch.device(args.device))
        torch.cuda.empty_cache()


def run_layers(views: list[KVCacheView], q: torch.Tensor, *args: Any, **kw: Any) -> None:
    """One decode step's attention launches, one a layer."""
    for view in views:
        decode_attention(q, view, *args, **kw)


def bench_point(model: str, batch: int, context: int, dev: torch.device) -> None:
    heads, kv_heads, dim, num_layers, bias = MODELS[model]
    lens = [context - (i * 37) % 64 for i in range(batch)]
    views, table = scattered_pool(
        lens, kv_heads, dim, block_size=16, dtype=torch.bfloat16, device=dev,
        num_layers=num_layers,
    )  # fmt: skip
    bf = torch.bfloat16
    qkv_heads = heads + 2 * kv_heads
    q = torch.randn(batch, heads, dim, device=dev).to(bf)
    key = torch.randn(batch, kv_heads, dim, device=dev).to(bf)
    value = torch.randn(batch, kv_heads, dim, device=dev).to(bf)
    pos = torch.tensor(lens, device=dev) - 1
    seq = torch.tensor(lens, device=dev)
    angles = torch.arange(4096, device=dev)[:, None] * torch.rand(dim // 2, device=dev)
    cos_sin = torch.stack([angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)], dim=1)
    slot_block = table[torch.arange(batch, device=dev), pos // 16]
    norm = DecodeNorm(
        stream=torch.randn(batch, heads * dim, device=dev).to(bf),
        eps=1e-6,
        bias=torch.randn(qkv_heads, dim, device=dev).to(bf) if bias else None,
    )
    rope = DecodeRope(pos, cos_sin, key, value, slot_block, pos % 16, norm)
    nbytes = sum(lens) * kv_heads * dim * 2 * 2
    default_splits = choose_num_splits(batch, kv_heads, max(lens), dev)
    base_out = None
    base_us = 0.0
    point = f"{model}:{batch}"
    for name, variant in VARIANTS[model].items():
        kw = dict(variant)
        splits = kw.pop("splits", default_splits)
        out = torch.full_like(q, float("nan"))
        run = functools.partial(
            run_layers, views, q, out, seq, table, dim**-0.5, splits, rope=rope, **kw
        )
        try:
            run()
            if dev.type != "cuda":  # smoke run: outputs only
                us = float("nan")
            else:
                torch.cuda.synchronize()
                us = triton.testing.do_bench_cudagraph(run, rep=100) * 1e3 / num_layers
        except Exception as e:  # a variant that does not compile (resources): say so
            print(f"{point:10} {name:24} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        if base_out is None:
            base_out, base_us = out.clone(), us
        assert not out.isnan().any(), f"{name}: outputs not written"
        diff = (out.float() - base_out.float()).abs().max().item()
        print(f"{point:10} {f'{name} ({splits})':24} {us:8.2f} {nbytes / us / 1e3:6.0f} "
              f"{us / base_us - 1:+10.1%} {diff:8.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
