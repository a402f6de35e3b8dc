"""Repetition, frequency and presence penalties on a batch of logits, with vLLM V1's rules.

* repetition (multiplicative, as in HF/CTRL): for every token that occurs in the row's prompt OR
  its output so far, a positive logit is divided by the penalty and a non-positive one multiplied
  by it, so a penalty > 1 always makes the token less likely whatever the logit's sign;
* frequency (additive, OpenAI): ``logit -= frequency_penalty * count_in_output``;
* presence (additive, OpenAI): ``logit -= presence_penalty * (count_in_output > 0)``.

Frequency and presence look at generated tokens only; the prompt never counts for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["apply_penalties", "token_counts", "token_presence"]


def _flat_indices(token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Indices into a flattened ``[B, vocab_size]`` tensor, one per token occurrence.

    Ids outside ``[0, vocab_size)`` are dropped: the logits have no column for them, so there is
    nothing to penalise (a tokenizer's vocabulary may be larger than the model's logit width).
    """
    lengths = torch.tensor([len(row) for row in token_ids], dtype=torch.int64)
    # One conversion of the concatenated ids beats one small tensor per row for large batches.
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids), dtype=torch.int64), lengths)
    keep = (flat >= 0) & (flat < vocab_size)
    return rows[keep] * vocab_size + flat[keep]


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[B, vocab_size]`` float32 tensor: how often each token id occurs in each row.

    Built by one ``scatter_add_`` into zeros; float32 so that it multiplies the float32 logits
    without a cast (counts stay exact far beyond any sequence length).
    """
    counts = torch.zeros(len(token_ids) * vocab_size, dtype=torch.float32, device=device)
    index = _flat_indices(token_ids, vocab_size).to(device)
    if index.numel():
        counts.scatter_add_(0, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts.view(len(token_ids), vocab_size)


def token_presence(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[B, vocab_size]`` bool tensor: whether each token id occurs in each row."""
    seen = torch.zeros(len(token_ids) * vocab_size, dtype=torch.bool, device=device)
    index = _flat_indices(token_ids, vocab_size).to(device)
    if index.numel():
        seen.index_fill_(0, index, True)
    return seen.view(len(token_ids), vocab_size)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return ``logits`` ([B, V] float32) with the three penalties applied per row.

    ``logits`` may be modified in place: pass a scratch copy. The penalty tensors are ``[B]``;
    rows with repetition 1.0 and frequency/presence 0.0 come back unchanged. Each penalty's
    count tensors are built only when some row of the batch uses that penalty, and the prompt
    is only scanned for the repetition penalty.
    """
    num_rows, vocab_size = logits.shape
    if not len(prompt_token_ids) == len(output_token_ids) == num_rows:
        raise ValueError(
            f"need {num_rows} prompt and output token rows, got {len(prompt_token_ids)} and "
            f"{len(output_token_ids)}"
        )
    device = logits.device
    repetition = repetition_penalties.to(device=device, dtype=torch.float32)
    frequency = frequency_penalties.to(device=device, dtype=torch.float32)
    presence = presence_penalties.to(device=device, dtype=torch.float32)
    use_repetition = bool((repetition != 1.0).any())
    use_frequency = bool((frequency != 0.0).any())
    use_presence = bool((presence != 0.0).any())
    if not (use_repetition or use_frequency or use_presence):
        return logits

    output_counts = token_counts(output_token_ids, vocab_size, device)
    if use_repetition:
        seen = token_presence(prompt_token_ids, vocab_size, device) | (output_counts > 0)
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
        # Dividing a negative logit would raise it; multiplying keeps "penalty > 1 = less likely".
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if use_frequency:
        logits.sub_(frequency.unsqueeze(1) * output_counts)
    if use_presence:
        logits.sub_(presence.unsqueeze(1) * (output_counts > 0))
    return logits
