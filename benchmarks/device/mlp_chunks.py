"""The prompt step's MLP in row chunks, so that its intermediate activations stay in the L2
(thirtieth session, issue 5).

    python benchmarks/device/mlp_chunks.py [--tokens 16384] [--chunks 0,1024,2048,4096]

A 16,384-token prompt step of Qwen2.5-0.5B spends ~2.8 ms of its ~23 ms in SiLU-and-multiply
(twenty-ninth session's profile): gate_up writes 16,384 x 9,728 bf16 values (319 MB) a layer,
SiLU-and-multiply reads them and writes half as many, the down projection reads those, all
through the memory at ~4 TB/s. Run over row chunks of C tokens, a chunk's gate_up output
(C x 9,728 x 2 bytes: 20 MB at 1,024) and its product can stay in the H200's 60 MiB L2 between
the three kernels. This times the folded MLP (``DecoderLayer.folded_mlp``: gate_up GEMM on the
residual stream, SiLU-and-multiply applying the norm's 1/rms, the down GEMM adding into the
stream) of every layer in turn (each its own weights, as in a step) in one CUDA graph, whole
(chunk 0) and in chunks, and compares the stream after it with the whole run's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from baton_kernels.triton.fused_ops import silu_and_mul

SHAPES = {"qwen": (896, 4864, 24), "llama": (4096, 14336, 32)}  # hidden, intermediate, layers


def mlp(stream: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, chunk: int) -> None:
    rows = stream.shape[0]
    step = chunk or rows
    for r in range(0, rows, step):
        part = stream[r : r + step]
        act = silu_and_mul(F.linear(part, gate_up), norm_of=part, eps=1e-6)
        part.addmm_(act, down.t())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunks", default="0,512,1024,2048,4096,8192")
    args = p.parse_args()
    hidden, inter, layers = SHAPES[args.shape]
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    weights = [
        ((torch.randn(2 * inter, hidden, device=dev) * hidden**-0.5).to(bf),
         (torch.randn(hidden, inter, device=dev) * inter**-0.5).to(bf))
        for _ in range(layers)
    ]  # fmt: skip
    start = torch.randn(args.tokens, hidden, device=dev).to(bf)
    stream = start.clone()
    base: torch.Tensor | None = None
    base_ms = 0.0
    print(f"{args.shape} {args.tokens} tokens, {layers} layers: chunk, ms a step, vs whole, "
          "max |diff| of the stream after one pass")  # fmt: skip
    for chunk in (int(c) for c in args.chunks.split(",")):

        def run(c: int = chunk) -> None:
            for gu, d in weights:
                mlp(stream, gu, d, c)

        stream.copy_(start)
        run()
        out = stream.clone()
        ms = triton.testing.do_bench_cudagraph(run, rep=200)
        if base is None:
            base, base_ms = out, ms
        diff = (out.float() - base.float()).abs().max().item()
        print(f"  {chunk or args.tokens:6} {ms:8.3f} {ms / base_ms - 1:+7.1%} {diff:9.2e}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
