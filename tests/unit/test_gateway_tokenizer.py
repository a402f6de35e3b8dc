"""The gateway's tokenizer: read from a GGUF's metadata (no torch) it equals the converted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from baton_engine.model_files import (
    converted_model_dir,
    default_model_path,
    load_gguf_tokenizer,
    load_model_tokenizer,
    served_model_name,
)
from baton_gateway.chat import ChatDefaults, detect_content_format, render_chat_prompt
from baton_gateway.errors import GatewayError
from baton_gateway.protocol import ChatCompletionRequest
from baton_gateway.responses_api import ResponsesRequest, chat_request

TEXTS = ["The capital of France is Paris.", "Ünïcödé 你好 🙂", "  two  spaces\tand\ttabs\n", ""]


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Any:
    return load_gguf_tokenizer(default_model_path())


def test_gguf_tokenizer_equals_the_converted_one(gguf_tokenizer: Any, tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert gguf_tokenizer.encode(text, add_special_tokens=False) == ids
        assert gguf_tokenizer.decode(ids) == text
    assert gguf_tokenizer.chat_template == tokenizer.chat_template
    assert gguf_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert sorted(gguf_tokenizer.all_special_ids) == sorted(tokenizer.all_special_ids)
    assert len(gguf_tokenizer) == len(tokenizer)


def test_model_tokenizer_without_conversion(tmp_path: Path, default_model_dir: Path) -> None:
    assert converted_model_dir(None, cache_dir=tmp_path) is None  # empty cache: not converted
    tok = load_model_tokenizer(None, cache_dir=tmp_path)
    assert tok.encode("hi there") == load_model_tokenizer(str(default_model_dir)).encode("hi there")
    assert not list(tmp_path.iterdir())  # nothing was written
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    # as vLLM: the path as given
    assert served_model_name("/m/Foo-1B.Q4.gguf") == "/m/Foo-1B.Q4.gguf"
    assert served_model_name(str(default_model_dir)) == str(default_model_dir)


def test_chat_template_rendering(tokenizer: Any) -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    text = render_chat_prompt(tokenizer, request)
    assert "<|im_start|>user\na\nb<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(GatewayError, match="not supported") as e:
        render_chat_prompt(tokenizer, image)
    assert e.value.status == 400


def test_documents_and_reasoning_effort_reach_the_template(tokenizer: Any) -> None:
    """vLLM's ``documents`` (RAG templates) and OpenAI's ``reasoning_effort`` (gpt-oss's
    template reads it) are the template's variables, over chat_template_kwargs; the Responses
    API's ``reasoning.effort`` is the latter."""
    template = (
        "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "effort={{ reasoning_effort | default('none') }};"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    fields = {"messages": [{"role": "user", "content": "Q"}], "chat_template": template}
    plain = ChatCompletionRequest.model_validate(fields)
    assert render_chat_prompt(tokenizer, plain) == "effort=none;Q"
    rich = ChatCompletionRequest.model_validate(
        {
            **fields,
            "documents": [
                {"title": "Paris", "text": "The capital."},
                {"title": "Oslo", "text": "Cold."},
            ],
            "reasoning_effort": "high",
            "chat_template_kwargs": {"reasoning_effort": "low"},
        }
    )
    text = render_chat_prompt(tokenizer, rich)
    assert text == "[Paris: The capital.][Oslo: Cold.]effort=high;Q"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**fields, "reasoning_effort": "extreme"})
    responses = ResponsesRequest.model_validate({"input": "Q", "reasoning": {"effort": "medium"}})
    chat = ChatCompletionRequest.model_validate(chat_request(responses, []))
    assert chat.reasoning_effort == "medium"


def test_broken_or_hostile_template_is_a_400(tokenizer: Any) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    original = tokenizer.chat_template
    try:
        for template in (
            "{% for m in messages %}{{ m.content ",  # syntax error
            "{{ raise_exception('no') }}",
            # The sandbox refuses to reach Python internals from a template.
            "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        ):
            tokenizer.chat_template = template
            with pytest.raises(GatewayError) as e:
                render_chat_prompt(tokenizer, request)
            assert e.value.status == 400
    finally:
        tokenizer.chat_template = original


# A template written for OpenAI's content parts (as multimodal models' are): it loops over a
# message's content, through a variable.
PARTS_TEMPLATE = (
    "{% for m in messages %}{% set parts = m['content'] %}{{ m.role }}:"
    "{% for p in parts | selectattr('type', 'equalto', 'text') %}[{{ p.text }}]{% endfor %};"
    "{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "detected"),
    [
        (PARTS_TEMPLATE, "openai"),
        ("{% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for t in m.tool_calls %}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content ", "string"),  # (does not parse: rendering says)
    ],
)
def test_content_format_is_detected_from_the_template(template: str, detected: str) -> None:
    assert detect_content_format(template) == detected


def test_content_reaches_the_template_in_its_format(tokenizer: Any) -> None:
    """vLLM's --chat-template-content-format: "openai" hands a template the content as a list
    of parts (a string as one part); "string" joins text parts by newlines; "auto" reads the
    template: the model's own (SmolLM2's, which prints ``message['content']``) gets strings."""
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    parts = "system:[Be brief.];user:[a][b];"
    assert render_chat_prompt(tokenizer, request, ChatDefaults(PARTS_TEMPLATE)) == parts
    openai = ChatDefaults(PARTS_TEMPLATE, content_format="openai")
    assert render_chat_prompt(tokenizer, request, openai) == parts
    # Forced to "string", the same template iterates the characters of a string: no parts.
    string = ChatDefaults(PARTS_TEMPLATE, content_format="string")
    assert render_chat_prompt(tokenizer, request, string) == "system:;user:;"
    for content_format in ("auto", "string"):
        text = render_chat_prompt(tokenizer, request, ChatDefaults(content_format=content_format))
        assert "<|im_start|>user\na\nb<|im_end|>" in text
    assert detect_content_format(tokenizer.chat_template) == "string"


def test_a_tool_calling_conversation_renders_with_a_template_without_tools(
    tokenizer: Any,
) -> None:
    """An assistant's tool call carries no content: the template gets "" (vLLM's string
    format), so a template that adds the content to text (SmolLM2's) renders the conversation
    instead of failing it with a 400."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "Call f."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        }
    )
    text = render_chat_prompt(tokenizer, request)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n42<|im_end|>" in text
