"""SamplingParams: how to pick tokens and when to stop, with vLLM's names and meanings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top logprobs per token Baton returns at most (vLLM's default cap)

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """What a request's output must follow (vLLM's ``StructuredOutputsParams``): exactly one of
    a JSON schema (a dict or its JSON text), a regular expression, a list of choices, an EBNF
    grammar (XGrammar's, GBNF-like), or ``json_object=True`` for any JSON object.
    ``disable_any_whitespace`` makes JSON output compact (no free whitespace between tokens).
    ``reasoning_end`` (Baton's; vLLM gets it from its reasoning parser): the output first
    reasons freely, up to and including this text (``"</think>"``), and then follows the
    constraint, after up to 4 whitespace characters. Compiled by the engine
    (``baton_engine.structured_output``), which reports a schema, pattern or grammar it cannot
    compile as ``InvalidRequestError``."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: XGrammar's structural tag, as JSON text or a dict: its ``{"type":
    # "structural_tag", "format": {...}}``, or the older ``{"structures": [{"begin", "schema",
    # "end"}], "triggers": [...]}`` (free text, where each trigger starts a tagged JSON value).
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in self._kinds() if value is not None and value is not False]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output takes exactly one of json, regex, choice, grammar, "
                f"json_object and structural_tag, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError("structured output choice must be non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"structured output {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidRequestError("structured output json must be a schema (dict or text)")
        tag = self.structural_tag
        if tag is not None and not isinstance(tag, str | dict):
            raise InvalidRequestError(
                "structured output structural_tag must be JSON text or a dict"
            )
        if self.reasoning_end is not None and (
            not isinstance(self.reasoning_end, str) or not self.reasoning_end
        ):
            raise InvalidRequestError("structured output reasoning_end must be non-empty text")

    def _kinds(self) -> list[tuple[str, Any]]:
        return [
            ("json", self.json),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
            ("json_object", self.json_object),
            ("structural_tag", self.structural_tag),
        ]

    @property
    def kind(self) -> tuple[str, Any]:
        """``(name, value)`` of the one constraint given."""
        return next((k, v) for k, v in self._kinds() if v is not None and v is not False)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM's names and meanings).

    ``ignore_eos`` keeps generating after EOS without suppressing it; ``min_tokens`` suppresses EOS
    and ``stop_token_ids`` until that many tokens were generated. ``logprobs=N`` returns the sampled
    token's logprob plus the top N of the model's raw distribution.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Per prompt token (from the second): its logprob given the tokens before it, with the top N.
    # Such prompts skip prefix-cache hits (a cached token's logits are never computed).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's: accepted for its scripts. The tokenizer's own decoder decides the text between
    # special tokens (byte-level BPE models' decoders put no spaces there either way).
    spaces_between_special_tokens: bool = True
    # False: the output's text stays empty (token ids only; no stop strings), as in vLLM.
    detokenize: bool = True
    # Arguments for extensions (vLLM's ``extra_args``); Baton's own sampling reads none.
    extra_args: dict[str, Any] | None = None
    # The output must follow this JSON schema, pattern, choice list or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Added to these tokens' logits before sampling (OpenAI's logit_bias, by token id).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never to generate (vLLM's bad_words). The sampler bans them as the token sequences
    # below, which the engine that holds the tokenizer fills from these words
    # (tokenize_bad_words: LLMEngine offline, the gateway for the workers).
    bad_words: list[str] | None = None
    # Per banned sequence, its token ids: the last is never sampled while the output ends with
    # the others (a sequence of one token: never). When given, bad_words are not tokenized.
    bad_words_token_ids: list[list[int]] | None = None
    # Keep only the prompt's last N tokens (-1: as many as max_model_len), as vLLM's.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first bad field."""

        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}")
        # NaN passes every range check below (all comparisons are false) and then samples garbage.
        for name in ("temperature", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative")
        if self.stop and not self.detokenize:
            raise bad("stop strings are only supported when detokenize is True")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise bad(f"logit_bias keys must be token ids, got {token_id!r}")
                if not math.isfinite(bias):
                    raise bad(f"logit_bias of token {token_id} must be a finite number, got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids must be non-negative")
        words = self.bad_words
        if words is not None and (
            isinstance(words, str) or not all(isinstance(w, str) for w in words)
        ):
            raise bad("bad_words must be a list of strings")
        if self.bad_words_token_ids is not None:
            for ids in self.bad_words_token_ids:
                if not ids:
                    raise bad("bad_words_token_ids must not hold an empty sequence")
                if any(t < 0 for t in ids):
                    raise bad("bad_words_token_ids must be non-negative")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad(
                f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def tokenize_bad_words(bad_words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences that ban ``bad_words`` (vLLM's ``update_from_tokenizer``).

    A word is banned as it is tokenized at the start of a text and, when that differs, after
    a space: each word (leading whitespace stripped) is encoded without special tokens, then
    with a space in front; the second is kept only if it starts with another token and has
    as many. Raises ``InvalidRequestError`` for a word that encodes to no token.
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        text = word.lstrip()
        plain = list(tokenizer.encode(text, add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(f"bad_words entry {word!r} encodes to no token")
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + text, add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def check_truncate_prompt_tokens(keep: int | None) -> None:
    if keep is not None and keep != -1 and keep < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be at least 1, or -1, got {keep}")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: max_model_len's
    worth; None: all of it). Raises ``InvalidRequestError`` when ``keep`` exceeds
    ``max_model_len``."""
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len}); "
            "select a smaller truncation size"
        )
    return token_ids[-(max_model_len if keep == -1 else keep) :]
