"""Tool calling on chat completions: OpenAI's ``tools`` and ``tool_choice``, served as vLLM does.

- A named ``tool_choice`` (``{"type": "function", "function": {"name": ...}}``): the worker
  constrains the output to that function's ``parameters`` schema (structured output), and the
  text is the call's arguments. ``finish_reason`` stays "stop", as with OpenAI.
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` objects, each naming one of ``tools`` (vLLM's schema;
  ``parallel_tool_calls: false`` caps it at one call). ``finish_reason`` is "tool_calls".
- ``"auto"`` (the default when tools are given): the model writes freely and the server's tool
  parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds the calls in its text;
  without them "auto" is a 400, as in vLLM. ``finish_reason`` is "tool_calls" when it found any.
- ``"none"``: plain text. Tools still reach the chat template in every case.

Parsers: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the
format of Hermes, Qwen2.5 and many others), ``llama3_json`` (Llama 3.1's JSON calls,
``{"name": ..., "parameters": {...}}``, several separated by ``;``), ``mistral`` (Mistral's
``[TOOL_CALLS]`` token and a JSON list of calls, or its newer ``[TOOL_CALLS]name[ARGS]{...}``;
the text keeps special tokens so that the token shows, and call ids are the 9 letters and digits
Mistral's chat templates require), ``pythonic`` (Llama 3.2/4's Python-style list of calls,
``[get_weather(city="Paris"), get_time()]``), ``qwen3_coder`` (Qwen3-Coder's XML:
``<function=NAME>`` and ``<parameter=KEY>`` tags in ``<tool_call>`` blocks), ``glm45`` (GLM-4.5
and 4.6: the name, then ``<arg_key>``/``<arg_value>`` pairs in ``<tool_call>`` blocks) and
``deepseek_v3``/``deepseek_v31`` (DeepSeek's section of calls between its tool-call tokens),
``kimi_k2`` (Kimi K2's section of calls; their ids kept), ``jamba`` (a JSON list in
``<tool_calls>``) and ``internlm`` (InternLM2's action tokens around a JSON call).
The XML formats write values as text; the tool's parameters schema types them, as in vLLM.

One :class:`ToolCallReader` per choice turns the text into content and tool-call pieces, fed as
the text streams in; a non-streamed response feeds it the whole text and merges the pieces, so
both give the same calls. A named call streams its arguments as they come; the other readers
send each call whole, in one piece, once its text is complete. Text that is not a well-formed
call stays in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from baton_gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from baton_gateway.reasoning import partial_tag_length

if TYPE_CHECKING:
    from baton_gateway.protocol import ChatCompletionRequest


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a required or named ``tool_choice`` constrains the output to, or None."""
    choice = request.effective_tool_choice
    tools = request.tools or []
    if choice == "named":
        name = request.tool_choice.function.name  # type: ignore[union-attr]
        params = next((t.function.parameters for t in tools if t.function.name == name), None)
        return params if params else {"type": "object", "properties": {}}
    if choice != "required":
        return None
    items = []
    defs: dict[str, Any] = {}
    for tool in tools:
        params = dict(tool.function.parameters or {"type": "object", "properties": {}})
        # JSON-schema references resolve from the root: hoist each tool's $defs there.
        defs.update(params.pop("$defs", {}))
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(slots=True)
class ReadOut:
    """What a reader releases for one piece of text: content, tool-call pieces, and (see
    ``reading.py``) reasoning."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    reasoning: str = ""


class ToolCallReader:
    """Turns one choice's text into content and tool calls, piece by piece.

    :meth:`feed` takes each new piece of text (``final`` on the last) and returns what can be
    released. Subclasses implement :meth:`_read`; this class numbers the calls.
    ``keeps_special_tokens``: the format uses special tokens, so the text must keep them.
    """

    keeps_special_tokens = False

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> ReadOut:
        return self._read(text, final)

    def _read(self, text: str, final: bool) -> ReadOut:
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> DeltaToolCall:
        """A whole call: ``arguments`` as JSON text (a string is taken to be JSON already)."""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = DeltaToolCall(
            index=self.num_calls,
            id=tool_call_id(),
            type="function",
            function=DeltaFunctionCall(name=name, arguments=arguments),
        )
        self.num_calls += 1
        return call


class NamedCallReader(ToolCallReader):
    """A named ``tool_choice``: all the text is the arguments of one call to ``name``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def _read(self, text: str, final: bool) -> ReadOut:
        if self.num_calls == 0 and (text or final):
            return ReadOut(tool_calls=[self._call(self._name, text)])
        if text:
            return ReadOut(
                tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
            )
        return ReadOut()


