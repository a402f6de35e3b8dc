"""Top-p on the GPU: sorting every row against two sort-free cuts (a probe).

    python benchmarks/device/top_p_gpu.py [--vocab 151936] [--rows 64,256]

The first sort-free cut finds each row's threshold by bucketing: a histogram of the
probability mass over 1,024 logit buckets (the top 40 logits' worth of range, by
``scatter_add_``), the bucket where the mass from the top reaches p, then the same inside that
bucket, three levels deep. The second is the sampler's: ``baton_kernels.triton.top_p``'s search
(one program per row, the mass at 32 pivots per pass). Neither waits for the device. Prints, per
row count and logit scale (flat to peaked), each cut's median time and how many tokens'
kept/masked state differ from the sort's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baton_engine.sampler import _apply_top_k_top_p_sorted
from baton_kernels.triton.top_p import top_p_threshold


def bucketed_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, bins: int = 1024, levels: int = 3, span: float = 40.0
) -> torch.Tensor:
    rows = logits.size(0)
    probs = logits.softmax(dim=1)
    lo = logits.amax(dim=1, keepdim=True) - span
    width = torch.full_like(lo, span / bins)
    target = top_p.unsqueeze(1).to(probs.dtype)
    kept = torch.zeros_like(logits, dtype=torch.bool)
    member = torch.ones_like(logits, dtype=torch.bool)
    for _ in range(levels):
        idx = ((logits - lo) / width).floor_().clamp_(0, bins - 1).long()
        hist = torch.zeros(rows, bins, dtype=probs.dtype, device=logits.device)
        hist.scatter_add_(1, idx, probs * member)
        at_or_above = hist.flip(1).cumsum(1).flip(1)
        b = ((at_or_above >= target).sum(1, keepdim=True) - 1).clamp_(min=0)
        target = target - (at_or_above.gather(1, b) - hist.gather(1, b))
        kept |= member & (idx > b)
        member &= idx == b
        lo = lo + b * width
        width = width / bins
    kept |= member | (top_p >= 1.0).unsqueeze(1)
    return logits.masked_fill_(~kept, float("-inf"))


def median_ms(fn, iters: int = 20) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="64,256")
    args = p.parse_args()
    print(
        f"{'rows':>5} {'scale':>6} {'sorted ms':>10} {'bucketed ms':>12} {'differ':>7} {'kept':>9}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        top_p = torch.full((rows,), 0.9, device="cuda")
        for scale in (0.3, 1.0, 3.0, 8.0):
            x = torch.randn(rows, args.vocab, device="cuda") * scale
            ref = _apply_top_k_top_p_sorted(x.clone(), None, top_p)
            got = bucketed_top_p(x.clone(), top_p)
            differ = int((ref.isfinite() != got.isfinite()).sum())
            sort_ms = median_ms(lambda x=x, p=top_p: _apply_top_k_top_p_sorted(x.clone(), None, p))
            bucket_ms = median_ms(lambda x=x, p=top_p: bucketed_top_p(x.clone(), p))
            cut = top_p_threshold(x, top_p).unsqueeze(1)
            search_differ = int((ref.isfinite() != (x >= cut)).sum())
            search_ms = median_ms(lambda x=x, p=top_p: x < top_p_threshold(x, p).unsqueeze(1))
            print(f"{rows:>5} {scale:>6} {sort_ms:>10.3f} {bucket_ms:>12.3f} {differ:>7} "
                  f"{search_ms:>10.3f} {search_differ:>7} "
                  f"{int(ref.isfinite().sum()):>9}")  # fmt: skip


if __name__ == "__main__":
    main()
