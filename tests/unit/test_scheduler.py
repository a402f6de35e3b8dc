"""Scheduler with a fake model runner: token budget, chunking, ordering, preemption, prefix hits,
aborts and stop conditions. No model, no torch."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from baton_engine.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from baton_engine.core.scheduler import Scheduler
from baton_engine.errors import InvalidRequestError
from baton_engine.kv_cache import KVCacheManager
from baton_engine.pooling_params import PoolingParams
from baton_engine.request import Request, RequestStatus
from baton_engine.sampling_params import SamplingParams

SAMPLED_TOKEN = 7  # what the fake runner samples unless told otherwise
ABORTED = RequestStatus.FINISHED_ABORTED
TokenFn = Callable[[Request], int]  # the request (before its new token) -> the token it samples


# --- factories and the fake runner --------------------------------------------------------------


def make_scheduler(
    *,
    num_blocks: int = 256,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 4096,
    long_prefill_token_threshold: int = 0,
    enable_caching: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,
    )


def make_request(
    req_id: str,
    token_ids: Sequence[int],
    *,
    max_tokens: int = 4,
    params: SamplingParams | None = None,
    eos_token_ids: tuple[int, ...] = (),
    priority: int = 0,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(token_ids),
        sampling_params=params or SamplingParams(max_tokens=max_tokens),
        eos_token_ids=eos_token_ids,
        max_tokens=max_tokens,
        priority=priority,
    )


def make_requests(
    n: int,
    num_tokens: int | Sequence[int],
    *,
    max_tokens: int = 4,
    priorities: Sequence[int] | None = None,
) -> list[Request]:
    """``n`` requests ``r0, r1, ...`` with unrelated prompts (no accidental prefix hits), in
    arrival order."""
    lengths = [num_tokens] * n if isinstance(num_tokens, int) else list(num_tokens)
    return [
        make_request(
            f"r{i}",
            range(10_000 * (i + 1), 10_000 * (i + 1) + lengths[i]),
            max_tokens=max_tokens,
            priority=priorities[i] if priorities is not None else 0,
        )
        for i in range(n)
    ]


def fake_runner(
    scheduler: Scheduler, so: SchedulerOutput, token_fn: TokenFn | None = None
) -> ModelRunnerOutput:
    """Sample one token for every scheduled request whose prefill completes this step."""
    sampled: dict[str, int] = {}
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled[req_id] = token_fn(request) if token_fn is not None else SAMPLED_TOKEN
    return ModelRunnerOutput(sampled_token_ids=sampled)


@dataclass
class Run:
    """What a run produced: every step's SchedulerOutput and every request's outputs."""

    steps: list[SchedulerOutput] = field(default_factory=list)
    running_before: list[list[str]] = field(default_factory=list)  # per step, in admission order
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> sampled tokens
    finish_reasons: dict[str, str] = field(default_factory=dict)  # req_id -> finish reason
    outputs: list[EngineCoreOutput] = field(default_factory=list)  # in order, all steps
    step_outputs: list[list[EngineCoreOutput]] = field(default_factory=list)  # per step


def step(
    scheduler: Scheduler,
    run: Run,
    token_fn: TokenFn | None = None,
    forward: Callable[[SchedulerOutput], None] | None = None,
) -> SchedulerOutput:
    """schedule(), the fake runner (``forward`` stands in for the forward pass), update."""
    run.running_before.append([r.req_id for r in scheduler.running])
    so = scheduler.schedule()
    scheduler.check_invariants()
    if forward is not None:
        forward(so)
    outputs = scheduler.update_from_output(so, fake_runner(scheduler, so, token_fn))
    scheduler.check_invariants()
    run.steps.append(so)
    for out in outputs:
        assert out.req_id not in run.finish_reasons, f"{out.req_id} produced after finishing"
        run.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        if out.finish_reason is not None:
            run.finish_reasons[out.req_id] = out.finish_reason
    run.outputs.extend(outputs)
    run.step_outputs.append(outputs)
    return so


def run_until_done(
    scheduler: Scheduler,
    token_fn: TokenFn | None = None,
    forward: Callable[[SchedulerOutput], None] | None = None,
    *,
    run: Run | None = None,
    max_steps: int = 2000,
) -> Run:
    run = run if run is not None else Run()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return run
        step(scheduler, run, token_fn, forward)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def add_all(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)


# --- the token budget and chunked prefill --------------------------------------------------------


def test_token_budget_is_respected_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    requests = make_requests(8, [10, 200, 33, 64, 1, 95, 17, 128], max_tokens=5)
    add_all(scheduler, requests)
    run = run_until_done(scheduler)
    for so in run.steps:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= 64
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
    # Every prompt token and every output but the last is computed exactly once.
    total = sum(so.total_num_scheduled_tokens for so in run.steps)
    assert total == sum(r.num_prompt_tokens + 4 for r in requests)
    assert run.finish_reasons == {r.req_id: "length" for r in requests}
    assert all(len(run.tokens[r.req_id]) == 5 for r in requests)
    assert scheduler.kv.num_free_blocks == 256


def test_long_prompt_is_chunked_by_the_threshold() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    (request,) = make_requests(1, 100, max_tokens=2)
    scheduler.add_request(request)
    run = run_until_done(scheduler)
    assert [so.num_scheduled_tokens["r0"] for so in run.steps] == [24, 24, 24, 24, 4, 1]
    assert sum(so.num_scheduled_tokens["r0"] for so in run.steps[:5]) == 100
    # Only the last chunk samples a token.
    assert [len(outputs) for outputs in run.step_outputs] == [0, 0, 0, 0, 1, 1]
    assert run.tokens["r0"] == [SAMPLED_TOKEN, SAMPLED_TOKEN]


def test_long_prompts_are_chunked_by_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    add_all(scheduler, make_requests(2, 100, max_tokens=3))
    run = run_until_done(scheduler)
    assert [dict(so.num_scheduled_tokens) for so in run.steps] == [
        {"r0": 64},
        {"r0": 36, "r1": 28},
        {"r0": 1, "r1": 63},
        {"r0": 1, "r1": 9},
        {"r1": 1},
        {"r1": 1},
    ]
    # The runner sees each prefill chunk's start.
    assert [c.num_computed_tokens for c in run.steps[1].scheduled_cached_reqs] == [64]
    assert [n.num_computed_tokens for n in run.steps[1].scheduled_new_reqs] == [0]
    assert [c.num_computed_tokens for c in run.steps[2].scheduled_cached_reqs] == [100, 28]


def test_running_requests_are_scheduled_before_waiting_ones() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    a, b = make_requests(2, 64, max_tokens=3)
    run = Run()
    scheduler.add_request(a)
    assert dict(step(scheduler, run).num_scheduled_tokens) == {"r0": 32}
    scheduler.add_request(b)
    so = step(scheduler, run)  # a's second chunk takes the whole budget: b must wait
    assert dict(so.num_scheduled_tokens) == {"r0": 32}
    assert so.scheduled_new_reqs == []
    assert scheduler.num_waiting == 1 and b.status == RequestStatus.WAITING
    so = step(scheduler, run)
    assert list(so.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 31)]
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["r0"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r1"]
    assert so.scheduled_new_reqs[0].block_ids == [5, 6]  # r0 just took block 4 for its decode


def test_max_num_seqs_is_respected() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    add_all(scheduler, make_requests(5, 20, max_tokens=3))
    run = run_until_done(scheduler)
    for so in run.steps:
        assert len(so.num_scheduled_tokens) <= 2
    assert [sorted(so.num_scheduled_tokens) for so in run.steps[:4]] == [
        ["r0", "r1"],
        ["r0", "r1"],
        ["r0", "r1"],
        ["r2", "r3"],
    ]
    assert len(run.finish_reasons) == 5


# --- preemption ---------------------------------------------------------------------------------


def _token_for(request: Request) -> int:
    """A deterministic token per (request, position): recompute must not repeat or skip any."""
    return int(request.req_id[1:]) * 100 + request.num_output_tokens


def test_preemption_under_a_tiny_pool() -> None:
    # 10 blocks of 4 tokens; each request needs 5 blocks by the end, 30 in all.
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=256)
    requests = make_requests(6, 8, max_tokens=12)
    add_all(scheduler, requests)
    run = run_until_done(scheduler, _token_for)

    assert scheduler.num_preemptions > 0
    assert sum(len(so.preempted_req_ids) for so in run.steps) == scheduler.num_preemptions
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    for so, running in zip(run.steps, run.running_before, strict=True):
        num = len(so.preempted_req_ids)
        if num:
            # The most recently admitted running requests are the victims, and nothing is
            # admitted in a step that had to preempt.
            assert so.preempted_req_ids == frozenset(running[len(running) - num :])
            assert so.scheduled_new_reqs == []
            assert not so.preempted_req_ids & set(so.num_scheduled_tokens)
    for request in requests:
        expected = [int(request.req_id[1:]) * 100 + i for i in range(12)]
        assert run.tokens[request.req_id] == expected
        assert request.output_token_ids == expected
        assert run.finish_reasons[request.req_id] == "length"
    assert any(r.num_preemptions for r in requests)
    assert scheduler.kv.num_free_blocks == 10


def test_preempted_request_resumes_with_its_outputs() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=256)
    requests = make_requests(6, 8, max_tokens=12)
    add_all(scheduler, requests)
    run = Run()
    resumed = []
    while scheduler.has_unfinished_requests():
        so = step(scheduler, run, _token_for)
        resumed += [n for n in so.scheduled_new_reqs if n.output_token_ids]
    assert resumed, "no preempted request was resumed"
    for new in resumed:
        # Prompt and outputs so far are recomputed (minus what the prefix cache still holds).
        assert len(new.block_ids) * 4 >= len(new.prompt_token_ids) + len(new.output_token_ids)
        assert new.num_computed_tokens % 4 == 0


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=256)
    a, b = make_requests(2, 8, max_tokens=4)
    add_all(scheduler, [a, b])
    run = Run()
    assert dict(step(scheduler, run).num_scheduled_tokens) == {"r0": 8, "r1": 8}
    so = step(scheduler, run)  # both need a third block: b goes, then a grows
    assert so.preempted_req_ids == frozenset({"r1"})
    assert dict(so.num_scheduled_tokens) == {"r0": 1}
    assert scheduler.waiting[0] is b and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    run_until_done(scheduler)


# --- priority scheduling ------------------------------------------------------------------------


def _admitted(run: Run) -> list[str]:
    return [new.req_id for so in run.steps for new in so.scheduled_new_reqs]


def test_waiting_requests_go_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    requests = make_requests(6, 8, max_tokens=2, priorities=[1, 0, 1, -3, 0, -1])
    add_all(scheduler, requests[:5])
    assert [r.req_id for r in scheduler.waiting] == ["r3", "r1", "r4", "r0", "r2"]
    run = Run()
    step(scheduler, run)
    scheduler.add_request(requests[5])  # arrives last, goes ahead of all that wait
    run_until_done(scheduler, run=run)
    assert _admitted(run) == ["r3", "r5", "r1", "r4", "r0", "r2"]
    assert run.finish_reasons == {r.req_id: "length" for r in requests}


def test_fcfs_refuses_a_priority() -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled"):
        scheduler.add_request(make_request("a", [1, 2, 3], priority=1))
    assert not scheduler.requests and not scheduler.waiting
    scheduler.add_request(make_request("b", [1, 2, 3], priority=0))
    assert run_until_done(scheduler).finish_reasons == {"b": "length"}
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        make_scheduler(scheduling_policy="lifo")


def test_preemption_takes_the_lowest_priority_running_request() -> None:
    # 6 blocks of 4 tokens. r0, the lowest priority, runs first; r1 and r2 join it, and their
    # three 7-token prompts then fill the pool.
    scheduler = make_scheduler(num_blocks=6, block_size=4, scheduling_policy="priority")
    requests = make_requests(3, 7, max_tokens=8, priorities=[2, 0, 1])
    rank = {r.req_id: (r.priority, r.arrival_time) for r in requests}
    run = Run()
    scheduler.add_request(requests[0])
    step(scheduler, run, _token_for)
    add_all(scheduler, requests[1:])
    so = step(scheduler, run, _token_for)
    assert list(so.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 7), ("r2", 7)]
    so = step(scheduler, run, _token_for)
    # r0 needs a third block: it is the one preempted, though it came first (fcfs would
    # preempt r2, the last admitted, for it).
    assert so.preempted_req_ids == frozenset({"r0"})
    assert list(so.num_scheduled_tokens.items()) == [("r1", 1), ("r2", 1)]
    assert requests[0].status == RequestStatus.PREEMPTED
    assert requests[0].num_computed_tokens == 0
    run_until_done(scheduler, _token_for, run=run)
    assert scheduler.num_preemptions > 1
    for so, running in zip(run.steps, run.running_before, strict=True):
        num = len(so.preempted_req_ids)
        if num:  # the victims are the worst-ranked running requests
            assert so.preempted_req_ids == frozenset(sorted(running, key=lambda r: rank[r])[-num:])
    for request in requests:
        expected = [int(request.req_id[1:]) * 100 + i for i in range(8)]
        assert run.tokens[request.req_id] == expected
    assert scheduler.kv.num_free_blocks == 6


@pytest.mark.parametrize("num_blocks", [4, 5], ids=["no-free-block", "one-free-block"])
def test_a_lower_priority_request_gives_way_though_it_came_first(num_blocks: int) -> None:
    """Two 8-token prompts in blocks of 4, both about to need a third block: b (priority 0)
    preempts a (priority 1), or takes the one free block, and a then preempts itself (the
    scheduler stops there)."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, scheduling_policy="priority")
    a, b = make_requests(2, 8, max_tokens=4, priorities=[1, 0])
    add_all(scheduler, [a, b])
    run = Run()
    step(scheduler, run)
    so = step(scheduler, run)
    assert so.preempted_req_ids == frozenset({"r0"})
    assert dict(so.num_scheduled_tokens) == {"r1": 1}
    assert a.status == RequestStatus.PREEMPTED and scheduler.running == [b]
    run_until_done(scheduler, run=run)
    assert run.finish_reasons == {"r0": "length", "r1": "length"}