class _ObjectScanner:
    """Finds whole top-level JSON objects in text that grows at its end, skipping the
    characters in ``separators`` between them (and whitespace). ``rest`` is the text after the
    last whole object; ``broken`` is set at the first character that cannot start one."""

    def __init__(self, separators: str) -> None:
        self._separators = separators
        self.text = ""
        self._start = 0  # where the object being read starts (or where scanning resumes)
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.broken = False

    @property
    def rest(self) -> str:
        return self.text[self._start :]

    def add(self, text: str) -> list[tuple[str, int]]:
        """The objects that ``text`` completes: each one's JSON text and where it ends."""
        self.text += text
        done: list[tuple[str, int]] = []
        t = self.text
        while not self.broken and self._pos < len(t):
            c = t[self._pos]
            self._pos += 1
            if self._depth == 0:
                if c == "{":
                    self._start, self._depth = self._pos - 1, 1
                elif c.isspace() or c in self._separators:
                    self._start = self._pos
                else:
                    self._start, self.broken = self._pos - 1, True
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done.append((t[self._start : self._pos], self._pos))
                    self._start = self._pos
        return done


def _parse_call(text: str, arguments_key: tuple[str, ...]) -> tuple[str, Any] | None:
    """``(name, arguments)`` of a JSON call object, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_key:
        if key in obj:
            return obj["name"], obj[key]
    return obj["name"], {}


def _json_calls(text: str) -> list[tuple[str, Any]] | None:
    """The calls of a JSON list of ``{"name", "arguments"}`` objects (or of one such object),
    or None when it is not that."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    calls = []
    for obj in parsed if isinstance(parsed, list) else [parsed]:
        call = _parse_call(json.dumps(obj), ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
    return calls


class RequiredCallsReader(ToolCallReader):
    """``tool_choice="required"``: a JSON array of ``{"name", "parameters"}`` objects; each
    call goes out once its object is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._scanner = _ObjectScanner("[],")

    def _read(self, text: str, final: bool) -> ReadOut:
        out = ReadOut()
        for obj, _ in self._scanner.add(text):
            parsed = _parse_call(obj, ("parameters", "arguments"))
            if parsed is None:
                out.content += obj
            else:
                out.tool_calls.append(self._call(*parsed))
        if final:
            out.content += self._scanner.rest.strip().rstrip("]").strip()
        return out


class Llama3JsonReader(ToolCallReader):
    """Llama 3.1's JSON tool calls: text that starts with ``{`` (or Llama's ``<|python_tag|>``)
    is one or more ``{"name", "parameters"}`` objects separated by ``;``. Any other text is
    content, and so is the text from the first object that is not a call (all of it, exactly,
    when no call came before)."""

    _PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided; "content" or "calls"
        self._head = ""  # text before the mode is known
        self._scanner = _ObjectScanner(";")
        self._done = 0  # where the text after the last call starts, in the scanner's text

    def _read(self, text: str, final: bool) -> ReadOut:
        if self._mode is None:
            self._head += text
            head = self._head.lstrip()
            if head.startswith(self._PYTHON_TAG):
                self._mode, text = "calls", head[len(self._PYTHON_TAG) :]
            elif head.startswith("{"):
                self._mode, text = "calls", self._head
            elif (head and not self._PYTHON_TAG.startswith(head)) or final:
                self._mode, text = "content", self._head
            else:
                return ReadOut()
        if self._mode == "content":
            return ReadOut(content=text)
        out = ReadOut()
        broken = False
        for obj, end in self._scanner.add(text):
            parsed = _parse_call(obj, ("parameters", "arguments"))
            if parsed is None:
                broken = True
                break
            out.tool_calls.append(self._call(*parsed))
            self._done = end
        if broken or self._scanner.broken or final:
            rest = self._scanner.text[self._done :]
            out.content += rest.lstrip(" \t\r\n;") if self.num_calls else rest
            self._mode = "content"
        return out


class TaggedCallsReader(ToolCallReader):
    """Calls in ``START`` ... ``END`` blocks among content; a subclass reads a block's body
    (:meth:`_parse_block`: its calls, or None when it holds none).

    Content streams as it comes, except text that may begin ``START`` (held until it does or
    does not) and trailing whitespace (held until more content follows it). Whitespace before,
    between and after calls is dropped; a reply without calls keeps its text exactly. A block
    that holds no call goes out as content, tags and all; so does an unterminated one that does
    not parse at the end. ``schemas``: each tool's parameters schema, by name (formats whose
    values are text use it to type them).
    """

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.schemas = schemas or {}
        self._buffer = ""
        self._in_call = False
        self._after_call = False  # the content being released follows a call: drop its lead
        self._gap = ""  # the whitespace before the open block

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        raise NotImplementedError

    def _read(self, text: str, final: bool) -> ReadOut:
        self._buffer += text
        out = ReadOut()
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    if final:
                        self._close_call(self._buffer, out, terminated=False)
                        self._buffer = ""
                    return out
                made = self._close_call(self._buffer[:end], out, terminated=True)
                self._buffer = self._buffer[end + len(self.END) :]
                self._in_call, self._after_call = False, made
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                lead = self._buffer[:start]
                self._release(out, lead.rstrip())
                # (the whitespace before the block: dropped if it holds calls)
                self._gap = "" if self._after_call else lead[len(lead.rstrip()) :]
                self._buffer = self._buffer[start + len(self.START) :]
                self._in_call = True
                continue
            if final:
                self._release(out, self._buffer.rstrip() if self.num_calls else self._buffer)
                self._buffer = ""
                return out
            keep = _held_back(self._buffer, self.START)
            self._release(out, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def _release(self, out: ReadOut, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        out.content += text

    def _close_call(self, body: str, out: ReadOut, terminated: bool) -> bool:
        """Release the block ``body`` as calls, or as content if it holds none; True for
        calls."""
        calls = self._parse_block(body)
        if not calls:
            out.content += self._gap + self.START + body + (self.END if terminated else "")
            return False
        out.tool_calls += [self._call(name, arguments) for name, arguments in calls]
        return True


class HermesReader(TaggedCallsReader):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among content."""

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        parsed = _parse_call(body.strip(), ("arguments", "parameters"))
        return None if parsed is None else [parsed]


