"""Batch-1 linear layers on the GPU: cuBLAS (F.linear) against the Triton GEMV with its fused
prologue / epilogue (``baton_kernels.triton.gemv``), per weight shape and as whole layer stacks.

    python benchmarks/bench_gemv_gpu.py [--sweep] [--rows 1]

Per shape (Llama-3.1-8B and Qwen2.5-0.5B projections): microseconds per call and GB/s of weight
read, replayed from a CUDA graph over enough weight copies to defeat the 50 MB L2; with
``--sweep``, every launch configuration of the GEMV. Then the decode layers without attention
(add + RMSNorm, QKV, O, add + RMSNorm, gate/up, SiLU-and-mul, down: 9 kernels a layer) against
the fused GEMV path (4 a layer), each stack captured in one graph: the difference is what the
engine's batch-1 decode step would gain. Every GEMV result is checked against ``ref_gemv``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "libs" / "kernels"))
SMOKE = "--smoke" in sys.argv  # CPU, Triton's interpreter, tiny shapes: checks the script runs
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
from baton_kernels.triton import common, fused_ops  # noqa: E402
from baton_kernels.triton import gemv as gemv_mod  # noqa: E402
from baton_kernels.triton.gemv import choose_launch, gemv, ref_gemv  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float32 if os.environ.get("GEMV_FP32") else torch.bfloat16
L2_BYTES = 50 << (0 if SMOKE else 20)
# name -> (hidden, q+2kv, intermediate, layers, qkv bias); intermediate 0: the attention's
# projections only (a mixture of experts: its experts have their own kernels)
MODELS = {"llama": (4096, 6144, 14336, 32, False), "qwen": (896, 1152, 4864, 24, True),
          "qwen3moe": (2048, 5120, 0, 48, False)}  # fmt: skip
Q_WIDTH = {"qwen3moe": 4096}  # o_proj's input where the query heads are not the hidden size
if SMOKE:
    MODELS = {"llama": (64, 96, 160, 2, False), "qwen": (32, 48, 96, 2, True),
              "qwen3moe": (32, 80, 0, 2, False)}  # fmt: skip
    Q_WIDTH = {"qwen3moe": 64}


def graph_us(fn: Callable[[], object], reps: int = 20, outputs: list[Any] | None = None) -> float:
    """Microseconds per replay of a CUDA graph of one ``fn()`` call (median of ``reps``);
    ``outputs`` gets what the captured call returned (as of the last replay)."""
    if SMOKE:
        start = time.perf_counter()
        out = fn()
        if outputs is not None:
            outputs.append(out)
        return (time.perf_counter() - start) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    if outputs is not None:
        outputs.append(out)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


FOLDED = "--folded" in sys.argv  # the engine's calls once the norms are folded (gemv_down)


def shapes(model: str) -> list[tuple[str, int, int, str]]:
    """(name, N, K, prologue/epilogue) of one layer's projections; with ``--folded`` as the
    engine's batch-1 decode layers call them once their norms are folded into the weights
    (``LlamaDecoderLayer.forward_gemv`` with ``gemv_down``): gate_up without a prologue, the
    down projection scaling gate and up by the residual stream's 1/rms."""
    h, qkv, inter, _, _ = MODELS[model]
    attention = [(f"{model} qkv", qkv, h, "norm"), (f"{model} o", h, Q_WIDTH.get(model, h), "res")]
    if not inter:
        return attention
    return [
        *attention,
        (f"{model} gate_up", 2 * inter, h, "plain" if FOLDED else "norm"),
        (f"{model} down", h, inter, "silu_norm+res" if FOLDED else "silu+res"),
    ]


# The fixed-grid kernel's sweep (``--stream-sweep``): (columns, K per step, warps) x programs an SM
STREAM_TILES = [(4, 1024, 4), (8, 512, 4), (2, 2048, 4), (4, 2048, 8), (8, 1024, 8), (16, 512, 8)]
STREAM_PER_SM = (2, 3, 4, 6)
# gemv's config and its stream (programs an SM, 0: none); or "dot" and the tensor-core kernel's
# launch (columns, K per step, warps, stages, programs a column block)
Launch = tuple[Any, ...]


def launch_kwargs(launch: Launch) -> dict[str, Any]:
    if launch[0] == "dot":
        return {"dot": tuple(launch[1:])}
    return {"config": tuple(launch[:4]), "stream": launch[4]}