def test_a_preempted_request_waits_at_its_priority() -> None:
    """Under fcfs a preempted request goes back to the front of the queue; under priority it
    waits behind the better-ranked requests that arrived since."""
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, max_num_seqs=2, scheduling_policy="priority"
    )
    a, b, c = make_requests(3, 8, max_tokens=4, priorities=[2, 1, 0])
    add_all(scheduler, [a, b])
    run = Run()
    step(scheduler, run)
    scheduler.add_request(c)  # waits: two requests run already
    so = step(scheduler, run)  # b takes the free block, a preempts itself
    assert so.preempted_req_ids == frozenset({"r0"})
    assert list(scheduler.waiting) == [c, a]
    so = step(scheduler, run)
    assert [new.req_id for new in so.scheduled_new_reqs] == ["r2"]  # into a's freed blocks
    run_until_done(scheduler, run=run)
    assert run.finish_reasons == {"r0": "length", "r1": "length", "r2": "length"}


@pytest.mark.parametrize("ok", [True, False], ids=["pulled", "pull-failed"])
def test_priority_after_a_remote_kv_load(ok: bool) -> None:
    """A request whose remote KV landed holds its blocks: it goes to the front, as under fcfs.
    One whose pull failed must compute its prompt: it waits at its priority."""
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    remote = Request(
        req_id="remote",
        prompt_token_ids=list(range(100, 108)),
        sampling_params=SamplingParams(max_tokens=3),
        max_tokens=3,
        output_token_ids=[SAMPLED_TOKEN],  # the prefill worker's first token
        remote_kv="kv handle",
        priority=1,
    )
    scheduler.add_request(remote)
    run = Run()
    step(scheduler, run)
    (load,) = scheduler.take_kv_loads()
    assert load.req_id == "remote" and scheduler.num_loading == 1
    better, worse = make_requests(2, 8, max_tokens=3, priorities=[0, 2])
    add_all(scheduler, [better, worse])  # wait: the load holds the one seat
    assert step(scheduler, run).is_empty
    scheduler.finish_kv_load("remote", ok)
    first = remote if ok else better
    assert scheduler.waiting[0] is first
    so = step(scheduler, run)
    assert [new.req_id for new in so.scheduled_new_reqs] == [first.req_id]
    assert so.num_scheduled_tokens[first.req_id] == (1 if ok else 8)
    run_until_done(scheduler, run=run)
    assert run.finish_reasons == {"remote": "length", "r0": "length", "r1": "length"}
    assert scheduler.kv.num_free_blocks == 256


