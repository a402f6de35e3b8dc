"""Reasoning outputs in the gateway: the reader that splits a choice's text at ``<think>`` and
``</think>`` (the same split fed whole or in pieces), what each parser does with a text that
opens no block, tool calls read after the reasoning, and earlier reasoning reaching the
template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from baton_gateway.chat import render_chat_prompt
from baton_gateway.protocol import ChatCompletionRequest
from baton_gateway.reading import ChatReading
from baton_gateway.reasoning import REASONING_PARSERS, reasoning_use
from baton_gateway.tools import ToolCallsSoFar, tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}
PLAIN_PROMPT = "<|im_start|>assistant\n"
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def read(reading: ChatReading, text: str, step: int | None) -> tuple[str, str, list[Any], str]:
    """``text`` through a fresh choice reader in pieces of ``step`` characters (None: whole):
    the reasoning, the content, the calls and the finish reason, merged as a client does."""
    reader = reading.new_reader()
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    reasoning = content = ""
    calls = ToolCallsSoFar()
    for i, piece in enumerate(pieces):
        out = reader.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + out.reasoning, content + out.content
        calls.add(out.tool_calls)
    merged = [(c.function.name, json.loads(c.function.arguments)) for c in calls.as_list()]
    return reasoning, content, merged, str(reader.finish_reason("stop"))


def split(parser: str, prompt: str, text: str, step: int | None = None) -> tuple[str, str]:
    use = reasoning_use(parser, prompt, include=True, constrained=False)
    assert use is not None
    reasoning, content, calls, _ = read(ChatReading(reasoning=use), text, step)
    assert not calls
    return reasoning, content


CASES = [
    # parser, prompt, output, reasoning, content
    ("qwen3", PLAIN_PROMPT, "<think>\nParis, so sunny?\n</think>\n\nSunny.", "\nParis, so sunny?\n",
     "\n\nSunny."),
    ("qwen3", PLAIN_PROMPT, "  <think>a < b</think>", "a < b", ""),
    ("qwen3", PLAIN_PROMPT, "Sunny, no thinking. <think>x</think>", "",
     "Sunny, no thinking. <think>x</think>"),
    ("qwen3", PLAIN_PROMPT, "<thin", "", "<thin"),  # could have opened a block; it did not
    ("qwen3", PLAIN_PROMPT, "<think>cut off mid-thought </thi", "cut off mid-thought </thi", ""),
    ("qwen3", OPEN_PROMPT, "Paris.\n</think>\n\nSunny.", "Paris.\n", "\n\nSunny."),
    ("qwen3", CLOSED_PROMPT, "Sunny. </think>", "", "Sunny. </think>"),
    ("deepseek_r1", PLAIN_PROMPT, "<think>Paris.</think>Sunny.", "Paris.", "Sunny."),
    ("deepseek_r1", PLAIN_PROMPT, "Paris.</think>Sunny.", "Paris.", "Sunny."),
    ("deepseek_r1", OPEN_PROMPT, "still thinking when max_tokens ran out",
     "still thinking when max_tokens ran out", ""),
    ("deepseek_r1", PLAIN_PROMPT, "</think>", "", ""),
    # GLM-4.5 opens its block; DeepSeek-V3.1's template opens it (thinking) or closes it.
    ("glm45", PLAIN_PROMPT, "<think>Paris.</think>Sunny.", "Paris.", "Sunny."),
    ("glm45", CLOSED_PROMPT, "Sunny.", "", "Sunny."),
    ("deepseek_v3", OPEN_PROMPT, "Paris.</think>Sunny.", "Paris.", "Sunny."),
    ("deepseek_v3", CLOSED_PROMPT, "Sunny.", "", "Sunny."),
    # Other tags: Seed-OSS's (deepseek_r1's rule), Magistral's (qwen3's); step3 as deepseek_r1.
    ("seed_oss", PLAIN_PROMPT, "<seed:think>Paris.</seed:think>Sunny.", "Paris.", "Sunny."),
    ("seed_oss", PLAIN_PROMPT, "Paris, still.", "Paris, still.", ""),
    ("seed_oss", PLAIN_PROMPT, "<think>x</think>y", "<think>x</think>y", ""),
    ("mistral", PLAIN_PROMPT, "[THINK]Paris.[/THINK]Sunny.", "Paris.", "Sunny."),
    ("mistral", PLAIN_PROMPT, "Sunny. [/THINK]", "", "Sunny. [/THINK]"),
    ("mistral", "<s>[INST]Hi[/INST][THINK]", "Paris.[/THINK]Sunny.", "Paris.", "Sunny."),
    ("step3", PLAIN_PROMPT, "Paris.</think>Sunny.", "Paris.", "Sunny."),
    # Granite's phrases, either spelling of each; an answer that opens otherwise is content
    ("granite", PLAIN_PROMPT, "Here is my thought process:\nParis.\nHere is my response:\nSunny.",
     "\nParis.\n", "\nSunny."),
    ("granite", PLAIN_PROMPT, " Here's my thought process: Paris. Here's my response: Sunny.",
     " Paris. ", " Sunny."),
    ("granite", PLAIN_PROMPT, "Here is the weather: sunny.", "", "Here is the weather: sunny."),
    ("granite", PLAIN_PROMPT, "Here is my thought process: cut off", " cut off", ""),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "prompt", "text", "reasoning", "content"), CASES)
def test_reasoning_split(parser: str, prompt: str, text: str, reasoning: str, content: str) -> None:
    assert split(parser, prompt, text) == (reasoning, content)
    for step in range(1, 12):  # streamed in pieces of every size: the same split
        assert split(parser, prompt, text, step) == (reasoning, content), step


def test_special_tags_are_kept_in_the_text() -> None:
    """Magistral's [THINK] tags are special tokens: its parser asks for them in the text (the
    gateway then sets skip_special_tokens false), and its constrained outputs start after
    [/THINK]."""
    use = reasoning_use("mistral", "[THINK]", include=True, constrained=True)
    assert use is not None and use.form.special and use.grammar_after == "[/THINK]"
    assert not REASONING_PARSERS["qwen3"].special


def test_streamed_pieces_hold_back_only_a_possible_tag() -> None:
    use = reasoning_use("qwen3", PLAIN_PROMPT, include=True, constrained=False)
    assert use is not None
    reader = use.new_reader()
    assert reader.feed("\n<th", final=False) == ("", "")
    assert reader.feed("ink>Paris", final=False) == ("Paris", "")
    assert reader.feed(" is sunny </", final=False) == (" is sunny ", "")
    assert reader.feed("b> so </think>", final=False) == ("</b> so ", "")
    assert reader.feed("Sunny <", final=False) == ("", "Sunny <")  # content is never held
    assert reader.feed("", final=True) == ("", "")


def test_tool_calls_are_read_after_the_reasoning() -> None:
    request = chat(tools=[WEATHER])
    tools = tool_use(request, "hermes")
    use = reasoning_use("qwen3", OPEN_PROMPT, include=True, constrained=False)
    text = (
        'A <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> here '
        'is only thought about.</think>\nChecking.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    )
    expected = (
        'A <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> here '
        "is only thought about.",
        "\nChecking.",
        [("get_weather", {"city": "Paris"})],
        "tool_calls",
    )
    for step in (None, 1, 3, 7):
        assert read(ChatReading(tools, use), text, step) == expected
    hidden = reasoning_use("qwen3", OPEN_PROMPT, include=False, constrained=False)
    assert read(ChatReading(tools, hidden), text, None) == ("", *expected[1:])


def test_constrained_outputs_reason_first_where_the_output_begins_in_the_reasoning() -> None:
    """A constrained output's grammar starts after </think> where the output begins inside
    the reasoning (deepseek_r1, or an open block in the prompt); elsewhere it is all content."""
    assert reasoning_use(None, OPEN_PROMPT, include=True, constrained=False) is None
    assert reasoning_use("qwen3", PLAIN_PROMPT, include=True, constrained=True) is None
    for parser, prompt in (("qwen3", OPEN_PROMPT), ("deepseek_r1", PLAIN_PROMPT)):
        use = reasoning_use(parser, prompt, include=True, constrained=True)
        assert use is not None and use.grammar_after == "</think>"
        free = reasoning_use(parser, prompt, include=True, constrained=False)
        assert free is not None and free.grammar_after is None


def test_earlier_reasoning_reaches_the_template(tokenizer: Any) -> None:
    """An assistant message's reasoning reaches the template under both of its names."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning }}|{{ m.reasoning_content }}|"
        "{{ m.content }};{% endfor %}"
    )
    for key in ("reasoning", "reasoning_content"):
        answer = {"role": "assistant", "content": "Sunny.", key: "Paris is sunny in May."}
        request = chat(messages=[USER, answer, USER], chat_template=template)
        assert render_chat_prompt(tokenizer, request) == (
            "user:||Weather in Paris?;assistant:Paris is sunny in May.|Paris is sunny in May.|"
            "Sunny.;user:||Weather in Paris?;"
        )
