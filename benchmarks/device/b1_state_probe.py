"""Why Qwen's batch-1 decode graph takes ~0.88 ms in a fresh process and ~0.97 ms after another
engine ran in it: GPU kernels of 5 batch-1 decode steps, first engine vs after a batch-256 run.

    python benchmarks/device/b1_state_probe.py
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent.parent))
from bench_gpu_engine import SHAPES, engine, random_prompts

from baton_engine.config import ModelConfig
from baton_engine.sampling_params import SamplingParams

args = argparse.Namespace(device="cuda", prompt_len=512, output_len=256, num_prompts=1)
model = SHAPES["qwen"]
vocab = ModelConfig.from_path(model).vocab_size
params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def b1(label: str) -> None:
    core = engine(model, args, max_num_seqs=1)
    core.add_request("x", random_prompts(1, 512, vocab)[0], params)
    for _ in range(40):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            core.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / 5
    print(
        f"--- {label}: {total:.0f} us of kernels per step, {sum(e.count for e in events) // 5} "
        "kernels"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / 5:8.1f} us  {e.count // 5:4d}x  {e.key[:90]}")
    core.abort_requests(["x"])
    del core
    gc.collect()
    torch.cuda.empty_cache()


b1("first engine in the process")
big = engine(model, argparse.Namespace(**{**vars(args), "num_prompts": 256}), max_num_seqs=256)
for i, p in enumerate(random_prompts(256, 512, vocab)):
    big.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
while big.has_unfinished_requests():
    big.step()
del big
gc.collect()
torch.cuda.empty_cache()
b1("after a batch-256 engine")
