"""A decode step's forward as two half batches on two CUDA streams, graph-timed against the
engine's one-stream graph (thirtieth session, issue 5).

    python benchmarks/device/two_halves.py [--shape qwen] [--batch 256]

At Qwen2.5-0.5B's 256-request decode step the layers' four cuBLAS GEMMs take ~31 us a layer
(~0.75 ms a step, 1.0-1.5 TB/s: few tiles, latency-bound) and the decode attention ~29 us (its
programs fill every SM's registers). Run as two independent chains of 128 requests (each the
whole forward: its own GEMMs on its half of the rows, its own attention), one chain's GEMMs
may run beside the other's attention. This builds the engine as the benchmark does, runs the
workload, then times the 256-row graph replayed at the run's last full step ("one stream")
against graphs of the same rows as two forwards of half the rows, on one stream one after the
other ("halves, serial") and on two streams ("halves, 2 streams"), and compares their hidden
states with the one-stream graph's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a smoke run: the halves' outputs only

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gpu_engine import (
    FullStepRecorder,
    probe_args,
    probe_engine,
    random_prompts,
    run_all,
    warm_up,
)

from baton_kernels.attention import AttentionMetadata


def half_metadata(graphs: Any, lo: int, hi: int) -> AttentionMetadata:
    """The metadata of rows ``lo:hi`` of the decode graphs' buffers."""
    n = hi - lo
    return AttentionMetadata(
        num_reqs=n, num_decodes=n, num_tokens=n, query_start_loc=list(range(n + 1)),
        seq_lens=[graphs.max_blocks_per_req] * n, block_tables=graphs.block_tables[lo:hi],
        slot_block=graphs.slot_block[lo:hi], slot_offset=graphs.slot_offset[lo:hi],
        decode_bias=None, max_decode_blocks=graphs.max_blocks_per_req,
        decode_seq_lens=graphs.seq_lens[lo:hi],
    )  # fmt: skip


def timed(replay: Callable[[], None], reps: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / reps


def main() -> None:
    args = probe_args(__doc__).parse_args()
    core, mc, params = probe_engine(args, attention_backend="triton")
    if args.device == "cpu":
        core.runner.enable_decode_graphs(capture=False)  # the graphs' buffers, run eagerly
    warm_up(core, mc, params)
    recorder = FullStepRecorder(core, args.batch)
    r = run_all(core, random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size), params)
    print(f"run: {sum(len(t) for t in r['tokens'].values()) / r['elapsed']:,.0f} tok/s")
    graphs = core.runner.graphs
    assert graphs is not None and recorder.last is not None
    b = graphs.padded_size(len(recorder.last["input_ids"]))
    assert b is not None
    ids, pos = graphs.input_ids[:b], graphs.positions[:b]
    h = b // 2
    md = (half_metadata(graphs, 0, h), half_metadata(graphs, h, b))
    forward = graphs.forward
    if args.device == "cpu":  # no graphs: the two halves against all rows, eagerly
        inputs = {k: v for k, v in recorder.last.items() if k not in ("patch", "host")}
        graphs.run(**inputs)
        want = graphs.forward(ids, pos, graphs._metadata[b]).clone()
        got = torch.cat([forward(ids[:h], pos[:h], md[0]), forward(ids[h:], pos[h:], md[1])])
        print(f"cpu: max |diff| of the halves' hidden states {(got - want).abs().max():.2e}")
        return
    one = recorder.replay_seconds() * 1e3  # also fills the buffers with that step's inputs
    graphs._graphs[False, b].replay()
    want = graphs._outputs[False, b].clone()
    main_stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    kept = []  # each graph alive to the end, with its own pool
    for name, two in (("halves, serial", False), ("halves, 2 streams", True)):
        with torch.cuda.stream(main_stream):
            for _ in range(2):  # warm up
                forward(ids[:h], pos[:h], md[0])
                forward(ids[h:], pos[h:], md[1])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        kept.append(graph)
        with torch.cuda.graph(graph, stream=main_stream):
            if two:
                side.wait_stream(main_stream)
            out_a = forward(ids[:h], pos[:h], md[0])
            with torch.cuda.stream(side if two else main_stream):
                out_b = forward(ids[h:], pos[h:], md[1])
            if two:
                main_stream.wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        got = torch.cat([out_a, out_b])
        diff = (got.float() - want.float()).abs().max().item()
        rows.append((name, timed(graph.replay), diff))
    print(f"{args.shape} {b} rows: graph ms, vs one stream, max |diff| of the hidden states")
    print(f"  {'one stream':20} {one:7.3f}")
    for name, ms, diff in rows:
        print(f"  {name:20} {ms:7.3f} {ms / one - 1:+7.1%} {diff:9.2e}")


if __name__ == "__main__":
    main()