def dot_launches(n: int, k: int, sms: int, kind: str) -> list[Launch]:
    """The tensor-core kernel's sweep (``--dot-sweep``): column blocks of 32-256, K slices of
    64-256, 3-6 stages (8 of 64) within the shared memory, 4 warps (8 at 256 columns, both at
    128), K split so that the grid covers the SMs once or twice where the column blocks alone
    do not."""
    out: list[Launch] = []
    x_tiles = 2 if kind.startswith("silu") else 1
    for bn, bk, stages, warps in itertools.product(
        (32, 64, 128, 256), (64, 128, 256), (3, 4, 6, 8), (4, 8)
    ):
        smem = stages * (bn + 16 * x_tiles) * bk * 2
        if smem > 220_000 or bn * bk > 32_768 or (stages == 8) != (bk == 64):
            continue
        if warps != (8 if bn == 256 else 4) and bn != 128:
            continue
        blocks = -(-n // bn)
        splits = {1} | {max(1, round(waves * sms / blocks)) for waves in (1, 2)}
        for split in sorted(splits):
            if split <= 16 and k // split >= 2 * bk:
                out.append(("dot", bn, bk, warps, stages, split))
    return out


def per_shape(
    model: str,
    rows: int,
    sweep: bool,
    stream_sweep: bool,
    dot_sweep: bool = False,
    dot_json: Path | None = None,
) -> dict[str, Launch]:
    """Each shape's launches timed against cuBLAS; returns each shape's best. ``dot_json``:
    where the best tensor-core launch beats what the engine runs, it is added there."""
    best: dict[str, Launch] = {}
    for name, n, k, kind in shapes(model):
        copies = max(1, -(-2 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=DEV, dtype=DT) * 0.02 for _ in range(copies)]
        x = torch.randn(rows, k, device=DEV, dtype=DT)
        gb = copies * n * k * 2 / 1e9
        # the GEMV as the fused stack calls it: its prologue / epilogue included
        kw: dict[str, Any] = {}
        gx = x
        if kind == "norm":
            kw["norm_weight"] = torch.rand(k, device=DEV, dtype=DT) + 0.5
        if kind.startswith("silu"):
            gx = torch.randn(rows, 2 * k, device=DEV, dtype=DT)
            kw["silu_mul"] = True
        if kind.endswith("res"):
            kw["residual"] = torch.randn(rows, n, device=DEV, dtype=DT)
        if kind.startswith("silu_norm"):
            kw["norm_of"] = kw["residual"]
            kw["eps"] = 1e-5

        def cublas(ws: list[torch.Tensor] = ws, x: torch.Tensor = x) -> None:
            for w in ws:
                F.linear(x, w)

        t_cublas = graph_us(cublas)
        default_config, default_stream = choose_launch(n, k)
        chosen: Launch = (*default_config, default_stream)
        configs = [chosen]
        if sweep:
            grid = itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (4, 8), (2, 3), (0,))
            configs += [c for c in grid if c != chosen]
        if stream_sweep:
            configs += [(bn, bk, w, 1, p) for (bn, bk, w), p in
                        itertools.product(STREAM_TILES, STREAM_PER_SM)]  # fmt: skip
        if dot_sweep:
            configs += dot_launches(n, k, common.num_sms(DEV) if not SMOKE else 4, kind)
        timed = []
        for cfg in configs:
            try:
                got = gemv(gx, ws[0], **launch_kwargs(cfg), **kw)
            except Exception as e:  # a launch the GPU cannot run (its shared memory)
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                continue
            err = (got.float() - ref_gemv(gx, ws[0], **kw).float()).abs().max().item()
            if err > 0.05:
                print(f"  {name} {cfg}: max |diff| {err:.3g} FAIL")
                continue

            def triton_fn(
                cfg: Launch = cfg,
                ws: list[torch.Tensor] = ws,
                x: torch.Tensor = gx,
                kw: dict[str, Any] = kw,
            ) -> None:
                for w in ws:
                    gemv(x, w, **launch_kwargs(cfg), **kw)

            timed.append((graph_us(triton_fn), cfg))
        timed.sort()
        best[name] = timed[0][1]
        t_def = next(t for t, c in timed if c == chosen)
        top = ", ".join(f"{c} {gb / (t * 1e-6):.0f}" for t, c in timed[:4])
        classic = [t for t, c in timed if c[0] != "dot" and not c[4]]
        if stream_sweep and classic:
            top += f"; best one-program-a-block {gb / (classic[0] * 1e-6):.0f}"
        dots = [(t, c) for t, c in timed if c[0] == "dot"]
        if dots:
            top += f"; best tensor-core {dots[0][1]} {gb / (dots[0][0] * 1e-6):.0f}"
            # what the engine runs now: cuBLAS for a plain projection (gate_up), else the GEMV
            engine_us = t_cublas if kind == "plain" else t_def
            if dots[0][0] < engine_us and dot_json is not None:
                picks = json.loads(dot_json.read_text()) if dot_json.exists() else {}
                picks[f"{n},{k}"] = list(dots[0][1][1:])
                dot_json.write_text(json.dumps(picks))
        print(
            f"{name:14} N {n:6} K {k:6} ({kind:8}) x{copies:3}: cuBLAS {t_cublas / copies:7.1f} us "
            f"{gb / (t_cublas * 1e-6):5.0f} GB/s; gemv {chosen} {t_def / copies:7.1f} us "
            f"{gb / (t_def * 1e-6):5.0f} GB/s; best GB/s: {top}",
            flush=True,
        )
        ws.clear()
        torch.cuda.empty_cache()
    return best