def typed_value(text: str, schema: Any) -> Any:
    """A parameter written as text, as the type its ``schema`` gives it (vLLM's reading):
    a string, or a parameter the schema does not know, as written; ``null`` as None; else the
    text as JSON, else as a Python literal, else as written."""
    if not isinstance(schema, dict):
        return text
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind and text != "null"):
        return text
    if text.strip().lower() == "null":
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


class Qwen3CoderReader(TaggedCallsReader):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``), each in a ``<tool_call>`` block::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value's one leading and trailing newline are the layout's; the rest is typed by the
    tool's schema (:func:`typed_value`)."""

    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
    )

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        calls = []
        for function in self._FUNCTION.finditer(body):
            name = function.group(1).strip()
            properties = (self.schemas.get(name) or {}).get("properties") or {}
            arguments = {}
            for parameter in self._PARAMETER.finditer(function.group(2)):
                key, value = parameter.group(1).strip(), parameter.group(2)
                value = value.removeprefix("\n").removesuffix("\n")
                arguments[key] = typed_value(value, properties.get(key))
            calls.append((name, arguments))
        return calls or None


class Glm45Reader(TaggedCallsReader):
    """GLM-4.5 and 4.6's calls (vLLM's ``glm45``): the function's name, then its arguments
    as key and value tags, in a ``<tool_call>`` block::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Paris</arg_value>
        </tool_call>

    Values are typed by the tool's schema (:func:`typed_value`)."""

    _ARGUMENT = re.compile(
        r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL
    )

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        name, _, rest = body.strip().partition("<arg_key>")
        name = name.strip()
        if not name or any(c.isspace() or c in "<>{}" for c in name):
            return None
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments = {
            key.strip(): typed_value(value, properties.get(key.strip()))
            for key, value in self._ARGUMENT.findall("<arg_key>" + rest if rest else "")
        }
        return [(name, arguments)]