def test_first_scheduled_marks_each_request_once() -> None:
    """Where a request's queue time ends (vLLM's request_queue_time_seconds): the step that
    first admits it, to compute or to load its remote KV; not a resumption after preemption,
    nor the admission after its load."""
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3)
    requests = make_requests(6, 8, max_tokens=12)  # three seats, a pool for two by the end
    add_all(scheduler, requests)
    marked: list[str] = []
    run = Run()
    while scheduler.has_unfinished_requests():
        so = step(scheduler, run, _token_for)
        firsts = [req_id for req_id, _ in scheduler.first_scheduled]
        new = {n.req_id for n in so.scheduled_new_reqs if not n.output_token_ids}
        assert set(firsts) == new - set(marked)
        marked += firsts
    assert scheduler.num_preemptions > 0  # (resumptions were not marked again)
    assert marked == [r.req_id for r in requests]  # fcfs: in arrival order
    times = [when for _, when in scheduler.first_scheduled]
    assert times == sorted(times)

    remote = Request(
        req_id="remote",
        prompt_token_ids=list(range(100, 108)),
        sampling_params=SamplingParams(max_tokens=3),
        max_tokens=3,
        output_token_ids=[SAMPLED_TOKEN],
        remote_kv="kv handle",
    )
    scheduler.add_request(remote)
    step(scheduler, run)
    assert [req_id for req_id, _ in scheduler.first_scheduled] == ["remote"]  # its load starts
    scheduler.take_kv_loads()
    scheduler.finish_kv_load("remote", True)
    step(scheduler, run)
    assert scheduler.first_scheduled == []  # its admission after the load is not a first


