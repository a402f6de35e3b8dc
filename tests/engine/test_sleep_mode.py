"""Sleep mode (vLLM's ``enable_sleep_mode``, ``LLM.sleep`` / ``wake_up``) on the CPU: an idle
engine drops its KV cache (and every cached prefix) and, at level 2, its weights; it refuses
requests until both parts are woken, then gives the tokens it gave before. Level 2 reads the
weights again from the model's files. (On a GPU level 1 copies the weights to host memory and
the CUDA graphs are captured again: ``tests/gpu/test_engine_gpu.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_async_scheduling import make_core

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.errors import EngineBusyError, EngineSleepingError, InvalidRequestError
from baton_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 2000 + 10 for j in range(40 + 30 * i)] for i in range(3)]


def run(core: EngineCore, tag: str) -> dict[int, list[int]]:
    """Each prompt of ``PROMPTS`` greedily: its tokens, by index."""
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"{tag}{i}", prompt, GREEDY)
    tokens: dict[int, list[int]] = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens.setdefault(int(out.req_id[len(tag) :]), []).extend(out.new_token_ids)
    core.check_invariants()
    return tokens


def weight_bytes(core: EngineCore) -> int:
    return sum(p.untyped_storage().nbytes() for p in core.runner.model.parameters())


@pytest.fixture(scope="module")
def core(default_model_dir: Path) -> EngineCore:
    return make_core(default_model_dir, False, enable_sleep_mode=True)


@pytest.fixture(scope="module")
def first(core: EngineCore) -> dict[int, list[int]]:
    return run(core, "first")


@pytest.mark.parametrize("level", [1, 2])
def test_a_woken_engine_gives_the_same_tokens(
    core: EngineCore, first: dict[int, list[int]], level: int
) -> None:
    """Asleep: the KV pool holds no memory, no prefix is cached, the weights are gone at level 2
    (kept at level 1: host memory is where they would go), requests are refused, also with
    the weights woken; woken, the same tokens, every prompt computed again."""
    assert core.kv.cached_hashes()
    weights = weight_bytes(core)
    core.sleep(level)
    assert core.is_sleeping() and core.sleep_level == level
    assert core.runner.kv_pool is not None
    assert core.runner.kv_pool.untyped_storage().nbytes() == 0
    assert not core.kv.cached_hashes()
    assert weight_bytes(core) == (weights if level == 1 else 0)
    with pytest.raises(EngineSleepingError, match="asleep"):
        core.add_request("x", PROMPTS[0], GREEDY)
    core.wake_up(["weights"])
    assert weight_bytes(core) == weights
    with pytest.raises(EngineSleepingError):
        core.add_request("x", PROMPTS[0], GREEDY)
    core.wake_up(["kv_cache"])
    assert not core.is_sleeping() and core.sleep_level == 0
    computed = core.num_prompt_tokens
    assert run(core, f"l{level}-") == first
    # (nothing came from the dropped cache: every prompt token computed again)
    assert core.num_prompt_tokens - computed == sum(map(len, PROMPTS))


def test_level_2_reads_the_weights_again_from_the_files(
    core: EngineCore, first: dict[int, list[int]]
) -> None:
    """Weights changed in memory come back as the checkpoint has them after level 2 (so an
    engine whose weights were overwritten can be reset), and stay changed after level 1."""
    head = core.runner.model.layers[0].self_attn.o_proj.weight
    with torch.no_grad():
        head.mul_(-1.0)
    assert core.reset_prefix_cache()  # (no prompt's KV from the old weights)
    changed = run(core, "changed")
    assert changed != first
    core.sleep(1)
    core.wake_up()
    assert run(core, "kept") == changed
    core.sleep(2)
    core.wake_up()
    assert run(core, "read") == first


def test_reload_weights_reads_the_checkpoint_in_place(
    core: EngineCore, first: dict[int, list[int]]
) -> None:
    """vLLM's ``collective_rpc("reload_weights")``: weights changed in memory are read again
    from the files (in place: the same tensors), and the prefix cache whose KV came from the
    changed weights is forgotten; in vLLM's level-2 sequence it fits between waking the weights
    and the KV cache. Asleep weights or a busy engine: clear errors."""
    weight = core.runner.model.layers[1].mlp.down_proj.weight
    address = weight.data_ptr()
    with torch.no_grad():
        weight.mul_(0.5)
    assert core.reset_prefix_cache()
    changed = run(core, "halved")
    assert changed != first and core.kv.cached_hashes()
    core.reload_weights()
    assert weight.data_ptr() == address and not core.kv.cached_hashes()
    assert run(core, "reloaded") == first
    core.sleep(2)
    with pytest.raises(InvalidRequestError, match=r"wake_up\(\['weights'\]\) first"):
        core.reload_weights()
    core.wake_up(["weights"])
    core.reload_weights()
    core.wake_up(["kv_cache"])
    assert run(core, "sequence") == first
    core.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError, match="unfinished"):
        core.reload_weights()
    core.abort_requests(["busy"])


def test_what_sleep_refuses(core: EngineCore, default_model_dir: Path) -> None:
    """Clear errors: an unknown level or tag, a request still running (it runs on, unharmed);
    sleeping or waking twice changes nothing; an engine without sleep mode refuses."""
    with pytest.raises(InvalidRequestError, match="1 or 2"):
        core.sleep(3)
    core.add_request("busy", PROMPTS[0], GREEDY)
    tokens = [t for out in core.step() for t in out.new_token_ids]
    with pytest.raises(InvalidRequestError, match="1 requests are unfinished"):
        core.sleep(1)
    assert not core.is_sleeping()
    while core.has_unfinished_requests():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert len(tokens) == GREEDY.max_tokens
    core.wake_up()  # (awake: nothing to do)
    core.sleep(1)
    core.sleep(2)  # (asleep already: stays at level 1)
    assert core.sleep_level == 1
    with pytest.raises(InvalidRequestError, match=r"unknown wake_up tags \['weight'\]"):
        core.wake_up(["weight"])
    core.wake_up()
    core.wake_up()
    assert not core.is_sleeping()
    plain = make_core(default_model_dir, False)
    with pytest.raises(InvalidRequestError, match="enable_sleep_mode=True"):
        plain.sleep()


def test_packed_weights_stay_at_level_2(default_model_dir: Path) -> None:
    """bf16 on a CPU with AVX512-BF16: the layers are packed for its kernels, which the
    checkpoint does not load into; level 2 keeps them and still frees the KV cache."""
    config = EngineConfig(
        model=str(default_model_dir), dtype="bfloat16", max_model_len=256,
        kv_cache_memory=32 << 20, enable_sleep_mode=True,
    )  # fmt: skip
    core = EngineCore(config)
    if not core.runner.packed_weights:
        pytest.skip("this CPU's kernels pack no weights")
    want = run(core, "a")
    core.sleep(2)
    assert core.runner.kv_pool is not None
    assert core.runner.kv_pool.untyped_storage().nbytes() == 0
    assert weight_bytes(core) > 0
    core.wake_up()
    assert run(core, "b") == want
    with pytest.raises(InvalidRequestError, match="packed"):
        core.reload_weights()


def test_a_draft_model_sleeps_with_the_model(default_model_dir: Path) -> None:
    """The model as its own draft: level 2 drops and reads again both models' weights and KV;
    woken, the same tokens, and nearly every draft kept (the draft's weights are right)."""
    spec = {"model": str(default_model_dir), "num_speculative_tokens": 3}
    core = make_core(default_model_dir, False, speculative_config=spec, enable_sleep_mode=True)
    want = run(core, "a")
    core.sleep(2)
    assert core.runner.draft is not None
    drafter = core.runner.draft.runner
    assert drafter.asleep == {"weights", "kv_cache"}
    assert sum(p.untyped_storage().nbytes() for p in drafter.model.parameters()) == 0
    core.wake_up()
    assert not drafter.asleep
    sched = core.scheduler
    drafted, kept = sched.num_draft_tokens, sched.num_accepted_tokens
    assert run(core, "b") == want
    assert (sched.num_accepted_tokens - kept) / (sched.num_draft_tokens - drafted) > 0.8
