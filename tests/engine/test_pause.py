"""Pausing (vLLM's ``pause_generation`` / ``resume_generation``, and sleep's modes) on the CPU:
a paused engine holds the requests added since (accepted, not scheduled) until it resumes;
those in flight go on, or, kept (mode "keep"), stop where they are with their KV and go on
after. Sleeping with keep frees the kept requests' blocks: woken, they compute their tokens
again and end as if nothing had happened. Every run gives the tokens of a run never paused.
(The workers' modes "abort" and "wait", and the HTTP endpoints:
``tests/integration/test_serve.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_async_scheduling import make_core

from baton_engine.core.engine_core import EngineCore
from baton_engine.errors import EngineBusyError, EngineSleepingError, InvalidRequestError
from baton_engine.llm import LLM
from baton_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = {f"r{i}": [(11 * i + 5 * j) % 1500 + 20 for j in range(30 + 25 * i)] for i in range(3)}


def step(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    for out in core.step():
        tokens.setdefault(out.req_id, []).extend(out.new_token_ids)


def finish(core: EngineCore, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        step(core, tokens)
    assert not core.has_unfinished_requests()
    core.check_invariants()
    return tokens


@pytest.fixture(scope="module")
def core(default_model_dir: Path) -> EngineCore:
    return make_core(default_model_dir, True, enable_sleep_mode=True)


@pytest.fixture(scope="module")
def reference(core: EngineCore) -> dict[str, list[int]]:
    """The tokens of each prompt, never paused."""
    for req_id, prompt in PROMPTS.items():
        core.add_request(req_id, prompt, GREEDY)
    return finish(core, {})


def computed(core: EngineCore) -> dict[str, int]:
    return {r.req_id: r.num_computed_tokens for r in core.scheduler.requests.values()}


def test_a_pause_holds_new_requests_and_lets_those_in_flight_finish(
    core: EngineCore, reference: dict[str, list[int]]
) -> None:
    """Paused: a request added since waits (counted as waiting, never scheduled) while the
    one in flight runs to its end; then the engine is drained, and a resume runs the held
    one. Aborting a held request removes it; the prefix cache resets with one held."""
    tokens: dict[str, list[int]] = {}
    core.add_request("r0", PROMPTS["r0"], GREEDY)
    step(core, tokens)
    core.pause()
    assert core.is_paused() and not core.drained()
    core.add_request("r1", PROMPTS["r1"], GREEDY)
    core.add_request("gone", PROMPTS["r2"], GREEDY)
    assert core.stats().num_waiting == 2
    core.abort_requests(["gone"])
    while core.has_schedulable_requests():
        step(core, tokens)
        assert "r1" not in tokens and computed(core)["r1"] == 0
        core.check_invariants()
    assert core.drained() and core.has_unfinished_requests()
    assert tokens["r0"] == reference["r0"]
    assert core.reset_prefix_cache()  # (the held request holds no blocks)
    core.resume()
    assert not core.is_paused()
    assert finish(core, tokens)["r1"] == reference["r1"]
    assert "gone" not in tokens


def test_keep_stops_the_requests_in_flight_where_they_are(
    core: EngineCore, reference: dict[str, list[int]]
) -> None:
    """Mode "keep": the step in flight reports, then nothing runs (empty steps change
    nothing, the blocks stay held); a request added meanwhile is held too; after resume each
    ends with the tokens of a run never paused."""
    tokens: dict[str, list[int]] = {}
    core.add_request("r0", PROMPTS["r0"], GREEDY)
    core.add_request("r1", PROMPTS["r1"], GREEDY)
    for _ in range(4):
        step(core, tokens)
    core.pause(keep=True)
    while core.has_schedulable_requests():  # (the step in flight)
        step(core, tokens)
    frozen, used = computed(core), core.kv.usage()
    so_far = {req_id: list(t) for req_id, t in tokens.items()}
    assert 0 < len(so_far["r0"]) < GREEDY.max_tokens and used > 0
    core.add_request("r2", PROMPTS["r2"], GREEDY)
    for _ in range(3):
        step(core, tokens)
    assert computed(core) == {**frozen, "r2": 0} and tokens == so_far
    assert core.kv.usage() == used and not core.drained()
    with pytest.raises(EngineBusyError, match="blocks are held"):
        core.reload_weights()  # (their KV came from these weights)
    core.resume()
    assert finish(core, tokens) == reference


def test_sleep_with_keep_frees_their_blocks_and_they_go_on_after_waking(
    core: EngineCore, reference: dict[str, list[int]]
) -> None:
    """vLLM's sleep(mode="keep"): the engine, paused with keep, sleeps with its requests (its
    pool's memory freed, their progress dropped); the weights woken and read again (vLLM's
    level-2 sequence) and the KV cache woken, the engine resumes by itself and each request
    computes its tokens again and ends as if never paused. Without the pause first, or with
    a step in flight, the sleep is refused."""
    tokens: dict[str, list[int]] = {}
    for req_id, prompt in PROMPTS.items():
        core.add_request(req_id, prompt, GREEDY)
    for _ in range(5):
        step(core, tokens)
    with pytest.raises(InvalidRequestError, match="pause the engine with keep first"):
        core.sleep(2, keep=True)
    core.pause(keep=True)
    with pytest.raises(EngineBusyError, match="in flight"):
        core.sleep(2, keep=True)  # (the step launched last has not reported)
    while core.has_schedulable_requests():
        step(core, tokens)
    preemptions = core.stats().num_preemptions
    core.sleep(2, keep=True)
    assert core.is_sleeping() and core.runner.kv_pool is not None
    assert core.runner.kv_pool.untyped_storage().nbytes() == 0
    assert core.kv.usage() == 0 and set(computed(core).values()) == {0}
    assert core.stats().num_preemptions == preemptions + core.scheduler.num_waiting > 0
    core.wake_up(["weights"])
    core.reload_weights()  # (the kept requests hold no blocks now)
    assert core.is_paused()
    core.wake_up(["kv_cache"])
    assert not core.is_paused() and not core.is_sleeping()
    assert finish(core, tokens) == reference


def test_level_0_only_pauses_until_wake_up(
    core: EngineCore, reference: dict[str, list[int]]
) -> None:
    """vLLM's sleep(level=0): a pause (nothing freed, not sleeping) that wake_up ends."""
    core.sleep(0)
    assert core.is_paused() and not core.is_sleeping()
    assert core.runner.kv_pool is not None and core.runner.kv_pool.untyped_storage().nbytes()
    core.add_request("r2", PROMPTS["r2"], GREEDY)
    assert not core.has_schedulable_requests()
    core.wake_up()
    assert not core.is_paused()
    assert finish(core, {})["r2"] == reference["r2"]


