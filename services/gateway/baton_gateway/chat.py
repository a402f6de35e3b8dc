"""Chat messages -> prompt text -> token ids, with the model's own chat template.

The template is rendered by ``tokenizer.apply_chat_template``: transformers renders it in an
immutable sandboxed Jinja environment, so a template (or a message) cannot reach Python objects.
Any failure while rendering is the request's fault (or the template's) and becomes a 400.
"""

from __future__ import annotations

import json
from typing import Any

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


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """The message as the template sees it: text parts joined by newlines (vLLM's "string"
    content format); ``tool_calls`` with their arguments parsed; ``reasoning`` also as
    ``reasoning_content`` and the other way round; other keys (``name``, ``tool_call_id``...)
    passed through."""
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
        out["content"] = "\n".join(texts)
    else:
        out["content"] = content
    return out


def render_chat_prompt(
    tokenizer: Any,
    request: ChatPrompt,
    chat_template: str | None = None,
    default_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render ``request.messages`` into the prompt text with the request's chat template, else
    ``chat_template`` (the server's), else the tokenizer's; the request's
    ``chat_template_kwargs`` over ``default_kwargs`` (the server's,
    ``--default-chat-template-kwargs``).

    Raises a 400 GatewayError when there is no template or rendering fails.
    """
    template = request.chat_template or chat_template
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("the model has no chat template; use /v1/completions instead")
    given = {**(default_kwargs or {}), **(request.chat_template_kwargs or {})}
    kwargs = {k: v for k, v in given.items() if k not in _RESERVED_KWARGS}
    kwargs["add_generation_prompt"] = request.add_generation_prompt
    kwargs["continue_final_message"] = request.continue_final_message
    if template is not None:
        kwargs["chat_template"] = template
    messages = [message_dict(m) for m in request.messages]
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError, ValueError from transformers, ...
        raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e
    if not isinstance(text, str):
        raise bad_request("the chat template did not render to text", param="messages")
    return text


def tokenize_chat(
    tokenizer: Any,
    request: ChatPrompt,
    chat_template: str | None = None,
    default_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of a chat request (the template already writes special tokens, so
    none are added unless ``add_special_tokens`` asks for it, as in vLLM)."""
    text = render_chat_prompt(tokenizer, request, chat_template, default_kwargs)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    return ids


def tokenize_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ids
