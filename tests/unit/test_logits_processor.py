"""The custom logits processors' batch (baton_engine.logits_processor): the indices a processor
learns through ``BatchUpdate``s are the rows it is given, as vLLM's persistent batch keeps
them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from baton_engine.errors import InvalidRequestError
from baton_engine.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    ProcessorConfig,
    load_classes,
    process_dict_updates,
    validate_params,
)
from baton_engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Held:
    req_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)


class Mirror(LogitsProcessor):
    """Keeps each index's request id from the updates alone; ``apply`` adds to each row the tag
    its request's ``extra_args`` carry."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.ids: dict[int, str] = {}
        self.tags: dict[int, float] = {}
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.batch_size = batch_update.batch_size
        process_dict_updates(self.ids, batch_update, lambda p, _, __: p.extra_args["id"])
        process_dict_updates(self.tags, batch_update, lambda p, _, __: p.extra_args["tag"])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size
        for index, tag in self.tags.items():
            logits[index] += tag
        return logits


def _held(req_id: str, tag: float) -> Held:
    return Held(req_id, [1, 2], SamplingParams(extra_args={"id": req_id, "tag": tag}))


def test_the_indices_a_processor_learns_are_the_rows_it_is_given() -> None:
    """Requests come, go and come back (a preempted request returns as a new state): after each
    update the processor's own index -> request map, built from the updates alone, is the
    batch's (dense: 0..n-1), and the rows it rewrites are its requests', in whatever order and
    subset a step samples them."""
    rng = random.Random(0)
    batch = LogitsProcessors([Mirror], ProcessorConfig(None, None, None), torch.device("cpu"))
    mirror = batch.processors[0]
    assert isinstance(mirror, Mirror)
    held: dict[str, Held] = {}
    tags: dict[str, float] = {}
    count = 0
    for step in range(300):
        for req_id in list(held):
            if rng.random() < 0.25:
                del held[req_id]
        for req_id in list(held):
            if rng.random() < 0.05:  # preempted and resumed between two steps
                held[req_id] = _held(req_id, tags[req_id])
        for _ in range(rng.randrange(4)):
            count += 1
            req_id = f"r{count}"
            tags[req_id] = float(count)
            held[req_id] = _held(req_id, tags[req_id])
        batch.update(held, lambda state: [])
        assert sorted(mirror.ids.values()) == sorted(held), step
        assert sorted(mirror.ids) == list(range(len(held))), step
        if not held:
            continue
        sampled = rng.sample(sorted(held), rng.randrange(1, len(held) + 1))
        logits = torch.randn(len(sampled), 5)
        out = batch.apply(sampled, logits.clone(), argmax_invariant=False)
        expected = logits + torch.tensor([tags[r] for r in sampled]).unsqueeze(1)
        torch.testing.assert_close(out, expected)
        # (none of the other kind: the rows as they were)
        assert batch.apply(sampled, logits, argmax_invariant=True) is logits


def test_dict_updates_follow_swaps_and_one_way_moves() -> None:
    entries = {0: "a", 1: "b", 2: "c"}
    params = SamplingParams(extra_args={"v": "d"})
    update = BatchUpdate(
        batch_size=3,
        removed=[1],
        added=[(1, params, None, []), (3, SamplingParams(), None, [])],
        moved=[(0, 2, MoveDirectionality.SWAP), (3, 0, MoveDirectionality.UNIDIRECTIONAL)],
    )
    changed = process_dict_updates(entries, update, lambda p, _, __: (p.extra_args or {}).get("v"))
    # removed b; added d at 1 (and nothing at 3); swapped a and c; 3 (empty) moved onto 0
    assert changed and entries == {1: "d", 2: "a"}
    assert not process_dict_updates(entries, None, lambda p, _, __: None)


class NotAProcessor:
    pass


class Abstract(LogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False


class Refusing(Mirror):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if (sampling_params.extra_args or {}).get("bad"):
            raise ValueError("bad is bad")


def test_processors_load_by_class_or_name_and_refuse_clearly() -> None:
    assert load_classes([Mirror, f"{__name__}.Mirror", f"{__name__}:Refusing"]) == [
        Mirror,
        Mirror,
        Refusing,
    ]
    for spec, message in (
        ("no_such_module.Thing", "does not import"),
        (f"{__name__}.Missing", "does not import"),
        ("Mirror", "package.module.Class"),
        (f"{__name__}.NotAProcessor", "not a subclass"),
        (NotAProcessor, "not a subclass"),
        (Abstract, "abstract methods undefined: __init__, apply, update_state"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            load_classes([spec])
    validate_params([Mirror, Refusing], SamplingParams(extra_args={"bad": False}))
    with pytest.raises(InvalidRequestError, match="Refusing: bad is bad"):
        validate_params([Mirror, Refusing], SamplingParams(extra_args={"bad": True}))