# --- prefix caching -----------------------------------------------------------------------------


def test_host_tier_hits_reach_the_step_as_copies_and_shorten_a_remote_load() -> None:
    """With a host tier, a prefix the pool evicted is admitted as computed: the step carries
    the saves (as the pool evicts) and then the loads into the new blocks; a request whose
    prompt KV is remote pulls only the blocks after the tier's."""
    scheduler = Scheduler(
        KVCacheManager(5, 16, num_host_blocks=16),  # one prompt's blocks
        max_num_seqs=4, max_num_batched_tokens=512, max_model_len=80,
    )  # fmt: skip
    run = Run()
    first, second = list(range(1000, 1070)), list(range(2000, 2070))  # 4 full blocks and 6
    for req_id, prompt in (("a", first), ("b", second)):
        scheduler.add_request(make_request(req_id, prompt, max_tokens=1))
        so = step(scheduler, run)
    assert [c.to_host for c in so.kv_copies] == [True] * 4  # b evicted a's full blocks
    scheduler.add_request(make_request("a2", [*first, 7], max_tokens=1))
    so = step(scheduler, run)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 64 and dict(so.num_scheduled_tokens) == {"a2": 7}
    loads = [c for c in so.kv_copies if not c.to_host]
    assert [c.block_id for c in loads] == new.block_ids[:4]
    assert [c.to_host for c in so.kv_copies] == [True] * 4 + [False] * 4  # (b's, then a's)
    assert scheduler.kv.num_host_hits == 64

    remote = Request(  # b's prefix, in the tier now
        req_id="remote",
        prompt_token_ids=[*second[:64], *range(3000, 3010)],
        sampling_params=SamplingParams(max_tokens=3),
        max_tokens=3,
        output_token_ids=[SAMPLED_TOKEN],
        remote_kv="kv handle",
    )
    scheduler.add_request(remote)
    so = step(scheduler, run)
    (load,) = scheduler.take_kv_loads()
    found = remote.num_cached_tokens // 16
    assert found == 4 and load.first_block == found
    table = scheduler.kv.get_block_ids("remote")
    assert load.local_block_ids == table[found:]
    assert [(c.to_host, c.block_id) for c in so.kv_copies if not c.to_host] == [
        (False, b) for b in table[:found]
    ]
    scheduler.finish_kv_load("remote", True)
    step(scheduler, run)
    scheduler.check_invariants()


