"""Scheduler: one token budget per step, no prefill or decode phases.

Each step spends ``max_num_batched_tokens`` on running requests first (in admission order), then
admits waiting ones. A request's step is ``min(num_tokens - num_computed_tokens, threshold,
budget)`` tokens, so chunked prefill, prefix hits and recompute after preemption are the same
arithmetic. When the pool runs dry, the most recently admitted running request is preempted:
its blocks are freed, its progress reset, and it goes back to the front of the queue.

Priority scheduling (``scheduling_policy="priority"``, as vLLM's): each request's ``priority``
(lower is served first), then its arrival, ranks it, and ``waiting`` and ``running`` are both
kept in rank order. Admission takes the best-ranked waiting request; preemption still takes the
tail of ``running``, which is then the worst-ranked (vLLM's ``max(running, key=(priority,
arrival_time))``); a preempted request goes back to its rank in ``waiting``, not to the front.
Unlike vLLM, whose ``running`` stays in admission order, the token budget therefore goes to
the best-ranked running requests first, and a victim is never one this step already scheduled
(vLLM un-schedules it). A request whose remote KV has landed still goes to the front, as under
fcfs: it holds its blocks, which must not sit idle behind requests that may need them. Under
``fcfs`` every request's priority is 0.

Async scheduling: the engine may schedule step N+1 before step N's sampled tokens reach the
host. A request whose step ends at its last token will sample one, counted in
``num_pending_tokens`` until ``update_from_output`` reports it; scheduling treats pending tokens
as known (a decode of one token each), except that a request whose pending token must end it
(its ``max_tokens``, a prefill-only request) is not scheduled again. A request that stops on a
token found one step late has had one more step computed; that token is dropped.

Multi-step scheduling (``num_scheduler_steps`` > 1): when every running request is a plain
decode (``Request.multi_step``) and no waiting request could be admitted, a step runs up to that
many forward passes of the same requests, each pass's input the token the pass before sampled
(on the device). Blocks for every pass are allocated up front and each request counts one
pending token a pass; a request that stops on a token of an early pass drops the later ones.

Speculative decoding (``speculative``, n-gram drafts): a request about to decode one token
(its last known one) that asks for no prompt logprobs and has no seeded sampling
(``Request.speculative``) and is past its ``min_tokens`` takes the drafts ``NgramProposer``
finds for it, up to what fits the budget, its ``max_tokens`` and its grammar; they count as
known tokens of this step (``SchedulerOutput.spec_token_ids``) and the step samples once for
it. ``update_from_output`` gets the drafts it kept and one more token, and moves its computed
tokens back to the kept drafts. Blocks are indexed from known tokens only, so a block that held
a rejected draft is indexed once its tokens are real and recomputed. With async scheduling, a
request whose last token is pending takes drafts only if its sampling reads none of its tokens
on the host (``Request.multi_step``): its known tokens' proposal guesses the pending token
(dropped) and gives the drafts after it. Until a step of drafts reports, the request's computed
tokens run ahead of its known ones, so it is not scheduled again before.

Disaggregation adds one detour. A waiting request whose prompt KV lives on a prefill worker
(``remote_kv``) is admitted without compute: it matches the local prefix cache, gets blocks for
the rest of its prompt (left out of the prefix index until filled) and waits in ``loading``
while the caller pulls them (``take_kv_loads``). ``finish_kv_load`` then lets it run with its
prompt computed, or, if the pull failed, sends it back to compute the prompt itself. Blocks of a
request aborted while loading are freed only when its load is reported: a transfer may still be
writing them.

Pausing (vLLM's ``pause_generation``): ``pause()`` holds every request added from then on out
of ``waiting`` (``held``) until ``resume()``; the requests already in flight go on.
``pause(freeze=True)`` (vLLM's mode "keep") also stops scheduling them: ``schedule`` returns
empty steps and they keep their blocks, to go on where they were. ``preempt_all`` frees a
frozen engine's blocks (sleep mode): its requests compute everything again once resumed.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from operator import attrgetter

from baton_engine.config import SCHEDULING_POLICIES, SpeculativeConfig
from baton_engine.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    KVLoad,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from baton_engine.errors import InvalidRequestError
from baton_engine.kv_cache import KVCacheManager, PrefixMatch
from baton_engine.request import Request, RequestStatus
from baton_engine.spec_decode import ModelDrafts, NgramProposer

# Built per request per step: a NamedTuple's own constructor is a Python function, a third of
# the cost; tuple.__new__ fills every field (in declaration order) in one C call.
_tuple_new = tuple.__new__
_RUNNING = RequestStatus.RUNNING
_rank = attrgetter("priority", "arrival_time")  # the priority policy's order: lowest first


def _waiting_rank(request: Request) -> tuple[bool, int, float]:
    """The priority policy's waiting order: requests whose remote KV has landed first (they
    were admitted when their load began: a seat and their blocks; only their first token is
    left), then by ``_rank``."""
    return request.num_computed_tokens == 0, request.priority, request.arrival_time


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
        num_scheduler_steps: int = 1,
        scheduling_policy: str = "fcfs",
        max_loras: int | None = None,
        pool_every_token: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """``max_loras``: the most LoRA adapters the running requests may use at once (a
        waiting request with another adapter is passed over until one is free), None: any.
        ``pool_every_token``: embeddings read every prompt token's hidden state (MEAN or CLS
        pooling), so embedding requests take no prefix-cache hits. ``speculative``: n-gram
        drafts for decoding requests (see the module docstring)."""
        self.pool_every_token = pool_every_token
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}"
            )
        self.kv = kv_cache_manager
        self.scheduling_policy = scheduling_policy
        self._by_priority = scheduling_policy == "priority"
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_loras = max_loras
        self.speculative = speculative
        self.proposer: NgramProposer | ModelDrafts | None = None
        if speculative is not None and speculative.model is not None:
            self.proposer = ModelDrafts()  # (filled from the runner's outputs)
        elif speculative is not None:
            self.proposer = NgramProposer(
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
                speculative.num_speculative_tokens,
            )
        # speculative decoding: steps of a request with drafts, drafts scheduled, drafts
        # accepted, and accepted at each draft position (vLLM's spec_decode metrics)
        self.num_spec_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * (speculative.num_speculative_tokens if speculative else 0)
        self.num_guessed_drafts = 0  # drafts after a pending token (async scheduling)
        self.requests: dict[str, Request] = {}  # req_id -> every unfinished request
        # fcfs: arrival order, preempted requests at the front; priority: _waiting_rank order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission (priority: _rank) order; tail preempted first
        self.loading: dict[str, Request] = {}  # req_id -> request waiting for remote KV
        self._kv_loads: list[KVLoad] = []  # loads to start, for take_kv_loads()
        self._finished_req_ids: set[str] = set()  # since the last schedule()
        self._step_id = 0
        # step id -> the requests it scheduled, until its output is reported
        self._scheduled: dict[int, list[Request]] = {}
        self.num_preemptions = 0
        self.num_multi_steps = 0  # steps of more than one pass (multi-step scheduling)
        self.num_grammars = 0  # requests with structured output among ``requests``
        self.num_embeddings = 0  # embedding requests (PoolingParams) among ``requests``
        self.lora_refs: dict[str, int] = {}  # adapter name -> its requests among ``requests``
        # Requests the latest schedule() scheduled for the first time (admitted to compute, or
        # to load their remote KV), with when (time.monotonic()): where their queue time ends.
        # Replaced, not cleared, by the next schedule(), so a reader may keep the list.
        self.first_scheduled: list[tuple[str, float]] = []
        # Pausing: requests added while paused wait here (arrival order) until resume();
        # frozen, nothing is scheduled.
        self.paused = False
        self.frozen = False
        self.held: list[Request] = []
        self._preempted: set[str] = set()  # by preempt_all, for the next step's output

    # --- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check_priority(request.priority)
        self.requests[request.req_id] = request
        if self.paused:
            self.held.append(request)
        elif self._by_priority:
            bisect.insort(self.waiting, request, key=_waiting_rank)
        else:
            self.waiting.append(request)
        self.num_grammars += request.grammar is not None
        self.num_embeddings += request.pooling is not None
        if request.lora_name is not None:
            self.lora_refs[request.lora_name] = self.lora_refs.get(request.lora_name, 0) + 1

    def check_priority(self, priority: int) -> None:
        """Raise ``InvalidRequestError`` for a priority this policy cannot honour: any but 0
        under ``fcfs`` (as vLLM refuses it)."""
        if priority != 0 and not self._by_priority:
            raise InvalidRequestError(
                f"got priority {priority} but priority scheduling is not enabled "
                "(scheduling_policy='priority')"
            )

    def _requeue(self, request: Request) -> None:
        """Back to ``waiting`` (preempted, or its remote KV pulled): at the front under
        ``fcfs``, at its place under ``priority`` (``_waiting_rank``)."""
        if self._by_priority:
            bisect.insort(self.waiting, request, key=_waiting_rank)
        else:
            self.waiting.appendleft(request)

    def _forget(self, request: Request) -> None:
        del self.requests[request.req_id]
        if self.proposer is not None:
            self.proposer.forget(request.req_id)
        self.num_grammars -= request.grammar is not None
        self.num_embeddings -= request.pooling is not None
        name = request.lora_name
        if name is not None:
            self.lora_refs[name] -= 1
            if not self.lora_refs[name]:
                del self.lora_refs[name]

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown ids are ignored."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                # Its blocks may be being written: free them when the load is reported.
                request.status = status
                self._forget(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.held:
                self.held.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if status == RequestStatus.FINISHED_PREFILLED:
            self.kv.hold(request)
        else:
            self.kv.forget(request)
        self._forget(request)
        self._finished_req_ids.add(request.req_id)

    def release_held(self, req_id: str) -> bool:
        """Free the prompt blocks a prefilled request left held; False if none were."""
        return self.kv.release_held(req_id)

    def take_kv_loads(self) -> list[KVLoad]:
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def finish_kv_load(self, req_id: str, ok: bool) -> None:
        """A pull started from ``take_kv_loads`` ended. On success the request runs with its
        prompt computed; on failure it computes the prompt itself. Unknown ids are ignored."""
        request = self.loading.pop(req_id, None)
        if request is None:
            return
        if request.is_finished():  # aborted while loading
            self.kv.forget(request)
            self._finished_req_ids.add(req_id)
            return
        request.remote_kv = None
        if ok:
            # Back to the head of the queue with its prompt computed and its blocks in place:
            # admission then schedules the rest (the first token) like any other request.
            request.num_computed_tokens = request.num_prompt_tokens
            request.remote_kv_from = request.num_cached_tokens
            self.kv.cache_blocks(request, request.num_prompt_tokens)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._requeue(request)

    def pause(self, freeze: bool = False) -> None:
        """Hold the requests added from now on until ``resume``; ``freeze``: stop scheduling
        the requests in flight too (they keep their blocks). A frozen scheduler stays frozen
        when paused again."""
        self.paused = True
        self.frozen = self.frozen or freeze

    def resume(self) -> None:
        """Schedule again; the held requests join ``waiting`` (behind it, in arrival order)."""
        self.paused = self.frozen = False
        held, self.held = self.held, []
        for request in held:
            if self._by_priority:
                bisect.insort(self.waiting, request, key=_waiting_rank)
            else:
                self.waiting.append(request)

    def preempt_all(self) -> None:
        """Free every request's blocks (frozen, no step or pull in flight): the running ones',
        and the waiting ones' whose remote KV landed; each computes its tokens again once
        scheduled."""
        assert self.frozen and not self.loading
        while self.running:
            request = self.running.pop()
            self._preempt(request)
            self._preempted.add(request.req_id)
        for request in self.waiting:
            if request.num_computed_tokens:  # (its pulled prompt: not scheduled yet)
                self.kv.free(request)
                request.num_computed_tokens = 0

    @property
    def num_active(self) -> int:
        """Unfinished requests but the held ones."""
        return len(self.requests) - len(self.held)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Whether a step would do anything (requests waiting for remote KV, or held, do not
        count; nothing while frozen)."""
        return not self.frozen and bool(self.running or self.waiting)

    # --- one step ------------------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens + request.num_pending_tokens - num_computed
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    def schedule(self) -> SchedulerOutput:
        if self.first_scheduled:
            self.first_scheduled = []
        if self.frozen:
            return self._output([], [], [], {}, 0, set())
        if self.num_scheduler_steps > 1:
            num_steps = self._num_steps()
            if num_steps > 1:
                return self._schedule_steps(num_steps)
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        scheduled: list[Request] = []
        spec: dict[str, list[int]] = {}
        speculate = self.speculative is not None and (
            self.speculative.disable_by_batch_size is None
            or len(self.running) < self.speculative.disable_by_batch_size
        )

        # This loop runs for every running request every step: _num_new_tokens is inlined, and
        # allocate_slots is skipped while the request's blocks have room (kv_limit). Preemption
        # pops requests off the list's tail, which its iterator then never reaches.
        threshold = self.long_prefill_token_threshold
        running = self.running
        for request in running:
            if budget <= 0:
                break
            num_output = len(request.output_token_ids)
            num_pending = request.num_pending_tokens
            num_known = len(request.prompt_token_ids) + num_output + num_pending
            computed = request.num_computed_tokens
            num_new = num_known - computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (
                # a pending token certain to end it (its last, or a prefill-only request's
                # first): no step may run ahead of it
                num_pending
                and (request.prefill_only or num_output + num_pending >= request.max_tokens)
            ):
                continue
            drafts = None
            if speculate and num_new == 1 and request.speculative:
                drafts = []
                if not num_pending:
                    drafts = self._drafts(request, budget - 1)
                elif num_pending == 1 and request.multi_step:
                    # async scheduling: its last token is still on the device (as the input
                    # it decodes: drafts follow it; its sampling reads no token on the host)
                    drafts = self._drafts(request, budget - 1, after_pending=True)
                num_new += len(drafts)
                num_known += len(drafts)
            if computed + num_new <= request.kv_limit:
                new_block_ids: list[int] = []
            else:
                allocated = self.kv.allocate_slots(request, num_new)
                while allocated is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.add(victim.req_id)
                    if victim is request:
                        break
                    allocated = self.kv.allocate_slots(request, num_new)
                if allocated is None:
                    break
                new_block_ids = allocated
            cached_reqs.append(
                _tuple_new(CachedRequestData, (request.req_id, new_block_ids, computed))
            )
            if drafts:
                spec[request.req_id] = drafts
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            # Preemption takes the tail, which this loop has not reached: the requests it has
            # passed stay scheduled, so their progress is recorded now.
            computed += num_new
            request.num_computed_tokens = computed
            if computed == num_known:
                request.num_pending_tokens = num_pending + 1  # this step samples its next token
            scheduled.append(request)

        # Admit waiting requests only when nothing had to be preempted this step.
        loras: set[str] | None = None  # adapters of the running requests (max_loras)
        passed_over: list[Request] = []  # waiting for an adapter slot
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            request = self.waiting[0]
            if request.lora_name is not None and self.max_loras is not None:
                if loras is None:
                    loras = self.running_loras()
                if request.lora_name not in loras:
                    if len(loras) >= self.max_loras:
                        passed_over.append(self.waiting.popleft())
                        continue
                    loras.add(request.lora_name)  # (if it is not admitted, the loop ends)
            if request.remote_kv is not None:
                if not self._start_kv_load(request):
                    break
                continue
            # Prompt logprobs need every prompt token's logits, and MEAN / CLS pooling every
            # prompt token's hidden state: no prefix-cache hits then.
            fresh = (
                request.num_computed_tokens == 0
                and request.sampling_params.prompt_logprobs is None
                and not (self.pool_every_token and request.pooling is not None)
            )
            prefix = self.kv.match_prefix(request) if fresh else None
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
                    pooling=request.pooling,
                    lora_name=request.lora_name,
                    remote_kv_from=request.remote_kv_from,
                    prompt_embeds=request.prompt_embeds,
                )
            )
            num_scheduled[request.req_id] = num_new
            budget -= num_new
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens:
                request.num_pending_tokens += 1
            scheduled.append(request)
        self.waiting.extendleft(reversed(passed_over))  # (their order, at the front)

        return self._output(
            scheduled, new_reqs, cached_reqs, num_scheduled, self.max_num_batched_tokens - budget,
            preempted, spec_token_ids=spec,
        )  # fmt: skip

    def _drafts(self, request: Request, room: int, after_pending: bool = False) -> list[int]:
        """The drafts a decoding request takes this step (``room``: the budget left after its
        token): none below its ``min_tokens`` (its end tokens are suppressed there), and no
        more than would run past its ``max_tokens`` or the prefill chunk size.
        ``after_pending``: its last token is pending (async scheduling); the proposal from its
        known tokens guesses that token (dropped) and the drafts after it. A wrong guess costs
        only the drafts, which the check then rejects. A step of drafts leaves the request's
        count of tokens unknown until it reports: it is scheduled again after that (its
        computed tokens run ahead of the known ones until then)."""
        assert self.proposer is not None
        num_output = len(request.output_token_ids) + after_pending
        if num_output < request.sampling_params.min_tokens:
            return []
        room = min(room, request.max_tokens - num_output - 1)
        if self.long_prefill_token_threshold > 0:
            room = min(room, self.long_prefill_token_threshold - 1)
        if after_pending:
            guessed = self.proposer.propose(request, room + 1, extra=1)
            self.num_guessed_drafts += len(guessed[1:])
            return guessed[1:]
        drafts = self.proposer.propose(request, room)
        if drafts and request.grammar is not None:  # only what its grammar allows
            del drafts[request.grammar.valid_prefix(drafts) :]
        return drafts

    def running_loras(self) -> set[str]:
        """The adapters of the running requests and of those loading remote KV."""
        names = {r.lora_name for r in self.running if r.lora_name is not None}
        names.update(r.lora_name for r in self.loading.values() if r.lora_name is not None)
        return names

    def _output(
        self,
        scheduled: list[Request],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
        num_scheduled: dict[str, int],
        num_tokens: int,
        preempted: set[str],
        num_steps: int = 1,
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> SchedulerOutput:
        finished, self._finished_req_ids = self._finished_req_ids, set()
        if self._preempted:
            preempted, self._preempted = preempted | self._preempted, set()
        self._step_id += 1
        self._scheduled[self._step_id] = scheduled
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=num_tokens,
            finished_req_ids=frozenset(finished),
            preempted_req_ids=frozenset(preempted),
            num_steps=num_steps,
            spec_token_ids=spec_token_ids or {},
            kv_copies=self.kv.take_copies(),
        )

    # --- multi-step scheduling -----------------------------------------------------------------

    def _num_steps(self) -> int:
        """How many forward passes this step may run: up to ``num_scheduler_steps`` when every
        running request is a plain decode that may take them all (``Request.multi_step``, past
        its ``min_tokens``, that many tokens short of its ``max_tokens``) and the pool has the
        blocks; 1 while a waiting request could be admitted (it would wait for the whole run)
        or when every pass would not fit the token budget."""
        running = self.running
        if (
            not running
            or (self.waiting and len(running) + len(self.loading) < self.max_num_seqs)
            or len(running) > self.max_num_batched_tokens
        ):
            return 1
        num_steps = self.num_scheduler_steps
        block_size = self.kv.block_size
        num_blocks = 0  # at most what the passes need
        num_scheduled = 0
        for request in running:
            num_output = len(request.output_token_ids)
            num_pending = request.num_pending_tokens
            computed = request.num_computed_tokens
            if (
                not request.multi_step
                or num_output < request.sampling_params.min_tokens
                or len(request.prompt_token_ids) + num_output + num_pending - computed != 1
            ):
                return 1  # (a prompt chunk; sampling that reads its tokens or suppresses)
            left = request.max_tokens - num_output - num_pending
            if left <= 0:
                continue  # its pending token ends it: not scheduled
            num_scheduled += 1
            if left < num_steps:
                num_steps = left
                if num_steps == 1:
                    return 1
            if computed + num_steps > request.kv_limit:
                num_blocks += num_steps // block_size + 1
        return num_steps if num_scheduled and num_blocks <= self.kv.num_free_blocks else 1

    def _schedule_steps(self, num_steps: int) -> SchedulerOutput:
        """A step of ``num_steps`` passes over the running requests (``_num_steps`` checked
        that each may take them): blocks for all of them now, one token a pass."""
        num_scheduled: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        scheduled: list[Request] = []
        for request in self.running:
            num_pending = request.num_pending_tokens
            if len(request.output_token_ids) + num_pending >= request.max_tokens:
                continue  # its pending token ends it
            computed = request.num_computed_tokens
            if computed + num_steps <= request.kv_limit:
                new_block_ids: list[int] = []
            else:
                allocated = self.kv.allocate_slots(request, num_steps)
                assert allocated is not None, "_num_steps counted the blocks"
                new_block_ids = allocated
            cached_reqs.append(
                _tuple_new(CachedRequestData, (request.req_id, new_block_ids, computed))
            )
            num_scheduled[request.req_id] = 1
            request.num_computed_tokens = computed + num_steps
            request.num_pending_tokens = num_pending + num_steps  # a token a pass
            scheduled.append(request)
        self.num_multi_steps += 1
        return self._output(
            scheduled, [], cached_reqs, num_scheduled, len(scheduled), set(), num_steps
        )

    def _start_kv_load(self, request: Request) -> bool:
        """Admit a request whose prompt KV is remote: blocks for its prompt, no compute."""
        prefix = self.kv.match_prefix(request)
        num_cached = prefix.num_cached_tokens
        num_load = request.num_prompt_tokens - num_cached
        if self.kv.allocate_slots(request, num_load, prefix, cache=False) is None:
            return False
        self.waiting.popleft()
        self.kv.record_prefix_lookup(request.num_prompt_tokens, prefix)
        request.num_cached_tokens = num_cached
        self.first_scheduled.append((request.req_id, time.monotonic()))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.req_id] = request
        first_block = num_cached // self.kv.block_size
        block_ids = self.kv.get_block_ids(request.req_id)
        self._kv_loads.append(
            KVLoad(request.req_id, request.remote_kv, first_block, block_ids[first_block:])
        )
        return True

    def _admit(self, request: Request, prefix: PrefixMatch | None) -> None:
        num_cached = prefix.num_cached_tokens if prefix is not None else 0
        if prefix is not None:
            self.kv.record_prefix_lookup(request.num_tokens, prefix)
        if request.num_cached_tokens < 0:  # its first admission
            request.num_cached_tokens = num_cached
            self.first_scheduled.append((request.req_id, time.monotonic()))
        request.num_computed_tokens += num_cached
        request.status = RequestStatus.RUNNING
        if self._by_priority:
            bisect.insort(self.running, request, key=_rank)
        else:
            self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        if self.proposer is not None:
            self.proposer.forget(request.req_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the tokens a step sampled, finish requests that stop, and report what changed.
        Requests that ended (abort, stop) or were preempted since the step was scheduled are
        still matched by identity: a finished one's token is dropped, a preempted one keeps it."""
        if scheduler_output.num_steps > 1:
            return self._update_from_steps(scheduler_output, runner_output)
        outputs: list[EngineCoreOutput] = []
        sampled = runner_output.sampled_token_ids
        prompt_logprobs = runner_output.prompt_logprobs
        logprobs_of = runner_output.logprobs
        spec = runner_output.spec_token_ids
        any_finished = False
        if isinstance(self.proposer, ModelDrafts):
            live = self.requests  # (one aborted since the step was scheduled is gone)
            stepped = [r for r in scheduler_output.num_scheduled_tokens if r in live]
            self.proposer.record(stepped, runner_output.draft_token_ids)
        for request in self._scheduled.pop(scheduler_output.step_id, ()):
            if spec and request.req_id in spec:
                drafts = scheduler_output.spec_token_ids[request.req_id]
                kept = spec[request.req_id], runner_output.spec_logprobs.get(request.req_id)
                any_finished |= self._update_spec(request, drafts, *kept, outputs)
                continue
            token_id = sampled.get(request.req_id)
            if token_id is not None:
                request.num_pending_tokens -= 1
            if request.status is not _RUNNING and request.status.is_finished:
                continue  # its blocks are gone; a token sampled past its end is dropped
            if prompt_logprobs:
                _add_prompt_logprobs(request, prompt_logprobs.get(request.req_id))
            if token_id is None:  # a prefill chunk that is not the last
                continue
            out = request.output_token_ids
            out.append(token_id)
            if len(out) < request.stop_len and token_id not in request.stop_ids:
                # the common case (nothing can stop it, nothing more to report), built with the
                # fewest lookups: Request.check_stop would return None
                fields = (request.req_id, [token_id], None, None, None, request.num_cached_tokens,
                          None, None, None)  # fmt: skip
                outputs.append(_tuple_new(EngineCoreOutput, fields))
                continue
            if request.grammar is not None:
                request.grammar.accept(token_id)  # check_stop ends it if refused or complete
            status = request.check_stop()
            if (
                status is None
                and not logprobs_of
                and request.sampling_params.prompt_logprobs is None
            ):
                outputs.append(
                    EngineCoreOutput(
                        request.req_id, [token_id], None, None, None, request.num_cached_tokens
                    )
                )
                continue
            held = None
            if status is not None:
                if status == RequestStatus.FINISHED_PREFILLED:
                    held = self.kv.get_block_ids(request.req_id)
                if request.status == RequestStatus.RUNNING:
                    any_finished = True
                else:  # preempted after this step was launched
                    self.waiting.remove(request)
                self._free(request, status)
            logprobs = logprobs_of.get(request.req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id=request.req_id,
                    # an embedding's token is no output
                    new_token_ids=[token_id] if request.pooling is None else [],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_block_ids=held,
                    prompt_logprobs=(
                        request.prompt_logprobs
                        if request.sampling_params.prompt_logprobs is not None
                        and request.num_output_tokens == 1
                        else None
                    ),
                    pooled=runner_output.pooled.get(request.req_id),
                )
            )
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _update_from_steps(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """``update_from_output`` for a multi-step: each request's tokens in order up to the
        first that stops it (the passes after it computed tokens that are dropped), reported
        together."""
        outputs: list[EngineCoreOutput] = []
        num_steps = scheduler_output.num_steps
        step_tokens = runner_output.step_token_ids
        any_finished = False
        for request in self._scheduled.pop(scheduler_output.step_id, ()):
            tokens = step_tokens[request.req_id]
            request.num_pending_tokens -= num_steps
            if request.status is not _RUNNING and request.status.is_finished:
                continue
            output, finished = self._append_tokens(request, tokens)
            outputs.append(output)
            any_finished |= finished
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _update_spec(
        self,
        request: Request,
        drafts: list[int],
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
        outputs: list[EngineCoreOutput],
    ) -> bool:
        """``update_from_output`` for a request that had ``drafts``: its computed tokens go
        back to the drafts it kept (``tokens`` less the last), whose KV holds; the KV written
        past them is overwritten by the steps that compute those positions again. Whether it
        finished a running request."""
        request.num_pending_tokens -= 1
        if request.status is not _RUNNING and request.status.is_finished:
            return False
        num_accepted = len(tokens) - 1
        self.num_spec_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_per_pos[i] += 1
        if request.status is _RUNNING:
            request.num_computed_tokens -= len(drafts) - num_accepted
        output, finished = self._append_tokens(request, tokens, logprobs)
        outputs.append(output)
        return finished

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> tuple[EngineCoreOutput, bool]:
        """Append a step's several tokens (a multi-step's, a speculative step's, with their
        ``logprobs`` if asked for) to a request up to the first that stops it (those after it
        are dropped), and its output; whether it finished a running request."""
        out = request.output_token_ids
        if len(out) + len(tokens) < request.stop_len and request.stop_ids.isdisjoint(tokens):
            out += tokens  # the common case: none of them can stop it
            return _tuple_new(EngineCoreOutput, (request.req_id, tokens, None, None, None,
                                                 request.num_cached_tokens, None, None,
                                                 None)), False  # fmt: skip
        status = None
        grammar = request.grammar
        for i, token_id in enumerate(tokens):
            out.append(token_id)
            if grammar is not None:
                grammar.accept(token_id)  # check_stop ends it if refused or complete
            status = request.check_stop()
            if status is not None:
                tokens = tokens[: i + 1]
                break
        finished = False
        if status is not None:
            if request.status == RequestStatus.RUNNING:
                finished = True
            else:  # preempted after this step was launched
                self.waiting.remove(request)
            self._free(request, status)
        output = EngineCoreOutput(
            request.req_id,
            tokens,
            logprobs[: len(tokens)] if logprobs is not None else None,
            status.finish_reason if status is not None else None,
            request.stop_reason,
            request.num_cached_tokens,
        )
        return output, finished

    def check_invariants(self, full: bool = True) -> None:
        self.kv.check_invariants(full)
        assert len(self.running) <= self.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens + request.num_pending_tokens
        live_loading = sum(1 for r in self.loading.values() if not r.is_finished())
        assert len(self.running) + len(self.waiting) + len(self.held) + live_loading == len(
            self.requests
        )
        assert self.paused or not self.held
        if self._by_priority:
            waiting = [_waiting_rank(r) for r in self.waiting]
            running = [_rank(r) for r in self.running]
            assert waiting == sorted(waiting) and running == sorted(running), "out of order"
        else:
            assert all(r.priority == 0 for r in self.requests.values())


def _add_prompt_logprobs(request: Request, chunk: tuple[int, list[TokenLogprobs]] | None) -> None:
    """Keep the prompt logprobs of one computed chunk; a chunk recomputed after a preemption
    repeats positions already kept, which are skipped."""
    if chunk is None:
        return
    first, logprobs = chunk  # logprobs of prompt tokens first, first + 1, ...
    have = len(request.prompt_logprobs) + 1  # the next prompt token without one
    if first <= have < first + len(logprobs):
        request.prompt_logprobs.extend(logprobs[have - first :])