class DeepSeekReader(TaggedCallsReader):
    """DeepSeek's calls (vLLM's ``deepseek_v3`` and ``deepseek_v31``): one section of calls
    among content, each call ``function<｜tool▁sep｜>NAME`` and its arguments in a fenced JSON
    block (V3, R1), or ``NAME<｜tool▁sep｜>{...}`` (V3.1), between its begin and end tokens."""

    START, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL
    )
    _FENCED = re.compile(r"\s*(.*?)\s*\n```(?:json)?\s*\n(.*?)\s*```\s*$", re.DOTALL)

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        calls = []
        for head, rest in self._CALL.findall(body):
            if head.strip() == "function":  # V3: the name, then ```json ... ```
                fenced = self._FENCED.match(rest)
                if fenced is None:
                    return None
                name, arguments = fenced.group(1), fenced.group(2)
            else:  # V3.1
                name, arguments = head, rest
            try:
                calls.append((name.strip(), json.loads(arguments)))
            except ValueError:
                return None
        return calls or None


class KimiK2Reader(TaggedCallsReader):
    """Kimi K2's calls (vLLM's ``kimi_k2``): one section of calls among content, each an id
    ``functions.NAME:INDEX`` and its JSON arguments between the call tokens. The id is kept as
    the call's id: Kimi's template writes it back in later turns."""

    START, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    _CALL = re.compile(
        r"<\|tool_call_begin\|>\s*(\S+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
        re.DOTALL,
    )

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        super().__init__(schemas)
        self._ids: list[str] = []  # the ids of the calls the last block holds, in order

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        calls, ids = [], []
        for call_id, arguments in self._CALL.findall(body):
            try:
                calls.append((call_id.split(":")[0].split(".")[-1], json.loads(arguments)))
            except ValueError:
                return None
            ids.append(call_id)
        self._ids = ids
        return calls or None

    def _call(self, name: str, arguments: Any) -> DeltaToolCall:
        call = super()._call(name, arguments)
        call.id = self._ids.pop(0)
        return call


class JambaReader(TaggedCallsReader):
    """Jamba's calls (vLLM's ``jamba``): a JSON list of ``{"name", "arguments"}`` objects in a
    ``<tool_calls>`` block."""

    START, END = "<tool_calls>", "</tool_calls>"

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        return _json_calls(body) or None


class InternLM2Reader(TaggedCallsReader):
    """InternLM2's calls (vLLM's ``internlm``): ``{"name", "parameters"}`` after its action and
    plugin tokens, to the action's end token (special tokens: the text keeps them)."""

    START, END = "<|action_start|><|plugin|>", "<|action_end|>"
    keeps_special_tokens = True

    def _parse_block(self, body: str) -> list[tuple[str, Any]] | None:
        parsed = _parse_call(body.strip(), ("parameters", "arguments"))
        return None if parsed is None else [parsed]


