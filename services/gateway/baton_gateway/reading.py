"""A chat choice's text read into the parts of an assistant message: the reasoning
(``reasoning.py``), then the tool calls in what follows it (``tools.py``), and the content."""

from __future__ import annotations

from dataclasses import dataclass

from baton_gateway.reasoning import ReasoningUse
from baton_gateway.tools import ReadOut, ToolUse, finish_reason


@dataclass(frozen=True, slots=True)
class ChatReading:
    """How a request's choices are read; at least one of the two is set."""

    tools: ToolUse | None = None
    reasoning: ReasoningUse | None = None

    def new_reader(self) -> ChoiceReader:
        return ChoiceReader(self)


class ChoiceReader:
    """Reads one choice, fed its text piece by piece (or whole, in one ``final`` piece)."""

    def __init__(self, reading: ChatReading) -> None:
        self._tool_use = reading.tools
        self._tools = reading.tools.new_reader() if reading.tools is not None else None
        use = reading.reasoning
        self._reasoning = use.new_reader() if use is not None else None
        self._include_reasoning = use is not None and use.include

    def feed(self, text: str, final: bool) -> ReadOut:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text, final)
        out = self._tools.feed(text, final) if self._tools is not None else ReadOut(text)
        if self._include_reasoning:
            out.reasoning = reasoning
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason, given the engine's (see ``tools.finish_reason``)."""
        if self._tools is None or self._tool_use is None:
            return reason
        return finish_reason(reason, self._tool_use, self._tools.num_calls)
