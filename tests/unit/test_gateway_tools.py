"""Tool calling in the gateway: the readers that find calls in a choice's text, the schemas a
required or named ``tool_choice`` constrains the output to, vLLM's request checks, and tool
messages reaching the chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import StructuredOutputsParams
from baton_engine.structured_output import StructuredOutputManager
from baton_gateway.chat import ChatDefaults, render_chat_prompt
from baton_gateway.cli import load_chat_template
from baton_gateway.protocol import ChatCompletionRequest
from baton_gateway.tools import (
    DeepSeekReader,
    Glm45Reader,
    Granite20bFCReader,
    GraniteReader,
    HermesReader,
    InternLM2Reader,
    JambaReader,
    KimiK2Reader,
    Llama3JsonReader,
    MistralReader,
    NamedCallReader,
    PythonicReader,
    Qwen3CoderReader,
    RequiredCallsReader,
    ToolCallReader,
    ToolCallsSoFar,
    tool_call_schema,
    tool_use,
    typed_value,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def read(new_reader: Callable[[], ToolCallReader], text: str, step: int | None = None) -> Any:
    """``text`` through a fresh reader in pieces of ``step`` characters (None: whole):
    the content and the calls merged as a client merges a stream."""
    reader = new_reader()
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = "", ToolCallsSoFar()
    for i, piece in enumerate(pieces):
        out = reader.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        calls.add(out.tool_calls)
    merged = [(c.function.name, json.loads(c.function.arguments)) for c in calls.as_list()]
    assert len({c.id for c in calls.as_list()}) == len(merged)  # each call its own id
    assert reader.num_calls == len(merged)
    return content, merged


HERMES_CASES = [
    # Content, then two calls; whitespace around calls dropped.
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # No calls: the text exactly, trailing whitespace and tag-like text included.
    ("Hello there!\n", "Hello there!\n", []),
    ("if a < b: <tool", "if a < b: <tool", []),
    # A block that is not a call stays content, tags and all, and the whitespace before it.
    (
        'See:\n<tool_call>{"name": nope}</tool_call> then text',
        'See:\n<tool_call>{"name": nope}</tool_call> then text',
        [],
    ),
    # An unterminated block that parses is a call (the output ran out before the end tag).
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool"}}', "", [("f", {"s": "</tool"})]),
    # One that does not parse is content.
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    # Content after a call.
    ('<tool_call>{"name": "f"}</tool_call>\n\nDone.', "Done.", [("f", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_reader(text: str, content: str, calls: list[Any]) -> None:
    assert read(HermesReader, text) == (content, calls)
    for step in (1, 2, 3, 5, 11):  # however the text streams in, the same result
        assert read(HermesReader, text, step) == (content, calls), step


LLAMA_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
        '"parameters": {}}',
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    ('<|python_tag|>{"name": "f", "parameters": {"x": "};"}}', "", [("f", {"x": "};"})]),
    ("  The answer is {42}.", "  The answer is {42}.", []),
    # Starts like a call but is not one: all of it is content, exactly.
    ('{"a": 1} and more', '{"a": 1} and more', []),
    ('{"name": "f", "parame', '{"name": "f", "parame', []),
    ('{"name": "f", "parameters": {}} then prose', "then prose", [("f", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_reader(text: str, content: str, calls: list[Any]) -> None:
    assert read(Llama3JsonReader, text) == (content, calls)
    for step in (1, 2, 7):
        assert read(Llama3JsonReader, text, step) == (content, calls), step


MISTRAL_CASES = [
    # Mistral 7B v0.3 / Nemo: a JSON list after the token, content before it.
    (
        'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Checking. ",
        [("get_weather", {"city": "Rome"}), ("get_time", {})],
    ),
    # Tokenizers v11+: name[ARGS]{...} after each token.
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    # No calls: the text exactly, bracket-like text included.
    ("Use [TOOL] wisely [TOOL_CALL", "Use [TOOL] wisely [TOOL_CALL", []),
    # Calls that do not parse stay content, the token included.
    ('Hm [TOOL_CALLS] [{"name": "f", "argu', 'Hm [TOOL_CALLS] [{"name": "f", "argu', []),
    ("[TOOL_CALLS]just words", "[TOOL_CALLS]just words", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral_reader(text: str, content: str, calls: list[Any]) -> None:
    assert read(MistralReader, text) == (content, calls)
    for step in (1, 2, 5):
        assert read(MistralReader, text, step) == (content, calls), step


def test_mistral_call_ids_are_what_its_templates_accept() -> None:
    """Mistral's chat templates refuse a tool call id that is not 9 letters and digits."""
    reader = MistralReader()
    out = reader.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]', final=True)
    (call,) = out.tool_calls
    assert call.id is not None and len(call.id) == 9 and call.id.isalnum()
    assert tool_use(
        chat(messages=MESSAGES, tools=[WEATHER], tool_choice="auto"), "mistral"
    ).keeps_special_tokens


