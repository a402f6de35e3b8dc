"""Token sampler: per-step logits processing and sampling for a batch of requests (vLLM V1).

One call of :class:`Sampler` on ``[B, V]`` logits does, in this order:

1. upcast to float32, as a copy: the caller's tensor is never modified;
2. if any row wants logprobs, ``log_softmax`` of these RAW logits (vLLM V1's default
   ``raw_logprobs`` mode): the model's own distribution, before any per-request shaping (or,
   by the sampler's ``logprobs_mode``, the raw logits themselves, or the log-probabilities or
   logits a token is drawn from, after steps 3-6: see ``LOGPROBS_MODES``);
3. suppressed token ids (EOS/stop ids while below ``min_tokens``), the tokens outside a row's
   ``allowed_token_ids``, the last token of each of its bad words whose other tokens end its
   output, and those its grammar forbids (structured output) set to ``-inf``; a row's
   ``logit_bias`` added; then custom logits processors that may change the argmax
   (``baton_engine.logits_processor``);
4. repetition, frequency and presence penalties (:mod:`baton_engine.penalties`);
5. greedy rows take the argmax; when every row is greedy the step ends here;
6. random rows: temperature, argmax-invariant custom processors, top-k, top-p, min-p, then one
   draw from ``softmax``. On CPUs by the inverse CDF (one uniform per row, the cumulative sum
   in float64); elsewhere by the exponential race ``argmax(probs / q)`` with ``q ~ Exp(1)``
   (one Triton kernel for a batch with seeded rows), which needs no CDF search but a random
   number per token (on CPUs that cost ~5 ms a step for 16 x 49,152). A seeded request's row
   draws with a seed of its seed and the index of the token drawn (``draw_seed``), so its
   tokens depend on neither the rest of the batch, nor its row, nor how its run went: a
   preemption, a prefill worker sampling its first token, drafts checked a step (speculative
   decoding draws at each position as sampling without them would).

A row whose every token ends up ``-inf`` (everything suppressed) has no valid distribution;
callers must not suppress a whole vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton_engine import penalties
from baton_engine.config import LOGPROBS_MODES
from baton_engine.sampling_params import SamplingParams
from baton_engine.structured_output import apply_bitmask
from baton_kernels import fused

__all__ = [
    "LOGPROBS_MODES",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_logprobs",
    "draw",
    "draw_seed",
    "suppress_tokens",
]

# GPUs: batches with seeded rows drawn by the Triton kernel of baton_kernels.triton.sample
# (False: torch's exponential_, division and argmax, a reseed and a launch a seeded row; an A/B
# switch for benchmarks/bench_sampler.py).
RACE_KERNEL = True
# Same threshold as SamplingParams.is_greedy: temperatures below it mean argmax.
_SAMPLING_EPS = 1e-5
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step, per-row sampling inputs for a batch of ``B`` rows (row i = logits row i).

    Tensors are ``[B]`` and should live on the logits' device (they are moved if not). Disabled
    values: temperature 0 (greedy), top_k 0, top_p 1.0, min_p 0.0, penalties 1.0/0.0/0.0. The
    optional tensors are ``None`` when no row uses the feature, which skips its work entirely.
    ``seeds`` maps a row of a seeded request to the seed of its draw (``draw_seed``).
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: dict[int, int]
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    suppressed_token_ids: list[Sequence[int]]
    # Structured output: ``[B, ceil(V / 32)]`` int32, bit ``t`` of row i set when row i may
    # sample token ``t``, applied to ``grammar_rows`` (the rows with a grammar) only; None when
    # no row has one.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: Sequence[int] = ()
    # Per row: its logit_bias, allowed_token_ids and bad words' token sequences (None: unused);
    # empty when no row has any.
    logit_bias: Sequence[Mapping[int, float] | None] = ()
    allowed_token_ids: Sequence[Sequence[int] | None] = ()
    bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] = ()
    # Custom logits processors (baton_engine.logits_processor): called with the float32
    # logits and whether to run the argmax-invariant ones, returning the logits; None: none.
    processors: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Mapping[int, int],
        suppressed_token_ids: Sequence[Sequence[int]] | None = None,
        *,
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: Sequence[int] = (),
        processors: Callable[[torch.Tensor, bool], torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build the metadata of one step from each row's params and token history.

        Greedy rows (``SamplingParams.is_greedy``: temperature ~0 or top_k 1) get temperature 0,
        and their seeds are dropped, since argmax never draws. ``suppressed_token_ids``
        defaults to nothing suppressed. Raises ``ValueError`` if a per-row list's length differs
        from ``len(params)`` or a seed's row is out of range.
        """
        num_rows = len(params)
        suppressed: Sequence[Sequence[int]] = (
            [[] for _ in params] if suppressed_token_ids is None else suppressed_token_ids
        )
        for name, rows in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("suppressed_token_ids", suppressed),
        ):
            if len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows for {num_rows} params")
        if any(not 0 <= row < num_rows for row in seeds):
            raise ValueError(f"seeded rows {sorted(seeds)} out of range for {num_rows}")

        greedy = [p.is_greedy for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        no_penalties = all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            for p in params
        )
        return cls(
            temperature=floats(
                [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
            ),
            all_greedy=all(greedy),
            all_random=num_rows > 0 and not any(greedy),
            top_k=(
                to_device(torch.tensor(top_k, dtype=torch.int64), device)
                if any(k > 0 for k in top_k)
                else None
            ),
            top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=floats(min_p) if any(p > 0.0 for p in min_p) else None,
            seeds={row: seed for row, seed in seeds.items() if not greedy[row]},
            max_num_logprobs=max(logprobs) if logprobs else None,
            no_penalties=no_penalties,
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            suppressed_token_ids=list(suppressed),
            grammar_bitmask=None if grammar_bitmask is None else to_device(grammar_bitmask, device),
            grammar_rows=list(grammar_rows),
            logit_bias=(
                [p.logit_bias for p in params] if any(p.logit_bias for p in params) else []
            ),
            allowed_token_ids=(
                [p.allowed_token_ids for p in params]
                if any(p.allowed_token_ids is not None for p in params)
                else []
            ),
            bad_words_token_ids=(
                [p.bad_words_token_ids for p in params]
                if any(p.bad_words_token_ids for p in params)
                else []
            ),
            processors=processors,
        )


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of one step from the raw logits, for every row (callers slice per request).

    ``token_ids``/``logprobs`` are ``[B, 1 + N]``: column 0 is the sampled token, then the top N
    (``N = max_num_logprobs``) in descending order. ``ranks`` is ``[B]``: the sampled token's
    1-based rank under the raw distribution (ties count in the token's favour: rank = number of
    tokens with logprob >= its own).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass(frozen=True)
class SamplerOutput:
    """``sampled_token_ids``: ``[B]`` int64 on the logits' device; ``logprobs`` or ``None``."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def suppress_tokens(logits: torch.Tensor, suppressed_token_ids: Sequence[Sequence[int]]) -> None:
    """Set ``logits[i, t] = -inf`` for every ``t`` in row i's list, in place.

    Ids outside ``[0, V)`` are ignored: a token the logits cannot produce needs no suppressing.
    """
    vocab_size = logits.size(1)
    flat = [
        row * vocab_size + t
        for row, ids in enumerate(suppressed_token_ids)
        for t in ids
        if 0 <= t < vocab_size
    ]
    if flat:  # the usual case is nothing suppressed: no tensor, no kernel
        index = to_device(torch.tensor(flat, dtype=torch.int64), logits.device)
        logits.view(-1).index_fill_(0, index, _NEG_INF)


def allow_only(logits: torch.Tensor, allowed: Sequence[Sequence[int] | None]) -> None:
    """Set ``logits[i, t] = -inf`` for every ``t`` not in row i's list, in place (rows whose
    list is None are left alone). The mask is built on the logits' device: only the ids move."""
    rows = [i for i, ids in enumerate(allowed) if ids is not None]
    if not rows:
        return
    keep_rows = [j for j, i in enumerate(rows) for _ in allowed[i] or ()]
    keep_ids = [t for i in rows for t in allowed[i] or ()]
    index = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
    keep = to_device(torch.tensor([keep_rows, keep_ids], dtype=torch.int64), logits.device)
    mask = torch.ones(len(rows), logits.size(1), dtype=torch.bool, device=logits.device)
    mask[keep[0], keep[1]] = False
    logits[index] = logits[index].masked_fill_(mask, _NEG_INF)


