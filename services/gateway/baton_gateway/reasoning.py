"""Reasoning outputs: a thinking model's reasoning split from its answer, as vLLM serves it.

With ``--reasoning-parser NAME``, the text a chat choice writes between ``<think>`` and
``</think>`` comes back as ``message.reasoning`` (streamed as ``delta.reasoning``), and the rest
as ``content``; ``reasoning_content``, the field's older name that many clients still read,
carries the same text. A request's ``include_reasoning: false`` drops it. Parsers:

- ``deepseek_r1``: the output begins inside the reasoning (DeepSeek-R1's template opens
  ``<think>`` in the prompt; a ``<think>`` the model writes first is dropped), which lasts until
  ``</think>``, or to the end of the output when there is none.
- ``qwen3``: the output is reasoning only inside a ``<think>`` block that it opens first, or
  that the prompt left open (Qwen3's thinking templates end with ``<think>``); otherwise, as
  with ``enable_thinking: false``, all of it is content. ``glm45`` (GLM-4.5 and 4.6 open the
  block themselves, and their templates close it in the prompt when thinking is off) and
  ``deepseek_v3`` (DeepSeek-V3.1's template opens the block in the prompt with ``thinking:
  true``, and closes it otherwise) read the same way.
- ``step3`` reads as ``deepseek_r1``; ``seed_oss`` too, with Seed-OSS's ``<seed:think>`` and
  ``</seed:think>``; ``mistral`` as ``qwen3``, with Magistral's ``[THINK]`` and ``[/THINK]``,
  special tokens that the text then keeps.
- ``granite``: Granite 3.2/3.3's thinking mode writes its reasoning after "Here is my thought
  process:" and its answer after "Here is my response:" ("Here's" for either, as vLLM accepts);
  an output that does not open with the first is all content.

A constrained output (structured output, or a named or required tool choice) reasons first, as
in vLLM, when the output begins inside the reasoning (``deepseek_r1``, or a prompt that left
``<think>`` open): the worker's grammar lets it write freely up to ``</think>`` and constrains
what follows. Otherwise (``qwen3`` and no open block) the grammar applies from the first token
and all of the output is content.

One :class:`ReasoningReader` per choice reads the text as it streams in, holding back only what
could be the start of a tag; a non-streamed response feeds it the whole text, so both give the
same split.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a model marks its reasoning: the tags around it (and other spellings of each, read
    alike), whether an output that does not open with ``start`` begins inside the reasoning all
    the same, and whether the tags are special tokens (the text must keep them)."""

    start: str
    end: str
    by_default: bool
    special: bool = False
    other_starts: tuple[str, ...] = ()
    other_ends: tuple[str, ...] = ()


_THINK = ReasoningFormat(THINK_START, THINK_END, by_default=False)
_THINK_FIRST = ReasoningFormat(THINK_START, THINK_END, by_default=True)

# vLLM's parser names.
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": _THINK_FIRST,
    "deepseek_v3": _THINK,
    "glm45": _THINK,
    "granite": ReasoningFormat(
        "Here is my thought process:",
        "Here is my response:",
        by_default=False,
        other_starts=("Here's my thought process:",),
        other_ends=("Here's my response:",),
    ),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", by_default=False, special=True),
    "qwen3": _THINK,
    "seed_oss": ReasoningFormat("<seed:think>", "</seed:think>", by_default=True),
    "step3": _THINK_FIRST,
}


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could be the beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningReader:
    """Splits one choice's text into reasoning and content, piece by piece."""

    def __init__(self, in_reasoning: bool, form: ReasoningFormat = _THINK) -> None:
        """``in_reasoning``: the prompt left the reasoning open; ``form``: the model's tags,
        and whether text that does not open with the start tag is reasoning all the same."""
        self._state = "reasoning" if in_reasoning else "opening"
        self._starts = (form.start, *form.other_starts)
        self._ends = (form.end, *form.other_ends)
        self._by_default = form.by_default
        self._held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (``final`` on the last piece) releases."""
        text, self._held = self._held + text, ""
        reasoning = content = ""
        while text:
            if self._state == "opening":
                stripped = text.lstrip()
                start = next((s for s in self._starts if stripped.startswith(s)), None)
                if start is not None:
                    text = stripped[len(start) :]
                    self._state = "reasoning"
                elif any(s.startswith(stripped) for s in self._starts) and not final:
                    self._held, text = text, ""  # whitespace, or the beginning of the tag
                else:
                    self._state = "reasoning" if self._by_default else "content"
            elif self._state == "reasoning":
                found = [(at, tag) for tag in self._ends if (at := text.find(tag)) >= 0]
                if found:
                    end, tag = min(found)
                    reasoning += text[:end]
                    text = text[end + len(tag) :]
                    self._state = "content"
                    continue
                keep = 0 if final else max(partial_tag_length(text, t) for t in self._ends)
                reasoning += text[: len(text) - keep]
                self._held, text = text[len(text) - keep :], ""
            else:
                content += text
                text = ""
        return reasoning, content


@dataclass(frozen=True, slots=True)
class ReasoningUse:
    """How a request's choices are split: the parser's rule and what its prompt left open."""

    in_reasoning: bool
    form: ReasoningFormat
    include: bool  # the request's include_reasoning
    # the text after which the request's grammar applies (None: it has none)
    grammar_after: str | None = None

    def new_reader(self) -> ReasoningReader:
        return ReasoningReader(self.in_reasoning, self.form)


def reasoning_use(
    parser: str | None, prompt: str, include: bool, constrained: bool
) -> ReasoningUse | None:
    """How to split a chat request's choices, or None when they are all content: no
    ``parser``, or an output ``constrained`` from its first token. ``prompt`` is the rendered
    prompt. A constrained output that begins inside the reasoning gets ``grammar_after`` set:
    its grammar must start after it (the format's end tag)."""
    if parser is None:
        return None
    form = REASONING_PARSERS[parser]
    opened = prompt.rstrip().endswith(form.start)
    if constrained and not (opened or form.by_default):
        return None
    return ReasoningUse(opened, form, include, form.end if constrained else None)
