"""Custom logits processors for the tests (``--logits-processors``), written as vLLM's are:
importable by name (``example_logits_processors:TargetToken``) once this folder is on the
path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from baton_engine.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    RequestLogitsProcessor,
    process_dict_updates,
)
from baton_engine.sampling_params import SamplingParams


def _target(params: SamplingParams) -> int | None:
    target = (params.extra_args or {}).get("target_token")
    return None if target is None else int(target)


class TargetToken(LogitsProcessor):
    """vLLM's example: a request whose ``extra_args`` name a ``target_token`` can sample only
    that token."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a token id, got {target!r}")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}
        self.vocab_size = vllm_config.model_config.get_vocab_size()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update, lambda params, _, __: _target(params))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[1] == self.vocab_size
        for index, target in self.targets.items():
            kept = logits[index, target].item()
            logits[index] = float("-inf")
            logits[index, target] = kept
        return logits


class ArgmaxOnly(LogitsProcessor):
    """Argmax-invariant: leaves each row its largest logit alone (so a sampled request draws
    its argmax); counts its calls."""

    calls = 0

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        top = logits.argmax(dim=1, keepdim=True)
        kept = logits.gather(1, top)
        return torch.full_like(logits, float("-inf")).scatter_(1, top, kept)


class NoRepeats(AdapterLogitsProcessor):
    """Per request (``extra_args={"no_repeats": true}``): no token of its prompt or output may
    come again (a function of the prompt's and output's ids and the row)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        if not (params.extra_args or {}).get("no_repeats"):
            return None

        def ban(
            prompt_ids: list[int], output_ids: Sequence[int], row: torch.Tensor
        ) -> torch.Tensor:
            seen = torch.tensor([*prompt_ids, *output_ids], dtype=torch.long)
            return row.index_fill(0, seen.to(row.device), float("-inf"))

        return ban