def _shared_prefix_requests() -> tuple[Request, Request]:
    prefix = list(range(1000, 1048))
    return (
        make_request("a", [*prefix, *range(1, 11)]),
        make_request("b", [*prefix, *range(101, 111)]),
    )


def test_prefix_hit_schedules_fewer_tokens() -> None:
    scheduler = make_scheduler()
    a, b = _shared_prefix_requests()
    run = Run()
    scheduler.add_request(a)
    assert dict(step(scheduler, run).num_scheduled_tokens) == {"a": 58}
    scheduler.add_request(b)
    so = step(scheduler, run)
    assert dict(so.num_scheduled_tokens) == {"a": 1, "b": 10}
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 48
    assert new.block_ids[:3] == scheduler.kv.get_block_ids("a")[:3] == [0, 1, 2]
    assert b.num_cached_tokens == 48
    assert scheduler.kv.num_prefix_hits == 48
    assert scheduler.kv.num_prefix_queries == 116
    rest = run_until_done(scheduler)
    assert {o.num_cached_tokens for o in run.outputs + rest.outputs if o.req_id == "b"} == {48}


def test_prefix_hit_within_one_step() -> None:
    """Blocks are indexed when scheduled, so a request admitted later in the step shares them."""
    scheduler = make_scheduler()
    a, b = _shared_prefix_requests()
    add_all(scheduler, [a, b])
    so = step(scheduler, Run())
    assert dict(so.num_scheduled_tokens) == {"a": 58, "b": 10}
    assert scheduler.kv.num_prefix_hits == 48