def stacks(model: str, rows: int, best: dict[str, Launch]) -> None:
    h, qkv_n, inter, layers, has_bias = MODELS[model]
    q = h  # query heads x head size: the hidden size in both shapes
    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=DEV) * 0.02).to(DT)

    weights = [
        dict(
            qkv=rand(qkv_n, h),
            bias=rand(qkv_n) if has_bias else None,
            o=rand(h, q),
            gate_up=rand(2 * inter, h),
            down=rand(h, inter),
            n1=torch.ones(h, device=DEV, dtype=DT) + rand(h),
            n2=torch.ones(h, device=DEV, dtype=DT) + rand(h),
        )
        for _ in range(layers)
    ]
    x0 = torch.randn(rows, h, device=DEV, dtype=DT)
    names = [n for n, *_ in shapes(model)]

    def separate() -> torch.Tensor:
        hidden, residual = x0.clone(), None  # the fused add updates the residual in place
        for w in weights:
            if residual is None:
                normed, residual = fused_ops.rms_norm(hidden, w["n1"], 1e-6), hidden
            else:
                normed, residual = fused_ops.fused_add_rms_norm(hidden, residual, w["n1"], 1e-6)
            attn = F.linear(normed, w["qkv"], w["bias"])[:, :q]  # attention left out
            hidden = F.linear(attn, w["o"])
            normed, residual = fused_ops.fused_add_rms_norm(hidden, residual, w["n2"], 1e-6)
            hidden = F.linear(fused_ops.silu_and_mul(F.linear(normed, w["gate_up"])), w["down"])
        return hidden + residual

    def fused(per_shape_cfg: bool) -> Callable[[], torch.Tensor]:
        def cfg(i: int) -> dict[str, Any]:
            launch = best[names[i]]
            return launch_kwargs(launch) if per_shape_cfg else {}

        def run() -> torch.Tensor:
            stream = x0.clone()
            for w in weights:
                qkv = gemv(stream, w["qkv"], w["bias"], norm_weight=w["n1"], **cfg(0))
                gemv(qkv[:, :q], w["o"], residual=stream, out=stream, **cfg(1))
                gu = gemv(stream, w["gate_up"], norm_weight=w["n2"], **cfg(2))
                gemv(gu, w["down"], silu_mul=True, residual=stream, out=stream, **cfg(3))
            return stream

        return run

    a, b = separate(), fused(True)()
    err = (a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
    t_sep = graph_us(separate)
    t_best = graph_us(fused(True))
    gb = sum(w.numel() * 2 for lw in weights for w in lw.values() if w is not None) / 1e9
    print(
        f"{model} {layers} layers, {rows} row(s), {gb:.2f} GB of weights, attention left out: "
        f"separate kernels {t_sep:8.1f} us ({gb / (t_sep * 1e-6):.0f} GB/s); fused gemv "
        f"{t_best:8.1f} us (per-shape best: {[best[n] for n in names]}, launch as default); "
        f"relative |diff| of the output {err:.2e}",
        flush=True,
    )
    # choose_config's launches, with and without programmatic dependent launch (PDL) and the
    # first weight slice read before the wait; each graph's own output against the first's
    variants = [("no PDL", False, False), ("PDL", True, False), ("PDL + prefetch", True, True)]
    first: torch.Tensor | None = None
    saved = common.PDL, gemv_mod.PREFETCH
    for name, pdl, prefetch in variants:
        common.PDL, gemv_mod.PREFETCH = pdl, prefetch
        outs: list[torch.Tensor] = []
        t = graph_us(fused(False), outputs=outs)
        same = "" if first is None else f", equal to no PDL: {torch.equal(outs[0], first)}"
        first = outs[0] if first is None else first
        print(f"  fused gemv, choose_config, {name:15s} {t:8.1f} us "
              f"({gb / (t * 1e-6):.0f} GB/s){same}", flush=True)  # fmt: skip
    common.PDL, gemv_mod.PREFETCH = saved
    weights.clear()
    torch.cuda.empty_cache()


def folded_stack(model: str, picks: dict[tuple[int, int], tuple[int, ...]]) -> None:
    """The engine's batch-1 decode layers without attention, norms folded (``--folded-stack``):
    qkv (RMSNorm inside), o (residual), gate_up (cuBLAS, or the tensor-core GEMV where
    ``DOT_LAUNCHES`` has it), down (SiLU and the folded norm inside, a new residual stream),
    every layer its own weights, one CUDA graph. Variants of ``DOT_LAUNCHES`` (the sweep's
    ``picks``, all or one shape at a time) and ``DOT_PREFETCH``, in two rounds; each graph's
    output against the default's."""
    h, qkv_n, inter, layers, _ = MODELS[model]
    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=DEV) * 0.02).to(DT)

    weights = [
        (rand(qkv_n, h), rand(h, h), rand(2 * inter, h), rand(h, inter),
         torch.ones(h, device=DEV, dtype=DT) + rand(h))
        for _ in range(layers)
    ]  # fmt: skip
    x0 = torch.randn(1, h, device=DEV, dtype=DT)

    def run() -> torch.Tensor:
        stream = x0.clone()
        for qkv_w, o_w, gu_w, down_w, n1 in weights:
            qkv = gemv(stream, qkv_w, norm_weight=n1, eps=1e-5)
            gemv(qkv[:, :h], o_w, residual=stream, out=stream)
            gate_up = (gemv(stream, gu_w) if tuple(gu_w.shape) in gemv_mod.DOT_LAUNCHES
                       else F.linear(stream, gu_w))  # fmt: skip
            stream = gemv(gate_up, down_w, silu_mul=True, norm_of=stream, eps=1e-5,
                          residual=stream)  # fmt: skip
        return stream

    names = {(qkv_n, h): "qkv", (h, h): "o", (2 * inter, h): "gate_up", (h, inter): "down"}
    variants: list[tuple[str, dict[tuple[int, int], tuple[int, ...]], int]] = [("default", {}, 0)]
    if picks:
        variants += [("dot all", picks, 0), ("dot all, prefetch 1", picks, 1),
                     ("dot all, prefetch 2", picks, 2)]  # fmt: skip
        variants += [(f"dot {names.get(key, key)} only", {key: launch}, 0)
                     for key, launch in picks.items()]  # fmt: skip
    gb = sum(w.numel() * 2 for lw in weights for w in lw) / 1e9
    saved = gemv_mod.DOT_LAUNCHES, gemv_mod.DOT_PREFETCH
    first: torch.Tensor | None = None
    for round_ in (1, 2):
        for name, launches, prefetch in variants:
            gemv_mod.DOT_LAUNCHES, gemv_mod.DOT_PREFETCH = launches, prefetch  # type: ignore[assignment]
            outs: list[torch.Tensor] = []
            t = graph_us(run, outputs=outs)
            out = outs[0].float()
            first = out if first is None else first
            err = ((out - first).abs().max() / first.abs().max()).item()
            print(f"folded stack {model} round {round_} {name:24s} {t:8.1f} us "
                  f"({gb / (t * 1e-6):.0f} GB/s), relative |diff| {err:.1e}",
                  flush=True)  # fmt: skip
    gemv_mod.DOT_LAUNCHES, gemv_mod.DOT_PREFETCH = saved
    weights.clear()
    torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--models", default="llama,qwen")
    p.add_argument("--stream-sweep", action="store_true", help="the fixed-grid kernel's sweep")
    p.add_argument("--best-json", type=Path, help="write each shape's best launch: N,K -> launch")
    p.add_argument("--dot-sweep", action="store_true", help="the tensor-core kernel's sweep")
    p.add_argument("--folded", action="store_true", help="the engine's calls, norms folded")
    p.add_argument("--dot-json", type=Path, help="write (N,K -> launch) where --dot-sweep's best "
                   "beats the engine's launch (cuBLAS for gate_up with --folded)")  # fmt: skip
    p.add_argument("--folded-stack", action="store_true",
                   help="the engine's batch-1 layers, norms folded, tensor-core picks")  # fmt: skip
    p.add_argument("--no-stacks", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    args = p.parse_args()
    device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, bf16, {args.rows} row(s)")
    found: dict[str, Launch] = {}
    for model in args.models.split(","):
        best = per_shape(
            model, args.rows, args.sweep, args.stream_sweep, args.dot_sweep, args.dot_json
        )
        for name, n, k, _ in shapes(model):
            found[f"{n},{k}"] = best[name]
        if not args.no_stacks and MODELS[model][2]:
            stacks(model, args.rows, best)
    if args.best_json:
        args.best_json.write_text(json.dumps(found))
    if args.folded_stack:
        picked = (
            json.loads(args.dot_json.read_text())
            if args.dot_json and args.dot_json.exists()
            else {}
        )
        picks = {tuple(map(int, key.split(","))): tuple(v) for key, v in picked.items()}
        for model in args.models.split(","):
            if MODELS[model][2]:  # (a dense MLP's layers)
                folded_stack(model, picks)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
