"""Tensor parallelism on two GPUs (NCCL, CUDA graphs with the all-reduces inside): greedy tokens
of a model split across cuda:0 and cuda:1 equal the one-GPU engine's (float32, a tiny model
made by transformers; the tokenizer is the default model's, or that of the folder named by
``BATON_TEST_MODEL`` on hosts without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, greedy_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

PROMPTS = [[10 + i for i in range(n)] for n in (5, 23, 40, 70, 300)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_gpus_generate_what_one_does(
    arch: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    folder = os.environ.get("BATON_TEST_MODEL")
    tokenizer_dir = Path(folder) if folder else request.getfixturevalue("default_model_dir")
    build_model(arch, tokenizer_dir, tmp_path)
    engine = {"device": "cuda", "num_gpu_blocks_override": 1024}
    want = greedy_tokens(tmp_path, PROMPTS, 16, **engine)
    got = greedy_tokens(
        tmp_path, PROMPTS, 16, **engine, tensor_parallel_size=2, max_num_batched_tokens=64
    )
    assert got == want
