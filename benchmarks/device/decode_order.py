"""Decode attention's read rate on the KV pool's real layout (issue 5).

    python benchmarks/device/decode_order.py

``bench_attention_gpu.py`` times the kernel on a two-layer pool. The engine's pool is
block-major over all layers (a block of Qwen2.5-0.5B's is 24 layers x K/V x 16 tokens x 2 heads
x 64 dims: one layer's K of a block is 4 KiB every 192 KiB), and in the engine the kernel read
only ~2.5 TB/s where that benchmark saw ~3.3. For each point: graph-timed GB/s of the KV read
with a 2-layer pool and with the model's own layer count, blocks scattered at random, for a few
launch configurations; each output checked against ``ref_decode_attention``. (Its first run,
2026-12-01, also compared two grid orders through a kernel parameter since removed.)

Those rows replay one layer, whose ~72 MB at Qwen's 256 x 550 partly stay in the H200's L2
(60 MiB) from one replay to the next. The "all" rows replay one launch per layer, every layer
in turn, as a decode step does (each layer's KV read once per graph replay, after the other
layers' traffic), at block sizes 16 and 32, in the engine's launch configuration.
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
            views, table = scattered_pool(
                lens, kv_heads, dim, block_size=BLOCK, dtype=torch.bfloat16,
                device=torch.device("cuda"), num_layers=layers,
            )  # fmt: skip
            cache = views[layers // 2]
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
            del views, cache, table
            torch.cuda.empty_cache()
        for block in (16, 32):
            print(every_layer(model, lens, q, seq, splits, nbytes, block), flush=True)
            torch.cuda.empty_cache()


def every_layer(
    model: str, lens: list[int], q: torch.Tensor, seq: torch.Tensor, splits: int, nbytes: int,
    block: int,
) -> str:  # fmt: skip
    """GB/s of one graph that runs the decode kernel over each of the model's layers in turn."""
    _, kv_heads, dim, num_layers = MODELS[model]
    views, table = scattered_pool(
        lens, kv_heads, dim, block_size=block, dtype=torch.bfloat16,
        device=q.device, num_layers=num_layers,
    )  # fmt: skip
    out = torch.full_like(q, float("nan"))

    def run() -> None:
        for view in views:
            decode_attention(q, view, out, seq, table, dim**-0.5, splits)

    want = ref_decode_attention(q[:4], views[-1], lens[:4], table[:4], dim**-0.5)
    run()
    err = (out[:4].float() - want).abs().max().item()
    ms = triton.testing.do_bench_cudagraph(run, rep=50) / num_layers
    return (f"{model:6} {q.shape[0]:5} {max(lens):4} {'all':>6} {splits:6} "
            f"{f'block {block}':12} {nbytes / ms / 1e6:6.0f}   ({err:.1e})")  # fmt: skip


if __name__ == "__main__":
    main()
