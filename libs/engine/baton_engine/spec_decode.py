"""Speculative decoding: drafts after a request's last token, checked in one forward pass.

The scheduler asks ``NgramProposer`` for a decoding request's drafts (the tokens that followed
the latest earlier occurrence of its last few tokens), or ``ModelDrafts`` for those a draft
model proposed after the request's last step, and schedules them after its last token;
the runner computes logits at every one of those positions and ``verify`` keeps the drafts the
model agrees with, then one token more:

- greedy rows keep draft ``j`` while it is the argmax at its position; the token after the
  kept ones is the argmax there (the tokens greedy decoding gives without drafts);
- sampled rows draw a token at every position, as sampling without drafts would draw it
  there, and keep draft ``j`` while it is the token drawn at its position; the token after
  the kept ones is the one drawn there. A draft is thus kept with probability ``p_j(draft_j)``
  and a rejected position gives a token of ``p_j`` without the draft, renormalized: the
  rejection sampling of Leviathan et al. and Chen et al., 2023, with a certain proposal (``q``
  one-hot). Each kept token is distributed as ``p``, and a seeded request, whose draws are
  seeded by its tokens' indices (``sampler.draw_seed``), gets the very tokens it gets without
  drafts.

The KV written at rejected positions is garbage the next steps overwrite: the scheduler moves
the request's computed tokens back to the kept ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from baton_engine.request import Request
from baton_engine.sampler import draw


class NgramProposer:
    """Drafts of up to ``k`` tokens: find the longest n-gram (``min_n`` <= n <= ``max_n``)
    that ends the request's tokens and occurred before, and propose what followed its latest
    earlier occurrence. Each request's tokens are mirrored in a numpy buffer, extended as they
    grow, so a lookup costs one vectorized scan of the context, not a copy of it."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # req_id -> (buffer, length)

    def propose(self, request: Request, max_drafts: int, extra: int = 0) -> list[int]:
        """At most ``min(k + extra, max_drafts)`` draft tokens to follow ``request``'s tokens
        (``extra``: how many of the first ones guess its pending tokens, for the caller to
        drop)."""
        limit = min(self.k + extra, max_drafts)
        if limit <= 0:
            return []
        return propose_ngram(self._sync(request), self.min_n, self.max_n, limit)

    def forget(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)

    def _sync(self, request: Request) -> np.ndarray:
        buf, n = self._tokens.get(request.req_id, (None, 0))
        prompt, output = request.prompt_token_ids, request.output_token_ids
        total = len(prompt) + len(output)
        if buf is None or buf.shape[0] < total:
            grown = np.empty(max(64, 2 * total), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < len(prompt):
            buf[n : len(prompt)] = prompt[n:]
            n = len(prompt)
        if n < total:
            buf[n:total] = output[n - len(prompt) :]
        self._tokens[request.req_id] = (buf, total)
        return buf[:total]


class ModelDrafts:
    """The drafts a draft model proposed for each request after the step that last ran it
    (``runner.draft``: its greedy tokens after the request's known ones), held until the
    request's next step takes them (``propose``), or replaced by the next step's."""

    def __init__(self) -> None:
        self._drafts: dict[str, list[int]] = {}

    def propose(self, request: Request, max_drafts: int, extra: int = 0) -> list[int]:
        assert not extra, "a draft model's drafts follow known tokens only (no async scheduling)"
        drafts = self._drafts.pop(request.req_id, [])
        return drafts[: max(0, max_drafts)]

    def record(self, req_ids: Iterable[str], drafts: Mapping[str, list[int]]) -> None:
        """After a step: the drafts of its requests ``req_ids`` (those ``drafts`` lacks have
        none: their tokens changed, or they may not decode)."""
        for req_id in req_ids:
            new = drafts.get(req_id)
            if new:
                self._drafts[req_id] = new
            else:
                self._drafts.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._drafts.pop(req_id, None)


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` of ``min_n`` to ``max_n`` tokens; [] if none occurred before."""
    size = tokens.shape[0]
    if size < min_n + 1:
        return []
    # candidates: positions j < size - 1 where an earlier copy of the suffix may end
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    best = None
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends
    if best is None:
        return []
    start = int(best[-1]) + 1
    drafts: list[int] = tokens[start : start + k].tolist()
    return drafts


def draft_rows(num_drafts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For requests with ``num_drafts[i]`` drafts each, whose ``num_drafts[i] + 1`` positions
    are consecutive rows: the first row of each request (``[S + 1]``, the last entry the
    total), and the rows of the drafts' positions, in order."""
    counts = np.asarray(num_drafts, dtype=np.int64)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts + 1, out=starts[1:])
    # draft j of request i, the (sum of counts[:i]) + j-th draft, sits at row starts[i] + j
    rows = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(
        np.arange(len(counts), dtype=np.int64), counts
    )
    return starts, rows


def verify(
    drafts: torch.Tensor,
    rows: torch.Tensor,
    greedy_ids: torch.Tensor | None,
    probs: torch.Tensor | None,
    greedy_rows: torch.Tensor | None = None,
    seeds: Mapping[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the drafts ``drafts`` (``[D]``) at their rows ``rows`` (``[D]``, see
    ``draft_rows``) of a step's ``R`` verified positions: whether each is accepted (``[D]``
    bool) and the token each position gives if the drafts before it are all it keeps
    (``[R]``). ``greedy_ids`` is each row's argmax, ``probs`` (``[R, V]``, modified) each
    row's sampling distribution, None when every row is greedy; with both, ``greedy_rows``
    (``[R]`` bool) marks the greedy rows. ``seeds``: the seeded rows' draws' seeds."""
    if probs is None:
        assert greedy_ids is not None
        target = greedy_ids
    else:
        target = draw(probs, seeds or {})
        if greedy_rows is not None and greedy_ids is not None:
            target = torch.where(greedy_rows, greedy_ids, target)
    return target[rows] == drafts, target


def kept_tokens(
    draft_ids: Sequence[Sequence[int]], accept: Sequence[bool], target: Sequence[int]
) -> list[list[int]]:
    """Each request's new tokens from ``verify``'s outputs (on the host): its drafts up to
    the first rejected one, then the token its position after them gives."""
    tokens: list[list[int]] = []
    j = r = 0  # its first draft's index, its first row
    for drafts in draft_ids:
        a = 0
        while a < len(drafts) and accept[j + a]:
            a += 1
        tokens.append([*drafts[:a], target[r + a]])
        j += len(drafts)
        r += len(drafts) + 1
    return tokens
