"""How many compiled variants each Baton Triton kernel gathers over issue 5's workload, and what
tells them apart (issue 5: the first pass of the workload ran its prompt steps ~3 ms slower
than the second, as if steps were loading kernels).

    python benchmarks/device/triton_variants.py [--shape qwen] [--batch 256]

Builds the engine as ``bench_gpu_engine.py`` does, with its warm-up, runs the workload twice
(different prompts), and after each pass prints per kernel the number of compiled variants and
the pass's prompt-step wall times; then, for kernels with several variants, the arguments whose
specialisation differs between them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import probe_args, probe_engine, random_prompts, warm_up

import baton_kernels.triton.decode_attention as da
import baton_kernels.triton.fused_ops as fo
import baton_kernels.triton.gemv as gv
import baton_kernels.triton.kv_write as kw
import baton_kernels.triton.paged_attention as pa


def kernels() -> dict[str, Any]:
    out = {}
    for mod in (da, fo, gv, kw, pa):
        for name, obj in vars(mod).items():
            if hasattr(obj, "device_caches"):
                out[name] = obj
    return out


def variants(fn: Any) -> list[Any]:
    keys: list[Any] = []
    for cache in fn.device_caches.values():
        keys.extend(cache[0].keys())
    return keys


def counts(ks: dict[str, Any]) -> str:
    return ", ".join(f"{n} {len(variants(f))}" for n, f in ks.items() if variants(f))


def main() -> int:
    args = probe_args(__doc__).parse_args()
    core, mc, params = probe_engine(args)
    warm_up(core, mc, params)  # as bench_gpu_engine.py does
    ks = kernels()
    print(f"after start-up and warm-up: {counts(ks)}")
    for rnd in range(2):
        for i, prompt in enumerate(random_prompts(args.num_prompts, args.prompt_len,
                                                  mc.vocab_size, seed=rnd)):  # fmt: skip
            core.add_request(f"{rnd}-{i}", prompt, params)
        walls = []
        start = time.perf_counter()
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
        total = time.perf_counter() - start
        print(f"pass {rnd}: {total:.3f} s; first 18 steps (ms): "
              + " ".join(f"{w * 1e3:.0f}" for w in walls[:18]))  # fmt: skip
        print(f"  variants: {counts(ks)}")
    for name, fn in ks.items():
        keys = variants(fn)
        if len(keys) < 2:
            continue
        print(f"--- {name}: {len(keys)} variants")
        for key in keys[:12]:
            print("   ", str(key)[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
