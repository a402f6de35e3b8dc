"""The runner's persistent per-request state, updated from each SchedulerOutput's diff.

Every request the runner holds owns one row of two preallocated tables, its token ids and its
block ids, filled as tokens and blocks are appended, so a step gathers from rows instead of
rebuilding per-request lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from baton_engine.core.outputs import SchedulerOutput
from baton_engine.pooling_params import PoolingParams
from baton_engine.sampling_params import SamplingParams


@dataclass(eq=False)  # compared by identity
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    row: int  # its row of the block table
    num_blocks: int
    num_computed_tokens: int
    # its seed if it samples with one (not greedy): each token's draw is seeded by it and the
    # token's index (sampler.draw_seed), whoever sampled the tokens before
    seed: int | None
    # prompt + output tokens on the host, in its row of the token table (the output tokens are
    # kept there only: InputBatch.output_token_ids)
    num_tokens: int = 0
    # Tokens sampled by launched steps whose ids are still on the device: the last is the
    # input of this request's next decode (see ModelRunner.launch).
    num_pending: int = 0

    # sampling that reads nothing of the request's own tokens but min_tokens, and no grammar
    # (set below)
    host_free: bool = False
    # and greedy with nothing reported or reshaped (logit_bias, allowed_token_ids): the argmax
    # alone
    plain_greedy: bool = False
    wants_prompt_logprobs: bool = False
    pooling: PoolingParams | None = None  # an embedding request: its prompt's rows are pooled
    # MEAN / CLS pooling: the float32 sum of its prompt rows so far, or its first row
    pooled_rows: torch.Tensor | None = None
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    remote_kv_from: int | None = None  # NewRequestData.remote_kv_from
    # Its prompt as input embeddings, on the device (NewRequestData.prompt_embeds): the inputs
    # of its prompt's positions (its prompt_token_ids are the rows' ids, its token table row
    # zeros there)
    prompt_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        sp = self.sampling_params
        self.host_free = (
            sp.logprobs is None
            and sp.prompt_logprobs is None
            and sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0
            and sp.repetition_penalty == 1.0
            and sp.structured_outputs is None  # its mask needs its last token accepted
            and not sp.bad_words_token_ids  # their mask reads the output's last tokens
        )
        self.plain_greedy = (
            self.host_free
            and sp.is_greedy
            and sp.logit_bias is None
            and sp.allowed_token_ids is None
        )
        self.wants_prompt_logprobs = sp.prompt_logprobs is not None

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def always_host_free(self) -> bool:
        return self.host_free and self.sampling_params.min_tokens == 0

    @property
    def always_plain_greedy(self) -> bool:
        return self.plain_greedy and self.sampling_params.min_tokens == 0


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.device = device
        # row -> block ids / token ids; rows are handed out and returned as requests come and go
        max_blocks_per_req = -(max_model_len // -block_size)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.token_table = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}  # req_id -> state
        # Held requests whose sampling may need their tokens on the host (penalties, logprobs,
        # bad words, min_tokens), and those that are not plain greedy: when none, a step skips
        # the per-request checks.
        self.num_host_bound = 0
        self.num_not_plain_greedy = 0
        self.num_prompt_logprobs = 0  # held requests that ask for prompt logprobs
        self.num_pooling = 0  # held embedding requests
        self.num_lora = 0  # held requests with a LoRA adapter
        self.num_prompt_embeds = 0  # held requests whose prompts are embeddings
        self.num_removed = 0  # requests dropped so far (see record_sampled)
        # Custom logits processors are loaded: every request's sampling may read its tokens on
        # the host (none is host-free or plain greedy)
        self.host_bound = False

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._remove(req_id)
        for new in so.scheduled_new_reqs:
            self._remove(new.req_id)  # resumed after preemption: rebuilt from full data
            sp = new.sampling_params
            num_prompt = len(new.prompt_token_ids)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=sp,
                row=self._free_rows.pop(),
                num_blocks=0,
                num_computed_tokens=new.num_computed_tokens,
                seed=None if sp.is_greedy else sp.seed,
                num_tokens=num_prompt + len(new.output_token_ids),
                pooling=new.pooling,
                lora_name=new.lora_name,
                remote_kv_from=new.remote_kv_from,
                prompt_embeds=(
                    None if new.prompt_embeds is None else new.prompt_embeds.to(self.device)
                ),
            )
            if self.host_bound:
                state.host_free = state.plain_greedy = False
            self.requests[new.req_id] = state
            self._count(state, 1)
            # (an embeddings prompt's rows' ids are no tokens: its inputs are the embeddings)
            self.token_table[state.row, :num_prompt] = (
                new.prompt_token_ids if new.prompt_embeds is None else 0
            )
            self.token_table[state.row, num_prompt : state.num_tokens] = new.output_token_ids
            self._append_blocks(state, new.block_ids)
        requests = self.requests
        for cached in so.scheduled_cached_reqs:
            state = requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_block_ids:
                self._append_blocks(state, cached.new_block_ids)
        for req_id, drafts in so.spec_token_ids.items():
            # the step's inputs after the request's last token, pending or not (record_spec
            # overwrites them)
            state = requests[req_id]
            start = state.num_tokens + state.num_pending
            self.token_table[state.row, start : start + len(drafts)] = drafts

    def _append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if block_ids:
            self.block_table[state.row, state.num_blocks : state.num_blocks + len(block_ids)] = (
                block_ids
            )
            state.num_blocks += len(block_ids)

    def _count(self, state: CachedRequestState, sign: int) -> None:
        self.num_host_bound += sign * (not state.always_host_free)
        self.num_not_plain_greedy += sign * (not state.always_plain_greedy)
        self.num_prompt_logprobs += sign * state.wants_prompt_logprobs
        self.num_pooling += sign * (state.pooling is not None)
        self.num_lora += sign * (state.lora_name is not None)
        self.num_prompt_embeds += sign * (state.prompt_embeds is not None)

    def _remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._count(state, -1)
            self.num_removed += 1
            self._free_rows.append(state.row)

    def output_token_ids(self, state: CachedRequestState) -> list[int]:
        """The request's output tokens on the host (a full-length request's last one, which
        has no slot in the table, is left out: nothing is sampled after it)."""
        tokens: list[int] = self.token_table[
            state.row, len(state.prompt_token_ids) : state.num_tokens
        ].tolist()
        return tokens

    def live_output_token_ids(self, state: CachedRequestState) -> Sequence[int]:
        """The request's output tokens on the host as a view that grows with them (what a
        logits processor keeps of a request it is told of)."""
        return _LiveTokens(self.token_table, state)

    def record_spec(
        self, states: list[CachedRequestState], tokens: list[list[int]], num_removed: int
    ) -> None:
        """``record_sampled`` for requests that had drafts: each one's kept drafts and the
        token after them (``tokens``), over the drafts in its row."""
        live = self.requests if num_removed != self.num_removed else None
        width = self.token_table.shape[1]
        for state, new in zip(states, tokens, strict=True):
            state.num_pending -= 1
            if live is not None and live.get(state.req_id) is not state:
                continue  # finished or preempted since: its row is another's
            start = state.num_tokens
            end = min(start + len(new), width)  # (a full-length request's last needs none)
            self.token_table[state.row, start:end] = new[: end - start]
            state.num_tokens += len(new)

    def record_sampled(
        self,
        states: list[CachedRequestState],
        token_ids: list[int] | np.ndarray,
        num_removed: int,
        rows: np.ndarray | None = None,
    ) -> None:
        """One launched step's sampled tokens reached the host: one for each of ``states`` (or
        a row of ``k`` each, ``[len(states), k]``: a multi-step's passes), no longer pending.
        Each held request records its tokens; one finished or preempted since the launch
        (``num_removed`` was ``self.num_removed`` then) has given its row away. ``rows``: the
        states' rows, in order, if the caller has them."""
        ids = np.asarray(token_ids, dtype=np.int64)
        k = 1 if ids.ndim == 1 else ids.shape[1]
        for state in states:
            state.num_pending -= k
        if num_removed != self.num_removed:  # some state may be gone: keep the held ones
            live = self.requests
            keep = [i for i, s in enumerate(states) if live.get(s.req_id) is s]
            states, ids, rows = [states[i] for i in keep], ids[keep], None
        n = len(states)
        if rows is None:
            rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        cols = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=n)
        for state in states:
            state.num_tokens += k
        if k > 1:  # row i's tokens go to columns cols[i], cols[i] + 1, ...
            cols = (cols[:, None] + np.arange(k)).ravel()
            rows, ids = np.repeat(rows, k), ids.ravel()
        if n and cols.max() >= self.token_table.shape[1]:
            # the last token of a full-length request needs no slot
            keep_slot = cols < self.token_table.shape[1]
            rows, cols, ids = rows[keep_slot], cols[keep_slot], ids[keep_slot]
        self.token_table[rows, cols] = ids


class _LiveTokens(Sequence[int]):
    """A request's output tokens in its row of the token table, up to its host tokens."""

    def __init__(self, table: np.ndarray, state: CachedRequestState) -> None:
        self._table, self._state = table, state

    def _tokens(self) -> np.ndarray:
        state = self._state
        return self._table[state.row, len(state.prompt_token_ids) : state.num_tokens]

    def __len__(self) -> int:
        return len(self._tokens())

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        value: int | list[int] = self._tokens()[index].tolist()
        return value

    def __repr__(self) -> str:
        return repr(self._tokens().tolist())