def test_decode_steps_grow_and_index_blocks_as_they_fill() -> None:
    """Most decode steps skip the KV manager (the request's blocks have room, ``kv_limit``);
    the step that needs a new block still gets it, and a block that decode tokens fill is
    indexed in that step, so a later request with the same tokens hits it."""
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", range(100, 105), max_tokens=14)
    scheduler.add_request(a)
    run = Run()
    probes = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, run, token_fn=lambda r: 200 + r.num_output_tokens)
        if a.is_finished():
            break
        assert len(scheduler.kv.get_block_ids("a")) * 4 >= a.num_computed_tokens
        probe = make_request(f"p{probes}", [*a.all_token_ids, 999], max_tokens=1)
        probes += 1
        hit = scheduler.kv.match_prefix(probe).num_cached_tokens
        scheduler.kv.forget(probe)
        assert hit == min(a.num_computed_tokens, a.num_tokens) // 4 * 4
    assert run.tokens["a"] == [200 + i for i in range(14)]
    assert probes == 13 and scheduler.kv.num_free_blocks == 256


def test_running_ahead_indexes_each_filled_block_with_one_kv_call() -> None:
    """With async scheduling (each step scheduled before the previous step's token is back), a
    block that decode tokens fill is indexed by the next step, and the KV manager is called
    once per block: at the step that fills a block its last token is still pending."""
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", range(100, 105), max_tokens=30)
    scheduler.add_request(a)
    calls = 0
    allocate = scheduler.kv.allocate_slots

    def counted(*args: Any, **kwargs: Any) -> list[int] | None:
        nonlocal calls
        calls += 1
        return allocate(*args, **kwargs)

    scheduler.kv.allocate_slots = counted  # type: ignore[method-assign]
    tokens: list[int] = []
    in_flight = scheduler.schedule()
    while in_flight is not None:
        ahead = None if a.num_output_tokens + a.num_pending_tokens >= 30 else scheduler.schedule()
        if ahead is not None:  # it ran ahead: the token it decodes from is still pending
            assert a.num_pending_tokens == 2
        outputs = scheduler.update_from_output(
            in_flight, ModelRunnerOutput(sampled_token_ids={"a": 200 + len(tokens)})
        )
        tokens += [t for out in outputs for t in out.new_token_ids]
        in_flight = ahead
        known_full = min(a.num_computed_tokens, a.num_tokens) // 4
        probe = make_request(f"p{len(tokens)}", [*a.all_token_ids, 999], max_tokens=1)
        hit = scheduler.kv.match_prefix(probe).num_cached_tokens
        scheduler.kv.forget(probe)
        assert hit // 4 >= known_full - 1  # at most the block just filled is not indexed yet
    assert tokens == [200 + i for i in range(30)] and a.is_finished()
    # 34 tokens computed, in 9 blocks: at most one call per block (it was 15 calls).
    assert calls <= 9


def test_no_prefix_hits_without_caching() -> None:
    scheduler = make_scheduler(enable_caching=False)
    a, b = _shared_prefix_requests()
    add_all(scheduler, [a, b])
    assert dict(step(scheduler, Run()).num_scheduled_tokens) == {"a": 58, "b": 58}
    assert scheduler.kv.num_prefix_hits == 0


