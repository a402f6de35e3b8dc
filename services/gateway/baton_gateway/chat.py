"""Chat messages -> prompt text -> token ids, with the model's own chat template.

The template is rendered by ``tokenizer.apply_chat_template``: transformers renders it in an
immutable sandboxed Jinja environment, so a template (or a message) cannot reach Python objects.
Any failure while rendering is the request's fault (or the template's) and becomes a 400.

A message's content reaches the template as one string (vLLM's "string" content format: text
parts joined by newlines) or as OpenAI's list of parts (``[{"type": "text", "text": ...}]``,
"openai"), as ``--chat-template-content-format`` says; "auto" (the default) reads the template
and picks "openai" for one that loops over a message's content, as vLLM does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.nodes

from baton_gateway.errors import bad_request
from baton_gateway.protocol import ChatMessage, ChatPrompt

# apply_chat_template arguments that chat_template_kwargs must not override: they decide what
# the call returns, and the gateway relies on getting plain text back.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "chat_template",
    }
)


def _template_tool_calls(calls: Any) -> Any:
    """An assistant message's ``tool_calls`` as templates expect them (transformers' and
    vLLM's convention): each ``function.arguments`` a dict, not the API's JSON text."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = arguments  # left as it came; the template decides
            call = {**call, "function": {**function, "arguments": parsed}}  # type: ignore[dict-item]
        out.append(call)
    return out


CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True)
class ChatDefaults:
    """The server's side of rendering a conversation (vLLM's flags)."""

    template: str | None = None  # --chat-template; None: the tokenizer's
    kwargs: Mapping[str, Any] = field(default_factory=dict)  # --default-chat-template-kwargs
    content_format: str = "auto"  # --chat-template-content-format, one of CONTENT_FORMATS
    # --exclude-tools-when-tool-choice-none: a request's tools do not reach the template when
    # its tool_choice is "none"
    exclude_tools_when_tool_choice_none: bool = False


def _unfiltered(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """What filters apply to: ``x`` of ``x | select(...) | list``."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _content_access(node: jinja2.nodes.Node) -> bool:
    """``x['content']`` or ``x.content``, filtered or not."""
    node = _unfiltered(node)
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


def _loops_over_content(template: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    """The template's loops over a message's content, directly or through a variable set to
    it (``{% set c = message['content'] %}{% for part in c %}``)."""
    names = {
        assign.target.name
        for assign in template.find_all(jinja2.nodes.Assign)
        if isinstance(assign.target, jinja2.nodes.Name) and _content_access(assign.node)
    }
    for loop in template.find_all(jinja2.nodes.For):
        it = _unfiltered(loop.iter)
        if _content_access(it) or (isinstance(it, jinja2.nodes.Name) and it.name in names):
            yield loop


@functools.lru_cache(maxsize=64)
def detect_content_format(template: str) -> str:
    """ "openai" when ``template`` loops over a message's content (it expects OpenAI's list of
    parts), else "string" (also for a template that does not parse: rendering reports it)."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if next(_loops_over_content(ast), None) is not None else "string"


def _template_source(tokenizer: Any, template: str | None, tools: bool) -> str | None:
    """The template a render uses: ``template``, else the tokenizer's (of several named ones,
    "tool_use" when there are tools and it has one, else "default", as transformers picks)."""
    if template is not None:
        return template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        return own.get("tool_use") if tools and "tool_use" in own else own.get("default")
    return own if isinstance(own, str) else None


def message_dict(message: ChatMessage, content_format: str = "string") -> dict[str, Any]:
    """The message as the template sees it: its content in ``content_format`` ("string": text
    parts joined by newlines, no content as ""; "openai": a list of ``{"type": "text", "text":
    ...}`` parts, a string content as one part, no content as none, as vLLM passes them);
    ``tool_calls`` with their arguments parsed; ``reasoning`` also as ``reasoning_content`` and
    the other way round; other keys (``name``, ``tool_call_id``...) passed through."""
    out: dict[str, Any] = dict(message.model_extra or {})
    if "tool_calls" in out:
        out["tool_calls"] = _template_tool_calls(out["tool_calls"])
    # An earlier answer's reasoning, under both its names: templates read one or the other.
    reasoning = out.get("reasoning", out.get("reasoning_content"))
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    out["role"] = message.role
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"content parts of type {part.type!r} are not supported (text only)",
                    param="messages",
                )
            texts.append(part.text)
        out["content"] = (
            [{"type": "text", "text": t} for t in texts]
            if content_format == "openai"
            else "\n".join(texts)
        )
    elif content_format == "openai":
        out["content"] = [] if content is None else [{"type": "text", "text": content}]
    else:  # (an assistant's tool calls without content: "", which templates can add to)
        out["content"] = "" if content is None else content
    return out


def render_chat_prompt(
    tokenizer: Any, request: ChatPrompt, defaults: ChatDefaults | None = None
) -> str:
    """Render ``request.messages`` into the prompt text with the request's chat template, else
    the server's (``defaults.template``), else the tokenizer's; the request's
    ``chat_template_kwargs`` over the server's (``defaults.kwargs``), and its ``documents`` and
    ``reasoning_effort`` over both.

    Raises a 400 GatewayError when there is no template or rendering fails.
    """
    defaults = defaults if defaults is not None else ChatDefaults()
    template = request.chat_template or defaults.template
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the model has no chat template; use /v1/completions instead")
    given = {**defaults.kwargs, **(request.chat_template_kwargs or {})}
    kwargs = {k: v for k, v in given.items() if k not in _RESERVED_KWARGS}
    kwargs["add_generation_prompt"] = request.add_generation_prompt
    kwargs["continue_final_message"] = request.continue_final_message
    if request.documents is not None:
        kwargs["documents"] = request.documents
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    if template is not None:
        kwargs["chat_template"] = template
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    if defaults.exclude_tools_when_tool_choice_none and getattr(request, "tool_choice", None) == (
        "none"
    ):
        tools = None
    content_format = defaults.content_format
    if content_format == "auto":
        source = _template_source(tokenizer, template, tools is not None)
        content_format = detect_content_format(source) if source is not None else "string"
    messages = [message_dict(m, content_format) for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError, ValueError from transformers, ...
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e
    if not isinstance(text, str):
        raise bad_request("the chat template did not render to text", param="messages")
    return text


def tokenize_chat(
    tokenizer: Any, request: ChatPrompt, defaults: ChatDefaults | None = None
) -> list[int]:
    """The prompt token ids of a chat request (the template already writes special tokens, so
    none are added unless ``add_special_tokens`` asks for it, as in vLLM)."""
    text = render_chat_prompt(tokenizer, request, defaults)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    return ids


def _json_value(value: Any) -> Any:
    """``value`` as JSON holds it: an added token as its text, other objects as strings."""
    if hasattr(value, "content") and isinstance(value.content, str):  # AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_config(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration (its ``tokenizer_config.json``
    as loaded, without file paths), its class, and the chat template requests get (the
    server's, else the tokenizer's)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for path in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(path, None)
    out: dict[str, Any] = _json_value(config)
    out["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is not None:
        out["chat_template"] = template
    return out


def tokenize_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ids