def ban_bad_words(
    logits: torch.Tensor,
    bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """Set ``logits[i, w[-1]] = -inf``, in place, for each of row i's sequences ``w`` that is
    one token long or whose other tokens ``w[:-1]`` end row i's output (vLLM's
    ``apply_bad_words``: the prompt does not count)."""
    vocab_size = logits.size(1)
    flat = []
    for row, sequences in enumerate(bad_words_token_ids):
        output = output_token_ids[row]
        num_output = len(output)
        for ids in sequences or ():
            prefix = len(ids) - 1
            if prefix == 0 or (
                prefix <= num_output and list(output[num_output - prefix :]) == list(ids[:-1])
            ):
                flat.append(row * vocab_size + ids[-1])
    if flat:
        index = to_device(torch.tensor(flat, dtype=torch.int64), logits.device)
        logits.view(-1).index_fill_(0, index, _NEG_INF)


def add_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> None:
    """Add row i's bias to ``logits[i, t]`` for each of its tokens ``t``, in place."""
    vocab_size = logits.size(1)
    flat = [
        (row * vocab_size + t, b)
        for row, bias in enumerate(biases)
        for t, b in (bias or {}).items()
    ]
    if flat:
        index = to_device(torch.tensor([f for f, _ in flat], dtype=torch.int64), logits.device)
        values = to_device(torch.tensor([b for _, b in flat], dtype=logits.dtype), logits.device)
        logits.view(-1).index_add_(0, index, values)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small CPU tensor on ``device``; to a GPU through pinned memory, so that the copy does
    not wait for the work already queued (a copy from pageable memory may, which would stall
    async scheduling)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Return a float32 copy of ``logits`` with ``metadata``'s penalties applied (input untouched).

    The same processing :class:`Sampler` does between suppression and sampling; exposed so the
    rules can be checked on logits rather than through sampling statistics.
    """
    scratch = logits.to(torch.float32, copy=True)
    if metadata.no_penalties:
        return scratch
    return penalties.apply_penalties(
        scratch,
        metadata.prompt_token_ids,
        metadata.output_token_ids,
        metadata.presence_penalties,
        metadata.frequency_penalties,
        metadata.repetition_penalties,
    )


def compute_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Sampled token's logprob and rank plus the top ``num_logprobs`` of ``raw_logprobs``."""
    sampled_col = sampled.unsqueeze(1)
    sampled_logprob = raw_logprobs.gather(1, sampled_col)
    ranks = (raw_logprobs >= sampled_logprob).sum(dim=1)
    num = min(num_logprobs, raw_logprobs.size(1))
    if num == 0:
        return LogprobsTensors(sampled_col, sampled_logprob, ranks)
    top_logprobs, top_ids = raw_logprobs.topk(num, dim=1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled_col, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        ranks=ranks,
    )


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: ``topk`` to the batch's largest k, then a threshold mask."""
    vocab_size = logits.size(1)
    disabled = (top_k <= 0) | (top_k >= vocab_size)
    # Disabled rows ask for 1 so they do not inflate the batch's topk width; unmasked below.
    k = top_k.masked_fill(disabled, 1)
    top_values = logits.topk(int(k.max()), dim=1).values
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))
    kth_value.masked_fill_(disabled.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth_value, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to ``-inf``, in place) tokens outside each row's top-k and top-p nucleus.

    ``top_k`` 0 (or >= V) and ``top_p`` 1.0 disable a row. Top-p keeps the smallest set of most
    likely tokens whose probability reaches p, and always keeps at least the most likely token;
    with top-k too, p applies to the distribution renormalised over the top k.

    The cut is a logit threshold, and tokens tied with a row's last kept logit are all kept:
    - on CPUs, from each row's ``topk`` of 256 where the nucleus lies within it, else from the
      row's values sorted by numpy (torch's sort with indices takes ~40 ms for 16 rows of a
      49,152-token vocabulary there);
    - on GPUs, top-p alone, by the search of ``baton_kernels.triton.top_p`` (a sort of 256 rows
      of 151,936 took 4.2 ms on an H200), which never waits for the device.
    With top-k on a GPU, every row is sorted with its indices.
    """
    if top_p is None:
        return logits if top_k is None else _apply_top_k_only(logits, top_k)
    vocab_size = logits.size(1)
    k = (
        None
        if top_k is None
        else torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    )
    if logits.device.type == "cpu":
        return _apply_top_k_top_p_topk_first(logits, k, top_p)
    if k is None and logits.is_cuda and logits.dtype == torch.float32 and _has_triton():
        from baton_kernels.triton.top_p import top_p_threshold

        cut = top_p_threshold(logits, top_p).unsqueeze(1)
        return logits.masked_fill_(logits < cut, _NEG_INF)
    return _apply_top_k_top_p_sorted(logits, k, top_p)


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _apply_top_k_top_p_topk_first(
    logits: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p`` on CPU tensors (``k`` already V where top-k is off): each row's cut
    from its ``topk`` of ``_TOP_P_WIDTH`` logits where that settles it, else from the whole row's
    values sorted by numpy (a vectorised sort, ~13x faster than torch's here: 3.1 against 40 ms
    for 16 x 49,152)."""
    vocab_size = logits.size(1)
    threshold = torch.full_like(top_p, _NEG_INF, dtype=logits.dtype)
    lse = logits.logsumexp(dim=1)
    rows = torch.arange(logits.size(0))
    if vocab_size > _TOP_P_WIDTH:
        top = logits.topk(_TOP_P_WIDTH, dim=1).values
        cut, done = _top_p_cut(top, k, top_p, lse, vocab_size)
        threshold[done] = cut[done]
        rows = rows[~done]
    if len(rows):
        values = np.sort(logits[rows].numpy(), axis=1)[:, ::-1]  # descending
        cut, _ = _top_p_cut(
            torch.from_numpy(values.copy()),
            None if k is None else k[rows],
            top_p[rows],
            lse[rows],
            vocab_size,
        )
        threshold[rows] = cut
    return logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


