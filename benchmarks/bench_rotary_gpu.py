"""The prompt step's rotary + K/V write launch (``fused_ops.rotary_embedding_and_write_kv_``)
by tokens per program (``fused_ops.ROPE_TOKENS``), on a GPU (issue 5).

    python benchmarks/bench_rotary_gpu.py [--tokens 16384,2048] [--models qwen,llama]

A prompt step of Qwen2.5-0.5B at 16,384 tokens spent ~43 us a layer in this launch (the
twenty-second session's profile) for ~75 MB of reads and writes, ~18 us at the copy bandwidth:
one program per token and head block, each moving 2 KB or less. Each row: the q/k views of a
fused qkv projection output, 512-token prompts' positions, slots scattered over a block-major
pool of every layer (the engine's layout), graph-timed (``do_bench_cudagraph``); GB/s of q and
k read and written, v read and the cache's K/V written. Each variant's q and cache are compared
with one token a program (the same arithmetic: equal bit for bit).
"""

from __future__ import annotations

import argparse

import torch
import triton

from baton_kernels.triton import fused_ops

MODELS = {"qwen": (14, 2, 64, 24), "llama": (32, 8, 128, 32)}  # + layers (the pool's)
VARIANTS = [1, 2, 4, 8, 16, None]  # tokens a program; None: the default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="16384,2048")
    p.add_argument("--models", default="qwen,llama")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    args = p.parse_args()
    dev = torch.device(args.device)
    print(f"{'model':6} {'tokens':>6} {'per program':>11} {'us':>8} {'GB/s':>6} {'same':>5}")
    for model in args.models.split(","):
        for n in map(int, args.tokens.split(",")):
            bench(model, n, dev)


def bench(model: str, n: int, dev: torch.device) -> None:
    hq, hk, dim, layers = MODELS[model]
    torch.manual_seed(0)
    bf = torch.bfloat16
    qkv = torch.randn(n, (hq + 2 * hk) * dim, device=dev).to(bf)
    q, k, v = (t.view(n, -1, dim) for t in qkv.split([hq * dim, hk * dim, hk * dim], dim=-1))
    positions = torch.arange(n, device=dev) % 512
    block_size = 16
    num_blocks = n // block_size + 1
    pool = torch.zeros(num_blocks, layers, 2, block_size, hk, dim, dtype=bf, device=dev)
    kv = pool[:, 1]
    order = torch.randperm(num_blocks, device=dev)
    slot = torch.arange(n, device=dev)
    slot_block, slot_offset = order[slot // block_size], slot % block_size
    angles = torch.arange(4096, device=dev)[:, None] * torch.rand(dim // 2, device=dev)
    cos_sin = torch.stack([angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)], dim=1)
    nbytes = n * dim * 2 * (2 * (hq + hk) + hk + 2 * hk)
    fresh = qkv.clone()
    base: tuple[torch.Tensor, torch.Tensor] | None = None
    for tokens in VARIANTS:
        fused_ops.ROPE_TOKENS = tokens

        def run() -> None:
            fused_ops.rotary_embedding_and_write_kv_(
                q, k, v, positions, cos_sin, kv, slot_block, slot_offset
            )

        qkv.copy_(fresh)
        run()
        got = (qkv.clone(), kv.clone())
        if base is None:
            base = got
        same = torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
        us = float("nan")
        if dev.type == "cuda":
            us = triton.testing.do_bench_cudagraph(run, rep=100) * 1e3
        label = "default" if tokens is None else str(tokens)
        print(f"{model:6} {n:6} {label:>11} {us:8.2f} {nbytes / us / 1e3:6.0f} {same!s:>5}",
              flush=True)  # fmt: skip
    fused_ops.ROPE_TOKENS = None


if __name__ == "__main__":
    main()