class CallsToTheEndReader(ToolCallReader):
    """Content, then ``BOT`` and calls to the end: after each ``BOT``, a JSON list of
    ``{"name", "arguments"}`` objects or one such object, or ``name[ARGS]{...}``. Content
    streams (text that may begin ``BOT`` is held); the calls go out at the end, each whole.
    Calls that do not parse stay content, ``BOT`` included, so nothing the model wrote is
    lost."""

    BOT, ARGS = "", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._calls: str | None = None  # the text after the first BOT

    def _read(self, text: str, final: bool) -> ReadOut:
        out = ReadOut()
        if self._calls is None:
            self._buffer += text
            at = self._buffer.find(self.BOT)
            if at < 0:
                keep = 0 if final else partial_tag_length(self._buffer, self.BOT)
                out.content = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            out.content = self._buffer[:at]
            self._calls, self._buffer = self._buffer[at + len(self.BOT) :], ""
        else:
            self._calls += text
        if final:
            calls = self._parse(self._calls)
            if calls is None:
                out.content += self.BOT + self._calls
            else:
                out.tool_calls = [self._call(name, arguments) for name, arguments in calls]
        return out

    def _parse(self, text: str) -> list[tuple[str, Any]] | None:
        calls: list[tuple[str, Any]] = []
        for part in text.split(self.BOT):
            part = part.strip()
            if not part:
                continue
            if part[0] in "[{":  # a JSON list of calls, or one
                listed = _json_calls(part)
                if listed is None:
                    return None
                calls += listed
            elif self.ARGS in part:  # name[ARGS]{...}
                name, _, arguments = part.partition(self.ARGS)
                try:
                    calls.append((name.strip(), json.loads(arguments)))
                except ValueError:
                    return None
            else:
                return None
        return calls or None


class MistralReader(CallsToTheEndReader):
    """Mistral's tool calls: content, then ``[TOOL_CALLS]`` and a JSON list of calls (Mistral
    7B v0.3, Nemo), or ``name[ARGS]{...}`` after each ``[TOOL_CALLS]`` (tokenizers v11 and
    later)."""

    BOT = "[TOOL_CALLS]"
    keeps_special_tokens = True  # (the token is a special token)

    def _call(self, name: str, arguments: Any) -> DeltaToolCall:
        call = super()._call(name, arguments)
        call.id = "".join(random.choices(string.ascii_letters + string.digits, k=9))
        return call


class Granite20bFCReader(CallsToTheEndReader):
    """Granite-20B-FunctionCalling's calls (vLLM's ``granite-20b-fc``): content, then a
    ``{"name", "arguments"}`` object after each ``<function_call>``."""

    BOT = "<function_call>"


class GraniteReader(ToolCallReader):
    """IBM Granite 3.x's calls (vLLM's ``granite``): an output that is ``<|tool_call|>`` (3.0)
    or ``<tool_call>`` (3.1 and later), then a JSON list of ``{"name", "arguments"}`` objects
    to the end. Any other output is content, streamed as it comes (leading whitespace and a
    tag's beginning are held until they tell); calls that do not parse stay content."""

    TAGS = ("<|tool_call|>", "<tool_call>")

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._calls: bool | None = None  # None: not yet known whether the output is calls

    def _read(self, text: str, final: bool) -> ReadOut:
        out = ReadOut()
        if self._calls is False:
            out.content = text
            return out
        self._text += text
        lead = self._text.lstrip()
        if self._calls is None:
            if any(lead.startswith(tag) for tag in self.TAGS):
                self._calls = True
            elif final or (lead and not any(tag.startswith(lead) for tag in self.TAGS)):
                self._calls = False
                out.content, self._text = self._text, ""
                return out
        if final and self._calls:
            tag = next(tag for tag in self.TAGS if lead.startswith(tag))
            calls = _json_calls(lead[len(tag) :].strip())
            if calls:
                out.tool_calls = [self._call(name, arguments) for name, arguments in calls]
            else:
                out.content = self._text
        return out


class PythonicReader(ToolCallReader):
    """Llama 3.2/4's Python-style calls: an output that is a list of calls with keyword
    arguments of literal values, ``[f(a=1, b="x"), g()]`` (Llama 4 may wrap it in
    ``<|python_start|>`` / ``<|python_end|>``). An output that starts otherwise streams as
    content; one that starts like a list goes out at the end, as calls when it parses, else as
    content exactly."""

    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: undecided; "content" or "calls"
        self._text = ""

    def _read(self, text: str, final: bool) -> ReadOut:
        if self._mode == "content":
            return ReadOut(content=text)
        self._text += text
        head = self._text.lstrip()
        if self._mode is None:
            if head.startswith(("[", self.START)):
                self._mode = "calls"
            elif (head and not self.START.startswith(head)) or final:
                self._mode = "content"
                return ReadOut(content=self._text)
            else:
                return ReadOut()
        if not final:
            return ReadOut()
        body = head.removeprefix(self.START).strip().removesuffix(self.END).strip()
        calls = _python_calls(body)
        if calls is None:
            return ReadOut(content=self._text)
        return ReadOut(tool_calls=[self._call(name, arguments) for name, arguments in calls])


