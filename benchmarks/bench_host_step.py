"""Host time of a decode step on the GPU path, measured on any machine (issue 5: Qwen at 256 was
host-bound on the H200 until the eleventh session; the twenty-second found ~0.24 ms of slack a
step there, benchmarks/device/qwen256_bound.sh).

    python benchmarks/bench_host_step.py [--batch 256] [--steps 200] [--profile] [--bytecodes 20]
                                         [--num-scheduler-steps K]

The engine runs on the CPU with a tiny model; its decode steps go through ``DecodeGraphs`` (the
GPU path: persistent buffers, pending tokens patched in, argmax over the logits), but the
graph's forward returns a fixed hidden state instead of running the layers. What remains is
what the host does per step on a GPU: ``Scheduler.schedule``, the runner's input gathering and
launch, reading the sampled ids back and ``Scheduler.update_from_output``. Prints the median,
mean and maximum of each phase over ``--steps`` decode-only steps at full batch (async
scheduling, as on GPUs). The mean counts the steps in which the requests' blocks fill (every
16th, all requests at once in this lockstep workload): they allocate blocks and hash the full
ones for the prefix cache. With ``--num-scheduler-steps K`` a step runs K passes (multi-step
scheduling); "per pass" divides its time by the passes it ran.
Absolute figures depend on the CPU; compare variants in the same run or on the same machine.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.runner.cuda_graphs import DecodeGraphs
from baton_engine.sampling_params import SamplingParams

TIMES: dict[str, list[float]] = {}

# A small model: the LM head (computed here on the CPU, a kernel launch on a GPU) stays cheap.
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}


PHASE = ["other"]  # the timed phase running now (for --bytecodes)


def timed(obj: Any, name: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer, PHASE[0] = PHASE[0], name
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter() - start)
            PHASE[0] = outer

    setattr(obj, name, wrapper)


def count_bytecodes(core: EngineCore, steps: int) -> collections.Counter[str]:
    """Python bytecodes executed in ``steps`` decode steps, by phase: a measure of the host's
    Python work that does not depend on the CPU's speed (this VM's and the H200 host's vary by
    1.5x and more from run to run). Work in C (numpy, torch, the CPU kernels) is not counted."""
    counts: collections.Counter[str] = collections.Counter()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[PHASE[0]] += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    sys.settrace(tracer)
    try:
        for _ in range(steps):
            core.step()
    finally:
        sys.settrace(None)
    return counts


def build(batch: int, prompt_len: int, output_len: int, num_steps: int = 1) -> EngineCore:
    model = Path(tempfile.mkdtemp())
    (model / "config.json").write_text(json.dumps(MODEL))
    core = EngineCore(
        EngineConfig(
            model=str(model),
            load_format="dummy",
            dtype="bfloat16",
            device="cpu",
            max_model_len=prompt_len + output_len + 16,
            max_num_seqs=batch,
            max_num_batched_tokens=8192,
            num_gpu_blocks_override=batch * (-(-(prompt_len + output_len + 16) // 16) + 1),
            async_scheduling=True,
            num_scheduler_steps=num_steps,
            seed=0,
        )
    )
    runner = core.runner
    hidden = torch.zeros(batch, MODEL["hidden_size"], dtype=runner.dtype)
    runner.graphs = DecodeGraphs(
        lambda ids, pos, md: hidden[: ids.shape[0]],  # the layers' work is the GPU's
        max_batch_size=batch,
        max_blocks_per_req=-(runner.max_model_len // -runner.block_size),
        device=runner.device,
        capture=False,
    )
    return core


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="passes a decode step")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the steps")
    p.add_argument("--sort", default="tottime", help="the profile's order (pstats keys)")
    p.add_argument(
        "--bytecodes",
        type=int,
        default=0,
        metavar="N",
        help="then count the Python bytecodes of N more steps, by phase (speed-independent)",
    )
    args = p.parse_args()
    k = args.num_scheduler_steps
    output_len = (args.steps + args.bytecodes) * k + 64
    core = build(args.batch, args.prompt_len, output_len, k)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    vocab = int(MODEL["vocab_size"])
    for i in range(args.batch):
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
        core.add_request(f"r{i}", prompt, params)
    while core.scheduler.num_waiting or core.scheduler.running[-1].num_output_tokens < 2:
        core.step()  # the prompts (the tiny model's real forward), then the first decodes
    for name in ("schedule", "update_from_output"):
        timed(core.scheduler, name)
    for name in ("launch",):
        timed(core.runner, name)
    profiler = cProfile.Profile() if args.profile else None
    steps: list[float] = []
    per_pass: list[float] = []
    if profiler:
        profiler.enable()
    for _ in range(args.steps):
        start = time.perf_counter()
        outs = core.step()
        steps.append(time.perf_counter() - start)
        assert len(outs) == args.batch, "every step must be a full decode step"
        per_pass.append(steps[-1] * args.batch / sum(len(o.new_token_ids) for o in outs))
    if profiler:
        profiler.disable()
    print(f"decode steps at batch {args.batch}, over {args.steps} steps (ms):")
    print(f"  {'':21} {'median':>7} {'mean':>7} {'max':>7}")
    rows = {"whole step": steps, **({"whole step per pass": per_pass} if k > 1 else {}), **TIMES}
    for name, values in rows.items():
        ms = [v * 1e3 for v in values]
        median, mean = statistics.median(ms), statistics.mean(ms)
        print(f"  {name:<21} {median:7.3f} {mean:7.3f} {max(ms):7.3f}")
    if profiler:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(25)
    if args.bytecodes:
        counts = count_bytecodes(core, args.bytecodes)
        print(f"Python bytecodes per decode step (mean of {args.bytecodes}):")
        print(f"  {'whole step':<21} {sum(counts.values()) / args.bytecodes:9.0f}")
        for name in (*TIMES, "other"):  # other: reading the ids back, the engine's loop
            print(f"  {name:<21} {counts[name] / args.bytecodes:9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
