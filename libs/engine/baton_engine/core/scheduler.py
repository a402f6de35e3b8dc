"""Scheduler: one token budget per step, no prefill or decode phases.

Each step spends ``max_num_batched_tokens`` on running requests first (in admission order), then
admits waiting ones. A request's step is ``min(num_tokens - num_computed_tokens, threshold,
budget)`` tokens, so chunked prefill, prefix hits and recompute after preemption are the same
arithmetic. When the pool runs dry, the most recently admitted running request is preempted:
its blocks are freed, its progress reset, and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from baton_engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from baton_engine.kv_cache import KVCacheManager, PrefixMatch
from baton_engine.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.requests: dict[str, Request] = {}  # req_id -> every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self._finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0

    # --- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown ids are ignored."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.forget(request)
        del self.requests[request.req_id]
        self._finished_req_ids.add(request.req_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step ------------------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens - num_computed
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.req_id)
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            cached_reqs.append(
                CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens)
            )
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            prefix = self.kv.match_prefix(request) if request.num_computed_tokens == 0 else None
            num_computed = request.num_computed_tokens + (prefix.num_cached_tokens if prefix else 0)
            num_new = self._num_new_tokens(request, num_computed, budget)
            block_ids = self.kv.allocate_slots(request, num_new, prefix)
            if block_ids is None:
                break
            self.waiting.popleft()
            self._admit(request, prefix)
            new_reqs.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.get_block_ids(request.req_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            num_scheduled[request.req_id] = num_new
            budget -= num_new

        for req_id, num_new in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_new
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=frozenset(finished),
            preempted_req_ids=frozenset(preempted),
        )

    def _admit(self, request: Request, prefix: PrefixMatch | None) -> None:
        num_cached = prefix.num_cached_tokens if prefix is not None else 0
        if prefix is not None:
            self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens += num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that stop, and report what changed."""
        outputs: list[EngineCoreOutput] = []
        still_running: list[Request] = []
        sampled = runner_output.sampled_token_ids
        for request in self.running:
            token_id = sampled.get(request.req_id)
            if token_id is None:  # not scheduled, or a prefill chunk that is not the last
                still_running.append(request)
                continue
            request.append_output_token(token_id)
            status = request.check_stop()
            if status is not None:
                self._free(request, status)
            else:
                still_running.append(request)
            logprobs = runner_output.logprobs.get(request.req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id=request.req_id,
                    new_token_ids=[token_id],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        self.running = still_running
        return outputs

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        assert len(self.running) <= self.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
        assert len(self.running) + len(self.waiting) == len(self.requests)
