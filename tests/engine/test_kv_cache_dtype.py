"""``--kv-cache-dtype fp8`` (``fp8_e4m3``) and ``fp8_e5m2``: the KV cache stores K and V as 8-bit
floats (unit scale), so the same memory holds four times a float32 model's tokens (twice a
16-bit model's), and the model generates close to what it does with a cache of its own dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import forced_logprobs

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError
from baton_kernels.cpu_ops import load_cpu_ops

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NUM_TOKENS = 16
KV_MEMORY = 16 << 20


def run(model_dir: Path, kv_cache_dtype: str, forced: list[list[int]] | None = None) -> Any:
    """An engine with this cache: its greedy tokens for ``PROMPTS``, the logprobs it gives each
    token of ``forced`` (prompts with a continuation), its pool and its cache settings."""
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory=KV_MEMORY,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        tokenizer = llm.get_tokenizer()
        if forced is None:  # the prompts and this engine's own continuations
            forced = [tokenizer(p).input_ids + t for p, t in zip(PROMPTS, tokens, strict=True)]
        logprobs = forced_logprobs(llm, forced)
        core = llm.engine.core
        pool = core.kv_pool
        info = {**core.cache_config_info(), "backend": core.runner.backend.name}
        return tokens, forced, logprobs, pool.dtype, pool.shape[0], info
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> Any:
    return run(default_model_dir, "auto")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "mean_gap"),
    [("fp8", torch.float8_e4m3fn, 0.1), ("fp8_e5m2", torch.float8_e5m2, 0.2)],
)
def test_an_8bit_cache_holds_more_tokens_and_generates_close_to_the_models_dtype(
    default_model_dir: Path,
    reference: Any,
    kv_cache_dtype: str,
    dtype: torch.dtype,
    mean_gap: float,
) -> None:
    """Same memory, a quarter of the bytes a block (float32 -> 8 bits): four times the blocks.
    The prompts' continuations scored by both engines (teacher-forced, through prompt
    logprobs: prompt steps read the rounded K/V too) differ by ``mean_gap`` nats on average at
    most (measured: 0.04-0.05 with e4m3's 3 mantissa bits, 0.09 with e5m2's 2); with e4m3 the
    first 8 greedy tokens are the float32 cache's. On a CPU with the C++ kernels built, they
    write and read the 8-bit cache."""
    want_tokens, forced, want_logprobs, want_dtype, want_blocks, _ = reference
    assert want_dtype == torch.float32
    tokens, _, logprobs, got_dtype, blocks, info = run(default_model_dir, kv_cache_dtype, forced)
    assert got_dtype == dtype and info["cache_dtype"] == kv_cache_dtype
    assert blocks >= 4 * want_blocks and info["kv_cache_size_tokens"] == blocks * 16
    assert info["backend"] == ("cpu" if load_cpu_ops() is not None else "torch")
    for got, want in zip(logprobs, want_logprobs, strict=True):
        gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
        assert sum(gaps) / len(gaps) < mean_gap, gaps
    if dtype == torch.float8_e4m3fn:
        assert [t[:8] for t in tokens] == [t[:8] for t in want_tokens]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype 'fp8_inc' is not supported"),
        ({"kv_cache_dtype": "bfloat16"}, "needs a bfloat16 model, this one runs in torch.float32"),
    ],
)
def test_a_cache_dtype_baton_cannot_run_is_a_clear_error(
    default_model_dir: Path, settings: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        LLM(str(default_model_dir), dtype="float32", max_model_len=256, **settings)


def test_workers_whose_caches_differ_do_not_exchange_kv(default_model_dir: Path) -> None:
    """Disaggregation moves KV blocks as bytes: a prefill and a decode worker agree on what they
    mean (the handshake's compatibility hash) only if their caches have one dtype."""
    from baton_decode.server import engine_compat_hash
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore

    def compat(kv_cache_dtype: str) -> bytes:
        config = EngineConfig(
            model=str(default_model_dir), dtype="float32", max_model_len=256,
            kv_cache_memory=KV_MEMORY, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        return engine_compat_hash(EngineCore(config))

    fp8 = compat("fp8")
    assert fp8 == compat("fp8_e4m3")
    assert fp8 != compat("auto") and fp8 != compat("fp8_e5m2")