# The ``topk`` width in which the CPU path looks for a row's nucleus before sorting the row.
_TOP_P_WIDTH = 256


def _top_p_cut(
    top: torch.Tensor,
    k: torch.Tensor | None,
    top_p: torch.Tensor,
    lse: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's smallest kept logit, from its ``W`` largest (``top``, descending), and whether
    that settles the row: its top-k lies within them, or their probability reaches p.

    ``k`` (per row, V when off) and ``lse`` (the logsumexp of each whole row) as in the caller."""
    width = top.size(1)
    kth = torch.full_like(lse, _NEG_INF)
    fits = beyond = torch.zeros_like(top_p, dtype=torch.bool)
    if k is not None:
        fits = k <= width
        beyond = ~fits & (k < vocab_size)  # p applies within a top k wider than ``top``
        top = top.masked_fill(torch.arange(width, device=top.device) >= k.unsqueeze(1), _NEG_INF)
        kth = torch.where(
            fits, top.gather(1, (k.clamp(max=width) - 1).unsqueeze(1)).squeeze(1), kth
        )
        lse = torch.where(fits, top.logsumexp(dim=1), lse)  # p applies within the top k
    cumulative = (top - lse.unsqueeze(1)).exp_().cumsum_(dim=1)
    # Token j + 1 is kept when the mass above it, ``cumulative[j]``, is below p; token 0 always.
    below = torch.searchsorted(cumulative, top_p.unsqueeze(1).to(cumulative.dtype))
    last = top.gather(1, below.clamp_(max=width - 1)).squeeze(1)
    off = top_p >= 1.0
    done = fits | ~beyond & (off | (cumulative[:, -1] >= top_p))
    return torch.maximum(torch.where(off, _NEG_INF, last), kth), done


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p`` by a full sort of each row (``k`` already V where top-k is off)."""
    vocab_size = logits.size(1)
    # Ascending sort: the top-k cut is one gather, and a cumulative sum from the unlikely end
    # gives the top-p cut without a second pass.
    sorted_logits, order = logits.sort(dim=1)
    if k is not None:
        kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_value, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=1).cumsum(dim=1)
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False
    sorted_logits.masked_fill_(outside, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (in place) tokens whose probability is below ``min_p`` times the row's largest."""
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw of its output token ``index`` (0 for the first):
    a hash of both, so that each token's draw depends on them alone (63 bits, as
    ``torch.Generator.manual_seed`` takes; its CPU generator keeps the low 32, mixed as well)."""
    return _mix64((_mix64(seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64) >> 1


_thread = threading.local()  # engines in two threads of a process reseed their own


def _draw_generator(device: torch.device) -> torch.Generator:
    """The generator seeded rows draw from on ``device``, seeded afresh before each draw."""
    generators: dict[torch.device, torch.Generator] = _thread.__dict__.setdefault("gens", {})
    generator = generators.get(device)
    if generator is None:
        generator = generators[device] = torch.Generator(device=device)
    return generator


def draw(probs: torch.Tensor, seeds: Mapping[int, int]) -> torch.Tensor:
    """One token per row from ``probs`` (rows need not sum to 1); the rows in ``seeds`` draw
    with their seed (``draw_seed``), the others from the default generator."""
    if probs.device.type == "cpu":
        return _inverse_cdf(probs, seeds)
    return _exponential_race(probs, seeds)


def _inverse_cdf(probs: torch.Tensor, seeds: Mapping[int, int]) -> torch.Tensor:
    """Draw one token per row: the first whose cumulative probability exceeds ``u`` times the
    row's total, with one uniform ``u`` per row (float64). Unseeded rows share one batched draw
    from the default RNG; seeded rows then draw theirs with their own seed.

    A row whose constraints left no token (all NaN after the softmax) finds none: it gets the
    last token id, a meaningless but valid one (the vocabulary size would fail the step)."""
    u = torch.empty(probs.size(0), dtype=torch.float64)
    if len(seeds) < probs.size(0):
        u.uniform_()
    if seeds:
        generator = _draw_generator(probs.device)
        for row, seed in seeds.items():
            u[row : row + 1].uniform_(generator=generator.manual_seed(seed))
    cdf = probs.to(torch.float64).cumsum_(dim=1)
    total = cdf[:, -1:]
    # Below the total (u * total may round up to it), so the token found has a probability.
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=probs.size(1) - 1)


def _exponential_race(probs: torch.Tensor, seeds: Mapping[int, int]) -> torch.Tensor:
    """Draw one token per row from ``probs``: ``argmax(probs / q)`` with ``q ~ Exp(1)``.

    Unseeded rows share one batched draw from the default RNG; seeded rows then overwrite their
    row with draws seeded by their own seed, so their tokens depend only on it. On a GPU with
    Triton, a batch with seeded rows is drawn by one kernel (``baton_kernels.triton.sample``;
    unseeded rows with seeds from the default CPU generator), not a reseed and a launch a
    seeded row: 0.40 against 1.95 ms for 256 seeded rows of 151,936 on an H100 (0.09 against
    0.04 for one; without seeded rows torch's three launches are as fast or faster).
    """
    if seeds and RACE_KERNEL and probs.is_cuda and probs.dtype == torch.float32 and _has_triton():
        from baton_kernels.triton.sample import exponential_race

        row_seeds = torch.randint(0, 1 << 62, (probs.size(0),), dtype=torch.int64)
        row_seeds[torch.tensor(list(seeds), dtype=torch.int64)] = torch.tensor(
            list(seeds.values()), dtype=torch.int64
        )
        return exponential_race(probs, to_device(row_seeds, probs.device))
    q = torch.empty_like(probs)
    if len(seeds) < probs.size(0):
        q.exponential_()
    if seeds:
        generator = _draw_generator(probs.device)
        for row, seed in seeds.items():
            q[row].exponential_(generator=generator.manual_seed(seed))
    return probs.div_(q).argmax(dim=1)


class Sampler:
    """Turns one step's ``[B, V]`` logits into one token per row (see the module docstring);
    ``logprobs_mode``: what its logprobs report (``LOGPROBS_MODES``)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode
        self.processed = logprobs_mode.startswith("processed")

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row; ``logits`` may be any float dtype and is not modified."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        if metadata.temperature.numel() != logits.size(0):
            raise ValueError(
                f"metadata has {metadata.temperature.numel()} rows, logits {logits.size(0)}"
            )
        # no_grad rather than inference_mode: inference tensors could not be updated in place by
        # callers outside inference mode (e.g. a runner writing sampled ids into its buffers).
        with torch.no_grad():
            scratch = logits.to(torch.float32, copy=True)
            num_logprobs = metadata.max_num_logprobs
            reported = None
            if num_logprobs is not None and not self.processed:
                # taken before any in-place processing below: the model's own distribution
                reported = self._reported(scratch, copy=True)
            scratch = _process(scratch, metadata)
            if metadata.all_greedy:
                sampled, final = fused.argmax(scratch), scratch
            else:
                greedy, greedy_rows, final = _final_logits(scratch, metadata)
                sampled = draw(final.softmax(dim=1), metadata.seeds)
                if greedy is not None:
                    sampled = torch.where(greedy_rows, greedy, sampled)
            logprobs = None
            if num_logprobs is not None:
                if reported is None:  # (the distribution the token was drawn from)
                    reported = self._reported(final, copy=False)
                logprobs = compute_logprobs(reported, sampled, num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _reported(self, logits: torch.Tensor, copy: bool) -> torch.Tensor:
        """What the logprobs report of float32 ``logits`` (raw or processed): their
        ``log_softmax``, or themselves (a copy where ``copy``) in a ``*_logits`` mode."""
        if self.logprobs_mode.endswith("logits"):
            return logits.clone() if copy else logits
        return logits.log_softmax(dim=1)

    def reported(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The values the logprobs of ``[B, V]`` ``logits`` report in this sampler's mode, as
        ``__call__`` reports them (``metadata``: the rows' parameters, for a processed mode)."""
        with torch.no_grad():
            scratch = logits.to(torch.float32, copy=True)
            if not self.processed:
                return self._reported(scratch, copy=False)
            scratch = _process(scratch, metadata)
            if not metadata.all_greedy:
                scratch = _final_logits(scratch, metadata)[2]
            return self._reported(scratch, copy=False)

    def distribution(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What one token per row would be drawn from, without drawing it (speculative
        decoding checks drafts against it): each row's argmax (None when no row is greedy
        and top-k is unused), and the probabilities of the rows (``[B, V]`` float32,
        temperature, top-k, top-p and min-p applied) with the mask of greedy rows, both None
        when every row is greedy. The logits are processed as ``__call__`` processes them."""
        with torch.no_grad():
            scratch = _process(logits.to(torch.float32, copy=True), metadata)
            if metadata.all_greedy:
                return fused.argmax(scratch), None, None
            greedy, greedy_rows, final = _final_logits(scratch, metadata)
            return greedy, final.softmax(dim=1), greedy_rows


def _process(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 3 and 4 of the module docstring on float32 ``logits`` (in place where it can):
    suppressed and disallowed tokens, bad words, logit bias, grammar, penalties."""
    suppress_tokens(logits, metadata.suppressed_token_ids)
    allow_only(logits, metadata.allowed_token_ids)
    ban_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
    add_logit_bias(logits, metadata.logit_bias)
    if metadata.grammar_bitmask is not None:
        apply_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
    if metadata.processors is not None:
        logits = metadata.processors(logits, False)
    if not metadata.no_penalties:
        logits = penalties.apply_penalties(
            logits,
            metadata.prompt_token_ids,
            metadata.output_token_ids,
            metadata.presence_penalties,
            metadata.frequency_penalties,
            metadata.repetition_penalties,
        )
    return logits


def _final_logits(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Of processed float32 ``logits`` (modified in place), not all rows greedy: the argmax of
    each row (None when no row is greedy and top-k is unused), the mask of greedy rows, and
    the logits a row's token is drawn from: after temperature (1 for greedy rows), top-k,
    top-p and min-p (``-inf`` where they cut)."""
    device = logits.device
    temperature = metadata.temperature.to(device=device, dtype=torch.float32)
    top_k = None if metadata.top_k is None else metadata.top_k.to(device)
    top_p = None if metadata.top_p is None else metadata.top_p.to(device)
    min_p = None if metadata.min_p is None else metadata.min_p.to(device)

    greedy_rows = temperature < _SAMPLING_EPS
    if top_k is not None:
        # top_k 1 is greedy by definition; taking argmax avoids sampling among exact ties.
        greedy_rows |= top_k == 1
    greedy = None
    if not metadata.all_random or top_k is not None:
        greedy = fused.argmax(logits)  # before temperature/truncation rewrite ``logits``

    # Greedy rows divide by 1: their temperature is 0 and their result comes from argmax.
    logits.div_(torch.where(greedy_rows, 1.0, temperature).unsqueeze(1))
    if metadata.processors is not None:
        logits = metadata.processors(logits, True)
    logits = apply_top_k_top_p(logits, top_k, top_p)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return greedy, greedy_rows, logits
