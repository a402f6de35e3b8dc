"""Custom logits processors (vLLM's ``--logits-processors``): classes loaded at start-up that
rewrite every step's logits, with vLLM V1's interface, so that a processor written for vLLM
runs here once its imports name ``baton_engine.logits_processor`` instead of
``vllm.v1.sample.logits_processor``.

A processor sees the batch as vLLM's persistent batch: every request the engine's runner holds
(running, or part-way through its prompt) has an index in ``[0, batch_size)``, kept while it is
held; ``update_state`` learns of the changes before each step samples (``BatchUpdate``: the
indices removed, then the requests added, then the moves that keep the indices dense, in that
order; ``None`` when nothing changed), and ``apply`` gets ``[batch_size, vocab]`` float32 logits
whose row ``i`` is index ``i``'s (rows of requests that sample nothing this step hold zeros and
are dropped). Per-request arguments come in ``SamplingParams.extra_args`` (vLLM's
``vllm_xargs`` over HTTP); ``validate_params`` refuses a request before it is queued (a 400).

Where they apply (as in vLLM's sampler): processors whose ``is_argmax_invariant()`` is False
after banned, disallowed and grammar-forbidden tokens and logit bias, before penalties; those
that are argmax-invariant only for rows that sample at a temperature, after the temperature and
before top-k / top-p / min-p (greedy rows take the argmax without them). With processors loaded
every request's sampling reads its tokens on the host (no step runs ahead of a sampled token);
they do not run with speculative decoding or multi-step scheduling (vLLM refuses speculative
decoding with them too).
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Any, Protocol, TypeVar

import torch

from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at a moves to b; a is left empty
    SWAP = auto()  # the requests at a and b trade places


RemovedRequest = int
# (index, params, prompt token ids, output token ids: a live view that grows as it generates)
AddedRequest = tuple[int, SamplingParams, list[int] | None, Sequence[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the last ``update_state``: apply ``removed``, then
    ``added`` (an added request may take an index that was just removed), then ``moved``."""

    batch_size: int  # requests held now: their indices are 0..batch_size-1
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM V1's interface (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request this processor cannot serve (its
        ``extra_args``, most often): the request is refused before it is queued."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """``vllm_config``: a ``ProcessorConfig`` (what vLLM's processors read of theirs)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's ``[batch_size, vocab]`` float32 logits, rewritten (in place or not)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes which token is largest (then greedy rows skip
        it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Learn of the batch's changes before a step's ``apply``."""


# A request's own processor: (output ids, logits row) -> logits row, or with the prompt's ids
# first (prompt ids, output ids, logits row) -> logits row.
RequestLogitsProcessor = Callable[..., torch.Tensor]
_T = TypeVar("_T")


def process_dict_updates(
    req_entries: dict[int, _T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, Sequence[int]], _T | None],
) -> bool:
    """Apply ``batch_update`` to per-index state kept in a dict (vLLM's helper): a removed
    index's entry goes, an added request's is ``new_state(params, prompt ids, output ids)``
    (None: no entry), moves carry entries along. Returns whether any entry changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        elif req_entries.pop(index, None) is not None:
            changed = True
    for a, b, direction in batch_update.moved:
        a_entry = req_entries.pop(a, None)
        b_entry = req_entries.pop(b, None)
        if a_entry is not None:
            req_entries[b] = a_entry
            changed = True
        if b_entry is not None:
            changed = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a] = b_entry
    return changed


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs a per-request function on each row of the requests that have one (vLLM's
    adapter): subclasses define ``new_req_logits_processor(params)`` (the request's function,
    or None) and ``is_argmax_invariant``."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's function (it gets its output ids, or its prompt's and output's ids,
        and its logits row), or None when it has none."""

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: Sequence[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            row = logits[index]
            new = fn(row)
            if new is not row:
                logits[index] = new
        return logits


@dataclass(frozen=True)
class ModelView:
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype

    def get_vocab_size(self) -> int:
        return self.vocab_size


@dataclass(frozen=True)
class SchedulerView:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class ProcessorConfig:
    """What a processor's ``__init__`` gets as ``vllm_config``: the parts of vLLM's config its
    processors read (``model_config.get_vocab_size()``, ``scheduler_config.max_num_seqs``),
    and Baton's whole ``EngineConfig`` as ``engine_config``."""

    model_config: ModelView
    scheduler_config: SchedulerView
    engine_config: Any


def load_classes(specs: Iterable[str | type]) -> list[type[LogitsProcessor]]:
    """The classes named by ``specs``: classes as they are, or names ``package.module.Class``
    / ``package.module:Class`` imported (``InvalidRequestError`` for a name that does not
    import or a class that is not a ``LogitsProcessor``)."""
    classes = []
    for spec in specs:
        cls = spec if isinstance(spec, type) else _import(spec)
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise InvalidRequestError(
                f"logits processor {spec!r} is not a subclass of "
                "baton_engine.logits_processor.LogitsProcessor"
            )
        if inspect.isabstract(cls):
            raise InvalidRequestError(
                f"logits processor {cls.__qualname__} leaves abstract methods undefined: "
                f"{', '.join(sorted(cls.__abstractmethods__))}"
            )
        classes.append(cls)
    return classes


def _import(name: str) -> object:
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise InvalidRequestError(
            f"logits processor {name!r}: give a class as package.module.Class or "
            "package.module:Class"
        )
    try:
        value: object = importlib.import_module(module_name)
        for part in attr.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as e:
        raise InvalidRequestError(f"logits processor {name!r} does not import: {e}") from e
    return value


def validate_params(classes: Sequence[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Each class's ``validate_params`` of a request's ``params`` (``InvalidRequestError``
    naming the class where one refuses it)."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except Exception as e:  # (a processor's own error: the request is refused, not the engine)
            raise InvalidRequestError(f"{cls.__qualname__}: {e}") from e


class HeldRequest(Protocol):
    """What the batch tracks of a request the runner holds (the runner's state)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


_Held = TypeVar("_Held", bound=HeldRequest)


class LogitsProcessors:
    """The loaded processors and the batch indices they know: ``update`` turns the requests the
    runner holds into each processor's ``BatchUpdate`` (a new request takes the lowest free
    index, and removals are filled from the top: vLLM's condensed persistent batch), ``apply``
    runs them on one step's rows."""

    def __init__(
        self,
        classes: Sequence[type[LogitsProcessor]],
        config: ProcessorConfig,
        device: torch.device,
    ) -> None:
        pin = device.type == "cuda"
        self.classes = list(classes)
        self.processors = [cls(config, device, pin) for cls in classes]
        self._index: dict[str, int] = {}  # req_id -> its index
        self._held: list[HeldRequest] = []  # index -> the request there

    def update(
        self, held: Mapping[str, _Held], output_ids: Callable[[_Held], Sequence[int]]
    ) -> None:
        """Tell every processor how the held requests changed since the last call
        (``output_ids``: a request's live output ids)."""
        # (a request preempted and resumed is a new state: removed, then added)
        gone = [i for i, state in enumerate(self._held) if held.get(state.req_id) is not state]
        known = {id(state) for state in self._held}
        new = [state for state in held.values() if id(state) not in known]
        if not gone and not new:
            for p in self.processors:
                p.update_state(None)
            return
        slots: list[HeldRequest | None] = list(self._held)
        for i in gone:
            del self._index[self._held[i].req_id]
            slots[i] = None
        free = list(gone)  # ascending
        added: list[AddedRequest] = []
        for state in new:
            if free:
                i = free.pop(0)
                slots[i] = state
            else:
                i = len(slots)
                slots.append(state)
            self._index[state.req_id] = i
            added.append((i, state.sampling_params, state.prompt_token_ids, output_ids(state)))
        moved: list[MovedRequest] = []
        while slots and slots[-1] is None:
            slots.pop()
        for hole in free:  # the top request fills each hole left
            while slots and slots[-1] is None:
                slots.pop()
            if hole >= len(slots):
                break
            top = slots.pop()
            assert top is not None
            slots[hole] = top
            self._index[top.req_id] = hole
            moved.append((len(slots), hole, MoveDirectionality.UNIDIRECTIONAL))
        while slots and slots[-1] is None:
            slots.pop()
        self._held = [s for s in slots if s is not None]
        assert len(self._held) == len(slots), "the indices are dense"
        update = BatchUpdate(len(self._held), gone, added, moved)
        for p in self.processors:
            p.update_state(update)

    def apply(
        self, req_ids: Sequence[str], logits: torch.Tensor, argmax_invariant: bool
    ) -> torch.Tensor:
        """The processors of one kind (``argmax_invariant``) on float32 ``logits`` whose row
        ``j`` is request ``req_ids[j]``'s (held, ``update`` called since it came)."""
        procs = [p for p in self.processors if p.is_argmax_invariant() == argmax_invariant]
        if not procs:
            return logits
        rows = [self._index[r] for r in req_ids]
        size = len(self._held)
        if rows == list(range(size)):
            for p in procs:
                logits = p.apply(logits)
            return logits
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        batch = logits.new_zeros((size, logits.shape[1]))
        batch[index] = logits
        for p in procs:
            batch = p.apply(batch)
        return batch[index]
