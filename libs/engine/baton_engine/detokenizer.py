"""Incremental detokenization of generated tokens, with stop-string matching, for streaming.

The decoding follows vLLM's ``detokenize_incrementally``: only a small window of token ids is
decoded per step. ``prefix`` is the text of the tokens that were released last (the left context,
so that byte merges and leading spaces at the boundary decode exactly as in a full decode); the
text of the window beyond that prefix is new. New text is released once it does not end in
U+FFFD, i.e. once the last multi-byte UTF-8 character split across byte-level tokens is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens are decoded as left context for the first generated token.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character needs at most 4 byte tokens; past this many unreleased tokens the text is
# released as is (U+FFFD included: the bytes are invalid and a full decode shows U+FFFD too).
_MAX_UNRELEASED_TOKENS = 8


@dataclass(frozen=True, slots=True)
class DetokenizerDelta:
    """What one :meth:`IncrementalDetokenizer.update` released.

    ``text`` is the newly released text (possibly ""). ``stop_str`` is the stop string that
    matched, if any; generation must then stop, and nothing after the match is ever released.
    """

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a delta at a time.

    Contract:

    * Only complete UTF-8 is released: a character split across tokens appears once its last
      byte arrives. Without stop strings, the concatenation of all deltas (the last one with
      ``final=True``) equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``
      (tokenization-space clean-up is not applied).
    * The prompt ids are decoded only as left context; prompt text is never released, and stop
      strings inside the prompt do not match.
    * Stop strings match anywhere in the generated text, across token boundaries. A suffix of the
      unreleased text that is a prefix of some stop string is held back until it is known not to
      match; ``final=True`` (the request ended for another reason) releases it.
    * After a stop match or a ``final=True`` update, further updates release nothing.
    * A request the engine stopped at a token (EOS, or one of ``stop_token_ids``:
      ``stop_terminated``) does not show that token's text, unless
      ``include_stop_str_in_output`` (vLLM V1's rule).

    ``tokenizer`` is a Hugging Face fast tokenizer; its ``backend_tokenizer`` is used directly when
    present, otherwise its ``decode`` method. Empty stop strings are ignored.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._stop_first_chars = frozenset(s[0] for s in self._stops)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        # Window of ids: [0, _read) were released (their text is _prefix_text), the rest are not.
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        prefix_text = self._decode(context) if context else ""
        while prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: drop those ids so that output bytes continuing
            # it decode as in a full decode of the output alone (as U+FFFD), not merged with them.
            context.pop()
            prefix_text = self._decode(context) if context else ""
        self._ids = context
        self._read = len(context)
        self._prefix_text = prefix_text
        # Decoded but unreleased text (held back for stop-string matching).
        self._pending = ""
        self._released: list[str] = []
        self._output_cache: str | None = ""
        self._done = False

    @property
    def output_text(self) -> str:
        """All text released so far (the concatenation of every delta's ``text``)."""
        if self._output_cache is None:
            self._output_cache = "".join(self._released)
        return self._output_cache

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings it matches (empty ones left out)."""
        return self._stops

    @property
    def finished(self) -> bool:
        """Whether a stop string matched or a ``final=True`` update was made."""
        return self._done

    def update(
        self, new_token_ids: Sequence[int], final: bool = False, stop_terminated: bool = False
    ) -> DetokenizerDelta:
        """Add newly generated token ids and return the text that can now be released.

        ``final=True`` means no more tokens will come: everything decoded is released (held-back
        stop-string prefixes and any trailing incomplete UTF-8, shown as U+FFFD as in a full
        decode), unless a stop string matches first. ``stop_terminated``: the last of
        ``new_token_ids`` is the EOS or stop token the engine stopped at (its text is left
        out unless ``include_stop_str_in_output``).
        """
        if self._done:
            return DetokenizerDelta("")
        if stop_terminated and new_token_ids and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        for token_id in new_token_ids:
            self._ids.append(int(token_id))
            self._decode_step(force=False)
        if final:
            self._decode_step(force=True)
            self._done = True
        return self._release(final)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            text: str = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        else:
            text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return text

    def _decode_step(self, force: bool) -> None:
        """Move the text of unreleased ids to ``_pending`` when it ends on a complete character."""
        ids = self._ids
        unread = len(ids) - self._read
        if unread == 0:
            return
        text = self._decode(ids)
        prefix_len = len(self._prefix_text)
        if (
            not force
            and unread < _MAX_UNRELEASED_TOKENS
            and (len(text) <= prefix_len or text.endswith(_REPLACEMENT_CHAR))
        ):
            return  # incomplete character, or nothing visible yet (skipped special tokens)
        self._pending += text[prefix_len:]
        del ids[: self._read]
        self._read = len(ids)
        self._prefix_text = self._decode(ids)

    def _release(self, final: bool) -> DetokenizerDelta:
        """Release pending text up to a stop match, or up to a possible stop-string prefix."""
        pending = self._pending
        stop_str: str | None = None
        if self._stops and pending:
            match = self._find_stop(pending)
            if match is not None:
                index, stop_str = match
                out = pending[: index + len(stop_str)] if self._include_stop else pending[:index]
                pending = ""
                self._done = True
        if stop_str is None:
            hold = 0 if final else self._held_back_len(pending)
            cut = len(pending) - hold
            out, pending = pending[:cut], pending[cut:]
        self._pending = pending
        if out:
            self._released.append(out)
            self._output_cache = None
        return DetokenizerDelta(out, stop_str)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop-string match in ``text`` (ties: first in ``stop`` order).

        Only unreleased text is searched: released text never holds the start of a match, since
        any suffix that is a prefix of a stop string is held back.
        """
        best: tuple[int, str] | None = None
        for s in self._stops:
            index = text.find(s)
            if index != -1 and (best is None or index < best[0]):
                best = (index, s)
        return best

    def _held_back_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            if text[-k] in self._stop_first_chars:
                suffix = text[-k:]
                if any(s.startswith(suffix) for s in self._stops):
                    return k
        return 0