PYTHONIC_CASES = [
    (
        '[get_weather(city="San Francisco", unit="celsius"), get_time()]',
        "",
        [("get_weather", {"city": "San Francisco", "unit": "celsius"}), ("get_time", {})],
    ),
    # Llama 4's wrapper; literal values of every kind.
    (
        "<|python_start|>[f(a=1, b=[2.5, None], c={'k': True})]<|python_end|>",
        "",
        [("f", {"a": 1, "b": [2.5, None], "c": {"k": True}})],
    ),
    ("The answer is [1, 2].", "The answer is [1, 2].", []),
    # Starts like calls but is not: all of it is content, exactly.
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[f(x)]", "[f(x)]", []),  # (positional arguments: not a call Baton can name)
    ("[f(a=open('x'))]", "[f(a=open('x'))]", []),  # (not a literal)
    ("[f(a=1", "[f(a=1", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC_CASES)
def test_pythonic_reader(text: str, content: str, calls: list[Any]) -> None:
    assert read(PythonicReader, text) == (content, calls)
    for step in (1, 3, 8):
        assert read(PythonicReader, text, step) == (content, calls), step


# The XML formats' values are text; the tools' schemas type them.
SCHEMAS: dict[str, Any] = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "zip": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "where": {"type": "object"},
            "note": {"type": ["string", "null"]},
        },
    },
}


def test_typed_values() -> None:
    props = SCHEMAS["get_weather"]["properties"]
    assert typed_value("75001", props["zip"]) == "75001"  # a string as written
    assert typed_value("3", props["days"]) == 3
    assert typed_value("true", props["metric"]) is True
    assert typed_value("True", props["metric"]) is True  # (a Python literal)
    assert typed_value('{"lat": 1.5}', props["where"]) == {"lat": 1.5}
    assert typed_value("{'lat': 1.5}", props["where"]) == {"lat": 1.5}
    assert typed_value("null", props["days"]) is None
    assert typed_value("null", props["note"]) is None and typed_value("x", props["note"]) == "x"
    assert typed_value("soon", props["days"]) == "soon"  # not a number: kept as written
    assert typed_value("3", None) == "3"  # a parameter the schema does not know


QWEN3_CODER_CASES = [
    (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=where>\n{"lat": 48.9}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "Let me check.",
        [
            ("get_weather", {"city": "Paris", "zip": "75001", "days": 3, "where": {"lat": 48.9}}),
            ("get_time", {}),
        ],
    ),
    # A value over several lines keeps them (only the layout's newlines go).
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "New\nYork"})],
    ),
    ("No tools needed.\n", "No tools needed.\n", []),
    # A block without a function stays content, tags and all.
    ("<tool_call>\nhello\n</tool_call>", "<tool_call>\nhello\n</tool_call>", []),
    # Cut short: the call as far as it got.
    (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2",
        "",
        [("get_weather", {"days": 2})],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), QWEN3_CODER_CASES)
def test_qwen3_coder_reader(text: str, content: str, calls: list[Any]) -> None:
    for step in (None, 1, 2, 5, 13):
        assert read(lambda: Qwen3CoderReader(SCHEMAS), text, step) == (content, calls), step


GLM45_CASES = [
    (
        "I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "<arg_key>metric</arg_key>\n<arg_value>false</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n</tool_call>",
        "I will look.",
        [("get_weather", {"city": "Paris", "days": 3, "metric": False}), ("get_time", {})],
    ),
    ("Just text", "Just text", []),
    # No name: content.
    (
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), GLM45_CASES)
def test_glm45_reader(text: str, content: str, calls: list[Any]) -> None:
    for step in (None, 1, 3, 7):
        assert read(lambda: Glm45Reader(SCHEMAS), text, step) == (content, calls), step


