"""Benchmark workloads: random prompts of an exact token length, or prompts from a JSONL file.

Both return :class:`SampleRequest` lists; the tokenizer is the model's own (loaded without torch
through :mod:`baton_engine.model_files`), so prompt lengths are what the server will count.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Decoding random ids and re-encoding the text rarely gives the same ids (merges across token
# boundaries, partial UTF-8 bytes); a fix-up round or two converges in practice.
_MAX_FIXUP_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request of a workload: the prompt text, its length in tokens and the number of
    tokens to generate."""

    prompt: str
    prompt_len: int  # tokens, as the tokenizer encodes `prompt` without special tokens
    output_len: int  # max_tokens to ask for


def load_bench_tokenizer(path: str | None) -> Any:
    """The tokenizer of the model at ``path`` (a folder or a ``.gguf``), or of the default
    model when ``path`` is None. Torch-free; raises ``baton_engine.errors.ModelLoadError``."""
    from baton_engine.model_files import load_model_tokenizer

    return load_model_tokenizer(path)


def _sample_lens(rng: random.Random, length: int, range_ratio: float, num: int) -> list[int]:
    """``num`` lengths uniform in ``[length * (1 - r), length * (1 + r)]``, each at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def _token_ids_to_text(
    tokenizer: Any, token_ids: list[int], allowed: Sequence[int], rng: random.Random
) -> tuple[str, int]:
    """Text that re-encodes to ``len(token_ids)`` tokens, and the length it really has.

    Each round decodes, re-encodes, then truncates or pads (with random allowed ids) back to the
    target; the first round whose text re-encodes to exactly the target wins. After
    ``_MAX_FIXUP_ROUNDS`` the last text is returned with its real length and a warning.
    """
    target = len(token_ids)
    ids = token_ids
    text = ""
    num_tokens = 0
    for _ in range(_MAX_FIXUP_ROUNDS):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        reencoded = list(tokenizer.encode(text, add_special_tokens=False))
        num_tokens = len(reencoded)
        if num_tokens == target:
            return text, num_tokens
        if num_tokens > target:
            ids = reencoded[:target]
        else:
            ids = reencoded + [rng.choice(allowed) for _ in range(target - num_tokens)]
    logger.warning("a random prompt has %d tokens instead of %d", num_tokens, target)
    return text, num_tokens


def random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of random tokens, like vLLM's random dataset.

    Token ids are drawn uniformly from the vocabulary minus special and added tokens, decoded to
    text and fixed up so that the text encodes (without special tokens) to exactly the drawn
    length. With ``range_ratio`` r > 0, each prompt and output length is drawn uniformly from
    ``[len * (1 - r), len * (1 + r)]``. Deterministic for a given seed and tokenizer.
    """
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    allowed = [i for i in range(len(tokenizer)) if i not in excluded]
    input_lens = _sample_lens(rng, input_len, range_ratio, num_prompts)
    output_lens = _sample_lens(rng, output_len, range_ratio, num_prompts)
    samples = []
    for num_in, num_out in zip(input_lens, output_lens, strict=True):
        ids = [rng.choice(allowed) for _ in range(num_in)]
        text, num_tokens = _token_ids_to_text(tokenizer, ids, allowed, rng)
        samples.append(SampleRequest(text, num_tokens, num_out))
    return samples


def jsonl_requests(
    tokenizer: Any, path: Path, num_prompts: int, default_output_len: int
) -> list[SampleRequest]:
    """The first ``num_prompts`` lines of a JSONL file, in order.

    Each non-blank line is an object with a string ``prompt`` and an optional positive integer
    ``output_len`` (else ``default_output_len``). Fewer lines than ``num_prompts`` is allowed
    (with a warning). Raises ValueError naming the line for a malformed one, or when the file
    has no prompt at all.
    """
    samples: list[SampleRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(samples) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f'{path}:{lineno}: needs a non-empty string "prompt"')
            num_out = obj.get("output_len", default_output_len)
            if not isinstance(num_out, int) or isinstance(num_out, bool) or num_out < 1:
                raise ValueError(f'{path}:{lineno}: "output_len" must be a positive integer')
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            samples.append(SampleRequest(prompt, prompt_len, num_out))
    if not samples:
        raise ValueError(f"{path} has no prompts")
    if len(samples) < num_prompts:
        logger.warning("%s has only %d prompts (%d asked for)", path, len(samples), num_prompts)
    return samples