def _python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of a Python list of calls with literal keyword arguments, or None."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:
                return None
        calls.append((node.func.id, arguments))
    return calls


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` to hold: trailing whitespace and anything
    after it that could begin ``tag``."""
    keep = partial_tag_length(text, tag)
    body = text[: len(text) - keep]
    return keep + (len(body) - len(body.rstrip()))


# vLLM's names. Each reader class takes no argument or the tools' parameter schemas by name.
TOOL_PARSERS: dict[str, type[ToolCallReader]] = {
    "deepseek_v3": DeepSeekReader,
    "deepseek_v31": DeepSeekReader,
    "glm45": Glm45Reader,
    "granite": GraniteReader,
    "granite-20b-fc": Granite20bFCReader,
    "hermes": HermesReader,
    "internlm": InternLM2Reader,
    "jamba": JambaReader,
    "kimi_k2": KimiK2Reader,
    "llama3_json": Llama3JsonReader,
    "llama4_json": Llama3JsonReader,  # (vLLM's names for the same formats)
    "llama4_pythonic": PythonicReader,
    "mistral": MistralReader,
    "pythonic": PythonicReader,
    "qwen3_coder": Qwen3CoderReader,
    "qwen3_xml": Qwen3CoderReader,
}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How a request's choices are read: its effective ``tool_choice`` and a reader maker."""

    choice: str  # "required", "named" or "auto"
    new_reader: Callable[[], ToolCallReader]
    keeps_special_tokens: bool = False  # the format uses special tokens: the text keeps them


def tool_use(request: ChatCompletionRequest, tool_parser: str | None) -> ToolUse | None:
    """How to read ``request``'s choices, or None when their text is plain content.

    ``tool_parser`` is the server's (None: auto tool choice is off). Raises ValueError for
    "auto" without one, in vLLM's words.
    """
    choice = request.effective_tool_choice
    if choice == "named":
        name = request.tool_choice.function.name  # type: ignore[union-attr]
        return ToolUse(choice, lambda: NamedCallReader(name))
    if choice == "required":
        return ToolUse(choice, RequiredCallsReader)
    if choice == "auto":
        if tool_parser is None:
            raise ValueError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        reader = TOOL_PARSERS[tool_parser]
        if issubclass(reader, TaggedCallsReader):
            schemas = {t.function.name: t.function.parameters for t in request.tools or []}
            return ToolUse(choice, lambda: reader(schemas), reader.keeps_special_tokens)
        return ToolUse(choice, reader, reader.keeps_special_tokens)
    return None


@dataclass(slots=True)
class ToolCallsSoFar:
    """Tool-call pieces merged into whole calls (as a client does with a stream)."""

    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, pieces: list[DeltaToolCall]) -> None:
        for piece in pieces:
            arguments = piece.function.arguments or ""
            call = self.calls.get(piece.index)
            if call is None:
                self.calls[piece.index] = ToolCall(
                    id=piece.id or tool_call_id(),
                    function=FunctionCall(name=piece.function.name or "", arguments=arguments),
                )
            else:
                call.function.arguments += arguments

    def as_list(self) -> list[ToolCall]:
        return [self.calls[i] for i in sorted(self.calls)]


def finish_reason(reason: str | None, use: ToolUse, num_calls: int) -> str | None:
    """A choice's finish reason: "tool_calls" when a required or auto choice made calls and
    the model stopped by itself."""
    if reason == "stop" and num_calls and use.choice in ("required", "auto"):
        return "tool_calls"
    return reason
