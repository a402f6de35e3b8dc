"""What a prompt step's launches cost the host (issue 5: Qwen-256's prompt steps take ~2x their
kernel time, and the host's ``forward`` call takes nearly all of it).

    python benchmarks/device/launch_cost.py [--shape qwen]

1. Host time per call of each kind of launch in a prompt step, on tiny inputs (the GPU is never
   the limit): a torch elementwise op, ``F.linear``, and each of the Baton Triton kernels; for
   the Triton ones also the same launches straight through their compiled kernels' launchers
   (``CompiledKernel.run`` with the arguments bound once), which skips ``JITFunction.run``'s
   binding, specialisation and cache lookup, and through Baton's launch cache
   (``baton_kernels.triton.launch``, "cache") against Triton's path ("triton").
2. The engine on issue 5's workload: two 8,192-token prompt steps under cProfile (Python time by
   function) and the CUDA caching allocator's counters over the prompt phase (a retry frees the
   cache and synchronises).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts

from baton_kernels import fused
from baton_kernels.attention import KVCacheView
from baton_kernels.triton.decode_attention import decode_attention
from baton_kernels.triton.fused_ops import rotary_embedding_and_write_kv_
from baton_kernels.triton.paged_attention import paged_attention


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    sync()
    return host / n * 1e6


def direct_launches(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn``'s Triton launches, captured once (kernel, grid, bound arguments), replayed
    through each compiled kernel's launcher."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    calls = []
    orig = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        dev = driver.active.get_current_device()
        bound = self.device_caches[dev][4](*args, **kwargs)[0]
        g = tuple(grid(bound) if callable(grid) else grid)
        calls.append((kernel, g + (1,) * (3 - len(g)), tuple(bound.values())))
        return kernel

    from baton_kernels.triton import launch

    fast, launch.FAST_LAUNCH = launch.FAST_LAUNCH, False  # every launch through Triton's path
    JITFunction.run = run  # type: ignore[method-assign]
    try:
        fn()
    finally:
        JITFunction.run = orig  # type: ignore[method-assign]
        launch.FAST_LAUNCH = fast
    stream = driver.active.get_current_stream(driver.active.get_current_device())

    def replay() -> None:
        for k, g, a in calls:
            k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None, *a)

    return replay


def launch_costs(device: str, n: int) -> None:
    dev = torch.device(device)
    bf = torch.bfloat16
    t, hq, hk, d, bs = 16, 14, 2, 64, 16
    a = torch.randn(t, 896, device=dev, dtype=bf)
    res = torch.randn(t, 896, device=dev, dtype=bf)
    w = torch.randn(64, 896, device=dev, dtype=bf)
    norm = torch.ones(896, device=dev, dtype=bf)
    gu = torch.randn(t, 256, device=dev, dtype=bf)
    q = torch.randn(t, hq, d, device=dev, dtype=bf)
    k = torch.randn(t, hk, d, device=dev, dtype=bf)
    v = torch.randn(t, hk, d, device=dev, dtype=bf)
    kv = torch.zeros(8, 2, bs, hk, d, device=dev, dtype=bf)
    cache = KVCacheView(kv)
    pos = torch.arange(t, device=dev)
    cos_sin = torch.randn(64, 2, d, device=dev)
    slot_block = pos // bs
    slot_off = pos % bs
    table = torch.arange(8, device=dev).view(1, 8)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    lens = torch.tensor([t], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    one_len = torch.tensor([t], dtype=torch.int64, device=dev)
    cases: dict[str, Callable[[], object]] = {
        "torch add (aten)": lambda: torch.add(a, res),
        "F.linear (cuBLAS)": lambda: F.linear(a, w),
        "empty_like": lambda: torch.empty_like(a),
        "fused add_rms_norm (Triton)": lambda: fused.add_rms_norm(a, res.clone(), norm, 1e-6),
        "  (its clone alone)": lambda: res.clone(),
        "fused silu_and_mul (Triton)": lambda: fused.silu_and_mul(gu),
        "rotary + KV write (Triton)": lambda: rotary_embedding_and_write_kv_(
            q, k, v, pos, cos_sin, kv, slot_block, slot_off
        ),
        "paged_attention (Triton)": lambda: paged_attention(q, cache, out, cu, lens, table, 1.0, t),
        "decode_attention (Triton)": lambda: decode_attention(
            q[:1], cache, out[:1], one_len, table, 1.0, 1
        ),
    }
    print(f"host time per launch, tiny inputs ({n} calls; the first column through Baton's "
          "launch cache, 'triton' through Triton's path):")  # fmt: skip
    from baton_kernels.triton import launch

    launch.FAST_LAUNCH = True
    for name, fn in cases.items():
        line = f"  {name:32} {per_call_us(fn, n):7.1f} us"
        if "(Triton)" in name:
            launch.FAST_LAUNCH = False
            line += f"   triton {per_call_us(fn, n):7.1f} us"
            launch.FAST_LAUNCH = True
        if "(Triton)" in name and device == "cuda":
            try:
                line += f"   direct {per_call_us(direct_launches(fn), n):7.1f} us"
            except Exception as e:  # a probe: report and go on
                line += f"   direct failed: {e!r:.100}"
        print(line, flush=True)


def main() -> int:
    p = probe_args(__doc__)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--launches-only", action="store_true", help="the first part alone")
    args = p.parse_args()
    launch_costs(args.device, 2000 if args.device == "cuda" else 2)
    if args.device != "cuda" or args.launches_only:  # (a CPU smoke run: TRITON_INTERPRET=1)
        return 0
    core, mc, params = probe_engine(args)
    for rnd in range(2):
        stats0 = torch.cuda.memory_stats()
        for i, prompt in enumerate(random_prompts(args.num_prompts, args.prompt_len,
                                                  mc.vocab_size, seed=rnd)):  # fmt: skip
            core.add_request(f"{rnd}-{i}", prompt, params)
        for _ in range(3):
            core.step()
        if rnd == 1:
            host = cProfile.Profile()
            host.enable()
            for _ in range(2):
                core.step()
            host.disable()
        while core.scheduler.num_waiting:
            core.step()
        stats = torch.cuda.memory_stats()
        print(f"round {rnd} prompt phase, allocator: "
              + ", ".join(f"{key} +{stats.get(key, 0) - stats0.get(key, 0)}" for key in
                          ("num_alloc_retries", "num_device_alloc", "num_device_free",
                           "num_sync_all_streams")), flush=True)  # fmt: skip
        while core.has_unfinished_requests():
            core.step()
    print("--- two prompt steps (cProfile), by own time ---")
    pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)
    print("--- by cumulative time ---")
    pstats.Stats(host).sort_stats("cumulative").print_stats(args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
