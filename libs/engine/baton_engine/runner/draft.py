"""A draft model's proposals for speculative decoding (``--speculative-config '{"model": ...}'``).

The draft is a second, smaller model with its own runner (``ModelRunner``: weights, attention
backend, KV pool) that shares the target runner's request table (``InputBatch``): the same
block ids hold the draft's KV in its pool as the target's in its own, so the KV cache manager
allocates once for both. After each step, once its tokens are known (no async scheduling):

1. one pass over every request of the step feeds the draft the tokens it has not seen: a prompt
   chunk's, or a decoding request's known tokens from where the draft last stopped (the token
   the step sampled, and the drafts the step kept before it). Its logits after a request's last
   known token give that request's first draft (the argmax);
2. ``num_speculative_tokens - 1`` decode passes each feed the previous draft and give the next.

A prompt prefilled on another worker (disaggregated serving) arrives with the model's KV only:
the draft's first pass then computes its own KV of the pulled tokens.

The drafts return with the step's output (``ModelRunnerOutput.draft_token_ids``) and the
scheduler schedules them after the request's last token in its next step, where the target
checks them (``spec_decode.verify``). The drafts are greedy, as vLLM's: a sampled request's
check then keeps draft ``j`` with the target's probability of it, and each kept token is
distributed as the target's sampling. The KV a decode pass writes at a draft's position is
overwritten once the token there is known (pass 1 of a later step); the scheduler allocates
room for it (``KVCacheManager.num_lookahead_tokens``). Draft KV that is stale (a block the
host tier reloaded without it, say) costs acceptance only, never a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from baton_engine import distributed
from baton_engine.core.outputs import ModelRunnerOutput
from baton_engine.runner.cuda_graphs import DecodeGraphs
from baton_engine.runner.input_batch import CachedRequestState
from baton_kernels import fused

if TYPE_CHECKING:
    from baton_engine.runner.model_runner import ModelRunner

# A first pass of a few tokens a request runs each token as a decode row (through the decode
# graphs on GPUs, the C++ decode layers on CPUs); False: as a prompt step (the piecewise graphs
# on GPUs). Benchmarks compare the two.
SPLIT_FIRST_PASS = True

# a step's request, its computed tokens when the step started and the tokens it computed
StepRequest = tuple[CachedRequestState, int, int]


class DraftProposer:
    def __init__(
        self,
        runner: ModelRunner,
        num_speculative_tokens: int,
        disable_by_batch_size: int | None = None,
    ) -> None:
        """``runner``: the draft model's, sharing the target's ``batch``. While
        ``disable_by_batch_size`` or more requests are held, the scheduler takes no drafts:
        the draft then runs nothing, and catches up with the tokens it missed once fewer
        are."""
        self.runner = runner
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        # req_id -> (its state, the tokens of it the draft's KV holds): a state that is not
        # the batch's (the request was preempted and resumed, or finished) starts over
        self._seen: dict[str, tuple[CachedRequestState, int]] = {}
        self.num_split_passes = 0  # first passes run as decode rows, a row a token

    @torch.inference_mode()
    def propose(
        self, steps: Sequence[StepRequest], output: ModelRunnerOutput
    ) -> dict[str, list[int]]:
        """The drafts after a step whose output (its sampled tokens recorded in the batch) is
        ``output``, for each of its requests that sampled; the draft's KV catches up with every
        request of the step."""
        runner = self.runner
        live = runner.batch.requests
        if self.disable_by_batch_size is not None and len(live) >= self.disable_by_batch_size:
            for state, start, _ in steps:  # (where a new one's KV in the draft's pool ends)
                seen = self._seen.get(state.req_id)
                if seen is None or seen[0] is not state:
                    self._seen[state.req_id] = (state, _draft_from(state, start))
            return {}
        max_len = runner.max_model_len
        items: list[tuple[CachedRequestState, int, int, bool]] = []  # (state, from, to, samples)
        for state, start, num_new in steps:
            if live.get(state.req_id) is not state:
                continue  # finished or preempted since the launch
            sampled = state.req_id in output.sampled_token_ids or (
                state.req_id in output.spec_token_ids
            )
            end = min(state.num_tokens if sampled else start + num_new, max_len)
            seen = self._seen.get(state.req_id)
            begin = seen[1] if seen is not None and seen[0] is state else _draft_from(state, start)
            if end <= begin:
                continue
            self._seen[state.req_id] = (state, end)
            items.append((state, begin, end, sampled and end == state.num_tokens))
        self._prune(live)
        if not items:
            return {}
        assert not any(s.num_pending for s, *_ in items), "drafts follow known tokens only"
        # pass 1, in passes of at most the draft's token budget (a request's tokens split
        # between passes if need be: only its last part samples)
        drafters: list[CachedRequestState] = []
        last_hidden: list[torch.Tensor] = []
        for group in _passes(items, runner.max_num_batched_tokens):
            # the attention backend batches decodes first, then fresh prompts, then the rest
            group.sort(key=lambda it: (it[2] - it[1] != 1, it[1] > 0, it[2] - it[1]))
            counts = [end - begin for _, begin, end, _ in group]
            starts = np.asarray([begin for _, begin, _, _ in group], dtype=np.int64)
            which = [i for i, it in enumerate(group) if it[3]]
            last = (np.cumsum(counts) - 1)[which]
            hidden = self._forward([it[0] for it in group], starts, counts, rows=last)
            if which:
                drafters += [group[i][0] for i in which]
                last_hidden.append(hidden)
        if not drafters:
            return {}
        hidden = last_hidden[0] if len(last_hidden) == 1 else torch.cat(last_hidden)
        tokens = [self._greedy(hidden)]
        # where each one's next draft goes: after its known tokens
        positions = np.asarray([s.num_tokens for s in drafters], dtype=np.int64)
        index = np.arange(len(drafters))  # the drafters still drafting, of ``drafters``
        active = [index]
        graphs = runner.graphs
        if graphs is not None and len(drafters) > graphs.max_batch_size:
            graphs = None
        if graphs is not None:  # (every decode pass's inputs staged at once)
            runner.staging.next_step()
        try:
            for j in range(self.k - 1):
                room = positions[index] < max_len  # (a draft at the last position ends it)
                if not room.all():
                    index = index[room]
                if not len(index):
                    break
                keep = None
                if len(index) < len(active[-1]):  # rows of the previous pass still drafting
                    keep = np.flatnonzero(np.isin(active[-1], index))
                states = [drafters[i] for i in index]
                if graphs is None:
                    hidden = self._forward(
                        states, positions[index], [1] * len(index), (tokens[-1], keep)
                    )
                else:  # (the block tables again only when the rows change)
                    rows_changed = j == 0 or keep is not None
                    hidden = self._replay(
                        graphs, states, positions[index], tokens[-1], keep,
                        self.k - 1 - j if rows_changed else 0,
                    )  # fmt: skip
                tokens.append(self._greedy(hidden))
                positions[index] += 1
                active.append(index)
        finally:
            if graphs is not None:
                runner.staging.step_launched()
        drafts: dict[str, list[int]] = {s.req_id: [] for s in drafters}
        flat = iter(torch.cat(tokens).tolist())  # (one copy to the host)
        for index in active:
            for i in index.tolist():
                drafts[drafters[i].req_id].append(next(flat))
        return drafts

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's greedy tokens after ``hidden``: rank 0's on every rank (under tensor
        parallelism every rank feeds them to its share of the next pass)."""
        tokens = fused.argmax(self.runner.model.compute_logits(hidden))
        if self.runner.tp_size > 1:
            distributed.broadcast(tokens)
        return tokens

    def _forward(
        self,
        reqs: list[CachedRequestState],
        starts: np.ndarray,
        counts: list[int],
        input_ids: tuple[torch.Tensor, np.ndarray | None] | None = None,
        rows: np.ndarray | None = None,
    ) -> torch.Tensor:
        """The draft's hidden states for ``counts[i]`` tokens of request ``i`` from position
        ``starts[i]`` on, writing their KV to the draft's pool: their ids from the batch's
        token table, or ``input_ids`` (on the device, its rows ``[1]``, None: all); the hidden
        states' ``rows`` only, if given. A first pass of at most ``k + 1`` tokens a request
        (a request's kept drafts and the token after them: the steady state) runs each token
        as a decode row, as the target checks drafts: on GPUs one replay of the decode graphs
        instead of the piecewise graphs' eager attention, on CPUs the C++ decode layers."""
        runner = self.runner
        stage = runner.staging.to_device
        graphs = runner.graphs
        split = input_ids is None and SPLIT_FIRST_PASS and max(counts) <= self.k + 1
        self.num_split_passes += split
        runner.staging.next_step()
        try:
            if split and graphs is not None and sum(counts) <= graphs.max_batch_size:
                hidden, _ = runner._run_split_graph(graphs, reqs, counts, starts)
            else:
                ids, positions, metadata, _ = runner._prepare_inputs(
                    reqs, counts, split, starts=starts
                )
                if input_ids is not None:
                    ids, keep = input_ids
                    if keep is not None:
                        ids = ids[stage(keep, torch.long)]
                hidden = runner._forward(ids, positions, metadata)
            if rows is not None:
                hidden = hidden[stage(rows, torch.long)]
        finally:
            runner.staging.step_launched()
        return hidden

    def _replay(
        self,
        graphs: DecodeGraphs,
        reqs: list[CachedRequestState],
        positions: np.ndarray,
        previous: torch.Tensor,
        keep: np.ndarray | None,
        span: int,
    ) -> torch.Tensor:
        """A decode pass from the draft's decode graphs: each request's previous draft
        (``previous``, its rows ``keep``) at its position. ``span`` > 0: copy the block
        tables, covering this pass and the ``span - 1`` after it; 0: the last copy's serve."""
        runner = self.runner
        stage = runner.staging
        bs = runner.block_size
        rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=len(reqs))
        table = runner.batch.block_table
        tables = None
        if span:
            width = min((int(positions.max()) + span - 1) // bs + 1, table.shape[1])
            tables = table[rows, :width]
        ids = previous if keep is None else previous[stage.to_device(keep, torch.long)]
        return graphs.run(
            input_ids=positions,  # (every row patched below)
            positions=positions,
            block_tables=tables,
            slot_block=table[rows, positions // bs],
            slot_offset=positions % bs,
            patch=lambda buffer: buffer.copy_(ids),
            host=lambda a: stage.host(a, torch.int64),
        )

    def _prune(self, live: dict[str, CachedRequestState]) -> None:
        if len(self._seen) > 2 * len(live) + 64:
            self._seen = {r: seen for r, seen in self._seen.items() if live.get(r) is seen[0]}


def _draft_from(state: CachedRequestState, start: int) -> int:
    """Where the draft's KV of a request new to it ends: its first step's start (the tokens
    before are cached blocks, whose draft KV was computed with them), or the first position
    of a prompt's KV pulled from another worker, which brought none of the draft's."""
    if state.remote_kv_from is None:
        return start
    return min(start, state.remote_kv_from)


def _passes(
    items: list[tuple[CachedRequestState, int, int, bool]], budget: int
) -> list[list[tuple[CachedRequestState, int, int, bool]]]:
    """``items`` (request, first position, end, whether it samples) in passes of at most
    ``budget`` tokens, in order; a request's range split where a pass fills up (its first
    parts sample nothing)."""
    passes: list[list[tuple[CachedRequestState, int, int, bool]]] = [[]]
    room = budget
    for state, begin, end, samples in items:
        while end - begin > room:
            if room:
                passes[-1].append((state, begin, begin + room, False))
                begin += room
            passes.append([])
            room = budget
        passes[-1].append((state, begin, end, samples))
        room -= end - begin
    return [p for p in passes if p]
