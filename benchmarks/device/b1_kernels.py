"""Small decode kernels on the GPU, this tree against an older one (a probe).

    python benchmarks/device/b1_kernels.py [--old .ab_old]

1. Decode attention at batch 1 with the split count a CUDA graph captures (64, fitted to the
   longest context), against the split count the real length picks, for this tree's kernel
   (slices past the request's keys return at once; the reduce reads the others ``UNROLL`` at a
   time: 8, 4 or 64) and the old tree's (every slice runs and the reduce reads all of them).
   Graph-timed, us per call.
2. The greedy argmax of one or more rows of logits: torch's against ``fused_ops.argmax``,
   graph-timed (the kernels) and launched eagerly back to back (the launch's host cost).

The old tree is a ``git archive <commit> libs`` unpacked under ``--old``; its decode-attention
module is loaded beside this tree's under its own name.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import random
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "libs" / "kernels"))

from baton_kernels.attention import KVCacheView  # noqa: E402
from baton_kernels.triton import decode_attention as new_attention  # noqa: E402
from baton_kernels.triton import fused_ops  # noqa: E402

MODELS = {"qwen": (14, 2, 64), "llama": (32, 8, 128)}  # (query heads, KV heads, head size)
DEVICE = torch.device("cuda")


def load_old(old_root: Path) -> object | None:
    path = old_root / "libs/kernels/baton_kernels/triton/decode_attention.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("old_decode_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_us(fn: object) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=100)) * 1e3


def eager_us(fn: object, n: int = 2000) -> float:
    """Wall time per call of ``n`` eager calls back to back: the larger of launch and kernel."""
    for _ in range(20):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def attention_rows(old: object | None) -> None:
    print("\n## decode attention, batch 1, us per call (graph-timed)")
    print(
        "model  context  splits | new: unroll 8, 4, 64 | old    | max |diff| against the reference"
    )
    for model, context in (("llama", 640), ("llama", 768), ("llama", 2048), ("qwen", 640)):
        num_heads, num_kv_heads, head_dim = MODELS[model]
        bs = 16
        blocks = math.ceil(context / bs)
        pool = torch.randn(blocks + 1, 2, bs, num_kv_heads, head_dim, device=DEVICE).bfloat16()
        order = list(range(blocks + 1))
        random.Random(0).shuffle(order)
        table = torch.tensor([order[:blocks] + [0] * (256 - blocks)], device=DEVICE)
        cache = KVCacheView(pool)
        query = torch.randn(1, num_heads, head_dim, device=DEVICE).bfloat16()
        lens = torch.tensor([context], device=DEVICE, dtype=torch.int32)
        scale = head_dim**-0.5
        want = new_attention.ref_decode_attention(query, cache, [context], table, scale)
        real = new_attention.choose_num_splits(1, num_kv_heads, context, DEVICE)
        for splits in sorted({64, real}, reverse=True):
            cells, errs = [], []
            for module, unroll in (
                (new_attention, 8),
                (new_attention, 4),
                (new_attention, 64),
                (old, 0),
            ):
                if module is None:
                    cells.append("   -  ")
                    continue
                new_attention.COMBINE_UNROLL = unroll or 8
                out = torch.full_like(query, float("nan"))
                run = functools.partial(
                    module.decode_attention,
                    query,
                    cache,
                    out,
                    lens,
                    table,
                    scale,
                    splits,  # type: ignore[attr-defined]
                )
                run()
                errs.append(f"{(out.float() - want).abs().max().item():.1e}")
                cells.append(f"{graph_us(run):6.2f}")
            print(f"{model:6} {context:7} {splits:6} | {' '.join(cells)} | {', '.join(errs)}")


def argmax_rows() -> None:
    print("\n## argmax over the vocabulary, us per call (graph-timed)")
    print(
        "rows  vocab   dtype | torch   triton | equal | eager launches back to back: torch, triton"
    )
    for rows, vocab, dtype in (
        (1, 128256, torch.bfloat16),
        (1, 151936, torch.bfloat16),
        (64, 151936, torch.bfloat16),
        (256, 151936, torch.bfloat16),
        (256, 151936, torch.float32),
    ):
        logits = (torch.randn(rows, vocab, device=DEVICE) * 3).to(dtype)
        same = fused_ops.argmax(logits).equal(logits.argmax(dim=-1))
        t_torch = graph_us(lambda logits=logits: logits.argmax(dim=-1))
        t_triton = graph_us(lambda logits=logits: fused_ops.argmax(logits))
        host = [eager_us(lambda logits=logits: logits.argmax(dim=-1)),
                eager_us(lambda logits=logits: fused_ops.argmax(logits))]  # fmt: skip
        name = str(dtype).removeprefix("torch.")
        print(
            f"{rows:4} {vocab:6} {name:8} | {t_torch:6.1f} {t_triton:6.1f} | {same} "
            f"| eager {host[0]:6.1f} {host[1]:6.1f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--old", type=Path, default=ROOT / ".ab_old")
    args = p.parse_args()
    attention_rows(load_old(args.old))
    argmax_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