def test_offline_level_0_refuses_requests_until_woken(default_model_dir: Path) -> None:
    """An ``LLM`` has no requests in flight between calls: at level 0 a call would wait
    forever, so it is refused until ``wake_up``; an unknown mode is an error."""
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=8 << 20,
        enable_sleep_mode=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4)
    before = llm.generate(["Hello"], params)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="unknown mode 'later'"):
        llm.sleep(0, mode="later")
    llm.sleep(0, mode="keep")
    with pytest.raises(EngineSleepingError, match="paused"):
        llm.generate(["Hello"], params)
    assert not llm.is_sleeping()
    llm.wake_up()
    assert llm.generate(["Hello"], params)[0].outputs[0].token_ids == before


def test_kept_requests_give_their_rows_back_on_waking(default_model_dir: Path) -> None:
    """The runner forgets the requests sleep preempted at the first step after waking, not
    only once they are scheduled again: a better-ranked request held by the pause, admitted
    first, finds a row (two rows for two sequences here)."""
    core = make_core(
        default_model_dir,
        True,
        enable_sleep_mode=True,
        max_num_seqs=2,
        scheduling_policy="priority",
    )
    tokens: dict[str, list[int]] = {}
    core.add_request("r0", PROMPTS["r0"], GREEDY)
    core.add_request("r1", PROMPTS["r1"], GREEDY)
    for _ in range(3):
        step(core, tokens)
    core.pause(keep=True)
    core.add_request("first", PROMPTS["r2"], GREEDY, priority=-1)
    while core.has_schedulable_requests():
        step(core, tokens)
    core.sleep(1, keep=True)
    core.wake_up()
    finish(core, tokens)
    assert {r: len(t) for r, t in tokens.items()} == dict.fromkeys(["r0", "r1", "first"], 16)
