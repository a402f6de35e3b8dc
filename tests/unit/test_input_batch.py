"""The runner's per-request state: output tokens live in the token table only, so what a step
records there is what sampling (penalties, min_tokens) later reads back."""

from __future__ import annotations

import torch

from baton_engine.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from baton_engine.runner.input_batch import CachedRequestState, InputBatch
from baton_engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 12


def step(
    new: tuple[NewRequestData, ...] = (),
    cached: tuple[CachedRequestData, ...] = (),
    finished: frozenset[str] = frozenset(),
) -> SchedulerOutput:
    num_scheduled = {n.req_id: 1 for n in new} | {c.req_id: 1 for c in cached}
    return SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=len(num_scheduled),
        finished_req_ids=finished,
        preempted_req_ids=frozenset(),
    )


def new_request(req_id: str, prompt: list[int], output: tuple[int, ...] = ()) -> NewRequestData:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    return NewRequestData(req_id, prompt, list(output), params, [0], len(prompt) + len(output))


def make_batch() -> InputBatch:
    return InputBatch(4, MAX_MODEL_LEN, 4, torch.device("cpu"))


def launched(state: CachedRequestState) -> CachedRequestState:
    state.num_pending += 1  # what ModelRunner.launch does for each request it samples
    return state


def record(batch: InputBatch, states: list[CachedRequestState], token_ids: list[int]) -> None:
    batch.record_sampled(states, token_ids, batch.num_removed)  # nothing removed meanwhile


def test_sampled_tokens_are_read_back_after_a_resume() -> None:
    batch = make_batch()
    batch.update(step((new_request("a", [1, 2, 3], output=(7, 8)),)))  # resumed after preemption
    a = batch.requests["a"]
    assert batch.output_token_ids(a) == [7, 8]
    assert a.num_output_tokens == 2
    record(batch, [launched(a)], [9])
    record(batch, [launched(a)], [10])
    assert batch.output_token_ids(a) == [7, 8, 9, 10]
    assert a.num_tokens == 7 and a.num_pending == 0
    assert batch.token_table[a.row, :7].tolist() == [1, 2, 3, 7, 8, 9, 10]


def test_a_token_of_a_request_dropped_since_the_launch_is_not_recorded() -> None:
    batch = make_batch()
    batch.update(step((new_request("a", [1, 2, 3]), new_request("b", [4, 5]))))
    a, b = batch.requests["a"], batch.requests["b"]
    in_flight = [launched(a), launched(b)]
    num_removed = batch.num_removed  # at the launch
    # b finishes before its token is reported; c takes its row
    batch.update(step((new_request("c", [6, 6, 6, 6]),), finished=frozenset({"b"})))
    c = batch.requests["c"]
    assert c.row == b.row
    batch.record_sampled(in_flight, [11, 12], num_removed)
    assert batch.output_token_ids(a) == [11]
    assert batch.output_token_ids(c) == []
    assert batch.token_table[c.row, :4].tolist() == [6, 6, 6, 6]  # b's token 12 not written
    assert a.num_pending == b.num_pending == 0


def test_the_last_token_of_a_full_length_request_has_no_slot() -> None:
    batch = make_batch()
    prompt = list(range(1, MAX_MODEL_LEN))
    batch.update(step((new_request("a", prompt),)))
    a = batch.requests["a"]
    record(batch, [launched(a)], [20])  # fills the last slot
    record(batch, [launched(a)], [21])  # past max_model_len: kept off the table
    assert batch.output_token_ids(a) == [20]
    assert a.num_tokens == MAX_MODEL_LEN + 1