# --- aborts -------------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks_and_reports_ids() -> None:
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=1)
    a, b = make_requests(2, 40, max_tokens=10)
    add_all(scheduler, [a, b])
    run = Run()
    step(scheduler, run)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert scheduler.kv.num_free_blocks == 13
    scheduler.finish_requests(["r0", "r1", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.num_free_blocks == 16
    assert scheduler.kv.get_block_ids("r0") == []
    assert (a.status, b.status) == (RequestStatus.FINISHED_ABORTED,) * 2
    assert not scheduler.has_unfinished_requests()
    scheduler.check_invariants()
    so = scheduler.schedule()
    assert so.finished_req_ids == frozenset({"r0", "r1"})
    assert so.is_empty
    assert scheduler.schedule().finished_req_ids == frozenset()


def test_abort_between_schedule_and_update_drops_the_token() -> None:
    scheduler = make_scheduler()
    (a,) = make_requests(1, 20)
    scheduler.add_request(a)
    so = scheduler.schedule()
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(so, ModelRunnerOutput({"r0": 5})) == []
    assert a.output_token_ids == []
    assert scheduler.schedule().finished_req_ids == frozenset({"r0"})
    scheduler.check_invariants()


def test_finished_requests_are_reported_once() -> None:
    scheduler = make_scheduler()
    add_all(scheduler, make_requests(2, 10, max_tokens=1))
    run = Run()
    step(scheduler, run)
    assert run.finish_reasons == {"r0": "length", "r1": "length"}
    assert scheduler.kv.num_free_blocks == 256
    assert step(scheduler, run).finished_req_ids == frozenset({"r0", "r1"})


def test_an_embedding_request_ends_with_its_prompt() -> None:
    """Chunked like any prompt; the step that computes its last chunk reports the runner's
    pooled vector and no token, and a step scheduled before that report (async scheduling)
    does not run it again."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    embedding = Request("e", list(range(100, 140)), SamplingParams(max_tokens=1), max_tokens=1,
                        pooling=PoolingParams())  # fmt: skip
    (other,) = make_requests(1, 4, max_tokens=8)
    add_all(scheduler, [embedding, other])
    assert scheduler.num_embeddings == 1
    for _ in range(2):  # 16 + 16 of its 40 prompt tokens
        so = scheduler.schedule()
        assert so.num_scheduled_tokens == {"e": 16}
        assert scheduler.update_from_output(so, ModelRunnerOutput({})) == []
    last = scheduler.schedule()
    assert last.num_scheduled_tokens == {"e": 8, "r0": 4}
    ahead = scheduler.schedule()  # before `last` is reported: only r0 runs on
    assert ahead.num_scheduled_tokens == {"r0": 1}
    outputs = scheduler.update_from_output(
        last, ModelRunnerOutput({"e": 5, "r0": 6}, pooled={"e": [0.6, 0.8]})
    )
    (out,) = [o for o in outputs if o.req_id == "e"]
    assert out.pooled == [0.6, 0.8] and out.new_token_ids == [] and out.finish_reason == "stop"
    assert scheduler.num_embeddings == 0 and "e" not in scheduler.requests
    scheduler.update_from_output(ahead, ModelRunnerOutput({"r0": 6}))
    scheduler.check_invariants()


def test_max_loras_holds_back_other_adapters() -> None:
    """At most ``max_loras`` adapters among the running requests: a waiting request with
    another adapter is passed over (base-model and same-adapter requests behind it go ahead)
    and admitted, first, once an adapter's requests are done; equal prompts under different
    adapters share no cached block."""
    scheduler = Scheduler(
        KVCacheManager(256, 16, True),
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_model_len=4096,
        max_loras=1,
    )
    prompt = list(range(100, 148))
    adapters = {"a0": "x", "b0": "y", "a1": "x", "base": None, "b1": "y"}
    requests = [
        Request(rid, prompt, SamplingParams(max_tokens=3), max_tokens=3 if rid != "a0" else 5,
                lora_name=lora)
        for rid, lora in adapters.items()
    ]  # fmt: skip
    add_all(scheduler, requests)
    assert scheduler.lora_refs == {"x": 2, "y": 2}
    run = run_until_done(scheduler)
    assert run.finish_reasons == {rid: "length" for rid in adapters}
    first = set(run.steps[0].num_scheduled_tokens)
    assert first == {"a0", "a1", "base"}  # b0 and b1 wait for "x" to be done
    for so in run.steps:
        names = {adapters[r] for r in so.num_scheduled_tokens} - {None}
        assert len(names) <= 1
    admitted = [[n.req_id for n in so.scheduled_new_reqs] for so in run.steps]
    assert ["b0", "b1"] in admitted  # in their order, once a0 (the longest) is done
    assert admitted.index(["b0", "b1"]) == 1 + max(
        i for i, so in enumerate(run.steps) if "a0" in so.num_scheduled_tokens
    )
    # the same prompt hits the cache under the same adapter only (a1: a0's blocks; b1: b0's)
    cached = {r.req_id: r.num_cached_tokens for r in requests}
    assert cached == {"a0": 0, "b0": 0, "a1": 32, "base": 0, "b1": 32}
    assert scheduler.lora_refs == {}


# --- stop conditions ----------------------------------------------------------------------------


def _script(*tokens: int) -> TokenFn:
    return lambda request: tokens[request.num_output_tokens]


@pytest.mark.parametrize(
    ("params", "max_tokens", "expected", "reason", "stop_reason"),
    [
        pytest.param(SamplingParams(), 6, [1, 3, 2], "stop", None, id="eos"),
        pytest.param(SamplingParams(stop_token_ids=[3]), 6, [1, 3], "stop", 3, id="stop-token"),
        pytest.param(SamplingParams(), 2, [1, 3], "length", None, id="max-tokens"),
        pytest.param(SamplingParams(min_tokens=4), 6, [1, 3, 2, 2], "stop", None, id="min-tokens"),
        pytest.param(
            SamplingParams(min_tokens=3, stop_token_ids=[3]),
            6,
            [1, 3, 2],
            "stop",
            None,
            id="min-tokens-then-eos",
        ),
        pytest.param(
            SamplingParams(ignore_eos=True), 6, [1, 3, 2, 2, 5, 2], "length", None, id="ignore-eos"
        ),
        pytest.param(
            SamplingParams(ignore_eos=True, stop_token_ids=[5]),
            6,
            [1, 3, 2, 2, 5],
            "stop",
            5,
            id="ignore-eos-keeps-stop-ids",
        ),
    ],
)
def test_stop_conditions(
    params: SamplingParams,
    max_tokens: int,
    expected: list[int],
    reason: str,
    stop_reason: int | None,
) -> None:
    scheduler = make_scheduler()
    request = make_request("r", range(10), max_tokens=max_tokens, params=params, eos_token_ids=(2,))
    scheduler.add_request(request)
    run = run_until_done(scheduler, _script(1, 3, 2, 2, 5, 2, 2))
    assert run.tokens["r"] == expected
    assert run.finish_reasons["r"] == reason
    assert request.stop_reason == stop_reason
    assert run.outputs[-1].stop_reason == stop_reason
    assert [o.finished for o in run.outputs] == [False] * (len(expected) - 1) + [True]


def test_check_stop_directly() -> None:
    request = make_request(
        "r", [0], max_tokens=3, params=SamplingParams(min_tokens=2), eos_token_ids=(2,)
    )
    assert request.check_stop() is None  # no output yet
    request.append_output_token(2)
    assert request.check_stop() is None  # EOS before min_tokens is suppressed
    request.append_output_token(2)
    assert request.check_stop() == RequestStatus.FINISHED_STOPPED
    request.append_output_token(9)
    assert request.check_stop() == RequestStatus.FINISHED_LENGTH


# --- randomized ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_randomized_traffic_reads_the_right_kv(scheduling_policy: str) -> None:
    """Random arrivals, shared prefixes, chunking, a tight pool and aborts (and under the
    priority policy, random priorities). A fake KV store records which token each block slot
    holds; every scheduled request must read its own tokens at every computed position, through
    prefix hits, same-step sharing and preemption."""
    rng = random.Random(0)
    block_size = 4
    scheduler = make_scheduler(
        num_blocks=24,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=20,
        scheduling_policy=scheduling_policy,
    )
    kv = scheduler.kv
    content: dict[int, list[int | None]] = {}  # block_id -> token at each slot
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (0, 8, 13, 30)]
    requests: dict[str, Request] = {}

    def forward(so: SchedulerOutput) -> None:
        """Write each scheduled token's KV, then check every position each request reads."""
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        starts |= {c.req_id: c.num_computed_tokens for c in so.scheduled_cached_reqs}
        assert starts.keys() == so.num_scheduled_tokens.keys()
        for req_id, num in so.num_scheduled_tokens.items():
            table, ids = kv.get_block_ids(req_id), requests[req_id].all_token_ids
            assert starts[req_id] + num == requests[req_id].num_computed_tokens
            for pos in range(starts[req_id], starts[req_id] + num):
                slots = content.setdefault(table[pos // block_size], [None] * block_size)
                slots[pos % block_size] = ids[pos]
        for req_id in so.num_scheduled_tokens:
            table, ids = kv.get_block_ids(req_id), requests[req_id].all_token_ids
            for pos in range(requests[req_id].num_computed_tokens):
                held = content[table[pos // block_size]][pos % block_size]
                assert held == ids[pos], f"{req_id} reads wrong KV at {pos}"

    def sample(request: Request) -> int:
        return rng.randrange(50)

    run = Run()
    for i in range(400):
        if i < 300 and rng.random() < 0.3:
            req_id = f"r{i}"
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 30)
            priority = rng.randint(-2, 2) if scheduling_policy == "priority" else 0
            requests[req_id] = make_request(
                req_id, prompt, max_tokens=max_tokens, priority=priority
            )
            scheduler.add_request(requests[req_id])
        if scheduler.requests and rng.random() < 0.03:
            scheduler.finish_requests([rng.choice(list(scheduler.requests))], ABORTED)
        step(scheduler, run, sample, forward)
    run_until_done(scheduler, sample, forward, run=run)
    assert scheduler.num_preemptions > 0
    assert kv.num_prefix_hits > 0
    assert any(r.status == ABORTED for r in requests.values())
    for req_id, request in requests.items():
        if request.status != ABORTED:
            assert len(run.tokens[req_id]) == request.max_tokens
            assert run.finish_reasons[req_id] == "length"
    assert kv.num_free_blocks == 24