DEEPSEEK_CASES = [
    # V3 and R1: "function", the name, and fenced JSON.
    (
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
        "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Sure.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # V3.1: the name, then the JSON.
    (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    ("Plain answer.", "Plain answer.", []),
    # Arguments that are not JSON: all of the section is content.
    (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), DEEPSEEK_CASES)
def test_deepseek_reader(text: str, content: str, calls: list[Any]) -> None:
    for step in (None, 1, 4, 9):
        assert read(DeepSeekReader, text, step) == (content, calls), step


KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
    "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>"
)
SECTION_CASES = [
    (KimiK2Reader, "Checking." + KIMI, "Checking.", [("get_weather", {"city": "Paris"}),
                                                       ("get_time", {})]),
    (KimiK2Reader, KIMI.replace('{"city": "Paris"}', "{oops"), KIMI.replace(
        '{"city": "Paris"}', "{oops"), []),
    (JambaReader, 'Sure. <tool_calls>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {}}]</tool_calls>', "Sure.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (JambaReader, "<tool_calls>[1, 2]</tool_calls>", "<tool_calls>[1, 2]</tool_calls>", []),
    (InternLM2Reader, 'Let me look.<|action_start|><|plugin|>\n{"name": "get_weather", '
     '"parameters": {"city": "Rome"}}<|action_end|>', "Let me look.",
     [("get_weather", {"city": "Rome"})]),
    (JambaReader, "No tools.", "No tools.", []),
]  # fmt: skip


GRANITE_CASES = [
    # Granite 3.1 and later: <tool_call> then a JSON list, the whole output
    (GraniteReader, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {}}]', "", [("get_weather", {"city": "Oslo"}),
                                                   ("get_time", {})]),
    # Granite 3.0: its <|tool_call|> token, after whitespace
    (GraniteReader, ' \n<|tool_call|>[{"name": "get_time", "arguments": {}}]', "",
     [("get_time", {})]),
    # anything else is content, a tag later in the text included
    (GraniteReader, 'Sure. <tool_call>[{"name": "f", "arguments": {}}]',
     'Sure. <tool_call>[{"name": "f", "arguments": {}}]', []),
    (GraniteReader, "<tool", "<tool", []),  # a tag's beginning, then the end
    (GraniteReader, "<toolbox> is not a tag", "<toolbox> is not a tag", []),
    (GraniteReader, '<tool_call>[{"name": "f", "argu', '<tool_call>[{"name": "f", "argu', []),
    # Granite-20B-FunctionCalling: content, then an object after each <function_call>
    (Granite20bFCReader, 'Checking. <function_call> {"name": "get_weather", "arguments": '
     '{"city": "Rome"}}\n<function_call> {"name": "get_time", "arguments": {}}', "Checking. ",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    (Granite20bFCReader, "<function_call> oops", "<function_call> oops", []),
]  # fmt: skip


@pytest.mark.parametrize(("reader", "text", "content", "calls"), SECTION_CASES + GRANITE_CASES)
def test_kimi_jamba_internlm_and_granite_readers(
    reader: Callable[[], ToolCallReader], text: str, content: str, calls: list[Any]
) -> None:
    for step in (None, 1, 4, 9):
        assert read(reader, text, step) == (content, calls), step


def test_kimi_k2_keeps_the_models_call_ids() -> None:
    """Kimi's template writes each call's id back in later turns: it is the model's own."""
    out = KimiK2Reader().feed(KIMI, final=True)
    assert [c.id for c in out.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
    request = chat(messages=MESSAGES, tools=[WEATHER], tool_choice="auto")
    assert tool_use(request, "internlm").keeps_special_tokens  # type: ignore[union-attr]


def test_xml_readers_get_the_requests_schemas() -> None:
    """``tool_use`` hands the XML formats' readers the request's tools, so values are typed."""
    request = chat(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="auto")
    reader = tool_use(request, "qwen3_coder").new_reader()  # type: ignore[union-attr]
    out = reader.feed(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        final=True,
    )
    [call] = out.tool_calls
    assert json.loads(call.function.arguments or "") == {"city": "42", "unit": "celsius"}
    for parser in ("glm45", "deepseek_v3", "deepseek_v31", "hermes"):
        use = tool_use(request, parser)
        assert use is not None and not use.keeps_special_tokens


def test_required_and_named_readers() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "a\\"]}"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    calls = [("get_weather", {"city": 'a"]}'}), ("get_time", {})]
    for step in (None, 1, 4):
        assert read(RequiredCallsReader, text, step) == ("", calls)
    # Cut short by max_tokens: the complete calls, and the rest as content.
    cut = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "param'
    for step in (None, 1):
        assert read(RequiredCallsReader, cut, step) == (
            '{"name": "get_weather", "param',
            [("get_time", {})],
        )
    for step in (None, 1, 3):
        assert read(lambda: NamedCallReader("get_weather"), '{"city": "Rome"}', step) == (
            "",
            [("get_weather", {"city": "Rome"})],
        )


