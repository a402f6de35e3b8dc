"""Tensor parallelism on CPU (gloo): an engine split two ways across processes generates what
the same model generates in one process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, greedy_tokens

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError

PROMPTS = [[10 + i for i in range(n)] for n in (5, 23, 40, 70)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on the split q/k/v
def test_two_ranks_generate_what_one_does(arch: str, default_model_dir: Path, tmp_path: Path):
    build_model(arch, default_model_dir, tmp_path)
    want = greedy_tokens(tmp_path, PROMPTS, 12, kv_cache_memory=1 << 24)
    # a small step budget: prompts in chunks, mixed with the others' decodes
    got = greedy_tokens(
        tmp_path,
        PROMPTS,
        12,
        kv_cache_memory=1 << 24,
        tensor_parallel_size=2,
        max_num_batched_tokens=32,
    )
    assert got == want


def test_a_model_that_does_not_split_evenly_is_refused(default_model_dir: Path, tmp_path: Path):
    build_model("llama", default_model_dir, tmp_path)  # 4 attention heads, 2 KV heads
    with pytest.raises(InvalidRequestError, match="does not divide the model's attention heads"):
        LLM(str(tmp_path), tensor_parallel_size=3)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has two GPUs")
def test_more_ranks_than_gpus_is_refused(default_model_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 2 needs 2 GPUs"):
        LLM(str(default_model_dir), device="cuda", tensor_parallel_size=2)


def test_a_dead_helper_rank_fails_the_engine_fast(default_model_dir: Path, tmp_path: Path):
    """A helper process that dies makes the next step raise a clear error instead of leaving
    rank 0 waiting in a collective."""
    build_model("llama", default_model_dir, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
              tensor_parallel_size=2)  # fmt: skip
    try:
        helper = llm.engine.core._tp._procs[0]  # type: ignore[union-attr]
        helper.kill()
        helper.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
