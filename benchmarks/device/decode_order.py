"""Decode attention's read rate on the KV pool's real layout (issue 5).

    python benchmarks/device/decode_order.py

``bench_attention_gpu.py`` times the kernel on a two-layer pool. The engine's pool is
block-major over all layers (a block of Qwen2.5-0.5B's is 24 layers x K/V x 16 tokens x 2 heads
x 64 dims: one layer's K of a block is 4 KiB every 192 KiB), and in the engine the kernel read
only ~2.5 TB/s where that benchmark saw ~3.3. For each point: graph-timed GB/s of the KV read
with a 2-layer pool and with the model's own layer count, blocks scattered at random, for a few
launch configurations; each output checked against ``ref_decode_attention``. (Its first run,
2026-12-01, also compared two grid orders through a kernel parameter since removed.)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_pools import scattered_pool

from baton_kernels.triton.decode_attention import (
    choose_num_splits,
    decode_attention,
    ref_decode_attention,
)

MODELS = {"qwen": (14, 2, 64, 24), "llama": (32, 8, 128, 32)}  # heads, KV heads, dim, layers
POINTS = [("qwen", 256, 550), ("qwen", 256, 700), ("qwen", 64, 640), ("llama", 64, 640)]
POINTS += [("llama", 1, 640), ("qwen", 1, 640)]
CONFIGS = {"qwen": [(128, 4, 3), (128, 4, 2), (64, 4, 3)], "llama": [(64, 2, 3), (64, 4, 2)]}
BLOCK = 16


def main() -> None:
    torch.manual_seed(0)
    print("model  batch ctx layers splits config        GB/s   (max err)")
    for model, batch, ctx in POINTS:
        heads, kv_heads, dim, num_layers = MODELS[model]
        lens = [ctx - (i * 37) % 64 for i in range(batch)]  # a little spread, as in the engine
        q = torch.randn(batch, heads, dim, device="cuda").to(torch.bfloat16)
        seq = torch.tensor(lens, device="cuda")
        splits = choose_num_splits(batch, kv_heads, max(lens), torch.device("cuda"))
        nbytes = sum(lens) * kv_heads * dim * 2 * 2
        for layers in (2, num_layers):
            cache, table = scattered_pool(
                lens, kv_heads, dim, block_size=BLOCK, dtype=torch.bfloat16,
                device=torch.device("cuda"), num_layers=layers, layer=layers // 2,
            )  # fmt: skip
            want = ref_decode_attention(q[:4], cache, lens[:4], table[:4], dim**-0.5)
            for tile, warps, stages in CONFIGS[model]:
                out = torch.full_like(q, float("nan"))
                run = functools.partial(
                    decode_attention, q, cache, out, seq, table, dim**-0.5, splits, tile_n=tile,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip
                run()
                err = (out[:4].float() - want).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(run, rep=50)
                print(f"{model:6} {batch:5} {ctx:4} {layers:6} {splits:6} "
                      f"{f'{tile}/{warps}/{stages}':12} "
                      f"{nbytes / ms / 1e6:6.0f}   ({err:.1e})", flush=True)  # fmt: skip
            del cache, table
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
