"""Tensor parallelism on two GPUs: how long rank 0 takes to fail when a helper rank dies while
rank 0 waits for it in a collective (``tiny_models.helper_dies_mid_step``: the helper is stopped
mid-run, then killed), and how long the engine's shutdown takes after that.

    python benchmarks/device/tp_dead_helper.py [--tokenizer-dir DIR] [--runs 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))

from tiny_models import build_model, helper_dies_mid_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer-dir", default=".gpu/smollm2-shape")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (gloo) to try it here")
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp()) / "model"
    build_model("llama", Path(args.tokenizer_dir), model)
    for run in range(args.runs):  # each run a new engine in this process
        pool = {"num_gpu_blocks_override": 1024} if args.device == "cuda" else {}
        error, after_kill_s, shutdown_s = helper_dies_mid_step(model, device=args.device, **pool)
        print(f"run {run}: {error!r} {after_kill_s:.3f} s after the kill; "
              f"shutdown {shutdown_s:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
