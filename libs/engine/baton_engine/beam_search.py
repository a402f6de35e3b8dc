"""Beam search as vLLM runs it (``LLM.beam_search``): on top of the engine, one token at a time.

Each step asks the engine for one more token of every live beam (its whole sequence as the
prompt: the prefix cache computes only the new position) with the top ``2 * beam_width``
logprobs; every beam grows by each of those tokens; a beam that took an EOS is complete (unless
``ignore_eos``); each prompt keeps its ``beam_width`` best live beams. At the end the complete
and live beams are ranked together. A beam's score is its cumulative logprob divided by its
length (prompt included, a final EOS not) to the power ``length_penalty``, as vLLM's
``get_beam_search_score``.

:func:`expand` is the step's arithmetic alone (no engine), so that any caller's loop shares it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from baton_engine.errors import InvalidRequestError
from baton_engine.outputs import Logprob, SampleLogprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: how many beams each prompt keeps, and how long they grow."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be non-negative, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and then the generated ones (vLLM's shape);
    ``logprobs`` one dict per generated token."""

    tokens: list[int]
    logprobs: SampleLogprobs = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos_token_ids: Collection[int], length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``."""
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_token_ids:
        length -= 1
    try:
        divisor = float(length**length_penalty)
    except OverflowError:  # an extreme penalty: every beam scores (minus) zero
        divisor = math.inf
    if divisor == 0.0:  # (an extreme negative one underflows)
        return -math.inf if beam.cum_logprob < 0 else 0.0
    return beam.cum_logprob / divisor


def expand(
    beams: Sequence[BeamSearchSequence],
    next_logprobs: Sequence[dict[int, Logprob] | None],
    params: BeamSearchParams,
    eos_token_ids: Collection[int],
    completed: list[BeamSearchSequence],
) -> list[BeamSearchSequence]:
    """One step of one prompt: ``next_logprobs[i]`` is the top of beam ``i``'s next token
    (None: the beam could not grow, e.g. at the context's end: it is dropped, as vLLM). Beams
    ending in an EOS go to ``completed``; the best ``beam_width`` others are returned."""
    grown = []
    for beam, top in zip(beams, next_logprobs, strict=True):
        for token_id, lp in (top or {}).items():
            new = BeamSearchSequence(
                tokens=[*beam.tokens, token_id],
                logprobs=[*beam.logprobs, top or {}],
                cum_logprob=beam.cum_logprob + lp.logprob,
            )
            if token_id in eos_token_ids and not params.ignore_eos:
                new.finish_reason, new.stop_reason = "stop", None
                completed.append(new)
            else:
                grown.append(new)
    grown.sort(key=lambda b: score(b, eos_token_ids, params.length_penalty), reverse=True)
    return grown[: params.beam_width]


def best(
    live: list[BeamSearchSequence],
    completed: list[BeamSearchSequence],
    params: BeamSearchParams,
    eos_token_ids: Collection[int],
) -> list[BeamSearchSequence]:
    """The final ranking: complete and live beams together (live ones ran out of length)."""
    for beam in live:
        beam.finish_reason = "length"
    ranked = sorted(
        [*completed, *live],
        key=lambda b: score(b, eos_token_ids, params.length_penalty),
        reverse=True,
    )
    return ranked[: params.beam_width]
