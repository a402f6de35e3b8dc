"""Tensor parallelism on two GPUs (NCCL, CUDA graphs with the all-reduces inside): greedy tokens
of a model split across cuda:0 and cuda:1 equal the one-GPU engine's (float32, a tiny model
made by transformers; the tokenizer is the default model's, or that of the folder named by
``BATON_TEST_MODEL`` on hosts without it)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, greedy_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = [[10 + i for i in range(n)] for n in (5, 23, 40, 70, 300)]


def _tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    folder = os.environ.get("BATON_TEST_MODEL")
    return Path(folder) if folder else request.getfixturevalue("default_model_dir")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_gpus_generate_what_one_does(
    arch: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    build_model(arch, _tokenizer_dir(request), tmp_path)
    engine = {"device": "cuda", "num_gpu_blocks_override": 1024}
    want = greedy_tokens(tmp_path, PROMPTS, 16, **engine)
    got = greedy_tokens(
        tmp_path, PROMPTS, 16, **engine, tensor_parallel_size=2, max_num_batched_tokens=64
    )
    assert got == want


def test_a_helper_that_dies_inside_a_collective_fails_the_engine_fast(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Rank 0 waiting in an NCCL all-reduce (inside a CUDA graph) for a helper that then dies
    gets a clear error within seconds, and the engine shuts down. In a process of its own:
    what this guards against is a hang."""
    model = tmp_path / "model"
    build_model("llama", _tokenizer_dir(request), model)
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from pathlib import Path\n"
        "from tiny_models import helper_dies_mid_step\n"
        "if __name__ == '__main__':\n"
        f"    got = helper_dies_mid_step(Path({str(model)!r}), device='cuda',\n"
        "                               num_gpu_blocks_override=1024)\n"
        "    print('RESULT', repr(got), flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    error, after_kill_s, shutdown_s = ast.literal_eval(lines[0].removeprefix("RESULT "))
    assert "tensor-parallel rank 1 is gone" in error
    assert after_kill_s < 30, after_kill_s
    assert shutdown_s < 60, shutdown_s
