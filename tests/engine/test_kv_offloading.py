"""``--kv-offloading-size``: a host tier behind the prefix cache. A small pool evicts a long
prompt's blocks while another prompt runs; the tier keeps them, and when the first prompt comes
back its prefix is copied back instead of computed again. A prefix restored from the tier must
be the very KV the pool would have kept: the same request gives the same tokens and logprobs,
bit for bit, as on an engine whose pool is large enough to keep every block.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError

BLOCK_SIZE = 16
SMALL_POOL = 64  # blocks: one prompt's, not two
FIRST = "The history of the city, told by its river. " + " ".join(
    f"Fact {i}: the river carried {i} boats past the old mill." for i in range(45)
)
SECOND = "A recipe book for winter evenings. " + " ".join(
    f"Step {i}: stir the soup {i} times and add salt." for i in range(45)
)


def run(model_dir: Path, num_blocks: int, offload_gib: float | None, **kwargs: Any) -> Any:
    """FIRST, SECOND, then FIRST again, one at a time: the third's tokens and logprobs, each
    request's prompt tokens found cached, the prompts' lengths, the cache's hits (the pool's,
    the tier's queries and hits), its settings and its bytes a block."""
    llm = LLM(
        str(model_dir), max_model_len=1024, num_gpu_blocks_override=num_blocks,
        kv_offloading_size=offload_gib, **kwargs,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in (FIRST, SECOND, FIRST)]
        last = outs[-1].outputs[0]
        assert last.logprobs is not None
        logprobs = [{t: lp.logprob for t, lp in step.items()} for step in last.logprobs]
        core = llm.engine.core
        core.check_invariants()
        cached = [o.num_cached_tokens for o in outs]
        lengths = [len(o.prompt_token_ids) for o in outs]
        kv = core.kv
        hits = (kv.num_prefix_hits, kv.num_host_queries, kv.num_host_hits)
        info = {**core.cache_config_info(), "block_bytes": core.runner.kv_bytes_per_block()}
        return list(last.token_ids), logprobs, cached, lengths, hits, info
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"kv_cache_dtype": "fp8", "async_scheduling": True}],
    ids=["model-dtype", "fp8-cache-async"],
)
def test_a_prefix_the_pool_evicted_comes_back_from_the_host_tier(
    default_model_dir: Path, kwargs: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="baton_engine"):
        tokens, logprobs, cached, lengths, hits, info = run(
            default_model_dir, SMALL_POOL, 0.05, **kwargs
        )
    assert "KV offloading: a host tier of" in caplog.text
    num_first, num_second, _ = lengths
    assert num_first + num_second > SMALL_POOL * BLOCK_SIZE  # (the pool holds one of them)
    full = (num_first - 1) // BLOCK_SIZE * BLOCK_SIZE  # all but the block of the last token
    # The third request finds FIRST's whole prefix: the pool's head, the tier's the rest.
    assert cached == [0, 0, full]
    pool_hits, host_queries, host_hits = hits
    assert 0 < pool_hits < full and host_hits == full - pool_hits
    assert host_queries == 2 * num_first + num_second  # every admitted request's tokens
    assert info["num_cpu_blocks"] == int(0.05 * 2**30) // info["block_bytes"]

    # Without the tier, the small pool loses that part of the prefix ...
    _, _, cached_without, _, _, info_without = run(default_model_dir, SMALL_POOL, None, **kwargs)
    assert cached_without == [0, 0, pool_hits] and info_without["num_cpu_blocks"] == 0
    # ... and a pool that keeps everything finds the same prefix and gives the same output:
    # the tier's copy of the KV is exact.
    big_tokens, big_logprobs, big_cached, *_ = run(
        default_model_dir, 4 * SMALL_POOL, None, **kwargs
    )
    assert big_cached == [0, 0, full]
    assert tokens == big_tokens
    assert logprobs == big_logprobs


def test_bad_offloading_settings_are_clear_errors(default_model_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"lmcache.*not supported"):
        LLM(str(default_model_dir), kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(InvalidRequestError, match="needs prefix caching"):
        LLM(str(default_model_dir), kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(InvalidRequestError, match="at least 0"):
        LLM(str(default_model_dir), kv_offloading_size=-1)
    with pytest.raises(InvalidRequestError, match="holds no KV block"):
        LLM(str(default_model_dir), kv_offloading_size=1e-9, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="more than the host's available memory"):
        LLM(str(default_model_dir), kv_offloading_size=1 << 20, max_model_len=256)  # 1 PiB