def test_named_call_streams_its_arguments() -> None:
    reader = NamedCallReader("get_weather")
    first = reader.feed('{"ci', final=False).tool_calls
    assert len(first) == 1 and first[0].id and first[0].type == "function"
    assert first[0].function.name == "get_weather" and first[0].function.arguments == '{"ci'
    later = reader.feed('ty": "Rome"}', final=True).tool_calls
    assert [(p.index, p.id, p.function.name, p.function.arguments) for p in later] == [
        (0, None, None, 'ty": "Rome"}')
    ]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_tool_choice_defaults_and_checks() -> None:
    assert chat().effective_tool_choice == "none"
    assert chat(tools=[WEATHER]).effective_tool_choice == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").effective_tool_choice == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER], tool_choice=named).effective_tool_choice == "named"
    bad = [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": []}, "must not be an empty array"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "Tool 'x' has not been passed",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"},
            "not both",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
    ]
    for fields, message in bad:
        with pytest.raises(ValidationError, match=message):
            chat(**fields)
    # "auto" needs the server's parser (vLLM's message); "none" and required do not.
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        tool_use(chat(tools=[WEATHER]), None)
    assert tool_use(chat(tools=[WEATHER]), "hermes") is not None
    # vLLM's other names of formats read here: a Llama 4 output through "llama4_pythonic"
    use = tool_use(chat(tools=[WEATHER]), "llama4_pythonic")
    assert use is not None
    text = '<|python_start|>[get_weather(city="Oslo")]<|python_end|>'
    assert read(use.new_reader, text) == ("", [("get_weather", {"city": "Oslo"})])
    for alias, reader in (("llama4_json", Llama3JsonReader), ("qwen3_xml", Qwen3CoderReader)):
        use = tool_use(chat(tools=[WEATHER]), alias)
        assert use is not None and isinstance(use.new_reader(), reader)
    assert tool_use(chat(tools=[WEATHER], tool_choice="none"), None) is None
    assert tool_use(chat(tools=[WEATHER], tool_choice="required"), None) is not None
    # A response_format with "none" or "auto" is allowed, as in vLLM.
    fmt = {"type": "json_object"}
    assert chat(tools=[WEATHER], tool_choice="none", response_format=fmt).structured is not None


def test_tool_call_schemas() -> None:
    named = chat(tools=[WEATHER, TIME], tool_choice={"function": {"name": "get_weather"}})
    assert tool_call_schema(named) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert named.structured is not None
    assert tool_call_schema(
        chat(tools=[WEATHER, TIME], tool_choice={"function": {"name": "get_time"}})
    ) == {"type": "object", "properties": {}}
    required = tool_call_schema(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert required is not None and required["minItems"] == 1 and "maxItems" not in required
    names = [i["properties"]["name"]["enum"] for i in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    single = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert tool_call_schema(single)["maxItems"] == 1  # type: ignore[index]
    with_defs = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/date"}},
                "$defs": {"date": {"type": "string", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
            },
        },
    }
    hoisted = tool_call_schema(chat(tools=[with_defs, TIME], tool_choice="required"))
    assert hoisted is not None and "date" in hoisted["$defs"]


def test_tool_call_schemas_compile(tokenizer: Any) -> None:
    """A required choice's schemas compile with XGrammar, as the worker will compile them."""
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer))
    for fields in (
        {"tools": [WEATHER, TIME], "tool_choice": "required"},
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
        {"tools": [WEATHER, TIME], "tool_choice": {"function": {"name": "get_time"}}},
    ):
        schema = tool_call_schema(chat(**fields))
        manager.grammar(StructuredOutputsParams(json=json.dumps(schema)))


def test_tool_messages_reach_the_template(tokenizer: Any, tmp_path: Path) -> None:
    """An assistant message's tool calls reach the template with their arguments parsed, tool
    results with their ids; a request's template wins over the server's."""
    template = (
        "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.city }};{% endfor %}"
        "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }};"
        "{% else %}{{ m.role }}: {{ m.content }};{% endif %}{% endfor %}"
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    )
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    request = chat(messages=history, tools=[WEATHER, TIME], chat_template=template)
    assert render_chat_prompt(tokenizer, request, ChatDefaults("server {{ 1 }}")) == (
        "user: Weather in Paris?;CALL get_weather Paris;RESULT call_1 18 C;"
        "TOOLS get_weather,get_time"
    )
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    assert render_chat_prompt(tokenizer, chat(messages=MESSAGES), ChatDefaults(template)) == (
        "user: Weather in Paris?;"
    )
    # --exclude-tools-when-tool-choice-none: tools the request may not call stay out of the
    # prompt (vLLM's flag); without it they reach the template as always.
    hide = ChatDefaults(template, exclude_tools_when_tool_choice_none=True)
    for choice, listed in (("none", False), ("auto", True), (None, True)):
        request = chat(tools=[WEATHER], tool_choice=choice)
        assert ("TOOLS get_weather" in render_chat_prompt(tokenizer, request, hide)) == listed
        assert "TOOLS get_weather" in render_chat_prompt(tokenizer, request, ChatDefaults(template))
    with pytest.raises(InvalidRequestError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidRequestError, match="not a valid Jinja template"):
        load_chat_template("{% for x in %}")
